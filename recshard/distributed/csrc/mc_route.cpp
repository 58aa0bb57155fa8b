// Managed collision's id checks and routing in C++ (called through ctypes from
// recshard/distributed/mc_native.py's ids_in_range and route): every id of a batch within its
// table's hash size, and a batch's ids sent to the ranks owning their buckets (a counting sort).
// Part of the recshard.distributed._mc_index library (with mc_index.cpp, mc_draw.cpp).

#include <cstdint>
#include <vector>

#include "mc_bucket.h"
#include "mc_codes.h"
#include "mc_segments.h"

// ERR_ID when an id of segment s (laid out as for rs_mc_remap) is outside
// [0, hash_sizes[segment_tables[s]]).
extern "C" int rs_mc_check_ids(int64_t segments, const int64_t* segment_tables,
                               const int64_t* segment_lengths, int64_t count, const int64_t* ids,
                               int64_t tables, const int64_t* hash_sizes) try {
  if (!valid_segments(segments, segment_tables, segment_lengths, count, tables, false))
    return ERR_ARGUMENT;
  for (int64_t s = 0, at = 0; s < segments; ++s) {
    const int64_t t = segment_tables[s];
    for (int64_t end = at + segment_lengths[s]; at < end; ++at)
      if (ids[at] < 0 || ids[at] >= hash_sizes[t]) return ERR_ID;
  }
  return 0;
} catch (...) {
  return exception_code();
}

// Routing of a key-major batch (`keys` keys of `stride` bags each, `lengths[keys * stride]`,
// ids[count]; key k reads table key_tables[k]) to the owners of the ids' buckets
// (owner_of_bucket[first_owners[t] + id % buckets[t]], in [0, world)): `order[count]` (the
// ids in destination-major, then bag, then arrival order: a stable counting sort),
// `sent_to[count]` (its inverse) and `routed_lengths[world * keys * stride]`.
extern "C" int rs_mc_route(int64_t keys, int64_t stride, const int64_t* lengths, int64_t count,
                           const int64_t* ids, const int64_t* key_tables, int64_t tables,
                           const int64_t* buckets, const int64_t* first_owners,
                           int64_t owner_count, const int64_t* owner_of_bucket, int64_t world,
                           int64_t* order, int64_t* sent_to, int64_t* routed_lengths) try {
  if (keys < 0 || stride < 0 || count < 0 || world < 1) return ERR_ARGUMENT;
  const int64_t bags = keys * stride;
  int64_t total = 0;
  for (int64_t b = 0; b < bags; ++b) {
    if (lengths[b] < 0) return ERR_ARGUMENT;
    total += lengths[b];
  }
  if (total != count) return ERR_ARGUMENT;
  for (int64_t k = 0; k < keys; ++k) {
    const int64_t t = key_tables[k];
    if (t < 0 || t >= tables || buckets[t] < 1 || first_owners[t] < 0 ||
        first_owners[t] + buckets[t] > owner_count)
      return ERR_ARGUMENT;
  }
  std::vector<int64_t> start(world + 1, 0);  // before the first write: a failure writes nothing
  for (int64_t b = 0; b < world * bags; ++b) routed_lengths[b] = 0;
  // pass 1: each id's owner (kept in sent_to for now) and the per-destination counts
  for (int64_t b = 0, at = 0; b < bags; ++b) {
    const int64_t t = key_tables[b / (stride ? stride : 1)];
    for (int64_t end = at + lengths[b]; at < end; ++at) {
      if (ids[at] < 0) return ERR_ID;
      const int64_t owner = owner_of_bucket[first_owners[t] + bucket_of(ids[at], buckets[t])];
      if (owner < 0 || owner >= world) return ERR_ARGUMENT;
      sent_to[at] = owner;
      ++start[owner + 1];
      ++routed_lengths[owner * bags + b];
    }
  }
  for (int64_t r = 0; r < world; ++r) start[r + 1] += start[r];
  // pass 2: stable placement (ids arrive bag by bag, so each destination's are bag-major)
  for (int64_t at = 0; at < count; ++at) {
    const int64_t position = start[sent_to[at]]++;
    order[position] = at;
    sent_to[at] = position;
  }
  return 0;
} catch (...) {
  return exception_code();
}
