// A managed collision reset's numbers in C++ (called through ctypes from
// recshard/distributed/mc_native.py's draw_uniform; recshard/distributed/mc_reset.py gives the
// same numbers from torch ops): the default init's uniform numbers of the rows given to new ids,
// from a counter-based generator, written straight into the table's rows. Part of the
// recshard.distributed._mc_index library (with mc_index.cpp, mc_route.cpp).

#include <cstdint>

#include "mc_codes.h"

// The default init's numbers for a reset of `n` rows of a `dim`-column table, the columns
// [col_offset, col_offset + cols) of each, written to row `rows[j]` (of `row_count`, each
// `row_stride` floats apart) of `out` (recshard/distributed/mc_reset.py gives the same numbers
// from torch ops): number p = j * dim + col_offset + c of the block of whole rows is u * scale +
// low (float arithmetic), u = 24 bits of word p / 2 over 2**24: the top 24 of an even p's, the
// next 24 of an odd p's; word k = splitmix64's output for the state seed + (k + 1) * GAMMA. A
// counter-based generator: any row's or column's numbers without the others'.
namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MC_CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define MC_CLONES
#endif

constexpr uint64_t GAMMA = 0x9E3779B97F4A7C15ULL, M1 = 0xBF58476D1CE4E5B9ULL,
                   M2 = 0x94D049BB133111EBULL;

// Word k of the block: splitmix64's output for the state seed + (k + 1) * GAMMA.
inline uint64_t word(uint64_t seed, uint64_t k) {
  uint64_t z = seed + (k + 1) * GAMMA;
  z = (z ^ (z >> 30)) * M1;
  z = (z ^ (z >> 27)) * M2;
  return z ^ (z >> 31);
}

// The number a 24-bit draw gives: u * scale + low, u = drawn / 2**24 (exact), the same float
// operations in the same order wherever it is called (-ffp-contract=off: no fused multiply-add).
inline float number(uint64_t drawn, float low, float scale) {
  const float u = float(int32_t(drawn)) * (1.0f / 16777216.0f);
  const float scaled = u * scale;
  return scaled + low;
}

inline uint64_t even_bits(uint64_t z) { return z >> 40; }             // an even p's 24 bits
inline uint64_t odd_bits(uint64_t z) { return (z >> 16) & 0xFFFFFF; }  // an odd p's

// Numbers first .. first + cols - 1 of the block (see rs_mc_draw_uniform) into row[0, cols):
// each word drawn once for its two numbers (an even p and the odd p + 1), a word a lane, so the
// loop vectorizes (64-bit multiplies: emulated on AVX2, native on AVX-512, picked at load time);
// a row starting or ending inside a word draws that word for its one number.
MC_CLONES void draw_row(uint64_t seed, uint64_t first, int64_t cols, float low, float scale,
                        float* row) {
  int64_t c = 0;
  if (cols > 0 && (first & 1)) {
    row[0] = number(odd_bits(word(seed, first >> 1)), low, scale);
    c = 1;
  }
  const uint64_t first_word = (first + uint64_t(c)) >> 1;
  const int64_t pairs = (cols - c) / 2;
  float* out = row + c;
  for (int64_t k = 0; k < pairs; ++k) {
    const uint64_t z = word(seed, first_word + uint64_t(k));
    out[2 * k] = number(even_bits(z), low, scale);
    out[2 * k + 1] = number(odd_bits(z), low, scale);
  }
  if (c + 2 * pairs < cols)  // the last number is an even p's: its word's first
    row[cols - 1] = number(even_bits(word(seed, first_word + uint64_t(pairs))), low, scale);
}

}  // namespace

// `draws` resets' numbers in one call, draw d as described above with seed `seeds[d]`, n =
// `counts[d]` rows `row_ptrs[d]`, `dims[d]`, `col_offsets[d]`, `cols[d]`, `lows[d]`,
// `scales[d]`, into `out_ptrs[d]` (`row_counts[d]` rows, `row_strides[d]` floats apart). Every
// draw's arguments and rows are checked before the first number is written.
extern "C" int rs_mc_draw_uniform(int64_t draws, const int64_t* seeds, const int64_t* counts,
                                  const int64_t* row_ptrs, const int64_t* dims,
                                  const int64_t* col_offsets, const int64_t* cols,
                                  const float* lows, const float* scales,
                                  const int64_t* row_counts, const int64_t* row_strides,
                                  const int64_t* out_ptrs) try {
  if (draws < 0) return ERR_ARGUMENT;
  for (int64_t d = 0; d < draws; ++d) {
    const int64_t n = counts[d], dim = dims[d], col_offset = col_offsets[d];
    if (n < 0 || dim < 1 || col_offset < 0 || cols[d] < 0 || col_offset + cols[d] > dim ||
        row_strides[d] < cols[d] || row_counts[d] < 0)
      return ERR_ARGUMENT;
    const int64_t* rows = reinterpret_cast<const int64_t*>(row_ptrs[d]);
    for (int64_t j = 0; j < n; ++j)
      if (rows[j] < 0 || rows[j] >= row_counts[d]) return ERR_ARGUMENT;
  }
  for (int64_t d = 0; d < draws; ++d) {
    const int64_t* rows = reinterpret_cast<const int64_t*>(row_ptrs[d]);
    float* out = reinterpret_cast<float*>(out_ptrs[d]);
    for (int64_t j = 0; j < counts[d]; ++j)
      draw_row(uint64_t(seeds[d]), uint64_t(j * dims[d] + col_offsets[d]), cols[d], lows[d],
               scales[d], out + rows[j] * row_strides[d]);
  }
  return 0;
} catch (...) {
  return exception_code();
}
