// Specula's own int4 products for CPU decoding: y[m, n] = sum_k x[m, k] * w[n, k], with `w` stored in 4 bits and
// dequantized in registers (or, for passes of many rows on AVX2, once per block into a buffer that stays in L1).
// (int8 and a GGUF file's own blocks have their kernels in tiled_linear.cpp.)
//
// Decoding multiplies a few activation rows by every weight once per step, so the product is bound by the speed
// at which the weights stream from memory. PyTorch's packed int4 CPU kernel is compute-bound, reading weights well
// below the memory's bandwidth (docs/benchmarks.md#weight-only-quantization); these loops convert a vector of
// weights per instruction and keep several outputs' accumulators in registers, so a thread's share of the weights
// is read once, in order, at the memory's pace.
//
// Exactness: every output element is one thread's fixed-order sum (the build's lanes over k, then the lanes folded),
// whatever the number of rows, the blocking or the threads. A row's result never depends on what other rows
// share its step, so a verified draft row equals the plain decode row it stands for.
//
// Format (made by `quantized_linear.pack_int4_native`): weight rows in blocks of 4, interleaved so that a thread
// reads one sequential stream of whole cache lines, each holding the same inputs of the block's 4 rows:
// q4 [N / 4][K / 32][4 rows][16 bytes], byte j of a row holding input j in its low half and input j + 16 in its
// high half; sz [N / 4][K / group][4 rows][2] bfloat16 (scale, zero): w[n, k] = (q - 8) * scale + zero for k's
// group. N is padded to a multiple of 4 with zero rows, whose outputs are not written.
//
// Two builds of the blocks, one driver: with AVX-512, 16-wide vectors and int4 looked up in a 16-entry table by
// one permute; with AVX2 (`simd.h`'s 8-wide vectors), a 16-input line is two vectors and an int4 code is converted
// and scaled by a multiply-add, (q - 8) * scale + zero, which is the very value the AVX-512 table holds for it.
// Sums fold their lanes in each build's fixed order.

#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"
#include "team.h"

static constexpr int kCols = 4;  // weight rows per block: one 64-byte line holds 32 inputs of each
static constexpr int kAhead = 512;  // bytes prefetched ahead of the line being read
static constexpr int64_t kChunk = 64;  // activation rows per pass over the weights: a pass's rows stay in L2

static inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The bfloat16 (scale, zero) pairs of a product's 4-bit groups: code c of a group stands for
// (c - bias) * scale + zero.
struct Int4Groups {
  const uint16_t* pairs;
  static constexpr float bias = 8.0f;

  void get(int64_t i, float& scale, float& offset) const {
    scale = bf16_to_f32(pairs[2 * i]);
    offset = bf16_to_f32(pairs[2 * i + 1]);
  }
  Int4Groups at(int64_t i) const { return {pairs + 2 * i}; }  // the pairs from pair i on
};

#if defined(__AVX512F__)
typedef float f32x16 __attribute__((vector_size(64)));

static constexpr int kRows = 4;  // activation rows per register block (of 32 vector registers)

static inline f32x16 load_f32(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// 16 bytes of int4 pairs, dequantized through `table` (the 16 values a group's codes stand for): the low halves
// give inputs 0-15, the high halves inputs 16-31. vpermps reads only an index's low 4 bits, so the low halves
// need no mask, and one permute replaces a conversion and a multiply-add.
static inline void dequantize_u4(const uint8_t* p, __m512 table, f32x16& lo, f32x16& hi) {
  const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  lo = (f32x16)_mm512_permutexvar_ps(wide, table);
  hi = (f32x16)_mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), table);
}

static inline float lane_sum(f32x16 v) {
  // A fixed pairwise order: the same for every output element.
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static const __m512 kCodes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);

template <int MB>
static void int4_block(const float* x, int64_t K, const uint8_t* q4, Int4Groups sz, int64_t group, float* y,
                       int64_t N, int nb) {
  const int64_t groups = K / group;
  f32x16 acc[MB][kCols];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < kCols; ++j) acc[i][j] = f32x16{};
  for (int64_t g = 0; g < groups; ++g) {
    __m512 table[kCols];  // code c stands for (c - bias) * scale + offset
    for (int j = 0; j < kCols; ++j) {
      float s, z;
      sz.get(g * kCols + j, s, z);
      table[j] = _mm512_fmadd_ps(_mm512_sub_ps(kCodes, _mm512_set1_ps(sz.bias)), _mm512_set1_ps(s),
                                 _mm512_set1_ps(z));
    }
    for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
      const uint8_t* line = q4 + k / 2 * kCols;
      __builtin_prefetch(line + kAhead);
      f32x16 lo[kCols], hi[kCols];
      for (int j = 0; j < kCols; ++j) dequantize_u4(line + 16 * j, table[j], lo[j], hi[j]);
      for (int i = 0; i < MB; ++i) {
        const f32x16 xl = load_f32(x + i * K + k), xh = load_f32(x + i * K + k + 16);
        for (int j = 0; j < kCols; ++j) acc[i][j] += xl * lo[j] + xh * hi[j];
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < nb; ++j) y[i * N + j] = lane_sum(acc[i][j]);
}

#else  // AVX2: 8-wide vectors, two to a 16-input line

static constexpr int kRows = 2;  // activation rows per register block (of 16 vector registers)


// 8 bytes of int4 pairs, dequantized: (q - bias) * scale + offset for their low halves' codes and their high
// halves'.
static inline void dequantize_u4(const uint8_t* p, float bias, vfloat scale, vfloat offset, vfloat& lo, vfloat& hi) {
  const __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  lo = vfma((vfloat)_mm256_cvtepi32_ps(_mm256_and_si256(wide, _mm256_set1_epi32(15))) - bias, scale, offset);
  hi = vfma((vfloat)_mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4)) - bias, scale, offset);
}

template <int MB>
static void int4_block(const float* x, int64_t K, const uint8_t* q4, Int4Groups sz, int64_t group, float* y,
                       int64_t N, int nb) {
  const int64_t groups = K / group;
  vfloat acc[MB][kCols];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < kCols; ++j) acc[i][j] = vfloat{};
  for (int64_t g = 0; g < groups; ++g) {
    vfloat scale[kCols], zero[kCols];
    for (int j = 0; j < kCols; ++j) {
      float s, z;
      sz.get(g * kCols + j, s, z);
      scale[j] = vsplat(s);
      zero[j] = vsplat(z);
    }
    for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
      const uint8_t* line = q4 + k / 2 * kCols;
      __builtin_prefetch(line + kAhead);
      for (int half = 0; half < 16; half += kLanes) {  // bytes [half, half + kLanes): inputs there and 16 on
        for (int j = 0; j < kCols; ++j) {
          vfloat lo, hi;
          dequantize_u4(line + 16 * j + half, sz.bias, scale[j], zero[j], lo, hi);
          for (int i = 0; i < MB; ++i) {
            acc[i][j] = vfma(vload(x + i * K + k + half), lo, acc[i][j]);
            acc[i][j] = vfma(vload(x + i * K + k + 16 + half), hi, acc[i][j]);
          }
        }
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < nb; ++j) y[i * N + j] = vsum(acc[i][j]);
}

// Many rows: decoding a code costs more than multiplying it, so past a few rows a block's 4 weight rows are
// dequantized once into `w` [kCols][K] and every row of the pass reads them there. The values and the order of
// the multiply-adds are int4_block's, so a row's result is the same bits on either path.
static constexpr int64_t kDequantizeRows = 2 * kRows;  // passes of more rows than this take the buffer

static void dequantize_u4_block(const uint8_t* q4, Int4Groups sz, int64_t K, int64_t group, float* w) {
  for (int64_t g = 0; g < K / group; ++g) {
    for (int j = 0; j < kCols; ++j) {
      float s, z;
      sz.get(g * kCols + j, s, z);
      const vfloat scale = vsplat(s), zero = vsplat(z);
      for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
        for (int half = 0; half < 16; half += kLanes) {
          vfloat lo, hi;
          dequantize_u4(q4 + k / 2 * kCols + 16 * j + half, sz.bias, scale, zero, lo, hi);
          vstore(w + j * K + k + half, lo);
          vstore(w + j * K + k + 16 + half, hi);
        }
      }
    }
  }
}

template <int MB>
static void dequantized_block(const float* x, int64_t K, const float* w, float* y, int64_t N, int nb) {
  vfloat acc[MB][kCols];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < kCols; ++j) acc[i][j] = vfloat{};
  for (int64_t k = 0; k < K; k += 32) {
    for (int half = 0; half < 16; half += kLanes) {
      for (int j = 0; j < kCols; ++j) {
        const vfloat lo = vload(w + j * K + k + half), hi = vload(w + j * K + k + 16 + half);
        for (int i = 0; i < MB; ++i) {
          acc[i][j] = vfma(vload(x + i * K + k + half), lo, acc[i][j]);
          acc[i][j] = vfma(vload(x + i * K + k + 16 + half), hi, acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < nb; ++j) y[i * N + j] = vsum(acc[i][j]);
}

#endif  // __AVX512F__

// Runs `pass(begin, end, b, nb)` for activation rows [begin, end) of each pass and weight block `b`, the blocks
// shared among the calling team.
template <typename Pass>
static void for_each_pass(int64_t M, int64_t N, const Pass& pass) {
  const int64_t col_blocks = (N + kCols - 1) / kCols;
  for (int64_t chunk = 0; chunk < M; chunk += kChunk) {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < col_blocks; ++b) {
      const int nb = static_cast<int>(N - b * kCols < kCols ? N - b * kCols : kCols);
      pass(chunk, M < chunk + kChunk ? M : chunk + kChunk, b, nb);
    }
  }
}

// Runs `block(m0, mb, b, nb)` over [M, N] in blocks of at most kRows activation rows and the kCols weight rows of
// block `b` (`nb` of them real). The threads split the weight blocks (each reads its contiguous share once per
// pass); passes take kChunk activation rows at a time.
template <typename Block>
static void for_each_block(int64_t M, int64_t N, const Block& block) {
  for_each_pass(M, N, [&](int64_t begin, int64_t end, int64_t b, int nb) {
    for (int64_t m0 = begin; m0 < end; m0 += kRows)
      block(m0, static_cast<int>(end - m0 < kRows ? end - m0 : kRows), b, nb);
  });
}

#if !defined(__AVX512F__)
// Passes of many rows on AVX2: `dequantize(b, w)` writes weight block b's kCols rows as floats into `w` [kCols][K],
// which every row of the pass then reads (dequantized_block).
template <typename Dequantize>
static void buffered_passes(const float* x, int64_t M, int64_t K, int64_t N, float* y, const Dequantize& dequantize) {
  for_each_pass(M, N, [&](int64_t begin, int64_t end, int64_t b, int nb) {
    thread_local std::vector<float> w;
    w.resize(kCols * K);
    dequantize(b, w.data());
    for (int64_t m0 = begin; m0 < end; m0 += kRows) {
      const float* xm = x + m0 * K;
      float* ym = y + m0 * N + b * kCols;
      if (end - m0 < kRows) dequantized_block<1>(xm, K, w.data(), ym, N, nb);
      else dequantized_block<kRows>(xm, K, w.data(), ym, N, nb);
    }
  });
}
#endif

// x [M, K] float32; q4 [ceil(N / 4), K / 32, 4, 16] uint8; sz [ceil(N / 4), K / group, 4, 2] (scale, offset),
// bfloat16; codes stand for (q - 8) * scale + zero -> y [M, N]. group % 32 == 0.
void int4_linear_team(const float* x, int64_t M, int64_t K, const uint8_t* q4, const uint16_t* sz, int64_t group,
                      int64_t N, float* y) {
  const int64_t groups = K / group;
  const Int4Groups pairs{sz};
#if !defined(__AVX512F__)
  if (M > kDequantizeRows)
    return buffered_passes(x, M, K, N, y, [&](int64_t b, float* w) {
      dequantize_u4_block(q4 + b * kCols * (K / 2), pairs.at(b * kCols * groups), K, group, w);
    });
#endif
  for_each_block(M, N, [=](int64_t m0, int mb, int64_t b, int nb) {
    const float* xm = x + m0 * K;
    float* ym = y + m0 * N + b * kCols;
    const uint8_t* qb = q4 + b * kCols * (K / 2);
    const Int4Groups szb = pairs.at(b * kCols * groups);
    if (mb == 1) return int4_block<1>(xm, K, qb, szb, group, ym, N, nb);
    if constexpr (kRows > 3) {
      if (mb == 2) return int4_block<2>(xm, K, qb, szb, group, ym, N, nb);
      if (mb == 3) return int4_block<3>(xm, K, qb, szb, group, ym, N, nb);
    }
    return int4_block<kRows>(xm, K, qb, szb, group, ym, N, nb);
  });
}

extern "C" {

// `sz`: bfloat16 (scale, zero) pairs; codes stand for (q - 8) * scale + zero (`quantized_linear.pack_int4_native`).
void specula_int4_linear(const float* x, int64_t M, int64_t K, const uint8_t* q4, const uint16_t* sz, int64_t group,
                         int64_t N, float* y, int threads) {
#pragma omp parallel num_threads(threads)
  int4_linear_team(x, M, K, q4, sz, group, N, y);
}

}  // extern "C"
