// The small per-layer operations of a decoder step, each fused into one pass over its rows (float32, CPU).
//
// Around its four products a Llama layer runs about twenty PyTorch operators on a few rows: the RMS norms
// (a cast, a square, a mean, an add, a reciprocal square root, two multiplies), the residual adds, the rotary
// embedding (a concatenation, two multiplies, an add), the KV cache writes (two index copies) and SiLU times
// up. At one decoded row each costs its dispatch (microseconds), not its arithmetic; in a prompt, each is one
// more pass over memory. These functions do each group in one call and one pass:
//
//   specula_rms_norm        [x += delta;] out = weight * (x * rsqrt(mean(x^2) + eps))
//   specula_silu_mul        out = silu(gate) * up, from the fused gate/up product's rows
//   specula_rotary_cache    rotates the queries and keys in place in the fused q/k/v rows (rotate-half form),
//                           then stores the keys and values at their cache slots
//
// Rounding: the rotary embedding is the same multiplies and add as `fused.apply_rotary`, bit for bit
// (this file is compiled without fused multiply-adds of the compiler's making, by the pragmas below); the norm's
// mean is a sum in another order than PyTorch's, and SiLU's exponential another polynomial, each within a few
// units in the last place.

#include <cmath>
#include <cstdint>
#include <cstring>

#if !defined(__AVX512F__)
#error "the fused kernels need AVX-512 (elsewhere the worker uses PyTorch's operators)"
#endif
#include <immintrin.h>

#include "vector_math.h"

// No contraction of a * b + c into one fused multiply-add, as PyTorch's separate operators round each step
// (GCC reads the first pragma, Clang the second; the fused multiply-adds written as intrinsics stay).
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

static inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

// Rows are split among the threads only when there is enough work to pay for waking them.
static constexpr int64_t kParallelElements = 1 << 15;

extern "C" void specula_rms_norm(float* x, int64_t x_stride, const float* delta, int64_t delta_stride,
                                 const float* weight, int64_t rows, int64_t dim, float eps, float* out,
                                 int64_t out_stride, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * x_stride;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
      const __mmask16 m = tail_mask(dim - i);
      __m512 v = _mm512_maskz_loadu_ps(m, xr + i);
      if (delta) {
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, delta + r * delta_stride + i));
        _mm512_mask_storeu_ps(xr + i, m, v);
      }
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const float scale = 1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(dim) + eps);
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < dim; i += 16) {
      const __mmask16 m = tail_mask(dim - i);
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + i), s);
      _mm512_mask_storeu_ps(out + r * out_stride + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, weight + i), v));
    }
  }
}

extern "C" void specula_silu_mul(const float* gate_up, int64_t in_stride, int64_t rows, int64_t width, float* out,
                                 int64_t out_stride, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * width >= kParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * in_stride;
    const float* up = gate + width;
    for (int64_t i = 0; i < width; i += 16) {
      const __mmask16 m = tail_mask(width - i);
      const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
      const __m512 negative_exp = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), negative_exp));
      _mm512_mask_storeu_ps(out + r * out_stride + i, m, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(m, up + i)));
    }
  }
}

// qkv rows: [num_heads queries | num_kv_heads keys | num_kv_heads values] of head_dim each, `qkv_stride` apart;
// cos and sin: [tokens][head_dim] (sin half-negated, `RotaryEmbedding.tables`); caches [slots][kv_heads][head_dim].
extern "C" void specula_rotary_cache(float* qkv, int64_t qkv_stride, int64_t tokens, int64_t num_heads,
                                     int64_t num_kv_heads, int64_t head_dim, const float* cos, const float* sin,
                                     float* key_cache, float* value_cache, const int64_t* slot_mapping,
                                     int threads) {
  const int64_t half = head_dim / 2, rotated_heads = num_heads + num_kv_heads;
#pragma omp parallel for num_threads(threads) if (tokens * rotated_heads * head_dim >= kParallelElements)
  for (int64_t t = 0; t < tokens; ++t) {
    float* row = qkv + t * qkv_stride;
    const float* c = cos + t * head_dim;
    const float* s = sin + t * head_dim;
    float x[1024];  // one head's inputs (head_dim <= 1024, checked by the caller)
    for (int64_t h = 0; h < rotated_heads; ++h) {
      float* head = row + h * head_dim;
      std::memcpy(x, head, sizeof(float) * head_dim);
      for (int64_t i = 0; i < half; ++i) head[i] = x[i] * c[i] + x[i + half] * s[i];
      for (int64_t i = half; i < head_dim; ++i) head[i] = x[i] * c[i] + x[i - half] * s[i];
    }
    const int64_t kv = num_kv_heads * head_dim;
    std::memcpy(key_cache + slot_mapping[t] * kv, row + num_heads * head_dim, sizeof(float) * kv);
    std::memcpy(value_cache + slot_mapping[t] * kv, row + (num_heads + num_kv_heads) * head_dim, sizeof(float) * kv);
  }
}
