// Return codes of the managed collision library's C functions (mc_index.cpp, mc_draw.cpp):
// 0 ok, else one of these (recshard/distributed/mc_native.py's _ERRORS names them).
#pragma once

namespace {

constexpr int ERR_ARGUMENT = 1, ERR_PRESENT = 2, ERR_ABSENT = 3, ERR_FULL = 4, ERR_ID = 5,
              ERR_BUCKET = 6;

}  // namespace
