// recshard's CPU embedding-bag kernel: pooled forward, and backward with a fused exact
// update (row-wise Adagrad or SGD), over a batch of fp32 tables held back to back.
//
// Plain C++ with a C ABI (no torch headers: it compiles in about two seconds); Python calls
// it through ctypes on tensors' data pointers (recshard/lookup/native_tbe.py). One thread per
// call. The hot loops are compiled twice (baseline x86-64 and x86-64-v3: AVX2 + FMA) and
// picked at load time by GCC's function multi-versioning (`target_clones`, an ifunc); the
// common dims (32, 64, 128) get loops of a fixed length.
//
// Layout: table t's rows [rows_t, dim_t] start at float `weight_start[t]` of `weights`, its
// global rows at `row_start[t]` (`row_start[T]`: all rows; `momentum` [all rows]); feature f
// reads table `feature_table[f]` and pools into columns from `feature_column[f]` of the
// output [B, width]; bags feature-major (bag = f * B + b), `offsets` [F * B + 1] from 0.
//
// Backward: every id's global row is radix-sorted (one sort over all tables), then each
// distinct row's gradient is summed in a dim-float accumulator from its ids' bags'
// output-gradient rows and the row is updated once (fbgemm's "exact" optimizers):
//   row-wise Adagrad: m += mean(g * g);  w -= lr * (1 / (sqrt(m) + eps)) * g
//   SGD:              w -= lr * g
//
// Same bytes as the torch kernel (recshard/lookup/kernels.py): every float is rounded where
// torch rounds it. Built with -ffp-contract=off (no multiply-add is fused behind our back);
// the one fused multiply-add is explicit, where torch's weighted bags (fbgemm) use one. MEAN
// divides by the length (torch's `pooled / lengths`, `grad / lengths`) rather than
// multiplying by a rounded reciprocal; the Adagrad multiplier is lr times a reciprocal
// (torch's `lr / tensor`).
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RS_CLONES __attribute__((target_clones("default", "arch=x86-64-v3")))
#else
#define RS_CLONES
#endif

namespace {

constexpr int kPrefetch = 16;        // ids ahead whose rows are prefetched
constexpr int kPrefetchUpdate = 16;  // ids ahead whose weight row (read, then written) is
                                     // prefetched, with its momentum (8-16 alike, 24+ slower)

inline void prefetch_row(const float* row, int64_t dim) {
  for (int64_t i = 0; i < dim; i += 16) __builtin_prefetch(row + i, 0, 3);
}

inline void prefetch_row_for_write(const float* row, int64_t dim) {
  for (int64_t i = 0; i < dim; i += 16) __builtin_prefetch(row + i, 1, 3);
}

struct Layout {
  const int64_t* row_start;       // [T + 1]
  const int64_t* weight_start;    // [T]
  const int64_t* table_dim;       // [T]
  const int64_t* feature_table;   // [F]
  const int64_t* feature_column;  // [F]
  int64_t tables, features, batch, width;
};

// Whether every id in [begin, end) is below `rows` (one branch-free pass).
template <typename Index>
bool ids_below(const Index* indices, int64_t begin, int64_t end, uint64_t rows) {
  uint64_t bad = 0;
  for (int64_t p = begin; p < end; ++p) bad |= uint64_t(uint64_t(indices[p]) >= rows);
  return bad == 0;
}

// The position of the first id outside its table's rows, or -1 (ids in feature-major order).
template <typename Index, typename Offset>
int64_t first_id_outside(const Layout& l, const Index* indices, const Offset* offsets) {
  for (int64_t f = 0; f < l.features; ++f) {
    const int64_t t = l.feature_table[f];
    const uint64_t rows = uint64_t(l.row_start[t + 1] - l.row_start[t]);
    for (int64_t p = offsets[f * l.batch]; p < int64_t(offsets[(f + 1) * l.batch]); ++p) {
      if (uint64_t(indices[p]) >= rows) return p;
    }
  }
  return -1;
}

typedef float Vec8 __attribute__((vector_size(32)));  // 8 floats; 2 SSE halves without AVX

// One feature's bags (ids already checked against its table). kDim: the dim when known at
// compile time (a multiple of 8: the bag's sum stays in registers), else 0 (read `dim_arg`).
// Every float's sum adds the ids in order: `a[d] += row[d]`, or with per-sample weights
// (kWeighted) `a[d] = fma(weight, row[d], a[d])`, one rounding per id as torch's weighted bags
// (fbgemm's) take it. MEAN then divides by the length, as torch's `pooled / lengths`.
template <int kDim, bool kWeighted, typename Index, typename Offset>
RS_CLONES void pool_feature(const float* table, int64_t dim_arg, int64_t batch,
                            const Index* indices, const Offset* offsets,
                            const float* per_sample_weights, int mean, float* out,
                            int64_t width) {
  constexpr int kVecs = kDim / 8;
  const int64_t dim = kDim ? kDim : dim_arg;
  std::vector<float> dynamic(kDim ? 0 : dim);
  float* __restrict a = dynamic.data();
  const int64_t feature_end = offsets[batch];
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t begin = offsets[b], end = offsets[b + 1];
    Vec8 acc[kVecs ? kVecs : 1] = {};
    if (!kDim) {
      for (int64_t d = 0; d < dim; ++d) a[d] = 0.f;
    }
    for (int64_t p = begin; p < end; ++p) {
      if (p + kPrefetch < feature_end) {
        prefetch_row(table + int64_t(indices[p + kPrefetch]) * dim, dim);
      }
      const float* __restrict row = table + int64_t(indices[p]) * dim;
      const float scale = kWeighted ? per_sample_weights[p] : 1.f;
      if (kDim) {
#pragma GCC unroll 16
        for (int v = 0; v < kVecs; ++v) {
          Vec8 r;
          std::memcpy(&r, row + 8 * v, sizeof r);
          if (kWeighted) {
            for (int lane = 0; lane < 8; ++lane) {
              acc[v][lane] = __builtin_fmaf(scale, r[lane], acc[v][lane]);
            }
          } else {
            acc[v] += r;
          }
        }
      } else {
        for (int64_t d = 0; d < dim; ++d) {
          a[d] = kWeighted ? __builtin_fmaf(scale, row[d], a[d]) : a[d] + row[d];
        }
      }
    }
    float* __restrict o = out + b * width;
    const bool divide = mean && end > begin;
    const float length = float(end - begin);
    if (kDim) {
#pragma GCC unroll 16
      for (int v = 0; v < kVecs; ++v) {  // one vector at a time: `acc` stays in registers
        const Vec8 r = divide ? acc[v] / length : acc[v];
        std::memcpy(o + 8 * v, &r, sizeof r);
      }
    } else {
      for (int64_t d = 0; d < dim; ++d) o[d] = divide ? a[d] / length : a[d];
    }
  }
}

// -1, or the position of the first id outside its table (the output is then incomplete).
// Feature by feature (a table's rows stay cached while its ids are pooled); a feature's ids
// are checked against its table in one pass before its bags are pooled, and each bag's sum
// keeps its ids' order.
template <typename Index, typename Offset>
int64_t forward_impl(const float* weights, const Layout& l, const Index* indices,
                     const Offset* offsets, const float* per_sample_weights, int mean,
                     float* out) {
  for (int64_t f = 0; f < l.features; ++f) {
    const int64_t t = l.feature_table[f], dim = l.table_dim[t];
    const Offset* bags = offsets + f * l.batch;
    const uint64_t rows = uint64_t(l.row_start[t + 1] - l.row_start[t]);
    if (!ids_below(indices, bags[0], bags[l.batch], rows)) {
      return first_id_outside(l, indices, offsets);
    }
    const float* table = weights + l.weight_start[t];
    float* o = out + l.feature_column[f];
#define RS_FEATURE(D)                                                                       \
  (per_sample_weights                                                                       \
       ? pool_feature<D, true>(table, dim, l.batch, indices, bags, per_sample_weights, mean, o, \
                               l.width)                                                     \
       : pool_feature<D, false>(table, dim, l.batch, indices, bags, nullptr, mean, o, l.width))
    if (dim == 64) RS_FEATURE(64);
    else if (dim == 128) RS_FEATURE(128);
    else if (dim == 32) RS_FEATURE(32);
    else RS_FEATURE(0);
#undef RS_FEATURE
  }
  return -1;
}

// Scratch reused across calls (per thread): no per-step allocation of id-sized buffers.
// `pairs`: one (key << 32 | value) per id, sorted by key.
struct Scratch {
  std::vector<uint64_t> pairs, pairs_tmp;
  std::vector<uint32_t> grad_at, bag_of;
};
thread_local Scratch scratch;

inline uint32_t key_of(uint64_t pair) { return uint32_t(pair >> 32); }
inline uint32_t value_of(uint64_t pair) { return uint32_t(pair); }

// Stable LSD radix sort of `scratch.pairs` by key, 11-bit digits over the bits `max_key` needs;
// every digit's histogram is counted in one pass over the keys, then one scatter per digit.
void radix_sort(uint32_t max_key, int64_t n) {
  constexpr int kBits = 11, kBuckets = 1 << kBits, kMaxDigits = (32 + kBits - 1) / kBits;
  auto& s = scratch;
  int digits = 0;
  while (digits < kMaxDigits && (uint64_t(max_key) >> (kBits * digits))) ++digits;
  std::vector<int64_t> count(size_t(digits) * kBuckets, 0);
  uint64_t *p = s.pairs.data(), *pt = s.pairs_tmp.data();
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t key = key_of(p[i]);
    for (int d = 0; d < digits; ++d) ++count[d * kBuckets + ((key >> (kBits * d)) & (kBuckets - 1))];
  }
  for (int d = 0; d < digits; ++d) {
    int64_t* at = count.data() + d * kBuckets;
    int64_t sum = 0;
    for (int i = 0; i < kBuckets; ++i) {
      const int64_t c = at[i];
      at[i] = sum;
      sum += c;
    }
    const int shift = 32 + kBits * d;
    for (int64_t i = 0; i < n; ++i) pt[at[(p[i] >> shift) & (kBuckets - 1)]++] = p[i];
    std::swap(p, pt);
  }
  if (p != s.pairs.data()) std::memcpy(s.pairs.data(), p, n * sizeof(uint64_t));
}

// Keys: each id's global row. Values: where its bag's output-gradient row starts (a float
// index, b * width + column), or with kByPosition (per-sample weights or MEAN need it) the
// id's position, whose gradient row and bag `grad_at` and `bag_of` then hold.
// -1, or the position of the first id outside its table (nothing sorted then).
template <bool kByPosition, typename Index, typename Offset>
int64_t sort_ids(const Layout& l, const Index* indices, const Offset* offsets, int64_t n) {
  auto& s = scratch;
  if (int64_t(s.pairs.size()) < n) {
    s.pairs.resize(n);
    s.pairs_tmp.resize(n);
  }
  if (kByPosition && int64_t(s.grad_at.size()) < n) {
    s.grad_at.resize(n);
    s.bag_of.resize(n);
  }
  uint64_t* __restrict pairs = s.pairs.data();
  uint32_t* __restrict grad_at = s.grad_at.data();
  uint32_t* __restrict bag_of = s.bag_of.data();
  for (int64_t f = 0; f < l.features; ++f) {
    const int64_t t = l.feature_table[f];
    const uint32_t start = uint32_t(l.row_start[t]);
    const uint64_t rows = uint64_t(l.row_start[t + 1] - l.row_start[t]);
    for (int64_t b = 0; b < l.batch; ++b) {
      const int64_t bag = f * l.batch + b;
      const uint32_t at = uint32_t(b * l.width + l.feature_column[f]);
      for (int64_t p = offsets[bag]; p < offsets[bag + 1]; ++p) {
        if (uint64_t(indices[p]) >= rows) return p;
        const uint64_t key = uint64_t(start + uint32_t(indices[p])) << 32;
        if (kByPosition) {
          pairs[p] = key | uint32_t(p);
          grad_at[p] = at;
          bag_of[p] = uint32_t(bag);
        } else {
          pairs[p] = key | at;
        }
      }
    }
  }
  radix_sort(uint32_t(l.row_start[l.tables] - 1), n);
  return -1;
}

// One distinct row's gradient sum. kDim > 0 (a multiple of 8): in registers, as 8-float
// vectors; kDim == 0: `dim` floats in memory. Either way float d adds its terms in order
// (`a[d] += scale * g[d]`), and `square_sum` adds `a[d] * a[d]` for d = 0, 1, ... in order,
// so both give the same bits.
template <int kDim>
struct RowSum {
  static constexpr int kVecs = kDim / 8;
  Vec8 acc[kVecs];
  explicit RowSum(int64_t) {}
  void zero() {
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v) acc[v] = Vec8{};
  }
  void add(float scale, const float* __restrict g) {
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v) {
      Vec8 r;
      std::memcpy(&r, g + 8 * v, sizeof r);
      acc[v] += scale * r;
    }
  }
  void add_mean(float length, float scale, const float* __restrict g) {
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v) {
      Vec8 r;
      std::memcpy(&r, g + 8 * v, sizeof r);
      acc[v] += r / length * scale;
    }
  }
  float square_sum() const {
    float sum = 0.f;
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v) {
      const Vec8 squares = acc[v] * acc[v];
      for (int lane = 0; lane < 8; ++lane) sum += squares[lane];
    }
    return sum;
  }
  void apply(float* __restrict w, float multiplier) const {  // w -= multiplier * sum
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v) {
      Vec8 r;
      std::memcpy(&r, w + 8 * v, sizeof r);
      r -= multiplier * acc[v];
      std::memcpy(w + 8 * v, &r, sizeof r);
    }
  }
};

template <>
struct RowSum<0> {
  std::vector<float> a;
  explicit RowSum(int64_t dim) : a(dim) {}
  void zero() { std::fill(a.begin(), a.end(), 0.f); }
  void add(float scale, const float* __restrict g) {
    for (size_t d = 0; d < a.size(); ++d) a[d] += scale * g[d];
  }
  void add_mean(float length, float scale, const float* __restrict g) {
    for (size_t d = 0; d < a.size(); ++d) a[d] += g[d] / length * scale;
  }
  float square_sum() const {
    float sum = 0.f;
    for (const float x : a) sum += x * x;
    return sum;
  }
  void apply(float* __restrict w, float multiplier) const {
    for (size_t d = 0; d < a.size(); ++d) w[d] -= multiplier * a[d];
  }
};

// The sorted ids [begin, end) of one table: its rows start at `table` (global row `first`).
// kRowwise: row-wise Adagrad (`momentum` [all rows]), else SGD (`momentum` unused).
template <int kDim, bool kByPosition, bool kRowwise, typename Offset>
RS_CLONES void update_table(float* table, float* momentum, int64_t first, int64_t dim_arg,
                            int64_t begin, int64_t end, const Offset* offsets,
                            const float* per_sample_weights, int mean, const float* grad,
                            float lr, float eps, float* per_sample_grad) {
  const int64_t dim = kDim ? kDim : dim_arg;
  const auto& s = scratch;
  const uint64_t* pairs = s.pairs.data();
  const uint32_t* grad_at = s.grad_at.data();
  const uint32_t* bag_of = s.bag_of.data();
  RowSum<kDim> sum(dim);
  auto grad_row = [&](int64_t j) {
    return grad + (kByPosition ? grad_at[value_of(pairs[j])] : value_of(pairs[j]));
  };
  int64_t i = begin;
  while (i < end) {
    const uint32_t key = key_of(pairs[i]);
    float* __restrict w = table + (int64_t(key) - first) * dim;
    sum.zero();
    int64_t j = i;
    for (; j < end && key_of(pairs[j]) == key; ++j) {
      if (j + kPrefetch < end) prefetch_row(grad_row(j + kPrefetch), dim);
      const int64_t ahead = j + kPrefetchUpdate;
      if (ahead < end && key_of(pairs[ahead]) != key_of(pairs[ahead - 1])) {
        prefetch_row_for_write(table + (int64_t(key_of(pairs[ahead])) - first) * dim, dim);
        if (kRowwise) __builtin_prefetch(momentum + key_of(pairs[ahead]), 1, 3);
      }
      const float* __restrict go = grad_row(j);
      if (!kByPosition) {
        sum.add(1.f, go);
        continue;
      }
      const uint32_t p = value_of(pairs[j]);
      const uint32_t bag = bag_of[p];
      const float length = float(int64_t(offsets[bag + 1]) - int64_t(offsets[bag]));
      if (per_sample_grad) {  // d out / d weight of this id: its row (before the update) . grad
        float dot = 0.f;
        for (int64_t d = 0; d < dim; ++d) dot += w[d] * go[d];
        per_sample_grad[p] = mean ? dot / length : dot;
      }
      const float scale = per_sample_weights ? per_sample_weights[p] : 1.f;
      if (mean) {
        sum.add_mean(length, scale, go);
      } else {
        sum.add(scale, go);
      }
    }
    float multiplier = lr;
    if (kRowwise) {
      const float m = momentum[key] + sum.square_sum() / float(dim);
      momentum[key] = m;
      multiplier = lr * (1.f / (std::sqrt(m) + eps));  // as torch's `lr / tensor`
    }
    sum.apply(w, multiplier);
    i = j;
  }
}

template <bool kByPosition, bool kRowwise, typename Index, typename Offset>
int64_t backward_sorted(float* weights, float* momentum, const Layout& l, const Index* indices,
                     const Offset* offsets, const float* per_sample_weights, int mean,
                     const float* grad, float lr, float eps, float* per_sample_grad, int64_t n) {
  const int64_t bad = sort_ids<kByPosition>(l, indices, offsets, n);
  if (bad >= 0) return bad;  // before any update
  const uint64_t* pairs = scratch.pairs.data();
  int64_t begin = 0;
  for (int64_t t = 0; t < l.tables && begin < n; ++t) {  // tables' rows ascend with t
    const uint64_t next_table = uint64_t(l.row_start[t + 1]) << 32;  // its first (key, 0)
    const int64_t end = std::lower_bound(pairs + begin, pairs + n, next_table) - pairs;
    if (end == begin) continue;
    float* table = weights + l.weight_start[t];
    const int64_t first = l.row_start[t], dim = l.table_dim[t];
#define RS_TABLE(D)                                                                      \
  update_table<D, kByPosition, kRowwise>(table, momentum, first, dim, begin, end, offsets,        \
                               per_sample_weights, mean, grad, lr, eps, per_sample_grad)
    if (dim == 64) RS_TABLE(64);
    else if (dim == 128) RS_TABLE(128);
    else if (dim == 32) RS_TABLE(32);
    else RS_TABLE(0);
#undef RS_TABLE
    begin = end;
  }
  return -1;
}

// The pooled output's gradient must be contiguous [B, width]. -1, or the position of the first
// id outside its table (nothing updated then).
template <bool kRowwise, typename Index, typename Offset>
int64_t backward_impl(float* weights, float* momentum, const Layout& l, const Index* indices,
                   const Offset* offsets, const float* per_sample_weights, int mean,
                   const float* grad, float lr, float eps, float* per_sample_grad) {
  const int64_t n = int64_t(offsets[l.features * l.batch]);
  if (n <= 0) return -1;
  if (per_sample_weights || per_sample_grad || mean) {
    return backward_sorted<true, kRowwise>(weights, momentum, l, indices, offsets, per_sample_weights, mean, grad,
                          lr, eps, per_sample_grad, n);
  }
  return backward_sorted<false, kRowwise>(weights, momentum, l, indices, offsets, nullptr, 0, grad, lr, eps,
                                nullptr, n);
}

// `f(I{}, O{})` with the index and offset types of the given byte widths (4: int32, 8: int64);
// -2 for another width.
template <typename F>
int64_t with_widths(int index_bytes, int offset_bytes, F&& f) {
  if (index_bytes == 8 && offset_bytes == 8) return f(int64_t{}, int64_t{});
  if (index_bytes == 8 && offset_bytes == 4) return f(int64_t{}, int32_t{});
  if (index_bytes == 4 && offset_bytes == 8) return f(int32_t{}, int64_t{});
  if (index_bytes == 4 && offset_bytes == 4) return f(int32_t{}, int32_t{});
  return -2;
}

// The backward of either optimizer; momentum is null for SGD.
template <bool kRowwise>
int64_t backward(float* weights, float* momentum, const int64_t* row_start,
                 const int64_t* weight_start, const int64_t* table_dim, int64_t tables,
                 const int64_t* feature_table, const int64_t* feature_column, int64_t features,
                 int64_t batch, int64_t width, const void* indices, int index_bytes,
                 const void* offsets, int offset_bytes, const float* per_sample_weights, int mean,
                 const float* grad, float lr, float eps, float* per_sample_grad) {
  const Layout l{row_start, weight_start, table_dim, feature_table, feature_column,
                 tables,    features,     batch,     width};
  return with_widths(index_bytes, offset_bytes, [&](auto index, auto offset) {
    using I = decltype(index);
    using O = decltype(offset);
    return backward_impl<kRowwise, I, O>(weights, momentum, l, (const I*)indices,
                                         (const O*)offsets, per_sample_weights, mean, grad, lr,
                                         eps, per_sample_grad);
  });
}

}  // namespace

extern "C" {

// index_bytes / offset_bytes: 4 (int32) or 8 (int64). Both calls return -1 when done, the
// position of the first id outside its table's rows (>= 0), or -2 for a bad width.
int64_t rs_tbe_forward(const float* weights, const int64_t* row_start, const int64_t* weight_start,
                   const int64_t* table_dim, int64_t tables, const int64_t* feature_table,
                   const int64_t* feature_column, int64_t features, int64_t batch,
                   int64_t width, const void* indices, int index_bytes, const void* offsets,
                   int offset_bytes, const float* per_sample_weights, int mean, float* out) {
  const Layout l{row_start, weight_start, table_dim, feature_table, feature_column,
                 tables,    features,     batch,     width};
  return with_widths(index_bytes, offset_bytes, [&](auto index, auto offset) {
    using I = decltype(index);
    using O = decltype(offset);
    return forward_impl<I, O>(weights, l, (const I*)indices, (const O*)offsets,
                              per_sample_weights, mean, out);
  });
}

// per_sample_grad may be null (no gradient wanted for the per-sample weights).
int64_t rs_tbe_backward_rowwise_adagrad(float* weights, float* momentum, const int64_t* row_start,
                                    const int64_t* weight_start, const int64_t* table_dim,
                                    int64_t tables, const int64_t* feature_table,
                                    const int64_t* feature_column, int64_t features,
                                    int64_t batch, int64_t width, const void* indices,
                                    int index_bytes, const void* offsets, int offset_bytes,
                                    const float* per_sample_weights, int mean, const float* grad,
                                    float lr, float eps, float* per_sample_grad) {
  return backward<true>(weights, momentum, row_start, weight_start, table_dim, tables,
                        feature_table, feature_column, features, batch, width, indices,
                        index_bytes, offsets, offset_bytes, per_sample_weights, mean, grad, lr,
                        eps, per_sample_grad);
}

// As above, with the exact SGD update (no optimizer state; eps unused).
int64_t rs_tbe_backward_sgd(float* weights, const int64_t* row_start, const int64_t* weight_start,
                            const int64_t* table_dim, int64_t tables, const int64_t* feature_table,
                            const int64_t* feature_column, int64_t features, int64_t batch,
                            int64_t width, const void* indices, int index_bytes,
                            const void* offsets, int offset_bytes,
                            const float* per_sample_weights, int mean, const float* grad, float lr,
                            float* per_sample_grad) {
  return backward<false>(weights, nullptr, row_start, weight_start, table_dim, tables,
                         feature_table, feature_column, features, batch, width, indices,
                         index_bytes, offsets, offset_bytes, per_sample_weights, mean, grad, lr,
                         0.f, per_sample_grad);
}

}  // extern "C"

// An importable module with no Python functions: setuptools builds it as an extension, and
// native_tbe.py opens the same file with ctypes.
static struct PyModuleDef rs_module = {PyModuleDef_HEAD_INIT, "_cpu_tbe", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__cpu_tbe(void) { return PyModule_Create(&rs_module); }
