// Float32 products y[m, n] = sum_k x[m, k] * w[n, k] + bias[n] for any number of rows, from one weight layout that
// serves a decode step's one row at the memory's pace and a prompt's hundreds of rows near the FMA units' peak.
//
// Layout ("panels", made by `linear.pack_panels`): the weight's rows in groups of kPanel (two vectors),
// each group stored input by input: panel p holds w[p * kPanel + j, k] at [p][k][j]. N is padded to a multiple of
// kPanel with zero rows, whose outputs are not written.
//
// One row (decode): a thread reads its contiguous share of the panels once, front to back (a single sequential
// stream, which the hardware prefetches), and for each input k multiplies two weight vectors by x[k] broadcast.
// oneDNN's and MKL's kernels take such a product at 7-15 GB/s on a 2-core VM whose memory gives 21.
// Many rows (prefill, verification, batches): the classic register-blocked micro-kernel, kRows rows x one panel of
// accumulators (12 of 16 registers with AVX2, 24 of 32 with AVX-512), each panel re-read from L1/L2 by every block
// of rows of a chunk of kChunk rows that stays in L2.
//
// Exactness: every output element is one sum over k in order, one fused multiply-add per input, whatever the
// number of rows, the blocking or the threads: a verified draft row equals the plain decode row it stands for, and
// a batch's row equals the same row alone. Against PyTorch's product it differs only in summation order.

#include <cstdint>

#include "simd.h"
#include "team.h"

namespace {

constexpr int kPanel = 2 * kLanes;           // weight rows per panel: two vectors of outputs
constexpr int kRows = kLanes == 16 ? 12 : 6;  // x rows per register block
constexpr int64_t kChunk = 96;               // x rows per pass over the panels
constexpr int kPrefetchRows = 3;             // blocks of fewer rows leave the weights' stream to the hardware

// MB rows of x against one panel; `cols` of its kPanel outputs are stored. `ahead`: the panel's input k + ... of
// weights to prefetch at input k (see `float_panel_rows`).
template <int MB>
void block(const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t N, int64_t cols,
           const float* ahead) {
  vfloat lo[MB], hi[MB];
  for (int i = 0; i < MB; ++i) lo[i] = hi[i] = vfloat{};
  for (int64_t k = 0; k < K; ++k) {
    if (MB >= kPrefetchRows) {  // an input's kPanel weights: one line with AVX2, two with AVX-512
      __builtin_prefetch(ahead + k * kPanel);
      if (kLanes == 16) __builtin_prefetch(ahead + k * kPanel + kLanes);
    }
    const vfloat w0 = vload(panel + k * kPanel), w1 = vload(panel + k * kPanel + kLanes);
    for (int i = 0; i < MB; ++i) {
      const vfloat xv = vsplat(x[i * K + k]);
      lo[i] = vfma(xv, w0, lo[i]);
      hi[i] = vfma(xv, w1, hi[i]);
    }
  }
  if (bias) {
    const vfloat b0 = vload_part(bias, cols), b1 = cols > kLanes ? vload_part(bias + kLanes, cols - kLanes) : vfloat{};
    for (int i = 0; i < MB; ++i) lo[i] += b0, hi[i] += b1;
  }
  for (int i = 0; i < MB; ++i) {
    vstore_part(y + i * N, lo[i], cols);
    if (cols > kLanes) vstore_part(y + i * N + kLanes, hi[i], cols - kLanes);
  }
}

template <int MB = kRows>
void rows(int64_t mb, const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t N,
          int64_t cols, const float* ahead) {
  if constexpr (MB > 1) {
    if (mb < MB) return rows<MB - 1>(mb, x, K, panel, bias, y, N, cols, ahead);
  }
  block<MB>(x, K, panel, bias, y, N, cols, ahead);
}

}  // namespace

// Rows x [M, K] against one panel [K][kPanel]: `cols` outputs of each row, at y + row * N; `next_panel`: the one
// this thread reads next from memory, or null.
//
// Prefetching: the first block of rows reads the panel from memory and prefetches its own lines kAhead inputs on;
// the later blocks read it again from the caches and meanwhile prefetch `next_panel`, so that a batch's weights
// stream while the blocks after the first compute.
// Without it a step of 8 rows took about the memory's time plus the multiply-adds' (docs/benchmarks.md).
void float_panel_rows(const float* x, int64_t M, int64_t K, const float* panel, const float* bias, float* y, int64_t N,
                      int64_t cols, const float* next_panel) {
  constexpr int64_t kAhead = 32;  // inputs (2 KB with AVX2)
  // One row, its own call: inlined into the loop below, a decode step's one row ran 3-5% slower (the same code).
  if (M == 1) return block<1>(x, K, panel, bias, y, N, cols, nullptr);
  for (int64_t m0 = 0; m0 < M; m0 += kRows) {
    const float* ahead = m0 == 0 || !next_panel ? panel + kAhead * kPanel : next_panel;
    rows(M - m0 < kRows ? M - m0 : kRows, x + m0 * K, K, panel, bias, y + m0 * N, N, cols, ahead);
  }
}

// x [M, K]; panels [ceil(N / kPanel)][K][kPanel]; bias [N] or null -> y [M, N]; float32, rows contiguous.
void float_linear_team(const float* x, int64_t M, int64_t K, const float* panels, const float* bias, int64_t N,
                       float* y) {
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  for (int64_t chunk = 0; chunk < M; chunk += kChunk) {
    const int64_t end = M < chunk + kChunk ? M : chunk + kChunk;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < num_panels; ++p) {
      const int64_t n0 = p * kPanel, cols = N - n0 < kPanel ? N - n0 : kPanel;
      const float* panel = panels + p * K * kPanel;
      const float* b = bias ? bias + n0 : nullptr;
      float_panel_rows(x + chunk * K, end - chunk, K, panel, b, y + chunk * N + n0, N, cols,
                       p + 1 < num_panels ? panel + K * kPanel : nullptr);
    }
  }
}

extern "C" {

void specula_float_linear(const float* x, int64_t M, int64_t K, const float* panels, const float* bias, int64_t N,
                          float* y, int threads) {
#pragma omp parallel num_threads(threads)
  float_linear_team(x, M, K, panels, bias, N, y);
}

// Weight rows per panel in this build (two vectors).
int specula_float_panel_rows() { return kPanel; }

// Floats per vector in this build: 16 (AVX-512) or 8 (AVX2).
int specula_vector_lanes() { return kLanes; }

}  // extern "C"
