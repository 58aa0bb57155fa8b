// The bucket of a raw id, shared by the managed collision library's C files (mc_index.cpp,
// mc_route.cpp): the remap, the routing and the LFU eviction must agree on it.
#pragma once

#include <cstdint>

namespace {

// id % buckets (id >= 0, buckets >= 1), without a division where buckets is a power of two (a
// 64-bit division per id was a tenth of an eviction)
inline int64_t bucket_of(int64_t id, int64_t buckets) {
  return (buckets & (buckets - 1)) == 0 ? id & (buckets - 1) : id % buckets;
}

}  // namespace
