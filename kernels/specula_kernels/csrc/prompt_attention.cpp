// Causal attention of a prompt's rows over its keys and values in the paged cache, float32 (`--dtype float32` on
// CPU): query row t, at position context - tokens + t, attends to positions 0 .. context - tokens + t.
//
// Why by hand: PyTorch's CPU kernel for a causal prompt (`scaled_dot_product_attention`, its flash kernel) took
// about 4 ms a layer for SmolLM2's 350-token prompts (9 heads over 3 KV heads of 64) on a 2-core AVX-512 VM, about
// 35 GFLOP/s, a sixth of a prompt's prefill there; the products of a prompt run near 200 (float_linear.cpp).
// `paged_attention.cpp` reads each key once per query row, which suits a few rows, not hundreds.
//
// How: the keys of the context are copied once, transposed per KV head (kt[kv_head][d][position]), so that the
// scores of a block of kRows query rows of one head against 2 x kLanes keys are the register-blocked micro-kernel
// of float_linear.cpp (the rows' query values broadcast, the keys' vectors loaded). Units of work, a head's block of
// query rows each, are shared among the team, the longest first. A unit: the scores of its rows against every
// position the last of them sees, each row's softmax over its own positions (two passes: the exact maximum, then the
// exponentials and their sum, a vector at a time), then the weighted sum of the values, kRows rows x two vectors of the head at a time,
// each value row read from where it lies in the cache. A row's result does not depend on the blocking or the
// threads; it differs from PyTorch's in the order of its sums (tests: within float32 tolerances).

#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

constexpr int kRows = kLanes == 16 ? 12 : 6;  // query rows per unit (the micro-kernel's register block)
constexpr int kKeys = 2 * kLanes;             // keys per block of scores

template <typename T>
T* grown(std::vector<T>& buffer, size_t size) {
  if (buffer.size() < size) buffer.resize(size);
  return buffer.data();
}

// Scores of MB query rows (`q`, rows `qs` apart, `dim` values) against kKeys keys stored transposed (`kt`, inputs
// `ld` apart): s[i * ls + j] = scale * q_i . k_j.
template <int MB>
void score_block(const float* q, int64_t qs, int64_t dim, const float* kt, int64_t ld, float scale, float* s,
                 int64_t ls) {
  vfloat lo[MB], hi[MB];
  for (int i = 0; i < MB; ++i) lo[i] = hi[i] = vfloat{};
  for (int64_t d = 0; d < dim; ++d) {
    const vfloat k0 = vload(kt + d * ld), k1 = vload(kt + d * ld + kLanes);
    for (int i = 0; i < MB; ++i) {
      const vfloat qv = vsplat(q[i * qs + d]);
      lo[i] = vfma(qv, k0, lo[i]);
      hi[i] = vfma(qv, k1, hi[i]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    vstore(s + i * ls, lo[i] * scale);
    vstore(s + i * ls + kLanes, hi[i] * scale);
  }
}

// MB rows' weighted sums of two vectors of the values (from `d0`) over positions [0, n): out_i += sum_j p[i][j] v_j,
// then scaled by inv[i]. `values` + slots[j] * slot_stride: position j's values for this KV head.
template <int MB>
void value_block(const float* p, int64_t ls, int64_t n, const float* values, const int64_t* slots,
                 int64_t slot_stride, int64_t d0, const float* inv, float* out, int64_t os) {
  vfloat lo[MB], hi[MB];
  for (int i = 0; i < MB; ++i) lo[i] = hi[i] = vfloat{};
  for (int64_t j = 0; j < n; ++j) {
    const float* v = values + slots[j] * slot_stride + d0;
    const vfloat v0 = vload(v), v1 = vload(v + kLanes);
    for (int i = 0; i < MB; ++i) {
      const vfloat w = vsplat(p[i * ls + j]);
      lo[i] = vfma(w, v0, lo[i]);
      hi[i] = vfma(w, v1, hi[i]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    vstore(out + i * os + d0, lo[i] * inv[i]);
    vstore(out + i * os + d0 + kLanes, hi[i] * inv[i]);
  }
}

// The blocks above for mb <= kRows rows.
template <int MB = kRows>
void score_rows(int64_t mb, const float* q, int64_t qs, int64_t dim, const float* kt, int64_t ld, float scale,
                float* s, int64_t ls) {
  if constexpr (MB > 1) {
    if (mb < MB) return score_rows<MB - 1>(mb, q, qs, dim, kt, ld, scale, s, ls);
  }
  score_block<MB>(q, qs, dim, kt, ld, scale, s, ls);
}

template <int MB = kRows>
void value_rows(int64_t mb, const float* p, int64_t ls, int64_t n, const float* values, const int64_t* slots,
                int64_t slot_stride, int64_t d0, const float* inv, float* out, int64_t os) {
  if constexpr (MB > 1) {
    if (mb < MB) return value_rows<MB - 1>(mb, p, ls, n, values, slots, slot_stride, d0, inv, out, os);
  }
  value_block<MB>(p, ls, n, values, slots, slot_stride, d0, inv, out, os);
}

}  // namespace

extern "C" {

// query [tokens][num_heads * head_dim] (rows `query_stride` apart); caches [slots][num_kv_heads][head_dim];
// slots[context]: each position's slot; out like query (rows `out_stride` apart). head_dim a multiple of
// 2 x kLanes (`specula_vector_lanes`); num_heads a multiple of num_kv_heads.
void specula_prompt_attention(const float* query, int64_t query_stride, const float* key_cache,
                              const float* value_cache, int64_t num_kv_heads, const int64_t* slots, int64_t context,
                              int64_t tokens, int64_t num_heads, int64_t head_dim, float scale, float* out,
                              int64_t out_stride, int threads) {
  const int64_t dim = head_dim, slot_stride = num_kv_heads * dim, start = context - tokens;
  const int64_t ld = (context + kKeys - 1) / kKeys * kKeys;  // positions per transposed row, padded with zeros
  const int64_t group = num_heads / num_kv_heads, blocks = (tokens + kRows - 1) / kRows;
  // The call's own (one layer's keys of the context, transposed): a buffer kept per thread would hold the size of
  // the longest prompt's for the process's life.
  std::vector<float> kt_buffer(static_cast<size_t>(num_kv_heads * dim * ld));
  float* kt = kt_buffer.data();
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t unit = 0; unit < num_kv_heads * (ld / kKeys); ++unit) {
      const int64_t g = unit / (ld / kKeys), j0 = unit % (ld / kKeys) * kKeys;
      float* dst = kt + g * dim * ld;
      for (int64_t j = j0; j < j0 + kKeys; ++j) {
        const float* src = j < context ? key_cache + slots[j] * slot_stride + g * dim : nullptr;
        for (int64_t d = 0; d < dim; ++d) dst[d * ld + j] = src ? src[d] : 0.0f;
      }
    }
    thread_local std::vector<float> scores_buffer;
    float* scores = grown(scores_buffer, static_cast<size_t>(kRows * ld));
    // Units: head h's block b of rows, the blocks with the most positions first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t unit = 0; unit < num_heads * blocks; ++unit) {
      const int64_t b = blocks - 1 - unit / num_heads, h = unit % num_heads, g = h / group;
      const int64_t t0 = b * kRows, mb = tokens - t0 < kRows ? tokens - t0 : kRows;
      const int64_t seen = start + t0 + mb;  // positions the block's last row sees
      const int64_t whole = (seen + kKeys - 1) / kKeys * kKeys;
      const float* q = query + t0 * query_stride + h * dim;
      for (int64_t j0 = 0; j0 < seen; j0 += kKeys)
        score_rows(mb, q, query_stride, dim, kt + g * dim * ld + j0, ld, scale, scores + j0, ld);
      float inv[kRows];
      for (int64_t i = 0; i < mb; ++i) {
        float* s = scores + i * ld;
        // Positions [0, own) are row i's; the scores stored reach `whole` (`seen` rounded up to kKeys).
        const int64_t own = start + t0 + i + 1, vectors = (own + kLanes - 1) / kLanes * kLanes;
        for (int64_t j = own; j < vectors; ++j) s[j] = -__builtin_inff();
        vfloat most = vload(s);
        for (int64_t j = kLanes; j < vectors; j += kLanes) most = vmax(most, vload(s + j));
        const float best = vmax_lane(most);
        for (int64_t j = 0; j < vectors; j += kLanes) vstore(s + j, vexp(vload(s + j) - best));
        for (int64_t j = own; j < whole; ++j) s[j] = 0.0f;  // after the row's own, up to the block's last row's
        vfloat sums{};
        for (int64_t j = 0; j < vectors; j += kLanes) sums += vload(s + j);
        inv[i] = 1.0f / vsum(sums);
      }
      for (int64_t d0 = 0; d0 < dim; d0 += 2 * kLanes)
        value_rows(mb, scores, ld, seen, value_cache + g * dim, slots, slot_stride, d0, inv,
                   out + t0 * out_stride + h * dim, out_stride);
    }
  }
}

}  // extern "C"
