// DLRM's pairwise interaction (recshard/models/interaction.py), forward and backward, computing
// only the upper triangle, with the bytes of the torch path it replaces:
//
//   combined = [dense; sparse]                  [n = F + 1, D] per sample
//   out      = [dense, gram[i, j] for i < j]    gram = bmm(combined, combined^T)   [D + P]
//
// torch's bmm calls MKL's sgemm, which for the shapes checked here sums each output as one
// fused multiply-add chain from +0 in increasing order of the contracted index and then adds
// +0 (a -0 sum comes out +0). These kernels keep that chain per output and vectorize across
// outputs, never across the sum. The backward replays autograd's bmm(G, C) and bmm(C^T, G)
// over the scattered pair gradient G (zero on and below the diagonal: zero products leave a
// chain unchanged, or only change the sign of a zero, which the final +0 erases), then their
// sum. Python checks the bytes against torch on a probe of each shape before trusting them.
//
// Every function returns IA_OK, IA_NONFINITE (an output is inf or nan: an input was, or a sum
// overflowed; the caller takes the torch path, whose nan propagation the kernels do not
// replay; every input takes part in some output's chain), IA_UNSUPPORTED (no AVX-512) or
// IA_NO_MEMORY (a scratch buffer could not be allocated: the torch path runs). No C++ exception
// crosses the C boundary or leaves a thread (either would abort the process).

#include <cstdint>
#include <cstring>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's AVX-512 headers start shuffles from an "undefined" vector it then calls uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace {

constexpr int IA_OK = 0;
constexpr int IA_NONFINITE = 1;
constexpr int IA_UNSUPPORTED = 2;
constexpr int IA_NO_MEMORY = 3;

// Where pair (i, j), i < j, sits in a sample's pairs: base(i) + j, base(i) = rows 0..i-1's
// n-1, n-2, ... pairs, less i + 1.
inline int64_t pair_base(int64_t i, int64_t n) { return i * (n - 1) - i * (i - 1) / 2 - i - 1; }

#if defined(__x86_64__)

#define IA_AVX512 __attribute__((target("avx512f")))
// Unrolls a loop over a block's rows or vectors fully, so that GCC keeps its arrays of
// accumulators in registers (not on the stack, a load and store around every FMA).
#define IA_UNROLL _Pragma("GCC unroll 16")

constexpr int kRows = 6;     // forward: gram rows computed together

// Lanes [0, count) of 16, count clamped to [0, 16].
IA_AVX512 inline __mmask16 first_lanes(int64_t count) {
  if (count >= 16) return (__mmask16)0xffff;
  return count <= 0 ? (__mmask16)0 : (__mmask16)((1u << count) - 1);
}

// Lanes of x[0, count) that are inf or nan, or-ed into `bad`.
IA_AVX512 inline __mmask16 nonfinite(const float* x, int64_t count, __mmask16 bad) {
  const __m512i exponent = _mm512_set1_epi32(0x7f800000);
  for (int64_t k = 0; k < count; k += 16) {
    const __mmask16 lanes = first_lanes(count - k);
    const __m512i bits = _mm512_and_si512(_mm512_maskz_loadu_epi32(lanes, x + k), exponent);
    bad |= _mm512_mask_cmpeq_epi32_mask(lanes, bits, exponent);
  }
  return bad;
}

// Transposes the 16 x 16 block r in place (r[p] becomes column p).
IA_AVX512 inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), e = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}
// Row r of a sample's combined matrix: the dense vector, then the sparse ones.
inline const float* row(const float* dense, const float* sparse, int64_t r, int64_t d) {
  return r == 0 ? dense : sparse + (r - 1) * d;
}

// Rows i0..i0+R-1 of the gram against columns j0..j0+16V-1 (stored: the pairs among them).
template <int R, int V>
IA_AVX512 void gram_block(const float* dense, const float* sparse, float* pairs, int64_t n,
                          int64_t d, const float* columns, int64_t stride, int64_t i0,
                          int64_t j0) {
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = row(dense, sparse, i0 + r, d);
  const __m512 zero = _mm512_setzero_ps();
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = zero;
  for (int64_t k = 0; k < d; ++k) {
    __m512 column[V];
    for (int v = 0; v < V; ++v) column[v] = _mm512_loadu_ps(columns + k * stride + j0 + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 xi = _mm512_set1_ps(x[r][k]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(xi, column[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t i = i0 + r;
    float* base = pairs + pair_base(i, n);
    for (int v = 0; v < V; ++v) {
      const int64_t j = j0 + 16 * v;  // lanes j.. of which j > i and j < n are pairs
      const __mmask16 lanes = first_lanes(n - j) & ~first_lanes(i + 1 - j);
      _mm512_mask_storeu_ps(base + j, lanes, _mm512_add_ps(acc[r][v], zero));
    }
  }
}

template <int V>
IA_AVX512 void gram_rows(int64_t rows, const float* dense, const float* sparse, float* pairs,
                         int64_t n, int64_t d, const float* columns, int64_t stride, int64_t i0,
                         int64_t j0) {
  switch (rows) {
    case 1: return gram_block<1, V>(dense, sparse, pairs, n, d, columns, stride, i0, j0);
    case 2: return gram_block<2, V>(dense, sparse, pairs, n, d, columns, stride, i0, j0);
    case 3: return gram_block<3, V>(dense, sparse, pairs, n, d, columns, stride, i0, j0);
    case 4: return gram_block<4, V>(dense, sparse, pairs, n, d, columns, stride, i0, j0);
    case 5: return gram_block<5, V>(dense, sparse, pairs, n, d, columns, stride, i0, j0);
    default: return gram_block<kRows, V>(dense, sparse, pairs, n, d, columns, stride, i0, j0);
  }
}

// One sample: out = [dense, <row i, row j> for i < j]; returns its nonfinite lanes.
// columns: [d][stride] scratch for the rows transposed (column j = row j), zero past n.
IA_AVX512 __mmask16 forward_sample(const float* dense, const float* sparse, float* out,
                                   int64_t n, int64_t d, float* columns, int64_t stride) {
  for (int64_t r0 = 0; r0 < n; r0 += 16) {
    for (int64_t k0 = 0; k0 < d; k0 += 16) {
      const __mmask16 lanes = first_lanes(d - k0);
      __m512 block[16];
      for (int q = 0; q < 16; ++q)
        block[q] = r0 + q < n ? _mm512_maskz_loadu_ps(lanes, row(dense, sparse, r0 + q, d) + k0)
                              : _mm512_setzero_ps();
      transpose16(block);
      for (int64_t p = 0; p < 16 && k0 + p < d; ++p)
        _mm512_storeu_ps(columns + (k0 + p) * stride + r0, block[p]);
    }
  }
  std::memcpy(out, dense, sizeof(float) * d);
  for (int64_t i0 = 0; i0 + 1 < n; i0 += kRows) {
    const int64_t rows = i0 + kRows < n - 1 ? kRows : n - 1 - i0;
    for (int64_t j0 = i0 + 1; j0 < n; j0 += 32) {
      if (n - j0 > 16)
        gram_rows<2>(rows, dense, sparse, out + d, n, d, columns, stride, i0, j0);
      else
        gram_rows<1>(rows, dense, sparse, out + d, n, d, columns, stride, i0, j0);
    }
  }
  return nonfinite(out, d + n * (n - 1) / 2, 0);
}

// Rows r0..r0+R-1 of one sample's gradients, columns k0..k0+16V-1: row r gets
// (sum_{j > r} G[r, j] row_j + 0) + (sum_{i < r} G[i, r] row_i + 0) (each sum an FMA chain in
// increasing index from +0), row 0 then plus the output's dense gradient. The R rows share
// each row they read; the first sum is stored before the second starts, so that 2RV
// accumulators never need to live at once (R = 4, V = 4: 16 of the 32 registers).
template <int R, int V>
IA_AVX512 void gradient_block(const float* dense, const float* sparse, const float* grad_out,
                              float* grad_dense, float* grad_sparse, int64_t n, int64_t d,
                              const int64_t* bases, int64_t r0, int64_t k0) {
  const float* grad_pairs = grad_out + d;
  const __m512 zero = _mm512_setzero_ps();
  __mmask16 lanes[V];
  IA_UNROLL for (int v = 0; v < V; ++v) lanes[v] = first_lanes(d - k0 - 16 * v);
  float* out[R];
  IA_UNROLL for (int q = 0; q < R; ++q)
    out[q] = (r0 + q == 0 ? grad_dense : grad_sparse + (r0 + q - 1) * d) + k0;
  __m512 acc[R][V];
  // sum_{j > r}: rows r0.. take j from r0 + 1, all R rows from j = r0 + R on.
  IA_UNROLL for (int q = 0; q < R; ++q)
    IA_UNROLL for (int v = 0; v < V; ++v) acc[q][v] = zero;
  for (int64_t j = r0 + 1; j < n; ++j) {
    __m512 x[V];
    IA_UNROLL for (int v = 0; v < V; ++v)
      x[v] = _mm512_maskz_loadu_ps(lanes[v], row(dense, sparse, j, d) + k0 + 16 * v);
    IA_UNROLL for (int q = 0; q < R; ++q) {
      if (j < r0 + R && r0 + q >= j) continue;
      const __m512 g = _mm512_set1_ps(grad_pairs[bases[r0 + q] + j]);
      IA_UNROLL for (int v = 0; v < V; ++v) acc[q][v] = _mm512_fmadd_ps(g, x[v], acc[q][v]);
    }
  }
  IA_UNROLL for (int q = 0; q < R; ++q)
    IA_UNROLL for (int v = 0; v < V; ++v)
      _mm512_mask_storeu_ps(out[q] + 16 * v, lanes[v], _mm512_add_ps(acc[q][v], zero));
  // sum_{i < r}: all R rows take i < r0, row r0 + q also i = r0..r0+q-1.
  IA_UNROLL for (int q = 0; q < R; ++q)
    IA_UNROLL for (int v = 0; v < V; ++v) acc[q][v] = zero;
  for (int64_t i = 0; i + 1 < r0 + R; ++i) {
    __m512 x[V];
    IA_UNROLL for (int v = 0; v < V; ++v)
      x[v] = _mm512_maskz_loadu_ps(lanes[v], row(dense, sparse, i, d) + k0 + 16 * v);
    IA_UNROLL for (int q = 0; q < R; ++q) {
      if (i >= r0 && i >= r0 + q) continue;
      const __m512 g = _mm512_set1_ps(grad_pairs[bases[i] + r0 + q]);
      IA_UNROLL for (int v = 0; v < V; ++v) acc[q][v] = _mm512_fmadd_ps(x[v], g, acc[q][v]);
    }
  }
  IA_UNROLL for (int q = 0; q < R; ++q) {
    IA_UNROLL for (int v = 0; v < V; ++v) {
      __m512 sum = _mm512_add_ps(_mm512_maskz_loadu_ps(lanes[v], out[q] + 16 * v),
                                 _mm512_add_ps(acc[q][v], zero));
      if (r0 + q == 0)
        sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(lanes[v], grad_out + k0 + 16 * v));
      _mm512_mask_storeu_ps(out[q] + 16 * v, lanes[v], sum);
    }
  }
}

// gradient_block for the last `rows` < R rows of a sample: R - 1 rows, or fewer.
template <int R, int V>
IA_AVX512 void gradient_rows(int64_t rows, const float* dense, const float* sparse,
                             const float* grad_out, float* grad_dense, float* grad_sparse,
                             int64_t n, int64_t d, const int64_t* bases, int64_t r0,
                             int64_t k0) {
  if constexpr (R > 1) {
    if (rows < R)
      return gradient_rows<R - 1, V>(rows, dense, sparse, grad_out, grad_dense, grad_sparse, n,
                                     d, bases, r0, k0);
  }
  gradient_block<R, V>(dense, sparse, grad_out, grad_dense, grad_sparse, n, d, bases, r0, k0);
}

// Rows of one sample's gradients in blocks of R, columns k0..k0+16V-1.
template <int R, int V>
IA_AVX512 void gradient_columns(const float* dense, const float* sparse, const float* grad_out,
                                float* grad_dense, float* grad_sparse, int64_t n, int64_t d,
                                const int64_t* bases, int64_t k0) {
  for (int64_t r0 = 0; r0 < n; r0 += R)
    gradient_rows<R, V>(n - r0, dense, sparse, grad_out, grad_dense, grad_sparse, n, d, bases,
                        r0, k0);
}

// One sample's gradients (gradient_block over rows and columns); returns their nonfinite lanes.
// Blocks of 4 rows by 4 vectors (16 accumulators), 8 by 2 and 16 by 1 where D has fewer left.
IA_AVX512 __mmask16 backward_sample(const float* dense, const float* sparse,
                                    const float* grad_out, float* grad_dense, float* grad_sparse,
                                    int64_t n, int64_t d, const int64_t* bases) {
  for (int64_t k0 = 0; k0 < d; k0 += 64) {
    const int64_t vectors = (d - k0 + 15) / 16;  // 16-wide vectors left
    auto run = vectors >= 4    ? gradient_columns<4, 4>
               : vectors == 3 ? gradient_columns<5, 3>
               : vectors == 2 ? gradient_columns<8, 2>
                              : gradient_columns<16, 1>;
    run(dense, sparse, grad_out, grad_dense, grad_sparse, n, d, bases, k0);
  }
  __mmask16 bad = nonfinite(grad_dense, d, 0);
  return nonfinite(grad_sparse, (n - 1) * d, bad);
}

#endif  // __x86_64__

bool has_avx512() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

// Runs body(first, last), which returns nonzero for an inf or nan, over [0, batch) in up to
// `threads` contiguous chunks of at least 64 samples, the caller's thread taking the first and
// a std::thread each other one (inline if one cannot start). Samples are independent, so the
// chunking changes no byte. Returns IA_NONFINITE if any chunk did, IA_NO_MEMORY if a chunk's
// scratch (or the chunks' books) could not be allocated.
template <typename Body>
int in_chunks(int64_t batch, int threads, Body body) try {
  auto chunk = [&body](int64_t first, int64_t last) {
    try {
      return body(first, last) ? IA_NONFINITE : IA_OK;
    } catch (const std::bad_alloc&) {
      return IA_NO_MEMORY;
    }
  };
  int64_t chunks = (batch + 63) / 64;
  if (chunks > threads) chunks = threads;
  if (chunks <= 1) return chunk(0, batch);
  std::vector<int> bad(chunks, 0);
  std::vector<std::thread> workers;
  workers.reserve(chunks - 1);  // may throw bad_alloc, but before any worker starts
  for (int64_t c = 1; c < chunks; ++c) {
    auto run = [&bad, &chunk, batch, chunks, c] {
      bad[c] = chunk(batch * c / chunks, batch * (c + 1) / chunks);
    };
    try {
      workers.emplace_back(run);
    } catch (const std::system_error&) {
      run();
    }
  }
  bad[0] = chunk(0, batch / chunks);
  for (std::thread& worker : workers) worker.join();
  for (int b : bad)
    if (b != IA_OK) return b;
  return IA_OK;
} catch (const std::bad_alloc&) {
  return IA_NO_MEMORY;
}

}  // namespace

// out [B, D + P] (P = n (n - 1) / 2, n = F + 1) from dense [B, D] and sparse [B, F, D], on up
// to `threads` threads.
extern "C" int ia_forward(const float* dense, const float* sparse, float* out, int64_t batch,
                          int64_t features, int64_t d, int threads) {
  if (!has_avx512()) return IA_UNSUPPORTED;
#if defined(__x86_64__)
  const int64_t n = features + 1, width = d + n * (n - 1) / 2;
  const int64_t stride = (n + 32 + 15) / 16 * 16;  // column loads past n stay inside
  return in_chunks(batch, threads, [=](int64_t first, int64_t last) {
    std::vector<float> columns(d * stride, 0.0f);
    __mmask16 bad = 0;
    for (int64_t b = first; b < last; ++b)
      bad |= forward_sample(dense + b * d, sparse + b * features * d, out + b * width, n, d,
                            columns.data(), stride);
    return bad != 0;
  });
#else
  return IA_OK;
#endif
}

// grad_dense [B, D], grad_sparse [B, F, D] from grad_out [B, D + P] (rows grad_stride apart)
// and the forward's dense and sparse, on up to `threads` threads.
extern "C" int ia_backward(const float* dense, const float* sparse, const float* grad_out,
                           int64_t grad_stride, float* grad_dense, float* grad_sparse,
                           int64_t batch, int64_t features, int64_t d, int threads) {
  if (!has_avx512()) return IA_UNSUPPORTED;
#if defined(__x86_64__)
  const int64_t n = features + 1;
  std::vector<int64_t> bases;
  try {
    bases.resize(n);
  } catch (const std::bad_alloc&) {
    return IA_NO_MEMORY;
  }
  for (int64_t i = 0; i < n; ++i) bases[i] = pair_base(i, n);
  return in_chunks(batch, threads, [=, &bases](int64_t first, int64_t last) {
    __mmask16 bad = 0;
    for (int64_t b = first; b < last; ++b)
      bad |= backward_sample(dense + b * d, sparse + b * features * d,
                             grad_out + b * grad_stride, grad_dense + b * d,
                             grad_sparse + b * features * d, n, d, bases.data());
    return bad != 0;
  });
#else
  return IA_OK;
#endif
}
