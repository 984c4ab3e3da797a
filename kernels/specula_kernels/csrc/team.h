// The kernels' work as "team" functions: called by every thread of an OpenMP parallel region, each shares its
// loops among the team with orphaned `omp for` constructs and ends on their barrier, so several can run one after
// another in one region. Each C entry point runs one in a region of its own; `decode_layers.cpp` runs a whole
// decoder stack in one.

#pragma once

#include <cstdint>

void rms_norm_team(float* x, int64_t x_stride, const float* delta, int64_t delta_stride, const float* weight,
                   int64_t rows, int64_t dim, float eps, float* out, int64_t out_stride);
void silu_mul_team(const float* gate_up, int64_t in_stride, int64_t rows, int64_t width, float* out,
                   int64_t out_stride);
void rotary_cache_team(float* qkv, int64_t qkv_stride, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, const float* cos, const float* sin, float* key_cache, float* value_cache,
                       const int64_t* slot_mapping);
void paged_attention_team(const float* query, int64_t query_stride, const float* key_cache, const float* value_cache,
                          int64_t num_kv_heads, const int64_t* context_slots, int64_t num_seqs, int64_t max_context,
                          const int64_t* query_index, const uint8_t* query_valid, int64_t max_query,
                          const uint8_t* mask, int64_t num_heads, int64_t head_dim, float scale, float* out,
                          int64_t out_stride);
void float_linear_team(const float* x, int64_t M, int64_t K, const float* panels, const float* bias, int64_t N,
                       float* y);
void float_panel_rows(const float* x, int64_t M, int64_t K, const float* panel, const float* bias, float* y, int64_t N,
                      int64_t cols, const float* next_panel);
void int8_linear_team(const float* x, int64_t M, int64_t K, const uint8_t* tiles, int64_t N, float* y);
void q4_linear_team(const float* x, int64_t M, int64_t K, const uint8_t* tiles, int32_t bias, int64_t group, int64_t N,
                    float* y);
void q8_0_linear_team(const float* x, int64_t M, int64_t K, const uint8_t* tiles, int64_t N, float* y);
void w8a8_linear_team(const float* x, int64_t M, int64_t K, const uint8_t* tiles, int64_t N, float* y);
