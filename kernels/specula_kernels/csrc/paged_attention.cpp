// Attention of a few query rows per sequence (decode, verification of drafts) over a paged KV cache, reading
// the keys and values where they lie in the cache.
//
// The PyTorch path (`paged_attention._attend`) first gathers every sequence's context into a dense buffer, then
// runs `scaled_dot_product_attention` over it: the context crosses memory three times (read, written, read
// again), and SDPA's CPU kernel is built for blocks of queries, not the one row a decode step has per sequence.
// With many sequences the two were a large share of a float32 decode step
// (docs/benchmarks.md#attention-in-place-fused-layer-operations-the-whole-step). Here, with sequences enough
// for the threads, a thread takes a sequence and, for each query row, reads each visible slot's keys as one
// contiguous run (dot products), then its values (weighted sums): the context crosses memory once per row. With
// fewer sequences than threads (one stream), the threads share each row: a range of its positions' scores each,
// then some heads' softmax each, then some vectors of head_dim of its weighted sums each, so that each key and
// value is still read once (a split by heads read a KV head shared by two ranges twice, and split nine heads four
// and five).
//
// Layouts (float32): query rows `[tokens][heads][head_dim]`, any stride between tokens (the rotated queries are
// a view into the fused q/k/v output); caches `[slots][kv_heads][head_dim]`; `context_slots [seqs][max_context]`,
// `query_index [seqs][max_query]` (row of the flat token list), `query_valid [seqs][max_query]`, `mask
// [seqs][max_query][max_context]` (1 = attend; null = every position), as in `PagedAttentionInputs`. A masked
// position is skipped, not weighted by zero, so whatever its slot holds never reaches the row.
//
// Exactness: a row's output is a fixed-order computation over its own query and visible keys and values (scores
// in order, the softmax sum in kLanes lanes folded in a fixed order, values accumulated in position order), so it
// does not depend on the other rows, sequences or padding of its step, nor on the threads: a row shared among the
// threads gets the bits it gets attended by one.
//
// head_dim a multiple of 16 up to 256 (the caller checks).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

#include "simd.h"
#include "team.h"

static constexpr int64_t kAhead = 8;  // positions ahead whose keys (values) are prefetched, for a range of heads

// The lines of one slot's keys or values in [first, last) floats of it (what a range of query heads reads).
static inline void prefetch_heads(const float* row, int64_t first, int64_t last) {
  const char* end = reinterpret_cast<const char*>(row + last);
  for (const char* p = reinterpret_cast<const char*>(row + first); p < end; p += 64) __builtin_prefetch(p);
}

static constexpr int kBatch = kLanes;  // positions whose dot products are folded together
static constexpr int64_t kValueBlock = 32;  // positions whose values the tiles of sums take in turn

// vsum of each of kLanes vectors, as lane p of the result: the same pairwise order (lanes i and i + kLanes / 2,
// then i and i + kLanes / 4, ...), so the same bits, in a few dozen shuffles and adds instead of kLanes scalar
// folds.
#if defined(__AVX512F__)
static inline vfloat vsum_lanes(const vfloat* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // lanes i and i + 8 of vectors 2i and 2i + 1
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4((__m512)v[2 * i], (__m512)v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4((__m512)v[2 * i], (__m512)v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // then i and i + 4: quarters of vectors 4i ... 4i + 3
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // then i and i + 2, within each quarter
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lanes: vectors 0, 4, 8, 12 | 1, 5, 9, 13 | 2, 6, 10, 14 | 3, 7, 11, 15 (a 4 x 4 transpose, its own inverse)
  return (vfloat)_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}
#else
static inline vfloat vsum_lanes(const vfloat* v) {
  __m256 half[4], pair[2];
  for (int i = 0; i < 4; ++i)
    half[i] = _mm256_add_ps(_mm256_permute2f128_ps((__m256)v[2 * i], (__m256)v[2 * i + 1], 0x20),
                            _mm256_permute2f128_ps((__m256)v[2 * i], (__m256)v[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)
    pair[i] = _mm256_add_ps(_mm256_shuffle_ps(half[2 * i], half[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm256_shuffle_ps(half[2 * i], half[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(pair[0], pair[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(pair[0], pair[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lanes: vectors 0, 2, 4, 6 | 1, 3, 5, 7
  return (vfloat)_mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

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

// The weighted sums of values of one row's query heads [h0, h1), vectors [va, vb) of head_dim: out[h] = recip[h] *
// sum_j w[h][j] V[h][j] (heads whose `recip` is -inf, with nothing visible, left alone). The sums stay in registers
// while a tile of them runs over a block of kValueBlock positions: kTileVectors vectors of the query heads that read
// one KV head (at most kTileHeads of them), each tile reading only its part of a slot, the block's slots in cache for
// the next tile (sums kept in memory instead, a store and a load a vector and position, were most of a decode step's
// attention with AVX-512). Between blocks a tile's sums wait in `sums` ((h1 - h0) * dim floats). Per head and lane
// the same order as one sum over the positions: fma(w, v, 0) first, then position by position.
template <int kTileHeads, int kTileVectors>
static void value_tiles(const float* values, int64_t slot_stride, int64_t group, int64_t h0, int64_t h1, int va,
                        int vb, const int64_t* slots, const uint8_t* visible, int64_t context, int dim,
                        const float* weights, const float* recip, int64_t first, int64_t last, float* sums,
                        float* out) {
  const float masked = -std::numeric_limits<float>::infinity();
  for (int64_t b0 = 0; b0 < context; b0 += kValueBlock) {
    const int64_t b1 = std::min(context, b0 + kValueBlock);
    bool fetch = true;  // the block's first tile fetches every line these heads read, kAhead positions on
    for (int64_t t0 = h0; t0 < h1;) {
      const int64_t t1 = std::min({h1, (t0 / group + 1) * group, t0 + kTileHeads});  // one KV head's, at most
      const int64_t n = t1 - t0, offset = (t0 / group) * dim;
      for (int v0 = va; v0 < vb; v0 += kTileVectors) {
        vfloat acc[kTileHeads][kTileVectors] = {};
        float* kept = sums + (t0 - h0) * dim + kLanes * v0;
        if (b0 > 0)
          for (int t = 0; t < kTileHeads && t < n; ++t)
            for (int v = 0; v < kTileVectors; ++v) acc[t][v] = vload(kept + t * dim + kLanes * v);
        for (int64_t j = b0; j < b1; ++j) {
          if (visible && !visible[j]) continue;  // skipped, not weighted by zero: a NaN there never reaches the row
          if (fetch && j + kAhead < context) prefetch_heads(values + slots[j + kAhead] * slot_stride, first, last);
          const float* val = values + slots[j] * slot_stride + offset + kLanes * v0;
          for (int t = 0; t < kTileHeads && t < n; ++t) {
            const vfloat w = vsplat(weights[(t0 - h0 + t) * context + j]);
            for (int v = 0; v < kTileVectors; ++v) acc[t][v] = vfma(w, vload(val + kLanes * v), acc[t][v]);
          }
        }
        fetch = false;
        if (b1 < context) {
          for (int t = 0; t < kTileHeads && t < n; ++t)
            for (int v = 0; v < kTileVectors; ++v) vstore(kept + t * dim + kLanes * v, acc[t][v]);
          continue;
        }
        for (int t = 0; t < kTileHeads && t < n; ++t) {
          const float r = recip[t0 - h0 + t];
          if (r == masked) continue;
          for (int v = 0; v < kTileVectors; ++v) vstore(out + (t0 + t) * dim + kLanes * (v0 + v), acc[t][v] * r);
        }
      }
      t0 = t1;
    }
  }
}

// The same sums kept in memory instead (`sums`, as above: a store and a load a vector and position, one pass over
// the positions): with AVX2's sixteen registers a tile holds a few vectors of a few heads, several tiles a block,
// measured slower than this on the AVX2 build (tiles of 2 x 4, 3 x 4 and 4 x 2 vectors, the real model's heads:
// 1.06-1.21x).
[[maybe_unused]] static void value_sums_in_memory(const float* values, int64_t slot_stride, const int64_t* offsets,
                                                  int64_t h0, int64_t h1, int va, int vb, const int64_t* slots,
                                                  const uint8_t* visible, int64_t context, int dim,
                                                  const float* weights, const float* recip, int64_t first,
                                                  int64_t last, float* sums, float* out) {
  const int64_t heads = h1 - h0;
  for (int64_t h = 0; h < heads; ++h) std::memset(sums + h * dim + kLanes * va, 0, sizeof(float) * kLanes * (vb - va));
  for (int64_t j = 0; j < context; ++j) {
    if (visible && !visible[j]) continue;  // skipped, not weighted by zero: a NaN there never reaches the row
    if (j + kAhead < context) prefetch_heads(values + slots[j + kAhead] * slot_stride, first, last);
    const float* row = values + slots[j] * slot_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const vfloat w = vsplat(weights[h * context + j]);
      const float* val = row + offsets[h];
      float* a = sums + h * dim;
      for (int v = va; v < vb; ++v) vstore(a + kLanes * v, vfma(w, vload(val + kLanes * v), vload(a + kLanes * v)));
    }
  }
  const float masked = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < heads; ++h) {
    if (recip[h] == masked) continue;
    for (int v = va; v < vb; ++v)
      vstore(out + (h0 + h) * dim + kLanes * v, vload(sums + h * dim + kLanes * v) * recip[h]);
  }
}

// Vectors [va, vb) of the weighted sums of values of query heads [h0, h1), each head's lines of a slot in [first,
// last) of it; `weights` [h1 - h0][context] (the heads' softmax weights), `recip` [h1 - h0] (their sums' reciprocals),
// `offsets` [h1 - h0] (where each head's value lies in a slot, computed once a call: not per position, a division).
static void accumulate_values(const float* values, int64_t slot_stride, int64_t group, const int64_t* offsets,
                              int64_t h0, int64_t h1, int va, int vb, const int64_t* slots, const uint8_t* visible,
                              int64_t context, int dim, const float* weights, const float* recip, int64_t first,
                              int64_t last, float* sums, float* out) {
#if defined(__AVX512F__)
  const int width = vb - va;
  if (width % 4 == 0)  // sixteen registers of sums out of 32
    return value_tiles<4, 4>(values, slot_stride, group, h0, h1, va, vb, slots, visible, context, dim, weights, recip,
                             first, last, sums, out);
  if (width % 2 == 0)
    return value_tiles<4, 2>(values, slot_stride, group, h0, h1, va, vb, slots, visible, context, dim, weights, recip,
                             first, last, sums, out);
  return value_tiles<4, 1>(values, slot_stride, group, h0, h1, va, vb, slots, visible, context, dim, weights, recip,
                           first, last, sums, out);
#else
  value_sums_in_memory(values, slot_stride, offsets, h0, h1, va, vb, slots, visible, context, dim, weights, recip,
                       first, last, sums, out);
#endif
}

// The scores of one row's query heads [h0, h1) (`q`: head h0's query) at positions [j0, j1) (j0 a multiple of kBatch),
// scale * q[h] . K[h][j] into scores[h - h0][j] (-inf where hidden), and the largest visible one of each head into
// best[h - h0] (-inf if none). Positions outer, heads inner, so each visible slot's keys for these heads are read as
// one contiguous run of lines, [first, last) of the slot, in the order the cache's blocks hold them; `offsets[h -
// h0]`: where head h's key lies in a slot. Each score is computed alone (kBatch positions' sums folded together at
// positions j0, j0 + kBatch, ...), so the scores do not depend on how a row's positions are split into ranges.
static void score_range(const float* q, const float* keys, int64_t slot_stride, const int64_t* offsets,
                        int64_t heads, const int64_t* slots, const uint8_t* visible, int64_t j0, int64_t j1,
                        int64_t context, int vectors, float scale, float* scores, vfloat* lane_best, float* best,
                        int64_t first, int64_t last) {
  const int dim = kLanes * vectors;
  // The cache's blocks lie in any order, so the hardware's prefetchers lose the stream at every block boundary;
  // the lines a position `kAhead` on needs are fetched ahead instead (half the time of a decode step's
  // attention, measured on the real model).
  const float masked = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < heads; ++h) lane_best[h] = vsplat(masked);  // each lane's best, kBatch positions at a time
  int64_t j = j0;
  for (; j + kBatch <= j1; j += kBatch) {  // kBatch positions at once, their sums folded together
    const float* rows[kBatch];
    for (int p = 0; p < kBatch; ++p) {
      if (j + p + kAhead < j1) prefetch_heads(keys + slots[j + p + kAhead] * slot_stride, first, last);
      rows[p] = keys + slots[j + p] * slot_stride;
    }
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t offset = offsets[h];
      const float* qh = q + h * dim;
      vfloat sums[kBatch];
      for (int p = 0; p < kBatch; ++p) sums[p] = vload(qh) * vload(rows[p] + offset);
      for (int v = 1; v < vectors; ++v) {
        const vfloat qv = vload(qh + kLanes * v);
        for (int p = 0; p < kBatch; ++p) sums[p] = vfma(qv, vload(rows[p] + offset + kLanes * v), sums[p]);
      }
      vfloat folded = vsum_lanes(sums) * scale;
      if (visible) {  // a hidden position's sum is computed, never used
        vint seen;
        for (int p = 0; p < kBatch; ++p) seen[p] = visible[j + p];
        folded = seen != 0 ? folded : vsplat(masked);
      }
      vstore(scores + h * context + j, folded);
      lane_best[h] = folded > lane_best[h] ? folded : lane_best[h];  // a NaN score is never the best, as below
    }
  }
  for (int64_t h = 0; h < heads; ++h) best[h] = vmax_lane(lane_best[h]);
  for (; j < j1; ++j) {
    if (visible && !visible[j]) {
      for (int64_t h = 0; h < heads; ++h) scores[h * context + j] = masked;
      continue;
    }
    if (j + kAhead < j1) prefetch_heads(keys + slots[j + kAhead] * slot_stride, first, last);
    const float* row = keys + slots[j] * slot_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const float* k = row + offsets[h];
      const float* qh = q + h * dim;
      vfloat sum = vload(qh) * vload(k);
      for (int v = 1; v < vectors; ++v) sum = vfma(vload(qh + kLanes * v), vload(k + kLanes * v), sum);
      const float s = vsum(sum) * scale;
      scores[h * context + j] = s;
      best[h] = s > best[h] ? s : best[h];
    }
  }
}

// softmax over one head's scores, given their largest: the weights in place, and the reciprocal of their sum
// returned; a head with nothing visible (a caller's padding row) gets zeros in `out` and -inf returned.
static float weigh_head(float* scores, int64_t context, float best, int dim, float* out) {
  if (best == -std::numeric_limits<float>::infinity()) {
    std::memset(out, 0, sizeof(float) * dim);
    return best;
  }
  return softmax_in_place(scores, context, best);
}

// Per-thread scratch of the kernel: kept by the thread (a step's layers reuse it), grown when a call needs more.
template <typename T>
static T* scratch(std::vector<T>& buffer, size_t size) {
  if (buffer.size() < size) buffer.resize(size);
  return buffer.data();
}

// A sequence's rows, each attended by one thread (there are sequences enough to share among the threads): query
// heads [0, heads), scores, softmax, then the sums of values.
static void attend_rows_alone(const float* query, int64_t query_stride, const float* keys, const float* values,
                              int64_t slot_stride, int64_t group, const int64_t* slots, int64_t context,
                              const int64_t* query_index, const uint8_t* query_valid, int64_t max_query,
                              const uint8_t* mask, int64_t heads, int vectors, float scale, float* out,
                              int64_t out_stride) {
  const int dim = kLanes * vectors;
  thread_local std::vector<float> scores_buffer, best_buffer, sums_buffer;
  thread_local std::vector<vfloat> lanes_buffer;
  thread_local std::vector<int64_t> offsets_buffer;
  float* scores = scratch(scores_buffer, heads * context);
  float* best = scratch(best_buffer, heads);
  float* sums = scratch(sums_buffer, heads * dim);
  vfloat* lanes = scratch(lanes_buffer, heads);
  int64_t* offsets = scratch(offsets_buffer, heads);
  for (int64_t h = 0; h < heads; ++h) offsets[h] = (h / group) * dim;  // not per position: a division
  for (int64_t qi = 0; qi < max_query; ++qi) {
    if (!query_valid[qi]) continue;
    const int64_t t = query_index[qi];
    const uint8_t* visible = mask ? mask + qi * context : nullptr;
    score_range(query + t * query_stride, keys, slot_stride, offsets, heads, slots, visible, 0, context, context,
                vectors, scale, scores, lanes, best, 0, slot_stride);
    for (int64_t h = 0; h < heads; ++h)
      best[h] = weigh_head(scores + h * context, context, best[h], dim, out + t * out_stride + h * dim);
    accumulate_values(values, slot_stride, group, offsets, 0, heads, 0, vectors, slots, visible, context, dim, scores,
                      best, 0, slot_stride, sums, out + t * out_stride);
  }
}

void paged_attention_team(const float* query, int64_t query_stride, const float* key_cache, const float* value_cache,
                          int64_t num_kv_heads, const int64_t* context_slots, int64_t num_seqs, int64_t max_context,
                          const int64_t* query_index, const uint8_t* query_valid, int64_t max_query,
                          const uint8_t* mask, int64_t num_heads, int64_t head_dim, float scale, float* out,
                          int64_t out_stride) {
  const int vectors = static_cast<int>(head_dim / kLanes);
  const int dim = static_cast<int>(head_dim);
  const int64_t group = num_heads / num_kv_heads;  // query heads per KV head
  const int64_t slot_stride = num_kv_heads * head_dim, context = max_context;
  const int64_t threads = omp_get_num_threads();
  if (num_seqs >= threads || context <= 0) {  // a sequence's rows to each thread
#pragma omp for schedule(dynamic, 1)
    for (int64_t s = 0; s < num_seqs; ++s)
      attend_rows_alone(query, query_stride, key_cache, value_cache, slot_stride, group,
                        context_slots + s * context, context, query_index + s * max_query,
                        query_valid + s * max_query, max_query, mask ? mask + s * max_query * context : nullptr,
                        num_heads, vectors, scale, out, out_stride);
    return;
  }
  // Fewer sequences than threads: every thread takes a share of each row's work, in three steps with the team's
  // barrier between them: a range of its positions' scores (all heads), then the softmax of some of its heads, then
  // some vectors of its sums of values (all positions). Each key and value is read by one thread, and the results
  // are the bits the rows would get attended alone: each score is computed alone, the largest score is the same
  // maximum, a head's softmax and each sum run over all positions in order as above.
  const int64_t rows = num_seqs * max_query, batches = context / kBatch;
  const int64_t units = num_kv_heads * vectors;  // a vector of a KV head's part of head_dim: phase three's work
  float* shared;
#pragma omp single copyprivate(shared)
  {
    thread_local std::vector<float> buffer;  // this thread's, kept: the team's while it runs
    shared = scratch(buffer, rows * num_heads * (context + 1 + threads));
  }
  float* scores = shared;  // [rows][heads][context]: scores, then weights
  float* part_best = scores + rows * num_heads * context;  // [rows][threads][heads]
  float* recip = part_best + rows * threads * num_heads;  // [rows][heads]
  thread_local std::vector<float> sums_buffer;
  thread_local std::vector<vfloat> lanes_buffer;
  thread_local std::vector<int64_t> offsets_buffer;
  float* sums = scratch(sums_buffer, num_heads * dim);
  vfloat* lanes = scratch(lanes_buffer, num_heads);
  int64_t* offsets = scratch(offsets_buffer, num_heads);
  for (int64_t h = 0; h < num_heads; ++h) offsets[h] = (h / group) * dim;
#pragma omp for schedule(static)
  for (int64_t item = 0; item < rows * threads; ++item) {  // positions [j0, j1) of a row's scores
    const int64_t row = item / threads, part = item % threads, s = row / max_query;
    if (!query_valid[row]) continue;
    const int64_t j0 = part * batches / threads * kBatch;
    const int64_t j1 = part == threads - 1 ? context : (part + 1) * batches / threads * kBatch;
    score_range(query + query_index[row] * query_stride, key_cache, slot_stride, offsets, num_heads,
                context_slots + s * context, mask ? mask + row * context : nullptr, j0, j1, context, vectors, scale,
                scores + row * num_heads * context, lanes, part_best + (row * threads + part) * num_heads, 0,
                slot_stride);
  }
#pragma omp for schedule(static)
  for (int64_t item = 0; item < rows * num_heads; ++item) {  // a head's softmax
    const int64_t row = item / num_heads, h = item % num_heads;
    if (!query_valid[row]) continue;
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t part = 0; part < threads; ++part) {
      const float b = part_best[(row * threads + part) * num_heads + h];
      best = b > best ? b : best;
    }
    recip[item] = weigh_head(scores + item * context, context, best, dim,
                             out + query_index[row] * out_stride + h * dim);
  }
#pragma omp for schedule(static)
  for (int64_t item = 0; item < rows * threads; ++item) {  // vectors [u0, u1) of the KV heads' parts, all positions
    const int64_t row = item / threads, part = item % threads, s = row / max_query;
    if (!query_valid[row]) continue;
    const int64_t u0 = part * units / threads, u1 = (part + 1) * units / threads;
    for (int64_t u = u0; u < u1;) {
      const int64_t kv = u / vectors, end = std::min(u1, (kv + 1) * vectors);
      const int va = static_cast<int>(u - kv * vectors), vb = static_cast<int>(end - kv * vectors);
      const int64_t h0 = kv * group;
      accumulate_values(value_cache, slot_stride, group, offsets + h0, h0, h0 + group, va, vb,
                        context_slots + s * context, mask ? mask + row * context : nullptr, context, dim,
                        scores + (row * num_heads + h0) * context, recip + row * num_heads + h0,
                        kv * dim + kLanes * va, kv * dim + kLanes * vb, sums, out + query_index[row] * out_stride);
      u = end;
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
