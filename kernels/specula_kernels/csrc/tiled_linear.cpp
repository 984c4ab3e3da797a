// Weight-only products over tiles of codes: y[m, n] = sum_k x[m, k] * w[n, k] for Specula's int8 and int4
// (`--quantize int8|int4`) and GGUF's Q4_0, Q4_1 and Q8_0 blocks as the file holds them (`--quantize gguf`). Each
// weight is computed as its reference dequantizer computes it (an exact product q * scale, q * d or (c - 8) * d, or
// one rounding of c * d + m, Specula's int4 being (c - 8) * scale + zero), so the values multiplied are the
// format's own.
//
// Why by hand: PyTorch's packed int8/int4 CPU kernels are compute-bound, reading weights well below the memory's
// bandwidth, and have no GGUF formats (docs/benchmarks.md#weight-only-quantization).
//
// Layout (`quantized_linear.pack_int8_native`, `pack_q4_tiles`): output rows in tiles of two
// panels, a panel being `float_linear.cpp`'s (kPanel = two vectors of rows, stored input by input). A tile is one
// sequential stream:
//   Q4:   per group of inputs (GGUF's blocks of 32; int4's groups), d[kPanel] and m[kPanel] float32 per panel
//         (the scale and the offset: Q4_1's minimum, int4's zero, 0 for Q4_0), then per input kLanes code bytes per
//         panel, byte r holding row r's code in its low half and row kLanes + r's in its high half; codes biased
//         by 8 for Q4_0 and int4.
//   Q8_0: per block of 32 inputs, d[kPanel] float32 per panel, then per input kPanel int8 codes per panel.
//   int8: scale[kPanel] float32 per panel, then per input kPanel int8 codes per panel.
// N is padded to a multiple of two panels with zero rows, whose outputs are not written.
//
// A few rows (decode, verification of drafts): each input's weights are decoded in registers and multiplied into
// every row's accumulators; at one or two rows both panels of a tile at once, so a thread reads its tiles front
// to back, one stream, and four sums per row hide the multiply-add latency. Many rows (prompts): a pass decodes a
// tile once into float32 panels that `float_linear.cpp`'s register-blocked kernel then multiplies by each block of
// rows, at the float32 kernel's pace.
//
// Exactness: on both paths every output element is one sum over k in order, one fused multiply-add per input, of
// the same weight values: a row's result is the same bits alone, in any batch and at any blocking or threads.

#include <cstdint>
#include <vector>

#include "simd.h"
#include "team.h"

namespace {

constexpr int kPanel = 2 * kLanes;  // output rows per panel (float_linear.cpp's); a tile holds two
constexpr int kBlock = 32;          // inputs per GGUF block (Q8_0's scales; Q4's groups may be longer)
constexpr int kDirectRows = 4;      // passes of more rows than this decode each tile once into float32 panels
constexpr int64_t kChunk = 96;      // rows per pass over the weights (float_linear.cpp's)
constexpr int kAhead = 2048;        // bytes prefetched ahead of the input being decoded

// The kLanes code bytes of one input, widened: their low halves (rows [0, kLanes)) and high halves.
inline void codes_u4(const uint8_t* p, vint& lo, vint& hi) {
#if defined(__AVX512F__)
  const vint wide = (vint)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#else
  const vint wide = (vint)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
#endif
  lo = wide & 15;
  hi = wide >> 4;
}

// kLanes int8 codes, widened.
inline vint codes_i8(const int8_t* p) {
#if defined(__AVX512F__)
  return (vint)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p));
#else
  return (vint)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
#endif
}

inline vfloat to_float(vint v) { return __builtin_convertvector(v, vfloat); }

// Panel q of a Q4 tile: input k's two weight vectors are (c - bias) * d + m for k's group (bias 8 for Specula's
// int4 and Q4_0, 0 for Q4_1).
//
// At one row this arithmetic sets the pace, not the memory: on a CPU with one 512-bit multiply-add unit, an
// input's two vectors took two conversions of codes to float and four multiply-adds on that one port. With
// AVX-512 a code's float, c - bias, is looked up instead in a table of the sixteen (a permutation, on the shuffle
// port; it reads only the low four bits of each index, so the low codes need no mask): the same value, exactly.
// Without AVX-512 (eight-lane permutations hold only half the table) codes are converted; `kBiased` false (Q4_1)
// skips the subtraction there.
template <bool kBiased>
struct Q4Panel {
  static constexpr int64_t kScaleBytes = 2 * (2 * kPanel * 4);  // both panels' d and m
  static int64_t block_bytes(int64_t group) { return kScaleBytes + group * 2 * kLanes; }

  const uint8_t* tile;
  int q;
  int32_t bias;
  int64_t group;  // inputs per block of scales

  int64_t inputs() const { return group; }

  struct Scales {
    vfloat d0, d1, m0, m1;
#if defined(__AVX512F__)
    vfloat codes;  // lane c: c - bias
#endif
  };
  Scales scales(int64_t b) const {
    const float* g = reinterpret_cast<const float*>(tile + b * block_bytes(group)) + q * 2 * kPanel;
#if defined(__AVX512F__)
    const vfloat iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return {vload(g), vload(g + kLanes), vload(g + kPanel), vload(g + kPanel + kLanes), iota - float(bias)};
#else
    return {vload(g), vload(g + kLanes), vload(g + kPanel), vload(g + kPanel + kLanes)};
#endif
  }
  void weights(const Scales& s, int64_t b, int i, vfloat& w0, vfloat& w1) const {
    const uint8_t* p = tile + b * block_bytes(group) + kScaleBytes + (i * 2 + q) * kLanes;
    __builtin_prefetch(p + kAhead);
#if defined(__AVX512F__)
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const vfloat lo = (vfloat)_mm512_permutexvar_ps(wide, (__m512)s.codes);
    const vfloat hi = (vfloat)_mm512_permutexvar_ps(_mm512_srli_epi32(wide, 4), (__m512)s.codes);
    w0 = vfma(lo, s.d0, s.m0);
    w1 = vfma(hi, s.d1, s.m1);
#else
    vint lo, hi;
    codes_u4(p, lo, hi);
    if constexpr (kBiased) {
      lo -= bias;
      hi -= bias;
    }
    w0 = vfma(to_float(lo), s.d0, s.m0);
    w1 = vfma(to_float(hi), s.d1, s.m1);
#endif
  }
};

// Panel q of a Q8_0 tile: input k's weights are c * d for k's block.
struct Q8Panel {
  static constexpr int64_t kScaleBytes = 2 * (kPanel * 4);  // both panels' d
  static constexpr int64_t kBlockBytes = kScaleBytes + kBlock * 2 * kPanel;

  const uint8_t* tile;
  int q;

  int64_t inputs() const { return kBlock; }

  struct Scales {
    vfloat d0, d1;
  };
  Scales scales(int64_t b) const {
    const float* g = reinterpret_cast<const float*>(tile + b * kBlockBytes) + q * kPanel;
    return {vload(g), vload(g + kLanes)};
  }
  void weights(const Scales& s, int64_t b, int i, vfloat& w0, vfloat& w1) const {
    const int8_t* p = reinterpret_cast<const int8_t*>(tile + b * kBlockBytes + kScaleBytes) + (i * 2 + q) * kPanel;
    __builtin_prefetch(p + kAhead);
    w0 = to_float(codes_i8(p)) * s.d0;
    w1 = to_float(codes_i8(p + kLanes)) * s.d1;
  }
};

// Panel q of a Specula int8 tile: input k's weights are q * scale for the panel's rows.
struct Int8Panel {
  static constexpr int kInputs = 16;  // one scale per row; the inputs taken 16 at a time
  static constexpr int64_t kScaleBytes = 2 * (kPanel * 4);  // both panels' row scales

  const uint8_t* tile;
  int q;

  int64_t inputs() const { return kInputs; }

  struct Scales {
    vfloat s0, s1;
  };
  Scales scales(int64_t) const {
    const float* g = reinterpret_cast<const float*>(tile) + q * kPanel;
    return {vload(g), vload(g + kLanes)};
  }
  void weights(const Scales& s, int64_t b, int i, vfloat& w0, vfloat& w1) const {
    const int8_t* p = reinterpret_cast<const int8_t*>(tile + kScaleBytes) + ((b * kInputs + i) * 2 + q) * kPanel;
    __builtin_prefetch(p + kAhead);
    w0 = to_float(codes_i8(p)) * s.s0;
    w1 = to_float(codes_i8(p + kLanes)) * s.s1;
  }
};

// MB rows of x against NP panels, decoding each input's weights once in registers; `cols[q]` of panel q's outputs
// are stored at y + q * kPanel.
template <int MB, int NP, typename Panel>
void direct_block(const float* x, int64_t K, const Panel* panels, float* y, int64_t N, const int64_t* cols) {
  vfloat lo[MB][NP], hi[MB][NP];
  for (int r = 0; r < MB; ++r)
    for (int q = 0; q < NP; ++q) lo[r][q] = hi[r][q] = vfloat{};
  const int64_t inputs = panels[0].inputs();
  for (int64_t b = 0; b < K / inputs; ++b) {
    typename Panel::Scales s[NP];
    for (int q = 0; q < NP; ++q) s[q] = panels[q].scales(b);
    for (int i = 0; i < inputs; ++i) {
      vfloat w0[NP], w1[NP];
      for (int q = 0; q < NP; ++q) panels[q].weights(s[q], b, i, w0[q], w1[q]);
      for (int r = 0; r < MB; ++r) {
        const vfloat xv = vsplat(x[r * K + b * inputs + i]);
        for (int q = 0; q < NP; ++q) {
          lo[r][q] = vfma(xv, w0[q], lo[r][q]);
          hi[r][q] = vfma(xv, w1[q], hi[r][q]);
        }
      }
    }
  }
  for (int r = 0; r < MB; ++r)
    for (int q = 0; q < NP; ++q) {
      float* out = y + r * N + q * kPanel;
      vstore_part(out, lo[r][q], cols[q]);
      if (cols[q] > kLanes) vstore_part(out + kLanes, hi[r][q], cols[q] - kLanes);
    }
}

template <int MB = kDirectRows, typename Panel>
void direct_rows(int64_t mb, const float* x, int64_t K, const Panel& panel, float* y, int64_t N, int64_t cols) {
  if constexpr (MB > 1) {
    if (mb < MB) return direct_rows<MB - 1>(mb, x, K, panel, y, N, cols);
  }
  direct_block<MB, 1>(x, K, &panel, y, N, &cols);
}

// A panel's weights as float32, [K][kPanel]: float_linear.cpp's panel layout.
template <typename Panel>
void decode_panel(const Panel& panel, int64_t K, float* w) {
  const int64_t inputs = panel.inputs();
  for (int64_t b = 0; b < K / inputs; ++b) {
    const typename Panel::Scales s = panel.scales(b);
    for (int i = 0; i < inputs; ++i) {
      vfloat w0, w1;
      panel.weights(s, b, i, w0, w1);
      vstore(w + (b * inputs + i) * kPanel, w0);
      vstore(w + (b * inputs + i) * kPanel + kLanes, w1);
    }
  }
}

// y [M, N] = x [M, K] w^T over ceil(N / (2 kPanel)) tiles, shared among the team; `panel(tile, q)` makes panel q
// of a tile.
template <typename Panel, typename MakePanel>
void tiles_team(const float* x, int64_t M, int64_t K, int64_t N, float* y, const MakePanel& panel) {
  const int64_t num_tiles = (N + 2 * kPanel - 1) / (2 * kPanel);
  auto cols = [&](int64_t p) {  // of panel p's rows, those below N
    const int64_t left = N - p * kPanel;
    return left < 0 ? int64_t{0} : left < kPanel ? left : int64_t{kPanel};
  };
  if (M == 1) {  // both panels of a tile at once
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tiles; ++t) {
      const Panel both[2] = {panel(t, 0), panel(t, 1)};
      const int64_t n[2] = {cols(2 * t), cols(2 * t + 1)};
      direct_block<1, 2>(x, K, both, y + 2 * t * kPanel, N, n);
    }
    return;
  }
  if (M <= kDirectRows) {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tiles; ++t)
      for (int q = 0; q < 2; ++q)
        if (cols(2 * t + q)) direct_rows(M, x, K, panel(t, q), y + (2 * t + q) * kPanel, N, cols(2 * t + q));
    return;
  }
  for (int64_t chunk = 0; chunk < M; chunk += kChunk) {
    const int64_t rows = M - chunk < kChunk ? M - chunk : kChunk;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tiles; ++t) {
      thread_local std::vector<float> w;
      w.resize(K * kPanel);
      for (int q = 0; q < 2; ++q) {
        const int64_t p = 2 * t + q;
        if (!cols(p)) continue;
        decode_panel(panel(t, q), K, w.data());
        float_panel_rows(x + chunk * K, rows, K, w.data(), nullptr, y + chunk * N + p * kPanel, N, cols(p),
                         nullptr);
      }
    }
  }
}

}  // namespace

// x [M, K] float32 -> y [M, N] for Q4 tiles (bias 8: Q4_0 and int4, 0: Q4_1; K % group == 0) or Q8_0 tiles as
// above (K % 32 == 0).
void q4_linear_team(const float* x, int64_t M, int64_t K, const uint8_t* tiles, int32_t bias, int64_t group, int64_t N,
                    float* y) {
  const int64_t tile_bytes = (K / group) * Q4Panel<true>::block_bytes(group);
  if (bias == 0)
    return tiles_team<Q4Panel<false>>(x, M, K, N, y, [=](int64_t t, int q) {
      return Q4Panel<false>{tiles + t * tile_bytes, q, 0, group};
    });
  tiles_team<Q4Panel<true>>(x, M, K, N, y, [=](int64_t t, int q) {
    return Q4Panel<true>{tiles + t * tile_bytes, q, bias, group};
  });
}

void q8_0_linear_team(const float* x, int64_t M, int64_t K, const uint8_t* tiles, int64_t N, float* y) {
  tiles_team<Q8Panel>(x, M, K, N, y, [=](int64_t t, int q) {
    return Q8Panel{tiles + t * (K / kBlock) * Q8Panel::kBlockBytes, q};
  });
}

// Specula's int8 (K % 16 == 0).
void int8_linear_team(const float* x, int64_t M, int64_t K, const uint8_t* tiles, int64_t N, float* y) {
  tiles_team<Int8Panel>(x, M, K, N, y, [=](int64_t t, int q) {
    return Int8Panel{tiles + t * (Int8Panel::kScaleBytes + K * 2 * kPanel), q};
  });
}

extern "C" {

void specula_int8_linear(const float* x, int64_t M, int64_t K, const uint8_t* tiles, int64_t N, float* y,
                         int threads) {
#pragma omp parallel num_threads(threads)
  int8_linear_team(x, M, K, tiles, N, y);
}

void specula_q4_linear(const float* x, int64_t M, int64_t K, const uint8_t* tiles, int32_t bias, int64_t group,
                       int64_t N, float* y, int threads) {
#pragma omp parallel num_threads(threads)
  q4_linear_team(x, M, K, tiles, bias, group, N, y);
}

void specula_q8_0_linear(const float* x, int64_t M, int64_t K, const uint8_t* tiles, int64_t N, float* y,
                         int threads) {
#pragma omp parallel num_threads(threads)
  q8_0_linear_team(x, M, K, tiles, N, y);
}

}  // extern "C"
