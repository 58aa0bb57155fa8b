// One bucket's eviction contest for the managed collision library (mc_index.cpp: rs_mc_contest
// over double scores, rs_mc_evict_lfu over a module's counts): which rows lose theirs to which
// new ids, paired in rank order, with its working arrays reserved ahead (`ContestScratch`) so an
// eviction allocates nothing once it writes. Integer scores within a span are counted by class
// (`contest_by_classes`); others are compared (a selection, then a sort of the few changing
// hands; a radix sort of a fill's new ids).
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t FREE_ID = INT64_MAX;  // a free row's raw id (recshard.modules.mc_base.FREE)
constexpr uint64_t SIGN = uint64_t(1) << 63;  // x ^ SIGN: int64 order as uint64 order

// New ids best first: score high to low, then key low to high.
template <class NewScore, class NewKey>
auto best_first(NewScore new_score, NewKey new_key) {
  return [=](int64_t a, int64_t b) {
    const auto sa = new_score(a), sb = new_score(b);
    return sa != sb ? sa > sb : new_key(a) < new_key(b);
  };
}

// Rows of one score, worst first: the later entry (held id high to low, then row high to low).
inline auto later_entry(const int64_t* held) {
  return [held](int64_t a, int64_t b) { return held[a] != held[b] ? held[a] > held[b] : a > b; };
}

// The score classes a contest over integer scores may count (`classes_for`): past that span of
// scores it compares instead.
size_t classes_for(size_t slots, size_t news) { return 2 * (slots + news) + 64; }

// A contest's working arrays (`contest`, `radix_sorted`), reserved before an eviction writes
// anything: a contest over at most `slots` rows and `news` new ids then allocates nothing.
struct ContestScratch {
  std::vector<int64_t> rows, order, sorted, tied, spare_rows, row_classes, new_classes, lanes;
  std::vector<uint64_t> keys, scores;
  std::vector<uint32_t> at, spare;

  void reserve(size_t slots, size_t news) {
    rows.reserve(slots);
    for (std::vector<int64_t>* v : {&tied, &spare_rows}) v->reserve(std::max(slots, news));
    for (std::vector<int64_t>* v : {&order, &sorted}) v->reserve(news);
    for (std::vector<int64_t>* v : {&row_classes, &new_classes})
      v->reserve(classes_for(slots, news) + 1);
    lanes.reserve(4 * (classes_for(slots, news) + 1));
    for (std::vector<uint64_t>* v : {&keys, &scores}) v->reserve(news);
    for (std::vector<uint32_t>* v : {&at, &spare}) v->reserve(news);
  }
};

// `order` (positions of new ids) sorted best first, score high to low, then key low to high,
// when all of them are wanted (`m`: a fill gives every candidate a row), the scores are
// integers and there are many: a stable LSD radix sort, 8 bits a pass, by key and then by
// score, each pass skipped where every value shares its byte. The keys are distinct, so the
// order is the comparison sort's; but comparing (score, key) on random ids mispredicted about
// every other branch: most of a first fill's eviction. Returns whether it sorted.
template <class Score, class NewScore, class NewKey>
bool radix_sorted(ContestScratch& scratch, int64_t m, NewScore new_score, NewKey new_key) {
  if constexpr (!std::is_integral_v<Score>) {
    return false;
  } else {
    std::vector<int64_t>& order = scratch.order;
    const size_t n = order.size();
    if (int64_t(n) != m || n < 256 || n > UINT32_MAX) return false;
    // ascending unsigned digits: keys low to high, then scores high to low
    std::vector<uint64_t>& keys = scratch.keys;
    std::vector<uint64_t>& scores = scratch.scores;
    keys.resize(n);
    scores.resize(n);
    for (size_t i = 0; i < n; ++i) {
      keys[i] = uint64_t(new_key(order[i])) ^ SIGN;
      scores[i] = ~(uint64_t(new_score(order[i])) ^ SIGN);
    }
    // positions into keys/scores, sorted in passes
    std::vector<uint32_t>& at = scratch.at;
    std::vector<uint32_t>& spare = scratch.spare;
    at.resize(n);
    spare.resize(n);
    std::iota(at.begin(), at.end(), 0u);
    for (const std::vector<uint64_t>* digits : {&keys, &scores}) {
      uint64_t all_or = 0, all_and = ~uint64_t(0);
      for (const uint64_t d : *digits) all_or |= d, all_and &= d;
      for (int shift = 0; shift < 64; shift += 8) {
        if ((((all_or ^ all_and) >> shift) & 0xFF) == 0) continue;  // one byte for all
        size_t starts[257] = {0};
        for (const uint32_t i : at) ++starts[(((*digits)[i] >> shift) & 0xFF) + 1];
        for (int b = 0; b < 256; ++b) starts[b + 1] += starts[b];
        for (const uint32_t i : at) spare[starts[((*digits)[i] >> shift) & 0xFF]++] = i;
        at.swap(spare);
      }
    }
    std::vector<int64_t>& sorted = scratch.sorted;
    sorted.resize(n);
    for (size_t i = 0; i < n; ++i) sorted[i] = order[at[i]];
    order.swap(sorted);
    return true;
  }
}

// tally[c] = how many of the `n` entries have class `class_of(i)` == c, for c < `limit` (a class
// >= limit is counted in tally[limit]): four interleaved tallies summed (most entries share a
// few classes: with one tally, each increment waited on the store of the one before).
template <class ClassOf>
void tally_classes(std::vector<int64_t>& tally, std::vector<int64_t>& lanes, int64_t n,
                   uint64_t limit, ClassOf class_of) {
  lanes.assign(4 * (limit + 1), 0);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t c = class_of(i);
    ++lanes[4 * (c < limit ? c : limit) + uint64_t(i & 3)];
  }
  tally.resize(limit + 1);
  for (uint64_t c = 0; c <= limit; ++c)
    tally[c] = lanes[4 * c] + lanes[4 * c + 1] + lanes[4 * c + 2] + lanes[4 * c + 3];
}

// Moves the `k` first of `v` under `before` to its front (0 < k < v.size(), in no order there).
// `digit(x)` is an unsigned key that `before` follows (digit(a) < digit(b): a before b): the
// entries past the k-th's top varying byte of it are dropped first (two branch-light passes),
// so the comparisons see about k of a large v. `spare` holds as many as v.
template <class Digit, class Before>
void select_first(std::vector<int64_t>& v, size_t k, Digit digit, Before before,
                  std::vector<int64_t>& spare) {
  uint64_t all_or = 0, all_and = ~uint64_t(0);
  for (const int64_t x : v) all_or |= digit(x), all_and &= digit(x);
  const uint64_t differ = all_or ^ all_and;
  if (differ != 0 && v.size() >= 64) {
    const int shift = (63 - __builtin_clzll(differ)) / 8 * 8;
    size_t counts[256] = {0};
    for (const int64_t x : v) ++counts[(digit(x) >> shift) & 0xFF];
    size_t last = 0, seen = counts[0];  // the k-th's byte, how many are at or below it
    while (seen < k && last < 255) seen += counts[++last];
    spare.clear();
    for (const int64_t x : v)
      if (((digit(x) >> shift) & 0xFF) <= last) spare.push_back(x);
    v.swap(spare);
  }
  if (k < v.size()) std::nth_element(v.begin(), v.begin() + (k - 1), v.end(), before);
}

// `contest` over integer scores spanning `width` classes from `lowest` (the worst row's score) to
// the best new id's: the rows below the best new id and the new ids above the worst row are
// counted per score (`row_classes`, `new_classes`), and those counts alone say how many change
// hands (w: the j-th best new id outscores the j-th worst row, j < w) and the scores of the
// last loser and winner. Only the rows tied at the last loser's score are ranked among
// themselves (by held id and row; a byte of the held ids drops most first), then the new ids
// at or above the last winner's score are sorted (a radix sort when many) and the first w
// taken; no comparison over the whole bucket.
template <class RowScore, class NewScore, class NewKey>
int64_t contest_by_classes(int64_t slots, RowScore row_score, const int64_t* held, int64_t news,
                           NewScore new_score, NewKey new_key, int64_t lowest, size_t width,
                           int64_t* lose, int64_t* win, ContestScratch& scratch) {
  const uint64_t top = width - 1;  // the best new id's class
  auto class_of = [&](int64_t score) { return uint64_t(score) - uint64_t(lowest); };
  std::vector<int64_t>& row_classes = scratch.row_classes;
  std::vector<int64_t>& new_classes = scratch.new_classes;
  // rows below the best new id (scores >= lowest: their class is < top), new ids above the worst
  // row (class in [1, top]; class - 1 of the others wraps past top)
  tally_classes(row_classes, scratch.lanes, slots, top,
                [&](int64_t r) { return class_of(row_score(r)); });
  tally_classes(new_classes, scratch.lanes, news, top,
                [&](int64_t i) { return class_of(new_score(i)) - 1; });
  // w: rows worst first against new ids best first, a class at a time (new_classes[c - 1]
  // counts class c)
  int64_t w = 0;
  uint64_t row_class = 0, new_class = top;
  int64_t rows_left = row_classes[0], news_left = new_classes[top - 1];
  while (row_class < new_class) {
    if (rows_left == 0) {
      rows_left = ++row_class < top ? row_classes[row_class] : 0;
    } else if (news_left == 0) {
      news_left = --new_class > 0 ? new_classes[new_class - 1] : 0;
    } else {
      const int64_t k = std::min(rows_left, news_left);
      w += k;
      rows_left -= k;
      news_left -= k;
    }
  }
  if (w == 0) return 0;
  // the last loser's class (rows below it all lose) and the last winner's (all above it win)
  uint64_t last_row = 0, last_new = top;
  int64_t rows_below = 0, news_above = 0;
  while (last_row < top && rows_below + row_classes[last_row] < w)
    rows_below += row_classes[last_row++];
  while (last_new > 1 && news_above + new_classes[last_new - 1] < w)
    news_above += new_classes[--last_new];
  // rows: a counting sort of the classes below last_row (each scanned from the last row: later
  // rows first), then the tied ones of last_row worst first (held id high to low, then row)
  const auto tie_after = later_entry(held);
  std::vector<int64_t>& losers = scratch.rows;
  std::vector<int64_t>& tied = scratch.tied;
  losers.resize(size_t(w));
  tied.clear();
  for (int64_t c = 0, at = 0; c < int64_t(last_row); ++c) {
    const int64_t n = row_classes[size_t(c)];
    row_classes[size_t(c)] = at;
    at += n;
  }
  for (int64_t r = slots - 1; r >= 0; --r) {
    const uint64_t c = class_of(row_score(r));
    if (c < last_row) {
      losers[size_t(row_classes[c]++)] = r;
    } else if (c == last_row) {
      tied.push_back(r);
    }
  }
  for (int64_t c = 0, begin = 0; c < int64_t(last_row); ++c) {
    const int64_t end = row_classes[size_t(c)];
    if (!std::is_sorted(losers.begin() + begin, losers.begin() + end, tie_after))
      std::sort(losers.begin() + begin, losers.begin() + end, tie_after);
    begin = end;
  }
  const size_t tied_rows = size_t(w - rows_below);
  if (!std::is_sorted(tied.begin(), tied.end(), tie_after)) {  // sorted: free rows (a fill)
    if (tied_rows < tied.size())
      select_first(
          tied, tied_rows, [&](int64_t r) { return ~(uint64_t(held[r]) ^ SIGN); }, tie_after,
          scratch.spare_rows);
    std::sort(tied.begin(), tied.begin() + tied_rows, tie_after);
  }
  std::copy(tied.begin(), tied.begin() + tied_rows, losers.begin() + rows_below);
  // new ids: those of last_new and above best first (a sort of them all, or of those above and
  // the tied ones with the lowest keys when those are a few of many), the first w winning
  const auto new_before = best_first(new_score, new_key);
  std::vector<int64_t>& order = scratch.order;
  order.clear();
  tied.clear();
  for (int64_t i = 0; i < news; ++i) {
    const uint64_t c = class_of(new_score(i));
    if (c - 1 >= top) continue;  // not above the worst row
    if (c > last_new) {
      order.push_back(i);
    } else if (c == last_new) {
      tied.push_back(i);
    }
  }
  const size_t tied_news = size_t(w - news_above);
  if (tied_news * 4 < tied.size()) {
    select_first(
        tied, tied_news, [&](int64_t i) { return uint64_t(new_key(i)) ^ SIGN; }, new_before,
        scratch.spare_rows);
    tied.resize(tied_news);
  }
  order.insert(order.end(), tied.begin(), tied.end());
  if (!radix_sorted<int64_t>(scratch, int64_t(order.size()), new_score, new_key))
    std::sort(order.begin(), order.end(), new_before);
  for (int64_t i = 0; i < w; ++i) {
    lose[i] = losers[size_t(w - 1 - i)];
    win[i] = order[size_t(i)];
  }
  return w;
}

// One bucket's eviction contest (recshard/modules/mc_compete.py's rank_contest, same result):
// its `slots` rows (`held[r]`: the id holding row r, INT64_MAX if free; `row_score(r)`) and
// `news` new ids (`new_score(i)`; ties by `new_key(i)`, distinct), ranked by score, highest
// first: rows by (held id, row) among equal scores, then the new ids. The first slots entries
// keep or get a row. The j-th best new id gets one exactly when it outscores the j-th worst row
// (so the winners are a prefix of the new ids best first, the losers of the rows worst first):
// integer scores within a span of classes_for(slots, news) are counted by class
// (`contest_by_classes`), others compared. Writes the rows that lose theirs (`lose`) and the new
// ids that get them (`win`, positions in the new ids), paired in rank order (the best winner
// takes the best loser); returns their count. Its working arrays are `scratch`'s (they grow
// here unless reserved for slots and news).
template <class Score, class RowScore, class NewScore, class NewKey>
int64_t contest(int64_t slots, RowScore row_score, const int64_t* held, int64_t news,
                NewScore new_score, NewKey new_key, int64_t* lose, int64_t* win,
                ContestScratch& scratch) {
  if (std::min(news, slots) == 0) return 0;
  Score best_new = new_score(0), worst_row = row_score(0);
  for (int64_t i = 1; i < news; ++i) best_new = std::max(best_new, new_score(i));
  for (int64_t r = 1; r < slots; ++r) worst_row = std::min(worst_row, row_score(r));
  if (!(best_new > worst_row)) return 0;  // nothing changes hands (the common quiet case)
  if constexpr (std::is_integral_v<Score>) {
    const uint64_t span = uint64_t(best_new) - uint64_t(worst_row);  // > 0, exact
    if (span < classes_for(size_t(slots), size_t(news)))
      return contest_by_classes(slots, row_score, held, news, new_score, new_key, worst_row,
                                size_t(span) + 1, lose, win, scratch);
  }
  // only the rows that can lose (scoring below the best new id) and the new ids that can win
  // (scoring above the worst row) are looked at, and only the few changing hands are sorted
  std::vector<int64_t>& rows = scratch.rows;
  std::vector<int64_t>& order = scratch.order;
  rows.clear();
  order.clear();
  bool free_alike = true;  // all of those rows free with one score (a first fill)
  for (int64_t r = slots - 1; r >= 0; --r) {
    if (row_score(r) < best_new) {
      free_alike &= held[r] == FREE_ID && row_score(r) == row_score(rows.empty() ? r : rows[0]);
      rows.push_back(r);
    }
  }
  for (int64_t i = 0; i < news; ++i)
    if (new_score(i) > worst_row) order.push_back(i);
  const int64_t m = std::min({news, slots, int64_t(rows.size()), int64_t(order.size())});
  // rows worst first: lower score, then (among equal scores) the later entry
  const auto later = later_entry(held);
  auto row_after = [&](int64_t a, int64_t b) {
    const Score sa = row_score(a), sb = row_score(b);
    return sa != sb ? sa < sb : later(a, b);
  };
  const auto new_before = best_first(new_score, new_key);
  if (!free_alike) {  // else they are in that order already: the later row first
    std::nth_element(rows.begin(), rows.begin() + (m - 1), rows.end(), row_after);
    std::sort(rows.begin(), rows.begin() + m, row_after);
  }
  if (!radix_sorted<Score>(scratch, m, new_score, new_key)) {
    std::nth_element(order.begin(), order.begin() + (m - 1), order.end(), new_before);
    std::sort(order.begin(), order.begin() + m, new_before);
  }
  int64_t w = 0;
  while (w < m && new_score(order[w]) > row_score(rows[w])) ++w;
  for (int64_t i = 0; i < w; ++i) {
    lose[i] = rows[w - 1 - i];
    win[i] = order[i];
  }
  return w;
}

}  // namespace
