// recshard's CPU embedding-bag kernel: pooled forward, and backward with the fused exact
// row-wise Adagrad update, over a batch of fp32 tables of one dim held back to back.
//
// Plain C++ with a C ABI (no torch headers: it compiles in about a second); Python calls it
// through ctypes on tensors' data pointers (recshard/lookup/native_tbe.py). One thread per
// call. The hot loops are compiled twice (baseline x86-64 and x86-64-v3: AVX2 + FMA) and
// picked at load time by GCC's function multi-versioning (`target_clones`, an ifunc).
//
// Layout: rows of every table back to back (`weights` [total rows, D], `momentum`
// [total rows]); feature f reads table rows starting at `row_start[f]`; bags feature-major
// (bag = f * B + b), `offsets` [F * B + 1]; the pooled output / its gradient is [B, F * D].
//
// Backward: every (row, id position) pair is radix-sorted by row (one sort over all tables),
// then each distinct row's gradient is summed in a D-float accumulator from its ids' bags'
// output-gradient rows and the row is updated once (fbgemm's "exact" optimizers):
//   m += mean(g * g);  w -= lr / (sqrt(m) + eps) * g.
#include <Python.h>

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

constexpr int kPrefetch = 16; // ids ahead whose rows are prefetched
constexpr int kPrefetchUpdate = 32;  // ids ahead whose weight row (read, then written) is

inline void prefetch_row(const float* row, int64_t dim) {
  for (int64_t i = 0; i < dim; i += 16) __builtin_prefetch(row + i, 0, 3);
}

inline void prefetch_row_for_write(const float* row, int64_t dim) {
  for (int64_t i = 0; i < dim; i += 16) __builtin_prefetch(row + i, 1, 3);
}

// kDim: the rows' dim when known at compile time (the common ones), else 0 (read `dim`).
template <int kDim, typename Index, typename Offset>
RS_CLONES void forward_impl(const float* weights, int64_t dim_arg, const int64_t* row_start,
                            int64_t features, int64_t batch, const Index* indices,
                            const Offset* offsets, const float* per_sample_weights, int mean,
                            float* out) {
  const int64_t dim = kDim ? kDim : dim_arg;
  const int64_t out_stride = features * dim;
  std::vector<float> acc(dim);
  float* __restrict a = acc.data();
  for (int64_t f = 0; f < features; ++f) {
    const float* table = weights + row_start[f] * dim;
    const int64_t feature_end = offsets[(f + 1) * batch];
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t bag = f * batch + b;
      const int64_t begin = offsets[bag], end = offsets[bag + 1];
      for (int64_t d = 0; d < dim; ++d) a[d] = 0.f;
      for (int64_t p = begin; p < end; ++p) {
        if (p + kPrefetch < feature_end) {
          prefetch_row(table + int64_t(indices[p + kPrefetch]) * dim, dim);
        }
        const float* __restrict row = table + int64_t(indices[p]) * dim;
        const float scale = per_sample_weights ? per_sample_weights[p] : 1.f;
        for (int64_t d = 0; d < dim; ++d) a[d] += scale * row[d];
      }
      const float divisor = (mean && end > begin) ? 1.f / float(end - begin) : 1.f;
      float* __restrict o = out + b * out_stride + f * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = a[d] * divisor;
    }
  }
}

// Scratch reused across calls (per thread): no per-step allocation of id-sized buffers.
struct Scratch {
  std::vector<uint32_t> keys, keys_tmp, values, values_tmp, bag_of;
};
thread_local Scratch scratch;

// LSD radix sort of (keys, values) by key, 11-bit digits over the bits `max_key` needs; stable.
void radix_sort(uint32_t max_key, int64_t n) {
  auto& s = scratch;
  int bits = 0;
  while (bits < 32 && (uint64_t(max_key) >> bits)) bits += 11;
  uint32_t *k = s.keys.data(), *kt = s.keys_tmp.data(), *v = s.values.data(),
           *vt = s.values_tmp.data();
  for (int shift = 0; shift < bits; shift += 11) {
    int64_t count[2048] = {0};
    for (int64_t i = 0; i < n; ++i) ++count[(k[i] >> shift) & 2047];
    int64_t sum = 0;
    for (int i = 0; i < 2048; ++i) {
      const int64_t c = count[i];
      count[i] = sum;
      sum += c;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = count[(k[i] >> shift) & 2047]++;
      kt[at] = k[i];
      vt[at] = v[i];
    }
    std::swap(k, kt);
    std::swap(v, vt);
  }
  if (k != s.keys.data()) {
    std::memcpy(s.keys.data(), k, n * sizeof(uint32_t));
    std::memcpy(s.values.data(), v, n * sizeof(uint32_t));
  }
}

// Keys: each id's row; values: its position (kByPosition: per-sample weights or MEAN need
// it; `bag_of` then maps it to its bag) or else straight its output-gradient slot b * F + f.
template <bool kByPosition, typename Index, typename Offset>
void sort_ids(const int64_t* row_start, int64_t features, int64_t batch, const Index* indices,
              const Offset* offsets, int64_t n, uint32_t max_key) {
  auto& s = scratch;
  if (int64_t(s.keys.size()) < n) {
    for (auto* v : {&s.keys, &s.keys_tmp, &s.values, &s.values_tmp, &s.bag_of}) v->resize(n);
  }
  uint32_t* __restrict keys = s.keys.data();
  uint32_t* __restrict values = s.values.data();
  uint32_t* __restrict bag_of = s.bag_of.data();
  for (int64_t f = 0; f < features; ++f) {
    const uint32_t start = uint32_t(row_start[f]);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t bag = f * batch + b;
      const uint32_t slot = uint32_t(b * features + f);
      for (int64_t p = offsets[bag]; p < offsets[bag + 1]; ++p) {
        keys[p] = start + uint32_t(indices[p]);
        if (kByPosition) {
          values[p] = uint32_t(p);
          bag_of[p] = uint32_t(bag);
        } else {
          values[p] = slot;
        }
      }
    }
  }
  radix_sort(max_key, n);
}

template <int kDim, bool kByPosition, typename Offset>
RS_CLONES void update_rowwise_adagrad(float* weights, float* momentum, int64_t dim_arg,
                                      int64_t features, int64_t batch, const Offset* offsets,
                                      const float* per_sample_weights, int mean,
                                      const float* grad, float lr, float eps,
                                      float* per_sample_grad, int64_t n) {
  const int64_t dim = kDim ? kDim : dim_arg;
  const auto& s = scratch;
  const uint32_t* keys = s.keys.data();
  const uint32_t* values = s.values.data();
  const uint32_t* bag_of = s.bag_of.data();
  std::vector<float> acc(dim);
  float* __restrict a = acc.data();
  auto slot_of = [&](uint32_t value) -> int64_t {
    if (!kByPosition) return value;
    const uint32_t bag = bag_of[value];
    return int64_t(bag % batch) * features + bag / batch;
  };
  int64_t i = 0;
  while (i < n) {
    const uint32_t key = keys[i];
    float* __restrict w = weights + int64_t(key) * dim;
    for (int64_t d = 0; d < dim; ++d) a[d] = 0.f;
    int64_t j = i;
    for (; j < n && keys[j] == key; ++j) {
      if (j + kPrefetch < n) prefetch_row(grad + slot_of(values[j + kPrefetch]) * dim, dim);
      if (j + kPrefetchUpdate < n && keys[j + kPrefetchUpdate] != keys[j + kPrefetchUpdate - 1]) {
        prefetch_row_for_write(weights + int64_t(keys[j + kPrefetchUpdate]) * dim, dim);
        __builtin_prefetch(momentum + keys[j + kPrefetchUpdate], 1, 0);
      }
      const float* __restrict go = grad + slot_of(values[j]) * dim;
      float scale = 1.f;
      if (kByPosition) {
        const uint32_t p = values[j];
        if (mean) {
          const uint32_t bag = bag_of[p];
          scale = 1.f / float(int64_t(offsets[bag + 1]) - int64_t(offsets[bag]));
        }
        if (per_sample_grad) {  // d out / d weight of this id: its row (before the update) . grad
          float dot = 0.f;
          for (int64_t d = 0; d < dim; ++d) dot += w[d] * go[d];
          per_sample_grad[p] = dot * scale;
        }
        if (per_sample_weights) scale *= per_sample_weights[p];
      }
      for (int64_t d = 0; d < dim; ++d) a[d] += scale * go[d];
    }
    float square_sum = 0.f;
    for (int64_t d = 0; d < dim; ++d) square_sum += a[d] * a[d];
    const float m = momentum[key] + square_sum / float(dim);
    momentum[key] = m;
    const float multiplier = lr / (std::sqrt(m) + eps);
    for (int64_t d = 0; d < dim; ++d) w[d] -= multiplier * a[d];
    i = j;
  }
}

template <bool kByPosition, typename Index, typename Offset>
void backward_sorted(float* weights, float* momentum, int64_t dim, const int64_t* row_start,
                     int64_t features, int64_t batch, const Index* indices, const Offset* offsets,
                     const float* per_sample_weights, int mean, const float* grad, float lr,
                     float eps, float* per_sample_grad, uint32_t max_key, int64_t n) {
  sort_ids<kByPosition>(row_start, features, batch, indices, offsets, n, max_key);
#define RS_UPDATE(D)                                                                        \
  update_rowwise_adagrad<D, kByPosition>(weights, momentum, dim, features, batch, offsets, \
                                         per_sample_weights, mean, grad, lr, eps,          \
                                         per_sample_grad, n)
  if (dim == 64) RS_UPDATE(64);
  else if (dim == 128) RS_UPDATE(128);
  else if (dim == 32) RS_UPDATE(32);
  else RS_UPDATE(0);
#undef RS_UPDATE
}

template <typename Index, typename Offset>
void forward_any_dim(const float* weights, int64_t dim, const int64_t* row_start,
                     int64_t features, int64_t batch, const Index* indices, const Offset* offsets,
                     const float* per_sample_weights, int mean, float* out) {
#define RS_FORWARD(D)                                                                         \
  forward_impl<D>(weights, dim, row_start, features, batch, indices, offsets, per_sample_weights, \
                  mean, out)
  if (dim == 64) RS_FORWARD(64);
  else if (dim == 128) RS_FORWARD(128);
  else if (dim == 32) RS_FORWARD(32);
  else RS_FORWARD(0);
#undef RS_FORWARD
}

// The pooled output's gradient must be contiguous [B, F * D] (slot b * F + f of D floats).
template <typename Index, typename Offset>
void backward_impl(float* weights, float* momentum, int64_t dim, const int64_t* row_start,
                   int64_t features, int64_t batch, const Index* indices, const Offset* offsets,
                   const float* per_sample_weights, int mean, const float* grad, float lr,
                   float eps, float* per_sample_grad, uint32_t max_key) {
  const int64_t n = int64_t(offsets[features * batch]);
  if (n <= 0) return;
  if (per_sample_weights || per_sample_grad || mean) {
    backward_sorted<true>(weights, momentum, dim, row_start, features, batch, indices, offsets,
                          per_sample_weights, mean, grad, lr, eps, per_sample_grad, max_key, n);
  } else {
    backward_sorted<false>(weights, momentum, dim, row_start, features, batch, indices, offsets,
                           nullptr, 0, grad, lr, eps, nullptr, max_key, n);
  }
}

}  // namespace

extern "C" {

// index_bytes / offset_bytes: 4 (int32) or 8 (int64). Returns 0, or -1 for a bad width.
int rs_tbe_forward(const float* weights, int64_t dim, const int64_t* row_start,
                   int64_t features, int64_t batch, const void* indices, int index_bytes,
                   const void* offsets, int offset_bytes, const float* per_sample_weights,
                   int mean, float* out) {
#define RS_FORWARD(I, O)                                                              \
  forward_any_dim<I, O>(weights, dim, row_start, features, batch, (const I*)indices, \
                        (const O*)offsets, per_sample_weights, mean, out)
  if (index_bytes == 8 && offset_bytes == 8) RS_FORWARD(int64_t, int64_t);
  else if (index_bytes == 8 && offset_bytes == 4) RS_FORWARD(int64_t, int32_t);
  else if (index_bytes == 4 && offset_bytes == 8) RS_FORWARD(int32_t, int64_t);
  else if (index_bytes == 4 && offset_bytes == 4) RS_FORWARD(int32_t, int32_t);
  else return -1;
#undef RS_FORWARD
  return 0;
}

// `max_key`: the largest row any id reaches (the sort's key range); per_sample_grad may be
// null (no gradient wanted for the per-sample weights).
int rs_tbe_backward_rowwise_adagrad(float* weights, float* momentum, int64_t dim,
                                    const int64_t* row_start, int64_t features, int64_t batch,
                                    const void* indices, int index_bytes, const void* offsets,
                                    int offset_bytes, const float* per_sample_weights, int mean,
                                    const float* grad, float lr, float eps,
                                    float* per_sample_grad, uint32_t max_key) {
#define RS_BACKWARD(I, O)                                                                    \
  backward_impl<I, O>(weights, momentum, dim, row_start, features, batch, (const I*)indices, \
                      (const O*)offsets, per_sample_weights, mean, grad, lr, eps,            \
                      per_sample_grad, max_key)
  if (index_bytes == 8 && offset_bytes == 8) RS_BACKWARD(int64_t, int64_t);
  else if (index_bytes == 8 && offset_bytes == 4) RS_BACKWARD(int64_t, int32_t);
  else if (index_bytes == 4 && offset_bytes == 8) RS_BACKWARD(int32_t, int64_t);
  else if (index_bytes == 4 && offset_bytes == 4) RS_BACKWARD(int32_t, int32_t);
  else return -1;
#undef RS_BACKWARD
  return 0;
}

}  // extern "C"

// An importable module with no Python functions: setuptools builds it as an extension, and
// native_tbe.py opens the same file with ctypes.
static struct PyModuleDef rs_module = {PyModuleDef_HEAD_INIT, "_cpu_tbe", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__cpu_tbe(void) { return PyModule_Create(&rs_module); }
