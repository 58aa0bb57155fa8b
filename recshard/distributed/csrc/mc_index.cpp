// Managed collision's per-batch work in C++ (called through ctypes from
// recshard/distributed/mc_native.py): each table's open-addressing id index (build, erase +
// insert at an eviction, find), the remap of a whole batch over every table's index in one
// call, a bucket's eviction contest (mc_contest.h), and the whole LFU evictions of several
// modules in one call (a reset's draws: mc_draw.cpp; id checks and routing: mc_route.cpp).
//
// An index is one int64 array of 2**log2 slots of two values each: slot s's key at 2 s (EMPTY =
// -1: ids are >= 0) and its global row at 2 s + 1, so a probe that finds a key has its row in
// the same cache line; linear probing from `key * odd constant`'s top bits, deletion by
// backward shift (no tombstones), at most half full (Python sizes it). Every array's length is
// passed and every index into one is checked here; Python checks dtypes, devices and lengths
// first.
// Return codes: 0 ok, then mc_codes.h's ERR_* (mc_native.py turns them into errors). No C++
// exception leaves a C function; one that fails (out of memory included) changes nothing but
// where it says so (a malformed index found midway: ERR_ABSENT, ERR_FULL).

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <vector>

#include "mc_bucket.h"
#include "mc_codes.h"
#include "mc_contest.h"
#include "mc_segments.h"

namespace {

constexpr int64_t EMPTY = -1;
constexpr uint64_t MIX = 0x9E3779B97F4A7C15ULL;
constexpr int64_t PREFETCH = 16;  // lookups ahead whose slots are prefetched

// The first slot probed for `key` in a hash of 2**(64 - shift) slots: its product with an odd
// constant's top bits.
inline uint64_t home_slot(int64_t key, int shift) { return (uint64_t(key) * MIX) >> shift; }

struct Index {
  int64_t* slots;  // 2 * (mask + 1) values: key, row of slot 0, then of slot 1, ...
  uint64_t mask;
  int shift;

  Index(int64_t* s, int64_t log2)
      : slots(s), mask((uint64_t(1) << log2) - 1), shift(64 - int(log2)) {}

  uint64_t home(int64_t key) const { return home_slot(key, shift); }
  int64_t& key_at(uint64_t at) const { return slots[2 * at]; }
  int64_t& row_at(uint64_t at) const { return slots[2 * at + 1]; }

  // start loading `key`'s home slot (a batch's indexes are mostly out of cache: a lookup
  // waits on memory, so the next ones' loads are started while it does; its key and row share
  // a line: the array is 64-byte aligned, a slot 16 bytes) and the slot after it, which lies in
  // the next line for the 1 home in 4 that ends a line (a miss probes on whenever its home is
  // taken, up to half the slots are, and that line was then waited on)
  void prefetch(int64_t key) const {
    const uint64_t at = home(key);
    __builtin_prefetch(slots + 2 * at);
    __builtin_prefetch(slots + 2 * ((at + 1) & mask));
  }

  // slot holding `key`, or -1
  int64_t slot(int64_t key) const {
    for (uint64_t at = home(key), probes = 0; probes <= mask; at = (at + 1) & mask, ++probes) {
      if (key_at(at) == key) return int64_t(at);
      if (key_at(at) == EMPTY) return -1;
    }
    return -1;
  }

  int insert(int64_t key, int64_t row) {
    for (uint64_t at = home(key), probes = 0; probes <= mask; at = (at + 1) & mask, ++probes) {
      if (key_at(at) == key) return ERR_PRESENT;
      if (key_at(at) == EMPTY) {
        key_at(at) = key;
        row_at(at) = row;
        return 0;
      }
    }
    return ERR_FULL;
  }

  int erase(int64_t key) {
    int64_t found = slot(key);
    if (found < 0) return ERR_ABSENT;
    uint64_t hole = uint64_t(found);
    for (uint64_t next = (hole + 1) & mask; key_at(next) != EMPTY; next = (next + 1) & mask) {
      uint64_t want = home(key_at(next));
      // move `next` into the hole unless its home lies cyclically in (hole, next]
      bool stays = hole <= next ? (hole < want && want <= next) : (hole < want || want <= next);
      if (!stays) {
        key_at(hole) = key_at(next);
        row_at(hole) = row_at(next);
        hole = next;
      }
    }
    key_at(hole) = EMPTY;
    return 0;
  }
};

bool valid_log2(int64_t log2) { return log2 >= 1 && log2 <= 40; }

}  // namespace


// An index of 2**log2 slots (`slots`: 2 * 2**log2 values) holding `ids[i]` at `rows[i]` (ids
// distinct, >= 0) and nothing else (free slots: key EMPTY, row 0).
extern "C" int rs_mc_build(int64_t log2, int64_t* slots, int64_t count, const int64_t* ids,
                           const int64_t* id_rows) try {
  if (!valid_log2(log2) || count < 0 || 2 * count > (int64_t(1) << log2)) return ERR_ARGUMENT;
  Index index(slots, log2);
  for (uint64_t at = 0; at <= index.mask; ++at) index.key_at(at) = EMPTY, index.row_at(at) = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (ids[i] < 0) return ERR_ID;
    if (int code = index.insert(ids[i], id_rows[i])) return code;
  }
  return 0;
} catch (...) {
  return exception_code();
}

// `old_ids` (each held) leave the index, then `new_ids` (none held) come in at `new_rows`;
// `held` is the count before, for the fill check.
extern "C" int rs_mc_replace(int64_t log2, int64_t* slots, int64_t held, int64_t old_count,
                             const int64_t* old_ids, int64_t new_count, const int64_t* new_ids,
                             const int64_t* new_rows) try {
  if (!valid_log2(log2) || old_count < 0 || new_count < 0 || old_count > held ||
      2 * (held - old_count + new_count) > (int64_t(1) << log2))
    return ERR_ARGUMENT;
  Index index(slots, log2);
  for (int64_t i = 0; i < old_count; ++i)
    if (int code = index.erase(old_ids[i])) return code;
  for (int64_t i = 0; i < new_count; ++i) {
    if (new_ids[i] < 0) return ERR_ID;
    if (int code = index.insert(new_ids[i], new_rows[i])) return code;
  }
  return 0;
} catch (...) {
  return exception_code();
}

// found[i] = whether ids[i] is held; rows[i] its row (0 where not).
extern "C" int rs_mc_find(int64_t log2, const int64_t* slots, int64_t count, const int64_t* ids,
                          uint8_t* found, int64_t* out_rows) try {
  if (!valid_log2(log2) || count < 0) return ERR_ARGUMENT;
  const Index index(const_cast<int64_t*>(slots), log2);
  for (int64_t i = 0; i < count; ++i) {
    int64_t at = index.slot(ids[i]);
    found[i] = at >= 0;
    out_rows[i] = at >= 0 ? index.row_at(uint64_t(at)) : 0;
  }
  return 0;
} catch (...) {
  return exception_code();
}

// The local row of every id of a batch laid out in segments (segment s: `segment_lengths[s]`
// ids of table `segment_tables[s]`): the row its table's index holds it at (global, less the
// table's `row_offsets`), or its bucket's reserved row `defaults[default_starts[t] + bucket]`
// (bucket = id % buckets[t] - first_buckets[t], which must be one of the table's
// `held_buckets[t]`). counts[2 t] += ids of table t, counts[2 t + 1] += those held.
// Per table t: `slot_ptrs[t]` is its index of 2**log2s[t] slots.
extern "C" int rs_mc_remap(int64_t segments, const int64_t* segment_tables,
                           const int64_t* segment_lengths, int64_t count, const int64_t* ids,
                           int64_t tables, const int64_t* slot_ptrs, const int64_t* log2s,
                           const int64_t* row_offsets, const int64_t* buckets,
                           const int64_t* first_buckets, const int64_t* held_buckets,
                           const int64_t* default_starts, int64_t default_count,
                           const int64_t* defaults, int64_t* out_rows,
                           int64_t* counts) try {
  if (!valid_segments(segments, segment_tables, segment_lengths, count, tables, false))
    return ERR_ARGUMENT;
  for (int64_t t = 0; t < tables; ++t) {
    if (!valid_log2(log2s[t]) || buckets[t] < 1 || held_buckets[t] < 0 ||
        default_starts[t] < 0 || default_starts[t] + held_buckets[t] > default_count)
      return ERR_ARGUMENT;
  }
  int64_t at = 0;
  for (int64_t s = 0; s < segments; ++s) {
    const int64_t t = segment_tables[s];
    const Index index(reinterpret_cast<int64_t*>(slot_ptrs[t]), log2s[t]);
    int64_t hits = 0;
    for (int64_t end = at + segment_lengths[s]; at < end; ++at) {
      if (at + PREFETCH < end) index.prefetch(ids[at + PREFETCH]);
      const int64_t id = ids[at];
      if (id < 0) return ERR_ID;
      const int64_t bucket = bucket_of(id, buckets[t]) - first_buckets[t];
      if (bucket < 0 || bucket >= held_buckets[t]) return ERR_BUCKET;
      const int64_t slot = index.slot(id);
      if (slot >= 0) {
        out_rows[at] = index.row_at(uint64_t(slot)) - row_offsets[t];
        ++hits;
      } else {
        out_rows[at] = defaults[default_starts[t] + bucket];
      }
    }
    counts[2 * t] += segment_lengths[s];
    counts[2 * t + 1] += hits;
  }
  return 0;
} catch (...) {
  return exception_code();
}

// `contest` over score arrays: `row_scores[slots]`, `new_scores[news]`; `pairs` its count. A NaN
// score ranks as -inf (as `rank_contest` ranks it): the comparisons see no NaN, whose order
// would be undefined in std::sort and nth_element.
extern "C" int rs_mc_contest(int64_t slots, const double* row_scores, const int64_t* held,
                             int64_t news, const double* new_scores, int64_t* lose, int64_t* win,
                             int64_t* pairs) try {
  if (slots < 0 || news < 0) return ERR_ARGUMENT;
  auto ranked = [](double score) { return std::isnan(score) ? -INFINITY : score; };
  ContestScratch scratch;  // grows in the contest, before it writes lose and win
  *pairs = contest<double>(
      slots, [&](int64_t r) { return ranked(row_scores[r]); }, held, news,
      [&](int64_t i) { return ranked(new_scores[i]); }, [](int64_t i) { return i; }, lose, win,
      scratch);
  return 0;
} catch (...) {
  return exception_code();
}

namespace {

// One table's arguments of an LFU eviction (see rs_mc_evict_lfu_tables).
struct LfuTable {
  int64_t log2;
  int64_t* slots;
  int64_t held, count;
  const int64_t* ids;
  int64_t row_count;
  int64_t* raw_ids;
  int64_t* counts;
  int64_t held_buckets;
  const int64_t* bucket_starts;
  int64_t buckets, first_bucket, row_offset;
};

// A new id seen since the last eviction: how often, and its local bucket.
struct Seen {
  int64_t id, count, bucket;
};

// What one table's eviction writes, worked out (`plan_lfu`) before any table is written
// (`apply_lfu`): the rows of the held ids seen (one count each), the new ids grouped by bucket
// (bucket b's from starts[b]), and the sizes of its largest contest.
struct LfuPlan {
  std::vector<int64_t> hit_rows, starts;
  std::vector<Seen> grouped;
  size_t most_slots = 0, most_news = 0;
};

// The working arrays of the contests, one set for all tables (the tables are written one after
// another): reserved for the largest contest of any table before the first write. (A set per
// table was ~0.4 MB of fresh pages per table at a process's first eviction, and 26 sets in
// different places of memory at every later one.)
struct ContestArrays {
  std::vector<int64_t> lose, win;
  ContestScratch scratch;

  void reserve(size_t slots, size_t news) {
    lose.resize(news);
    win.resize(news);
    scratch.reserve(slots, news);
  }
};

// A plan's passes' own arrays, kept from table to table and call to call (per thread): freed
// and allocated again per table, the larger were fresh pages each time.
struct PlanArrays {
  std::vector<int64_t> hit_ids, missed;
  std::vector<Seen> news;
};

// One table's arguments and history checked, its plan worked out: writes nothing of the table.
int plan_lfu(const LfuTable& table, LfuPlan& plan, PlanArrays& arrays) {
  const int64_t log2 = table.log2, held = table.held, count = table.count;
  const int64_t row_count = table.row_count, held_buckets = table.held_buckets;
  const int64_t buckets = table.buckets, first_bucket = table.first_bucket;
  const int64_t row_offset = table.row_offset;
  const int64_t* ids = table.ids;
  const int64_t* raw_ids = table.raw_ids;
  const int64_t* bucket_starts = table.bucket_starts;
  if (!valid_log2(log2) || held < 0 || held > row_count || count < 0 || row_count < 0 ||
      2 * row_count > (int64_t(1) << log2) || held_buckets < 0 || buckets < 1 ||
      first_bucket < 0 || first_bucket + held_buckets > buckets || bucket_starts[0] != 0 ||
      bucket_starts[held_buckets] != row_count)
    return ERR_ARGUMENT;
  for (int64_t b = 0; b < held_buckets; ++b)
    if (bucket_starts[b + 1] - bucket_starts[b] < 1) return ERR_ARGUMENT;
  const Index index(table.slots, log2);
  // one pass over the history in arrival order, looked up in the index with prefetches: a
  // held id's row is noted (its count written once every id is checked: an error writes
  // nothing), the others are kept to be coalesced. (Coalescing the whole history first cost a
  // hash as large as the history, a scan of it and a lookup per distinct id besides.)
  std::vector<int64_t>& hit_rows = plan.hit_rows;
  hit_rows.clear();
  std::vector<int64_t>& hit_ids = arrays.hit_ids;
  std::vector<int64_t>& missed = arrays.missed;
  hit_ids.clear();
  missed.clear();
  hit_rows.reserve(size_t(count));
  hit_ids.reserve(size_t(count));
  for (int64_t i = 0; i < count; ++i) {
    if (i + PREFETCH < count) index.prefetch(ids[i + PREFETCH]);
    const int64_t id = ids[i];
    if (id < 0) return ERR_ID;
    const int64_t slot = index.slot(id);
    if (slot < 0) {
      missed.push_back(id);
      continue;
    }
    const int64_t row = index.row_at(uint64_t(slot)) - row_offset;
    if (row < 0 || row >= row_count) return ERR_ARGUMENT;
    hit_rows.push_back(row);
    hit_ids.push_back(id);
  }
  // the index agrees with raw_ids (a pass of its own, so its loads are prefetched ahead)
  const int64_t hits = int64_t(hit_rows.size());
  for (int64_t h = 0; h < hits; ++h) {
    if (h + PREFETCH < hits) {
      __builtin_prefetch(raw_ids + hit_rows[size_t(h + PREFETCH)]);
      __builtin_prefetch(table.counts + hit_rows[size_t(h + PREFETCH)]);
    }
    if (raw_ids[hit_rows[size_t(h)]] != hit_ids[size_t(h)]) return ERR_ARGUMENT;
  }
  // the new ids coalesced in one pass: each distinct one in `news` (first seen first, its bucket
  // checked once) and how often it was seen, found again through a hash of positions in `news`
  // (its arrays kept from call to call, per thread: fresh ones were fresh zeroed pages at every
  // call; a scan of the hash for its ids mispredicted at every other slot)
  const int64_t misses = int64_t(missed.size());
  int64_t seen_log2 = 1;
  while ((int64_t(1) << seen_log2) < 2 * misses) ++seen_log2;
  struct SeenSlot {
    int64_t id, at;  // at: the position in news
  };
  static thread_local std::vector<SeenSlot> seen;
  seen.assign(size_t(1) << seen_log2, SeenSlot{EMPTY, 0});
  const uint64_t seen_mask = (uint64_t(1) << seen_log2) - 1;
  const int seen_shift = 64 - int(seen_log2);
  auto seen_home = [&](int64_t id) { return home_slot(id, seen_shift); };
  std::vector<Seen>& news = arrays.news;
  news.clear();
  news.reserve(size_t(misses));
  std::vector<int64_t>& starts = plan.starts;
  starts.assign(held_buckets + 1, 0);
  for (int64_t i = 0; i < misses; ++i) {
    if (i + PREFETCH < misses) __builtin_prefetch(&seen[seen_home(missed[size_t(i + PREFETCH)])]);
    const int64_t id = missed[size_t(i)];
    uint64_t at = seen_home(id);
    while (seen[at].id != EMPTY && seen[at].id != id) at = (at + 1) & seen_mask;
    if (seen[at].id == id) {
      ++news[size_t(seen[at].at)].count;
      continue;
    }
    const int64_t bucket = bucket_of(id, buckets) - first_bucket;
    if (bucket < 0 || bucket >= held_buckets) return ERR_BUCKET;
    ++starts[bucket + 1];
    seen[at] = {id, int64_t(news.size())};
    news.push_back({id, 1, bucket});
  }
  // the largest contest's sizes, for the contests' arrays (allocated before the first write:
  // out of memory changes nothing)
  size_t& most_slots = plan.most_slots;
  size_t& most_news = plan.most_news;
  most_slots = most_news = 0;
  for (int64_t b = 0; b < held_buckets; ++b) {
    most_news = std::max(most_news, size_t(starts[b + 1]));
    starts[b + 1] += starts[b];
    most_slots = std::max(most_slots, size_t(bucket_starts[b + 1] - 1 - bucket_starts[b]));
  }
  // grouped by bucket (a counting sort)
  std::vector<Seen>& grouped = plan.grouped;
  grouped.resize(news.size());
  {
    std::vector<int64_t> next(starts.begin(), starts.end() - 1);
    for (const Seen& n : news) grouped[size_t(next[n.bucket]++)] = n;
  }
  return 0;
}

// `plan_lfu`'s plan written: counts, the contests' winners into raw ids, counts and the index,
// the global rows that changed hands into `changed` (sorted), stats = {rows changed, ids that
// lost their row}. Allocates nothing; fails only on an index that disagrees with the rows
// (ERR_ABSENT, ERR_FULL), midway.
int apply_lfu(const LfuTable& table, const LfuPlan& plan, ContestArrays& arrays,
              int64_t* changed, int64_t* stats) {
  const int64_t held_buckets = table.held_buckets, row_offset = table.row_offset;
  const int64_t* bucket_starts = table.bucket_starts;
  int64_t* raw_ids = table.raw_ids;
  int64_t* counts = table.counts;
  const std::vector<int64_t>& starts = plan.starts;
  Index index(table.slots, table.log2);
  stats[0] = stats[1] = 0;
  int64_t* lose = arrays.lose.data();
  int64_t* win = arrays.win.data();
  for (const int64_t row : plan.hit_rows) ++counts[row];
  int64_t changes = 0, evicted = 0;
  for (int64_t bucket = 0; bucket < held_buckets; ++bucket) {
    const Seen* mine = plan.grouped.data() + starts[bucket];
    const int64_t mine_count = starts[bucket + 1] - starts[bucket];
    if (mine_count == 0) continue;
    const int64_t start = bucket_starts[bucket];
    const int64_t slots = bucket_starts[bucket + 1] - 1 - start;
    const int64_t pairs = contest<int64_t>(
        slots, [&](int64_t r) { return counts[start + r]; }, raw_ids + start, mine_count,
        [&](int64_t i) { return mine[i].count; }, [&](int64_t i) { return mine[i].id; },
        lose, win, arrays.scratch);
    const int64_t first_change = changes;
    for (int64_t p = 0; p < pairs; ++p) {
      if (p + PREFETCH < pairs) {  // the index slots of a later pair (a fill's are thousands)
        index.prefetch(mine[win[p + PREFETCH]].id);
        const int64_t leaving = raw_ids[start + lose[p + PREFETCH]];
        if (leaving != FREE_ID) index.prefetch(leaving);
      }
      const int64_t row = start + lose[p];
      if (raw_ids[row] != FREE_ID) {
        if (int code = index.erase(raw_ids[row])) return code;
        ++evicted;
      }
      const Seen& winner = mine[win[p]];
      if (int code = index.insert(winner.id, row + row_offset)) return code;
      raw_ids[row] = winner.id;
      counts[row] = winner.count;
      changed[changes++] = row + row_offset;
    }
    std::sort(changed + first_change, changed + changes);  // buckets ascend: all sorted
  }
  stats[0] = changes;
  stats[1] = evicted;
  return 0;
}

}  // namespace

// The whole LFU evictions of `tables` modules without a threshold filter (MCHManagedCollision
// Module._coalesce_and_evict's result), in one call. Table t: each of the `id_counts[t]` ids
// seen since its last one (`id_ptrs[t]`) that holds a row adds one to its row's count
// (`count_ptrs[t]`, `row_counts[t]` rows, in place); the others are coalesced (a hash of those
// ids alone, not a sort) and compete, bucket by bucket (local bucket = id % buckets -
// first_bucket, its rows [bucket_starts[b], bucket_starts[b + 1] - 1): the last is its reserved
// row; `held_buckets[t]` buckets, starts at `bucket_start_ptrs[t]`) with their counts as
// scores, ties by id (`contest`). Each row changing hands gets its new id in the raw ids
// (`raw_id_ptrs[t]`, INT64_MAX = free) and counts, and in the index (`log2s`, `slot_ptrs`,
// `helds` ids; rows global: local + `row_offsets[t]`). Writes table t's global rows that changed
// hands (sorted) to `changed` from the sum of the id counts before t (`changed_count` in all),
// and stats[2 t] = rows changed, stats[2 t + 1] = ids that lost their row. Every table's
// arguments and history are checked and all scratch is allocated before the first table is
// written (an error or out of memory changes nothing), then the tables are written in order;
// only an index that disagrees with its rows (ERR_ABSENT, ERR_FULL) fails midway, with the
// tables before it written. The tables' arrays must be distinct.
extern "C" int rs_mc_evict_lfu_tables(int64_t tables, const int64_t* log2s,
                                      const int64_t* slot_ptrs, const int64_t* helds,
                                      const int64_t* id_counts, const int64_t* id_ptrs,
                                      const int64_t* row_counts, const int64_t* raw_id_ptrs,
                                      const int64_t* count_ptrs, const int64_t* held_buckets,
                                      const int64_t* bucket_start_ptrs, const int64_t* buckets,
                                      const int64_t* first_buckets, const int64_t* row_offsets,
                                      int64_t changed_count, int64_t* changed,
                                      int64_t* stats) try {
  if (tables < 0) return ERR_ARGUMENT;
  std::vector<int64_t> changed_at(size_t(tables) + 1, 0);
  for (int64_t t = 0; t < tables; ++t) {
    if (id_counts[t] < 0 || id_counts[t] > changed_count - changed_at[t]) return ERR_ARGUMENT;
    changed_at[t + 1] = changed_at[t] + id_counts[t];
  }
  if (changed_at[tables] != changed_count) return ERR_ARGUMENT;
  auto as = [](int64_t address) { return reinterpret_cast<int64_t*>(address); };
  std::vector<LfuTable> args(tables);
  for (int64_t t = 0; t < tables; ++t)
    args[t] = {log2s[t],          as(slot_ptrs[t]),         helds[t],   id_counts[t],
               as(id_ptrs[t]),    row_counts[t],            as(raw_id_ptrs[t]), as(count_ptrs[t]),
               held_buckets[t],   as(bucket_start_ptrs[t]), buckets[t], first_buckets[t],
               row_offsets[t]};
  // the plans and arrays are kept from call to call, per thread (as the coalescing hash):
  // fresh ones were fresh pages at every call, all tables' at once
  static thread_local std::vector<LfuPlan> plans;
  static thread_local PlanArrays plan_arrays;
  static thread_local ContestArrays contest_arrays;
  if (plans.size() < size_t(tables)) plans.resize(tables);
  size_t most_slots = 0, most_news = 0;
  for (int64_t t = 0; t < tables; ++t) {
    if (int code = plan_lfu(args[t], plans[t], plan_arrays)) return code;
    most_slots = std::max(most_slots, plans[t].most_slots);
    most_news = std::max(most_news, plans[t].most_news);
  }
  contest_arrays.reserve(most_slots, most_news);
  for (int64_t t = 0; t < tables; ++t)
    if (int code =
            apply_lfu(args[t], plans[t], contest_arrays, changed + changed_at[t], stats + 2 * t))
      return code;
  return 0;
} catch (...) {
  return exception_code();
}
