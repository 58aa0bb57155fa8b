// Return codes of the managed collision library's C functions (mc_index.cpp, mc_route.cpp,
// mc_draw.cpp): 0 ok, else one of these (recshard/distributed/mc_native.py's _ERRORS names
// them). No C++ exception crosses the C boundary (ctypes would abort the process): every C
// function ends in `catch (...) { return exception_code(); }`, and one that can fail midway
// allocates all its scratch before it writes anything, so a failure changes nothing.
#pragma once

#include <new>
#include <stdexcept>

namespace {

constexpr int ERR_ARGUMENT = 1, ERR_PRESENT = 2, ERR_ABSENT = 3, ERR_FULL = 4, ERR_ID = 5,
              ERR_BUCKET = 6, ERR_MEMORY = 7, ERR_EXCEPTION = 8;

// The code of the exception being handled (call only inside a catch block): ERR_MEMORY for
// scratch that could not be allocated (std::bad_alloc, or a std::length_error: more than a
// vector can hold), else ERR_EXCEPTION.
inline int exception_code() noexcept {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    return ERR_MEMORY;
  } catch (const std::length_error&) {
    return ERR_MEMORY;
  } catch (...) {
    return ERR_EXCEPTION;
  }
}

}  // namespace
