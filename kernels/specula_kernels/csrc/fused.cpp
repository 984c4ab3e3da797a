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
//   specula_logit_rows      per row of logits: whether every value is finite, the first index of the largest,
//                           and the log of the softmax's normaliser (what greedy decoding reports a token with)
//
// The last is not a layer's but the step's: after the LM head a greedy step ran five PyTorch reductions over each
// row of logits (the finite check's max and min, argmax, logsumexp, a gather), about 0.5 ms of a one-stream step
// on a 49,152-token vocabulary with the calls around them and 2.7 ms for 32 rows, where one pass here takes
// 0.08 ms and 0.6 ms (docs/benchmarks.md#the-steps-work-around-the-model).
//
// Rounding: the rotary embedding is the same multiplies and add as `fused.apply_rotary`, bit for bit
// (this file is compiled without fused multiply-adds of the compiler's making, by the pragmas below); the norm's
// mean is a sum in another order than PyTorch's, and SiLU's exponential another polynomial, each within a few
// units in the last place.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"
#include "team.h"

// No contraction of a * b + c into one fused multiply-add, as PyTorch's separate operators round each step
// (GCC reads the first pragma, Clang the second; the fused multiply-adds written as `vfma` stay).
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

// Rows are split among the threads only when there is enough work to pay for waking them.
static constexpr int64_t kParallelElements = 1 << 15;

void rms_norm_team(float* x, int64_t x_stride, const float* delta, int64_t delta_stride, const float* weight,
                   int64_t rows, int64_t dim, float eps, float* out, int64_t out_stride) {
#pragma omp for
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * x_stride;
    vfloat squares{};
    for (int64_t i = 0; i < dim; i += kLanes) {
      vfloat v = vload_part(xr + i, dim - i);
      if (delta) {
        v += vload_part(delta + r * delta_stride + i, dim - i);
        vstore_part(xr + i, v, dim - i);
      }
      squares = vfma(v, v, squares);
    }
    const float scale = 1.0f / std::sqrt(vsum(squares) / static_cast<float>(dim) + eps);
    for (int64_t i = 0; i < dim; i += kLanes) {
      const vfloat v = vload_part(xr + i, dim - i) * scale;
      vstore_part(out + r * out_stride + i, vload_part(weight + i, dim - i) * v, dim - i);
    }
  }
}

void silu_mul_team(const float* gate_up, int64_t in_stride, int64_t rows, int64_t width, float* out,
                   int64_t out_stride) {
#pragma omp for
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * in_stride;
    const float* up = gate + width;
    for (int64_t i = 0; i < width; i += kLanes) {
      const vfloat g = vload_part(gate + i, width - i);
      const vfloat silu = g / (vexp(vfloat{} - g) + 1.0f);
      vstore_part(out + r * out_stride + i, silu * vload_part(up + i, width - i), width - i);
    }
  }
}

// qkv rows: [num_heads queries | num_kv_heads keys | num_kv_heads values] of head_dim each, `qkv_stride` apart;
// cos and sin: [tokens][head_dim] (sin half-negated, `RotaryEmbedding.tables`); caches [slots][kv_heads][head_dim].
void rotary_cache_team(float* qkv, int64_t qkv_stride, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, const float* cos, const float* sin, float* key_cache, float* value_cache,
                       const int64_t* slot_mapping) {
  const int64_t half = head_dim / 2, rotated_heads = num_heads + num_kv_heads;
#pragma omp for
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

// Row r of `logits` (`stride` apart, `vocab` wide), each output written where its pointer is given: finite[r] (no
// NaN, no infinity), argmax[r] (the first index of the largest value, as torch.argmax; meaningful only for finite
// rows) and log_normalizer[r],
// log(sum(exp(x))) as max + log(sum(exp(x - max))), where -inf values (tokens a grammar masked) weigh exactly 0
// and a NaN, a +inf or a row of -inf alone give NaN.
void logit_rows_team(const float* logits, int64_t stride, int64_t rows, int64_t vocab, uint8_t* finite,
                     int64_t* argmax, float* log_normalizer) {
  const int64_t whole = vocab / kLanes * kLanes;
  const vfloat minus_inf = vsplat(-INFINITY);
#pragma omp for
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * stride;
    vfloat best = minus_inf, bad{};
    vint best_index{}, index, nan{};
    for (int i = 0; i < kLanes; ++i) index[i] = i;
    for (int64_t i = 0; i < whole; i += kLanes, index += kLanes) {
      const vfloat v = vload(x + i);
      bad += v * 0.0f;  // NaN once any value is NaN or infinite
      nan |= v != v;
      const vint greater = v > best;  // strictly: each lane keeps its first occurrence of its largest value
      best = greater ? v : best;
      best_index = greater ? index : best_index;
    }
    float top = -INFINITY, nonfinite = vsum(bad);
    int64_t at = 0;
    bool has_nan = false;
    for (int i = 0; i < kLanes; ++i) {  // the lanes' largest, at its smallest index
      if (best[i] > top || (best[i] == top && best_index[i] < at)) top = best[i], at = best_index[i];
      has_nan |= nan[i] != 0;
    }
    for (int64_t i = whole; i < vocab; ++i) {  // the tail, past every index above
      nonfinite += x[i] * 0.0f;
      has_nan |= x[i] != x[i];
      if (x[i] > top) top = x[i], at = i;
    }
    if (finite) finite[r] = nonfinite == 0.0f;
    if (argmax) argmax[r] = at;
    if (!log_normalizer) continue;
    if (has_nan || !std::isfinite(top)) {
      log_normalizer[r] = NAN;
      continue;
    }
    vfloat sums{};
    const vfloat shift = vsplat(top);
    for (int64_t i = 0; i < whole; i += kLanes) {
      const vfloat v = vload(x + i);
      sums += v != minus_inf ? vexp(v - shift) : vfloat{};
    }
    float sum = vsum(sums);
    for (int64_t i = whole; i < vocab; ++i) sum += x[i] == -INFINITY ? 0.0f : std::exp(x[i] - top);
    log_normalizer[r] = top + std::log(sum);
  }
}

extern "C" {

void specula_rms_norm(float* x, int64_t x_stride, const float* delta, int64_t delta_stride, const float* weight,
                      int64_t rows, int64_t dim, float eps, float* out, int64_t out_stride, int threads) {
#pragma omp parallel num_threads(threads) if (rows * dim >= kParallelElements)
  rms_norm_team(x, x_stride, delta, delta_stride, weight, rows, dim, eps, out, out_stride);
}

void specula_silu_mul(const float* gate_up, int64_t in_stride, int64_t rows, int64_t width, float* out,
                      int64_t out_stride, int threads) {
#pragma omp parallel num_threads(threads) if (rows * width >= kParallelElements)
  silu_mul_team(gate_up, in_stride, rows, width, out, out_stride);
}

void specula_rotary_cache(float* qkv, int64_t qkv_stride, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                          int64_t head_dim, const float* cos, const float* sin, float* key_cache, float* value_cache,
                          const int64_t* slot_mapping, int threads) {
#pragma omp parallel num_threads(threads) if (tokens * (num_heads + num_kv_heads) * head_dim >= kParallelElements)
  rotary_cache_team(qkv, qkv_stride, tokens, num_heads, num_kv_heads, head_dim, cos, sin, key_cache, value_cache,
                    slot_mapping);
}

void specula_logit_rows(const float* logits, int64_t stride, int64_t rows, int64_t vocab, uint8_t* finite,
                        int64_t* argmax, float* log_normalizer, int threads) {
#pragma omp parallel num_threads(threads) if (rows > 1 && rows * vocab >= kParallelElements)
  logit_rows_team(logits, stride, rows, vocab, finite, argmax, log_normalizer);
}

}  // extern "C"
