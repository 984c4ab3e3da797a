// The vector width the native kernels are written in: 16 floats with AVX-512, 8 with AVX2 and FMA.
//
// Kernels are written once over `vfloat` (GCC/Clang vector extensions) and the few helpers below, and compile to
// either instruction set: `-march=native` picks the machine's own, `SPECULA_NATIVE_ARCH` another (the tests build
// the AVX2 variant on AVX-512 machines that way). Sums over lanes are folded in one fixed order, so a result
// depends on the build's width, never on the rows, blocking or threads of a call.

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
inline constexpr int kLanes = 16;
#elif defined(__AVX2__) && defined(__FMA__)
inline constexpr int kLanes = 8;
#else
#error "the native kernels need AVX2 with FMA, or AVX-512"
#endif

typedef float vfloat __attribute__((vector_size(4 * kLanes)));
typedef int32_t vint __attribute__((vector_size(4 * kLanes)));

static inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

static inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

static inline vfloat vsplat(float s) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_set1_ps(s);  // one broadcast (from memory where `s` is there), no arithmetic
#else
  return (vfloat)_mm256_set1_ps(s);
#endif
}

// The first `n` lanes of `p` (0 < n <= kLanes), the others zero; reads nothing past p[n - 1].
static inline vfloat vload_part(const float* p, int64_t n) {
  if (n >= kLanes) return vload(p);
  vfloat v{};
  for (int64_t i = 0; i < n; ++i) v[i] = p[i];
  return v;
}

static inline void vstore_part(float* p, vfloat v, int64_t n) {
  if (n >= kLanes) return vstore(p, v);
  for (int64_t i = 0; i < n; ++i) p[i] = v[i];
}

// a * b + c rounded once, whatever the file's contraction setting.
static inline vfloat vfma(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return (vfloat)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
}

// c - a * b rounded once.
static inline vfloat vfnma(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_fnmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return (vfloat)_mm256_fnmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
}

static inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }
static inline vfloat vmin(vfloat a, vfloat b) { return a < b ? a : b; }

// The lanes' sum in a fixed pairwise order: halves added lane by lane until one is left.
static inline float vsum(vfloat v) {
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof lanes);
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  return lanes[0];
}

static inline float vmax_lane(vfloat v) {
  float best = v[0];
  for (int i = 1; i < kLanes; ++i) best = v[i] > best ? v[i] : best;
  return best;
}

// exp(x), Cephes' single-precision polynomial: 2^n * p(r) with r = x - n ln 2 in [-ln2/2, ln2/2], within 2 ulp of
// expf. Inputs are clamped to [-87, 88], beyond which exp under- or overflows a float anyway (so exp of a very
// negative input is a tiny positive number, never exactly 0). n stays in [-126, 127]: 2^n is a normal float,
// built from its exponent bits.
static inline vfloat vexp(vfloat x) {
  x = vmin(vmax(x, vsplat(-87.0f)), vsplat(88.0f));
  vfloat n = x * 1.44269504088896341f;
#if defined(__AVX512F__)
  n = (vfloat)_mm512_roundscale_ps((__m512)n, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  n = (vfloat)_mm256_round_ps((__m256)n, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  vfloat r = vfnma(n, vsplat(0.693359375f), x);
  r = vfnma(n, vsplat(-2.12194440e-4f), r);
  vfloat p = vsplat(1.9875691500e-4f);
  p = vfma(p, r, vsplat(1.3981999507e-3f));
  p = vfma(p, r, vsplat(8.3334519073e-3f));
  p = vfma(p, r, vsplat(4.1665795894e-2f));
  p = vfma(p, r, vsplat(1.6666665459e-1f));
  p = vfma(p, r, vsplat(5.0000001201e-1f));
  const vfloat y = vfma(p, r * r, r) + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}
