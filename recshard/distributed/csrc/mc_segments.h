// Ids laid out in segments, shared by the managed collision library's entry points that take a
// batch by table (mc_index.cpp's remap, mc_route.cpp's id check, mc_record.cpp's record):
// segment s holds segment_lengths[s] ids of table segment_tables[s], one after another.
#pragma once

#include <cstdint>

namespace {

// Whether `segments` segments of tables in [0, tables) (or -1, a segment to skip, where
// `skippable`) cover exactly `count` ids. Each length is checked against the ids left, so no
// sum overflows.
inline bool valid_segments(int64_t segments, const int64_t* segment_tables,
                           const int64_t* segment_lengths, int64_t count, int64_t tables,
                           bool skippable) {
  if (segments < 0 || count < 0) return false;
  int64_t total = 0;
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t t = segment_tables[s], length = segment_lengths[s];
    if (t < (skippable ? -1 : 0) || t >= tables || length < 0 || length > count - total)
      return false;
    total += length;
  }
  return total == count;
}

}  // namespace
