// Managed collision's per-step history record of every module of a collection in one C++ call
// (called through ctypes from recshard/distributed/mc_native_record.py): each module's
// iteration counter advanced by one and the step's ids appended to its history arrays.
// Part of the recshard.distributed._mc_index library (with mc_index.cpp, mc_draw.cpp,
// mc_route.cpp).

#include <cstdint>
#include <limits>
#include <vector>

#include "mc_codes.h"
#include "mc_segments.h"

// One training step of `tables` modules. The ids come in segments (`ids[count]`, segment s
// holding segment_lengths[s] ids of module segment_tables[s], or of no module where that is
// -1: a column-split table's feature seen again). Module t's counter `*iterations[t]` (one
// int64) goes up by one and its new value is written to `recorded[t]`; its ids, in segment
// order, go to `history_ids[t][used[t]...]`, and where `history_seen[t]` is not 0, the new
// iteration to `history_seen[t][used[t]...]` as many times; how many were appended goes to
// `recorded[tables + t]`. Arrays hold `capacity[t]` entries (an empty one may have address 0):
// every argument is checked, and every module's room, before the first write (a refusal
// changes nothing).
extern "C" int rs_mc_record(int64_t segments, const int64_t* segment_tables,
                            const int64_t* segment_lengths, int64_t count, const int64_t* ids,
                            int64_t tables, const int64_t* history_ids,
                            const int64_t* history_seen, const int64_t* used,
                            const int64_t* capacity, const int64_t* iterations,
                            int64_t* recorded) try {
  if (tables < 0 || !valid_segments(segments, segment_tables, segment_lengths, count, tables, true))
    return ERR_ARGUMENT;
  std::vector<int64_t> appended(tables, 0);  // before the first write: a failure writes nothing
  for (int64_t s = 0; s < segments; ++s)
    if (segment_tables[s] >= 0) appended[segment_tables[s]] += segment_lengths[s];
  for (int64_t t = 0; t < tables; ++t) {
    if ((history_ids[t] == 0 && capacity[t] > 0) || iterations[t] == 0 || used[t] < 0 ||
        capacity[t] < used[t] ||
        appended[t] > capacity[t] - used[t])
      return ERR_ARGUMENT;
    if (*reinterpret_cast<const int64_t*>(iterations[t]) == std::numeric_limits<int64_t>::max())
      return ERR_ARGUMENT;
  }
  for (int64_t t = 0; t < tables; ++t) {
    int64_t* iteration = reinterpret_cast<int64_t*>(iterations[t]);
    recorded[t] = ++*iteration;
    recorded[tables + t] = appended[t];
    appended[t] = used[t];  // from here: where module t's next id goes
  }
  for (int64_t s = 0, at = 0; s < segments; ++s) {
    const int64_t t = segment_tables[s], end = at + segment_lengths[s];
    if (t < 0) {
      at = end;
      continue;
    }
    int64_t* out = reinterpret_cast<int64_t*>(history_ids[t]) + appended[t];
    int64_t* seen = history_seen[t] ? reinterpret_cast<int64_t*>(history_seen[t]) + appended[t]
                                    : nullptr;
    const int64_t iteration = recorded[t];
    for (int64_t k = 0; at < end; ++at, ++k) {
      out[k] = ids[at];
      if (seen) seen[k] = iteration;
    }
    appended[t] += segment_lengths[s];
  }
  return 0;
} catch (...) {
  return exception_code();
}
