// Attention of a few query rows per sequence (decode, verification of drafts) over a paged KV cache, reading
// the keys and values where they lie in the cache.
//
// The PyTorch path (`paged_attention._attend`) first gathers every sequence's context into a dense buffer, then
// runs `scaled_dot_product_attention` over it: the context crosses memory three times (read, written, read
// again), and SDPA's CPU kernel is built for blocks of queries, not the one row a decode step has per sequence.
// With many sequences the two were a large share of a float32 decode step
// (docs/benchmarks.md#attention-in-place-fused-layer-operations-the-whole-step). Here a
// thread takes a sequence and a range of its heads (all of them when there are sequences enough for the
// threads) and, for each query row, reads each visible slot's keys for those heads as one contiguous run (dot
// products), then its values the same way (weighted sums): the context crosses memory once per row.
//
// Layouts (float32): query rows `[tokens][heads][head_dim]`, any stride between tokens (the rotated queries are
// a view into the fused q/k/v output); caches `[slots][kv_heads][head_dim]`; `context_slots [seqs][max_context]`,
// `query_index [seqs][max_query]` (row of the flat token list), `query_valid [seqs][max_query]`, `mask
// [seqs][max_query][max_context]` (1 = attend; null = every position), as in `PagedAttentionInputs`. A masked
// position is skipped, not weighted by zero, so whatever its slot holds never reaches the row.
//
// Exactness: a row's output is a fixed-order computation over its own query and visible keys and values (scores
// in order, the softmax sum in kLanes lanes folded in a fixed order, values accumulated in position order), so it
// does not depend on the other rows, sequences or padding of its step, nor on the threads.
//
// head_dim a multiple of 16 up to 256 (the caller checks).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

#include "simd.h"
#include "team.h"

static constexpr int64_t kAhead = 4;  // positions ahead whose keys (values) are prefetched, for a range of heads

// The lines of one slot's keys or values that query heads [h0, h1) read.
static inline void prefetch_heads(const float* row, int64_t h0, int64_t h1, int64_t group, int dim) {
  const char* first = reinterpret_cast<const char*>(row + (h0 / group) * dim);
  const char* last = reinterpret_cast<const char*>(row + ((h1 - 1) / group + 1) * dim);
  for (const char* p = first; p < last; p += 64) __builtin_prefetch(p);
}

// Softmax weights in place of one head's scores, kLanes at a time; masked positions (-inf) become exactly 0.
// Returns the reciprocal of the weights' sum (their fixed-order sum: kLanes lanes, then the lanes folded).
static float softmax_in_place(float* scores, int64_t context, float best) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  vfloat total{};
  for (int64_t j = 0; j < context; j += kLanes) {
    vfloat s = vload_part(scores + j, context - j);
    for (int64_t i = context - j; i < kLanes; ++i) s[i] = minus_inf;  // lanes past the context
    const vfloat w = s != minus_inf ? vexp(s - best) : vfloat{};
    vstore_part(scores + j, w, context - j);
    total += w;
  }
  return 1.0f / vsum(total);
}

// One query row, query heads [h0, h1): out[h] = softmax(scale * q[h] . K[h]) V[h] over the visible positions.
// Positions outer, heads inner, so each visible slot's keys (then values) for these heads are read as one
// contiguous run of lines, in the order the cache's blocks hold them. `scores`: (h1 - h0) * context floats;
// `acc`: (h1 - h0) * dim floats.
static void attend_row(const float* q, const float* keys, const float* values, int64_t slot_stride, int64_t group,
                       int64_t h0, int64_t h1, const int64_t* slots, const uint8_t* visible, int64_t context,
                       int vectors, float scale, float* scores, float* acc, float* best, float* out) {
  const int dim = kLanes * vectors;
  const int64_t heads = h1 - h0;
  // A range of a slot's heads is a few lines every few KB, which the hardware does not prefetch; a whole slot's
  // are one contiguous run, which it does.
  const bool partial = heads * dim < slot_stride * group;
  const float masked = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < heads; ++h) best[h] = masked;
  for (int64_t j = 0; j < context; ++j) {
    if (visible && !visible[j]) {
      for (int64_t h = 0; h < heads; ++h) scores[h * context + j] = masked;
      continue;
    }
    if (partial && j + kAhead < context) prefetch_heads(keys + slots[j + kAhead] * slot_stride, h0, h1, group, dim);
    const float* row = keys + slots[j] * slot_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const float* k = row + ((h0 + h) / group) * dim;
      const float* qh = q + (h0 + h) * dim;
      vfloat sum = vload(qh) * vload(k);
      for (int v = 1; v < vectors; ++v) sum = vfma(vload(qh + kLanes * v), vload(k + kLanes * v), sum);
      const float s = vsum(sum) * scale;
      scores[h * context + j] = s;
      best[h] = s > best[h] ? s : best[h];
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    if (best[h] == masked) {  // nothing visible (a caller's padding row): zeros, never read
      std::memset(out + (h0 + h) * dim, 0, sizeof(float) * dim);
      continue;
    }
    best[h] = softmax_in_place(scores + h * context, context, best[h]);  // now the weights' reciprocal sum
  }
  std::memset(acc, 0, sizeof(float) * heads * dim);
  for (int64_t j = 0; j < context; ++j) {
    if (visible && !visible[j]) continue;  // skipped, not weighted by zero: a NaN there never reaches the row
    if (partial && j + kAhead < context) prefetch_heads(values + slots[j + kAhead] * slot_stride, h0, h1, group, dim);
    const float* row = values + slots[j] * slot_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const vfloat w = vsplat(scores[h * context + j]);
      const float* val = row + ((h0 + h) / group) * dim;
      float* a = acc + h * dim;
      for (int v = 0; v < vectors; ++v) vstore(a + kLanes * v, vfma(w, vload(val + kLanes * v), vload(a + kLanes * v)));
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    if (best[h] == masked) continue;
    for (int v = 0; v < vectors; ++v)
      vstore(out + (h0 + h) * dim + kLanes * v, vload(acc + h * dim + kLanes * v) * best[h]);
  }
}

void paged_attention_team(const float* query, int64_t query_stride, const float* key_cache, const float* value_cache,
                          int64_t num_kv_heads, const int64_t* context_slots, int64_t num_seqs, int64_t max_context,
                          const int64_t* query_index, const uint8_t* query_valid, int64_t max_query,
                          const uint8_t* mask, int64_t num_heads, int64_t head_dim, float scale, float* out,
                          int64_t out_stride) {
  const int vectors = static_cast<int>(head_dim / kLanes);
  const int64_t group = num_heads / num_kv_heads;  // query heads per KV head
  const int64_t slot_stride = num_kv_heads * head_dim;
  // A work item is a sequence and a range of its KV heads (with their query heads): all of them when there are
  // enough sequences to share among the threads, else split so that every thread has several items.
  int64_t splits = (4 * static_cast<int64_t>(omp_get_num_threads()) + num_seqs - 1) / num_seqs;
  splits = splits < 1 ? 1 : (splits > num_kv_heads ? num_kv_heads : splits);
  {
    const int64_t most = ((num_kv_heads + splits - 1) / splits) * group;  // query heads of the largest range
    const size_t context = static_cast<size_t>(max_context > 0 ? max_context : 1);
    std::vector<float> scores(most * context), acc(most * head_dim), best(most);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * splits; ++item) {
      const int64_t s = item / splits, part = item % splits;
      const int64_t h0 = (part * num_kv_heads / splits) * group, h1 = ((part + 1) * num_kv_heads / splits) * group;
      const int64_t* slots = context_slots + s * max_context;
      for (int64_t qi = 0; qi < max_query; ++qi) {
        if (!query_valid[s * max_query + qi]) continue;
        const int64_t t = query_index[s * max_query + qi];
        const uint8_t* visible = mask ? mask + (s * max_query + qi) * max_context : nullptr;
        attend_row(query + t * query_stride, key_cache, value_cache, slot_stride, group, h0, h1, slots, visible,
                   max_context, vectors, scale, scores.data(), acc.data(), best.data(), out + t * out_stride);
      }
    }
  }
}

extern "C" void specula_paged_attention(const float* query, int64_t query_stride, const float* key_cache,
                                        const float* value_cache, int64_t num_kv_heads, const int64_t* context_slots,
                                        int64_t num_seqs, int64_t max_context, const int64_t* query_index,
                                        const uint8_t* query_valid, int64_t max_query, const uint8_t* mask,
                                        int64_t num_heads, int64_t head_dim, float scale, float* out,
                                        int64_t out_stride, int threads) {
#pragma omp parallel num_threads(threads)
  paged_attention_team(query, query_stride, key_cache, value_cache, num_kv_heads, context_slots, num_seqs,
                       max_context, query_index, query_valid, max_query, mask, num_heads, head_dim, scale, out,
                       out_stride);
}
