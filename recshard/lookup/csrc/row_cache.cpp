// The key_value row cache's per-batch bookkeeping (recshard/lookup/key_value.py) in one call.
//
// rc_assign takes a batch's ids of one table (any order, repeated) and the cache's state
// arrays, and does what `_RowCache.ensure` does in torch: finds the distinct rows, sets the
// CLOCK reference bit of the cached ones (not of rows a prefetch brought in that no forward has
// read yet: `fresh`), takes a slot for each row not cached (slots never used first, then the
// CLOCK hand's victims, never a slot of this batch or one pinned by a batch in flight), lists
// the updated victims (sorted by row) for the write-back, and updates the row <-> slot maps.
// The caller reads the missing rows into their slots afterwards (row_io.cpp). With `forward`
// it also writes every id's slot, clears `fresh` of the batch's rows and pins them (one count
// per distinct slot, released by the update); with `pin` alone zero, nothing is pinned.
//
// The caller has checked every buffer's size and every id's range (native_row_cache.py); ids
// are checked here again before anything changes. A batch whose missing rows outnumber the
// free slots changes nothing and returns RC_OVERFLOW (free slots in *detail, the missing rows
// in counts[0]).
//
// Returns 0, RC_BAD_ID (position in *detail), RC_OVERFLOW, or RC_BAD_STATE (a map entry out
// of range: the arrays were changed behind the cache's back; the row or slot in *detail).

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

constexpr int RC_OK = 0;
constexpr int RC_BAD_ID = 1;
constexpr int RC_OVERFLOW = 2;
constexpr int RC_BAD_STATE = 3;

constexpr uint8_t kInBatch = 1;  // scratch marks, cleared before returning
constexpr uint8_t kTaken = 2;

}  // namespace

// counts (out): [0] missing rows, [1] distinct rows, [2] updated victims, [3] distinct slots
// pinned. cursor (in/out): [0] the CLOCK hand, [1] slots [filled, capacity) never used.
extern "C" int rc_assign(const int64_t* ids, int64_t count, int64_t rows, int32_t* row_slot,
                         int64_t* slot_row, uint8_t* referenced, uint8_t* fresh, uint8_t* dirty,
                         int32_t* pins, uint8_t* scratch, int64_t capacity, int64_t* cursor,
                         int forward, int pin, int64_t* id_slots, int64_t* missing,
                         int64_t* victims, int64_t* dirty_rows, int64_t* dirty_slots,
                         int64_t* pinned, int64_t* counts, int64_t* detail) {
  *detail = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (ids[i] < 0 || ids[i] >= rows) {
      *detail = i;
      return RC_BAD_ID;
    }
    if (row_slot[ids[i]] < -1 || row_slot[ids[i]] >= capacity) {  // the maps are corrupt
      *detail = ids[i];
      return RC_BAD_STATE;
    }
  }
  // Distinct rows: cached ones marked in scratch, missing ones marked -2 in row_slot until
  // their slots are known.
  std::vector<int64_t> batch_slots;
  int64_t misses = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t row = ids[i];
    const int32_t slot = row_slot[row];
    if (slot >= 0) {
      if (!(scratch[slot] & kInBatch)) {
        scratch[slot] |= kInBatch;
        batch_slots.push_back(slot);
      }
    } else if (slot == -1) {
      row_slot[row] = -2;  // listed; its slot comes below
      if (misses < capacity) missing[misses] = row;
      ++misses;  // more than `capacity`: an overflow, found below
    }
  }
  int64_t& hand = cursor[0];
  int64_t& filled = cursor[1];
  if (capacity > 0 && (hand < 0 || hand >= capacity || filled < 0 || filled > capacity)) {
    for (int64_t i = 0; i < count; ++i) {
      if (row_slot[ids[i]] == -2) row_slot[ids[i]] = -1;
    }
    for (int64_t s : batch_slots) scratch[s] = 0;
    *detail = hand;
    return RC_BAD_STATE;
  }
  const bool fill = misses <= capacity - filled;
  int64_t free_slots = capacity - filled;
  if (!fill) {
    int64_t kept = static_cast<int64_t>(batch_slots.size());
    for (int64_t s = 0; s < capacity; ++s) kept += pins[s] > 0 && !(scratch[s] & kInBatch);
    free_slots = capacity - kept;
  }
  if (misses > free_slots) {
    for (int64_t i = 0; i < count; ++i) {
      if (row_slot[ids[i]] == -2) row_slot[ids[i]] = -1;
    }
    for (int64_t s : batch_slots) scratch[s] = 0;
    counts[0] = misses;
    *detail = free_slots;
    return RC_OVERFLOW;
  }
  for (int64_t s : batch_slots) {
    if (!fresh[s]) referenced[s] = 1;
  }
  std::sort(missing, missing + misses);
  int64_t dirty_count = 0;
  if (fill) {
    for (int64_t k = 0; k < misses; ++k) victims[k] = filled + k;
    filled += misses;
  } else {
    // CLOCK: the hand passes slots of this batch and pinned ones untouched, clears a set
    // reference bit, takes a clear one.
    int64_t taken = 0;
    while (taken < misses) {
      const int64_t s = hand;
      hand = hand + 1 == capacity ? 0 : hand + 1;
      if (scratch[s] || pins[s] > 0) continue;
      if (referenced[s]) {
        referenced[s] = 0;
        continue;
      }
      if (slot_row[s] >= rows) {  // the maps are corrupt: stop before indexing with it
        *detail = s;
        return RC_BAD_STATE;
      }
      scratch[s] = kTaken;
      victims[taken++] = s;
    }
    filled = capacity;
    std::vector<std::pair<int64_t, int64_t>> written;  // (row, slot) of updated victims
    for (int64_t k = 0; k < misses; ++k) {
      const int64_t s = victims[k];
      scratch[s] = 0;
      const int64_t old = slot_row[s];
      if (old >= 0) {
        row_slot[old] = -1;
        if (dirty[s]) written.emplace_back(old, s);
      }
      dirty[s] = 0;
    }
    std::sort(written.begin(), written.end());
    for (const auto& [row, slot] : written) {
      dirty_rows[dirty_count] = row;
      dirty_slots[dirty_count++] = slot;
    }
  }
  for (int64_t k = 0; k < misses; ++k) {
    const int64_t s = victims[k];
    slot_row[s] = missing[k];
    row_slot[missing[k]] = static_cast<int32_t>(s);
    referenced[s] = 0;
    fresh[s] = 1;
  }
  int64_t pinned_count = 0;
  if (forward) {
    for (int64_t i = 0; i < count; ++i) id_slots[i] = row_slot[ids[i]];
    for (int64_t s : batch_slots) fresh[s] = 0;
    for (int64_t k = 0; k < misses; ++k) fresh[victims[k]] = 0;
    if (pin) {
      for (int64_t s : batch_slots) pinned[pinned_count++] = s;
      for (int64_t k = 0; k < misses; ++k) pinned[pinned_count++] = victims[k];
      for (int64_t k = 0; k < pinned_count; ++k) ++pins[pinned[k]];
    }
  }
  for (int64_t s : batch_slots) scratch[s] = 0;
  counts[0] = misses;
  counts[1] = static_cast<int64_t>(batch_slots.size()) + misses;
  counts[2] = dirty_count;
  counts[3] = pinned_count;
  return RC_OK;
}

// Releases the pins of `slots` (a forward's distinct slots) and marks them updated.
extern "C" void rc_release(const int64_t* slots, int64_t count, int32_t* pins, uint8_t* dirty,
                           int updated) {
  for (int64_t i = 0; i < count; ++i) {
    --pins[slots[i]];
    if (updated) dirty[slots[i]] = 1;
  }
}
