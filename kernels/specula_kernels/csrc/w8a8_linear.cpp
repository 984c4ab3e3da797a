// int8 x int8 products (`--quantize w8a8`): y[m, n] = scale[n] * sum over blocks b of d[m, b] * sum over k in b of
// q[n, k] * c[m, k]. The weights are Specula's int8 codes q with one scale per output row (`quantize_int8`); the
// activations are quantized at each product, per row and block of 32 inputs, to codes c in [-127, 127] with the
// scale d = max |x| / 127 (GGUF's Q8_0, the arithmetic llama.cpp multiplies its q8_0 weights with).
//
// Why by hand: the weight-only kernels (tiled_linear.cpp) decode every weight to a float and multiply-add it into
// every row's sums; at one row that still keeps up with the memory, but at the few rows of a verification or a
// batch, and the many of a prompt, that arithmetic sets their pace (docs/benchmarks.md#int8-activations-w8a8).
// An integer dot product takes four inputs a lane in one instruction: AVX-512 VNNI's vpdpbusd, or AVX2's
// vpmaddubsw and vpmaddwd. PyTorch has no such CPU kernel for float activations.
//
// Layout (`quantized_linear.pack_w8a8_native`), the same for every instruction set: output rows in tiles of 16,
// a tile being its rows' scales (float32 [16]) and then, per group of four inputs, the 16 rows' four codes (int8
// [K/4][16][4]: lane r of a 64-byte vector holds row r's codes of the group's inputs). Inputs are padded to a
// multiple of 32 and rows to a multiple of 16 with zero codes; padding rows' outputs are not written.
//
// Exactness: a block's sum is an integer (exact in any order and on either instruction set); the blocks are
// folded in order, one product and one sum a block, each rounded to float32 (no fused multiply-add), then the row
// scale: the same bits on AVX-512 and AVX2, in any batch, at any threads, and what
// `quantized_linear.w8a8_linear_reference` computes in PyTorch.

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"
#include "team.h"

namespace {

constexpr int kTileRows = 16;                       // output rows per tile
constexpr int kBlock = 32;                          // inputs per activation scale
constexpr int64_t kHeader = kTileRows * 4;          // a tile's row scales, bytes
constexpr int64_t kBlockBytes = kTileRows * kBlock;  // a tile's codes for one block of inputs
constexpr int kRowsPerPass = 4;                     // rows multiplied per pass over a tile
#if defined(__AVX512VNNI__)
// Calls of at most this many rows pass over a tile with 8 rows at once (their sums fill most of the 32
// registers): each weight vector loaded serves twice the rows. Measured faster up to 16 rows and slower at
// hundreds (a prompt's), where passes of 4 stay.
constexpr int64_t kWideRows = 16;
#else
constexpr int64_t kWideRows = 0;  // AVX2's 16 registers
#endif
constexpr int kAhead = 2048;                        // bytes prefetched ahead

// A call's activations, quantized: codes [M][padded], scales and code sums times 128 [M][padded / 32].
struct Activations {
  int8_t* codes;
  float* scales;
  int32_t* sums;
  int64_t padded;
};

// Block b of one row (x, K inputs): its codes, scale and sum. A block's scale is NaN where the block holds a NaN
// (and its codes then mean nothing), infinite where it holds an infinity with codes 0: either way the outputs
// become NaN, as a float product's would not be finite. In vectors of the build's width: a maximum, products and
// integer sums are the same in any order, so every build quantizes to the same codes and scales.
void quantize_block(const float* x, int64_t K, int64_t b, int8_t* codes, float* scales, int32_t* sums) {
  constexpr int kVectors = kBlock / kLanes;
  const int64_t start = b * kBlock, n = K - start < kBlock ? K - start : kBlock;
  vfloat v[kVectors];
  for (int i = 0; i < kVectors; ++i) {
    const int64_t left = n - i * kLanes;
    v[i] = left >= kLanes ? vload(x + start + i * kLanes) : left > 0 ? vload_part(x + start + i * kLanes, left)
                                                                     : vfloat{};
  }
  vfloat most{};
  vint nan{};
  for (int i = 0; i < kVectors; ++i) {
    const vfloat magnitude = (vfloat)((vint)v[i] & 0x7fffffff);
    nan |= magnitude != magnitude;
    most = vmax(most, magnitude);
  }
  float amax = vmax_lane(most);
  for (int l = 0; l < kLanes; ++l)
    if (nan[l]) amax = std::nanf("");  // a NaN stays
  const float scale = amax / 127.0f;
  const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
  vint total{};
  for (int i = 0; i < kVectors; ++i) {
    // To nearest, ties to even (the default rounding mode); a NaN converts to INT_MIN, clamped to -127.
#if defined(__AVX512F__)
    vint c = (vint)_mm512_cvtps_epi32((__m512)(v[i] * inverse));
#else
    vint c = (vint)_mm256_cvtps_epi32((__m256)(v[i] * inverse));
#endif
    c = c < -127 ? -127 : c > 127 ? 127 : c;
    total += c;
    typedef int8_t vbyte __attribute__((vector_size(kLanes)));
    const vbyte narrow = __builtin_convertvector(c, vbyte);
    std::memcpy(codes + start + i * kLanes, &narrow, kLanes);
  }
  int32_t sum = 0;
  for (int l = 0; l < kLanes; ++l) sum += total[l];
  scales[b] = scale;
  sums[b] = 128 * sum;
}

// A product rounded on its own: the empty asm keeps the compiler from fusing it into the sum that follows (a
// contraction the reference would not make).
template <typename V>
inline V apart(V v) {
  asm("" : "+v"(v));
  return v;
}

inline int32_t four_codes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// R rows (row0...) against one tile: `cols` of its 16 outputs stored at y (rows N apart).
template <int R>
void tile_rows(const uint8_t* tile, const Activations& a, int64_t row0, float* y, int64_t N, int64_t cols) {
  const int64_t blocks = a.padded / kBlock;
  const uint8_t* codes = tile + kHeader;
  const int8_t* x[R];
  const float* d[R];
  const int32_t* s[R];
  for (int r = 0; r < R; ++r) {
    x[r] = a.codes + (row0 + r) * a.padded;
    d[r] = a.scales + (row0 + r) * blocks;
    s[r] = a.sums + (row0 + r) * blocks;
  }
  float out[R][kTileRows];
#if defined(__AVX512VNNI__)
  // vpdpbusd multiplies unsigned bytes by signed ones: the weights go in as codes + 128, and each block's sum
  // then holds 128 times the block's activation codes too, which `sums` takes back out.
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  // Few rows: two sums a row (even and odd groups of inputs), so that fewer dot products wait on the one before;
  // four rows or more keep enough sums going with one.
  constexpr int kChains = R >= 4 ? 1 : 2;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = codes + b * kBlockBytes;
    __m512i dot[R][kChains];
    for (int r = 0; r < R; ++r) {  // the block's sums start from the correction they need
      dot[r][0] = _mm512_set1_epi32(-s[r][b]);
      if (kChains > 1) dot[r][kChains - 1] = _mm512_setzero_si512();
    }
    for (int g = 0; g < kBlock / 4; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(p + g * 64 + kAhead), _MM_HINT_T0);
      const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(p + g * 64), flip);
      for (int r = 0; r < R; ++r)
        dot[r][g % kChains] = _mm512_dpbusd_epi32(dot[r][g % kChains], w,
                                                  _mm512_set1_epi32(four_codes(x[r] + b * kBlock + g * 4)));
    }
    for (int r = 0; r < R; ++r) {
      const __m512i total = kChains > 1 ? _mm512_add_epi32(dot[r][0], dot[r][kChains - 1]) : dot[r][0];
      acc[r] = _mm512_add_ps(acc[r], apart(_mm512_mul_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(d[r][b]))));
    }
  }
  const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(tile));
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out[r], _mm512_mul_ps(acc[r], scale));
#else
  // Two halves of eight rows. vpmaddubsw multiplies unsigned bytes by signed ones into pairs of saturating 16-bit
  // sums; |w| times x with w's sign stays within 2 * 127 * 127, so no pair saturates.
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = codes + b * kBlockBytes;
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int g = 0; g < kBlock / 4; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(p + g * 64 + kAhead), _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + g * 64 + h * 32));
        const __m256i magnitude = _mm256_abs_epi8(w);
        for (int r = 0; r < R; ++r) {
          const __m256i signed_x = _mm256_sign_epi8(_mm256_set1_epi32(four_codes(x[r] + b * kBlock + g * 4)), w);
          dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_x), ones));
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        acc[r][h] = _mm256_add_ps(acc[r][h], apart(_mm256_mul_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_set1_ps(d[r][b]))));
  }
  const float* scale = reinterpret_cast<const float*>(tile);
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out[r] + 8 * h, _mm256_mul_ps(acc[r][h], _mm256_loadu_ps(scale + 8 * h)));
#endif
  for (int r = 0; r < R; ++r) std::memcpy(y + (row0 + r) * N, out[r], cols * sizeof(float));
}

void tile_all_rows(const uint8_t* tile, const Activations& a, int64_t M, float* y, int64_t N, int64_t cols) {
  int64_t row = 0;
  if (M <= kWideRows)
    for (; row + 2 * kRowsPerPass <= M; row += 2 * kRowsPerPass) tile_rows<2 * kRowsPerPass>(tile, a, row, y, N, cols);
  for (; row + kRowsPerPass <= M; row += kRowsPerPass) tile_rows<kRowsPerPass>(tile, a, row, y, N, cols);
  switch (M - row) {
    case 3: return tile_rows<3>(tile, a, row, y, N, cols);
    case 2: return tile_rows<2>(tile, a, row, y, N, cols);
    case 1: return tile_rows<1>(tile, a, row, y, N, cols);
    default: return;
  }
}

// Every thread's tiles of y; `a` holds every row's quantized activations.
void tiles_team(const Activations& a, int64_t M, const uint8_t* tiles, int64_t N, float* y) {
  const int64_t num_tiles = (N + kTileRows - 1) / kTileRows;
  const int64_t tile_bytes = kHeader + a.padded * kTileRows;
#pragma omp for schedule(static)
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t cols = N - t * kTileRows < kTileRows ? N - t * kTileRows : kTileRows;
    tile_all_rows(tiles + t * tile_bytes, a, M, y + t * kTileRows, N, cols);
  }
}

constexpr int64_t kOwnRows = 8;  // calls of at most this many rows quantize them on every thread

}  // namespace

// x [M, K] float32 -> y [M, N] over the tiles above; called by every thread of a region.
void w8a8_linear_team(const float* x, int64_t M, int64_t K, const uint8_t* tiles, int64_t N, float* y) {
  const int64_t padded = (K + kBlock - 1) / kBlock * kBlock, blocks = padded / kBlock;
  const int64_t bytes = M * padded + M * blocks * 8;
  auto view = [&](char* buffer) {
    return Activations{reinterpret_cast<int8_t*>(buffer + M * blocks * 8), reinterpret_cast<float*>(buffer),
                       reinterpret_cast<int32_t*>(buffer + M * blocks * 4), padded};
  };
  auto quantize = [&](const Activations& a, int64_t i) {
    const int64_t r = i / blocks;
    quantize_block(x + r * K, K, i % blocks, a.codes + r * padded, a.scales + r * blocks, a.sums + r * blocks);
  };
  if (M <= kOwnRows) {
    // A decode or verification step: each thread quantizes the few rows into its own buffer (a microsecond or
    // two), which saves the barriers a shared buffer needs around it.
    thread_local std::vector<char> own;
    if (static_cast<int64_t>(own.size()) < bytes) own.resize(bytes);
    const Activations a = view(own.data());
    for (int64_t i = 0; i < M * blocks; ++i) quantize(a, i);
    return tiles_team(a, M, tiles, N, y);
  }
  char* buffer;
#pragma omp single copyprivate(buffer)
  buffer = new char[bytes];
  const Activations a = view(buffer);
#pragma omp for schedule(static)
  for (int64_t i = 0; i < M * blocks; ++i) quantize(a, i);
  tiles_team(a, M, tiles, N, y);
#pragma omp single
  delete[] buffer;
}

extern "C" void specula_w8a8_linear(const float* x, int64_t M, int64_t K, const uint8_t* tiles, int64_t N, float* y,
                                    int threads) {
#pragma omp parallel num_threads(threads)
  w8a8_linear_team(x, M, K, tiles, N, y);
}

// Whether this build multiplies with AVX-512 VNNI (1) or AVX2's byte products (0).
extern "C" int specula_w8a8_vnni() {
#if defined(__AVX512VNNI__)
  return 1;
#else
  return 0;
#endif
}
