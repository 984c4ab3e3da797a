// A Llama-family decoder stack for a step of a few rows (decode, verification of drafts), in one call and one
// parallel region.
//
// At one decoded row a layer's products take a few hundred microseconds and everything around them (eight calls
// from Python, each with its argument conversion, output allocation and a wake-up of the threads) took a third as
// much again on the real model (docs/benchmarks.md#one-stream-where-a-decode-step-goes). Here the threads stay in
// one region for the whole stack and run, layer after layer, the very kernels the separate calls run (the team
// functions of `team.h`), in the same order on the same values: the results are the same bits as the unfused path.
//
// Per layer: h = rms_norm(x); qkv = h Wqkv^T; rotate q and k, store k and v in the cache; a = attention(q);
// x += a Wo^T; h = rms_norm(x); g = silu(gate) * up of h Wgu^T; x += g Wd^T.

#include <omp.h>

#include <cstdint>

#include "team.h"

namespace {

enum Kind : int32_t { kPanels = 0, kInt8 = 1, kInt4 = 2, kQ4_0 = 3, kQ4_1 = 4, kQ8_0 = 5, kW8A8 = 6 };

}  // namespace

extern "C" {

// A product's weight as the layer holds it (`linear.pack_panels`, `quantized_linear.pack_int8_native`,
// `pack_int4_native`, `pack_w8a8_native`, or GGUF's from `gguf_blocks.GGUFBlocks.pack_native`).
struct SpeculaProduct {
  int32_t kind;
  int64_t out_features, in_features, group_size;
  const void* weight;  // panels (float32) or tiles (int8, int4, GGUF), which hold their own scales
};

struct SpeculaLayer {
  const float* input_norm;
  const float* post_norm;
  SpeculaProduct qkv, o, gate_up, down;
  float* key_cache;  // [slots][kv_heads][head_dim]
  float* value_cache;
};

// One group of a step's sequences for attention, as `PagedAttentionInputs` (query_index: rows of the whole step).
struct SpeculaAttention {
  const int64_t* context_slots;  // [num_seqs][max_context]
  int64_t num_seqs, max_context;
  const int64_t* query_index;  // [num_seqs][max_query]
  const uint8_t* query_valid;
  int64_t max_query;
  const uint8_t* mask;  // [num_seqs][max_query][max_context] or null
};

// What every layer of one step shares: its shape, rotary tables, cache slots, attention groups (one, or the
// groups of a `GroupedAttentionInputs`) and the scratch rows the layers pass between their operators.
struct SpeculaStep {
  int64_t rows, hidden, num_heads, num_kv_heads, head_dim, intermediate;
  float eps, scale;
  const float* cos;  // [rows][head_dim], sin half-negated (`RotaryEmbedding.tables`)
  const float* sin;
  const int64_t* slot_mapping;  // [rows]
  const SpeculaAttention* attention;
  int64_t num_attention;
  float* normed;  // [rows][hidden]
  float* qkv;  // [rows][(heads + 2 kv_heads) head_dim]
  float* attended;  // [rows][heads head_dim]
  float* projected;  // [rows][hidden]
  float* gate_up;  // [rows][2 intermediate]
  float* activated;  // [rows][intermediate]
};

}  // extern "C"

// A clock for benchmark/decode_profile.py's view inside the stack: with a buffer set (`specula_stack_stamps`), the
// team's first thread writes the time (ns) when a call's region starts and after each operator of each layer (ten a
// layer, in the order below; every operator ends on the team's barrier, so a stamp marks the whole team's
// completion). One buffer for the process, set around one call at a time by the benchmark; null while serving: one
// untaken branch an operator.
static int64_t* g_stamps = nullptr;

extern "C" void specula_stack_stamps(int64_t* buffer) { g_stamps = buffer; }

static inline void stamp(int64_t*& cursor) {
  if (cursor != nullptr) *cursor++ = static_cast<int64_t>(omp_get_wtime() * 1e9);
}

static void product_team(const SpeculaProduct& p, const float* x, int64_t rows, float* y) {
  switch (p.kind) {
    case kPanels:
      return float_linear_team(x, rows, p.in_features, static_cast<const float*>(p.weight), nullptr, p.out_features,
                               y);
    case kInt8:
      return int8_linear_team(x, rows, p.in_features, static_cast<const uint8_t*>(p.weight), p.out_features, y);
    case kW8A8:
      return w8a8_linear_team(x, rows, p.in_features, static_cast<const uint8_t*>(p.weight), p.out_features, y);
    case kInt4:
    case kQ4_0:
    case kQ4_1:  // Specula's int4 codes are biased by 8, as Q4_0's
      return q4_linear_team(x, rows, p.in_features, static_cast<const uint8_t*>(p.weight), p.kind == kQ4_1 ? 0 : 8,
                            p.group_size, p.out_features, y);
    default:
      return q8_0_linear_team(x, rows, p.in_features, static_cast<const uint8_t*>(p.weight), p.out_features, y);
  }
}

// x [rows][hidden] += y [rows][hidden], rows shared among the team.
static void add_team(float* x, const float* y, int64_t rows, int64_t hidden) {
#pragma omp for
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < hidden; ++i) x[r * hidden + i] += y[r * hidden + i];
}

// One layer's work after its input norm: `input` [rows][in] is what its q/k/v product reads (the normed residual
// stream `hidden`, or EAGLE-3's wider input below). Called by every thread of the region.
static void layer_team(const SpeculaLayer& layer, const SpeculaStep& s, const float* input, float* hidden,
                       int64_t*& cursor) {
  const int64_t q_width = s.num_heads * s.head_dim, qkv_width = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim;
  product_team(layer.qkv, input, s.rows, s.qkv);
  stamp(cursor);
  rotary_cache_team(s.qkv, qkv_width, s.rows, s.num_heads, s.num_kv_heads, s.head_dim, s.cos, s.sin,
                    layer.key_cache, layer.value_cache, s.slot_mapping);
  stamp(cursor);
  for (int64_t g = 0; g < s.num_attention; ++g) {
    const SpeculaAttention& a = s.attention[g];
    paged_attention_team(s.qkv, qkv_width, layer.key_cache, layer.value_cache, s.num_kv_heads, a.context_slots,
                         a.num_seqs, a.max_context, a.query_index, a.query_valid, a.max_query, a.mask,
                         s.num_heads, s.head_dim, s.scale, s.attended, q_width);
  }
  stamp(cursor);
  product_team(layer.o, s.attended, s.rows, s.projected);
  stamp(cursor);
  rms_norm_team(hidden, s.hidden, s.projected, s.hidden, layer.post_norm, s.rows, s.hidden, s.eps, s.normed,
                s.hidden);
  stamp(cursor);
  product_team(layer.gate_up, s.normed, s.rows, s.gate_up);
  stamp(cursor);
  silu_mul_team(s.gate_up, 2 * s.intermediate, s.rows, s.intermediate, s.activated, s.intermediate);
  stamp(cursor);
  product_team(layer.down, s.activated, s.rows, s.projected);
  stamp(cursor);
  add_team(hidden, s.projected, s.rows, s.hidden);
  stamp(cursor);
}

extern "C" void specula_decode_layers(const SpeculaLayer* layers, int64_t num_layers, const SpeculaStep* step,
                                      float* hidden, int threads) {
  const SpeculaStep& s = *step;
#pragma omp parallel num_threads(threads)
  {
    int64_t* cursor = omp_get_thread_num() == 0 ? g_stamps : nullptr;
    stamp(cursor);
    for (int64_t l = 0; l < num_layers; ++l) {
      rms_norm_team(hidden, s.hidden, nullptr, 0, layers[l].input_norm, s.rows, s.hidden, s.eps, s.normed,
                    s.hidden);
      stamp(cursor);
      layer_team(layers[l], s, s.normed, hidden, cursor);
    }
  }
}

// EAGLE-3's first draft layer (server/specula_server/speculation/eagle3.py): its q/k/v product reads
// [input_layernorm(embeds), hidden_norm(state)], 2 x hidden wide (`input` is that scratch, [rows][2 hidden]), and its
// residual stream starts from the state, or from hidden_norm(state) with norm_before_residual; the rest is a decoder
// layer's, by the same kernels in the order the layer-by-layer path runs them. `embeds` and `state` are
// [rows][hidden]; `hidden` [rows][hidden] receives the layer's output.
extern "C" void specula_eagle3_layer(const SpeculaLayer* layer, const float* hidden_norm, int32_t norm_before_residual,
                                     const SpeculaStep* step, float* embeds, float* state, float* input,
                                     float* hidden, int threads) {
  const SpeculaStep& s = *step;
  const int64_t h = s.hidden;
#pragma omp parallel num_threads(threads)
  {
    rms_norm_team(embeds, h, nullptr, 0, layer->input_norm, s.rows, h, s.eps, input, 2 * h);
    rms_norm_team(state, h, nullptr, 0, hidden_norm, s.rows, h, s.eps, input + h, 2 * h);
#pragma omp for
    for (int64_t r = 0; r < s.rows; ++r) {
      const float* from = norm_before_residual ? input + r * 2 * h + h : state + r * h;
      for (int64_t i = 0; i < h; ++i) hidden[r * h + i] = from[i];
    }
    int64_t* cursor = nullptr;  // not stamped
    layer_team(*layer, s, input, hidden, cursor);
  }
}
