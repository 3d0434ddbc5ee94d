// The experts of a mixture-of-experts layer as one grouped GEMM on the CPU (C ABI in
// kernels/include/bmt_kernels.h): the rows x [rows, h] are sorted by expert, expert e owning the
// counts[e] rows from offset off_e = counts[0] + ... + counts[e-1], and each expert is a SwiGLU MLP with
// weights in Paddle's [in, out] layout: gate_e, up_e [h, f], down_e [f, h].
//
// Forward, for every expert e over its rows X_e:
//   G = X_e gate_e, U = X_e up_e   (kept in gate_up [rows, 2f] = [G | U] for the backward)
//   y_e = (silu(G) * U) down_e
// Backward, from dy [rows, h]:
//   A = silu(G) * U, dA = dy_e down_e^T, dG = dA * U * silu'(G), dU = dA * silu(G)
//   dx_e = dG gate_e^T + dU up_e^T
//   dgate_e = X_e^T dG, dup_e = X_e^T dU, ddown_e = A^T dy_e   (zeros for an expert without rows;
//   skipped when dgate is NULL: frozen experts)
//
// Work is dealt to OpenMP threads in blocks: the row-wise products in (expert, tile of kRowTile rows)
// blocks, the weight gradients in (expert, weight, kWeightRows rows of that weight) blocks, so an expert
// that takes every token still spreads over the threads and each block writes its own part of the result
// (no atomics; the result does not depend on the thread count). The inner products are BLAS sgemm calls,
// single-threaded inside the region (gemm.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bmt_kernels.h"
#include "gemm.h"
#include "parallel.h"

namespace {

constexpr int64_t kRowTile = 128;     // rows of x per forward / input-gradient block
constexpr int64_t kWeightRows = 256;  // rows of one weight gradient per block
using bmt::gemm;
using bmt::kParallelMin;

inline float sigmoid(float g) { return 1.f / (1.f + std::exp(-g)); }

struct Experts {
  int64_t count;
  const float* const* gate;
  const float* const* up;
  const float* const* down;
  int64_t h, f;
  std::vector<int64_t> off;  // count + 1 row offsets
};

struct Block {
  int64_t e, r0, r1;  // expert and its rows (forward / dx); or weight kind and its rows (weight gradients)
};

std::vector<Block> row_blocks(const Experts& ex) {
  std::vector<Block> out;
  for (int64_t e = 0; e < ex.count; ++e)
    for (int64_t r = ex.off[e]; r < ex.off[e + 1]; r += kRowTile) out.push_back({e, r, std::min(ex.off[e + 1], r + kRowTile)});
  return out;
}

bool threaded(const Experts& ex) { return ex.off[ex.count] * ex.h * ex.f >= kParallelMin; }

void forward(const Experts& ex, const float* x, float* gate_up, float* y) {
  const int64_t h = ex.h, f = ex.f;
  const std::vector<Block> blocks = row_blocks(ex);
  const int64_t nb = static_cast<int64_t>(blocks.size());
#pragma omp parallel if (threaded(ex))
  {
    std::vector<float> act(static_cast<size_t>(kRowTile * f));
#pragma omp for schedule(monotonic : dynamic, 1)
    for (int64_t b = 0; b < nb; ++b) {
      const Block& bl = blocks[b];
      const int64_t m = bl.r1 - bl.r0;
      const float* xb = x + bl.r0 * h;
      float* gu = gate_up + bl.r0 * 2 * f;
      gemm(false, false, m, f, h, xb, h, ex.gate[bl.e], f, 0.f, gu, 2 * f);
      gemm(false, false, m, f, h, xb, h, ex.up[bl.e], f, 0.f, gu + f, 2 * f);
      for (int64_t i = 0; i < m; ++i) {
        const float* g = gu + i * 2 * f;
        float* a = act.data() + i * f;
#pragma omp simd
        for (int64_t j = 0; j < f; ++j) a[j] = g[j] * sigmoid(g[j]) * g[f + j];
      }
      gemm(false, false, m, h, f, act.data(), f, ex.down[bl.e], h, 0.f, y + bl.r0 * h, h);
    }
  }
}

void backward(const Experts& ex, const float* x, const float* gate_up, const float* dy, float* dx,
              float* const* dgate, float* const* dup, float* const* ddown) {
  const int64_t h = ex.h, f = ex.f, rows = ex.off[ex.count];
  const std::vector<Block> blocks = row_blocks(ex);
  const int64_t nb = static_cast<int64_t>(blocks.size());
  const bool weights = dgate != nullptr;  // NULL: the input gradient only (frozen experts)
  // A and [dG | dU] of every row, for the weight gradients
  std::vector<float> act(static_cast<size_t>(weights ? rows * f : 0)), dgu(static_cast<size_t>(rows * 2 * f));
  std::vector<Block> wblocks;  // e, weight (0 gate, 1 up, 2 down), first row of that weight's gradient
  for (int64_t e = 0; weights && e < ex.count; ++e)
    for (int64_t w = 0; w < 3; ++w)
      for (int64_t r = 0; r < (w == 2 ? f : h); r += kWeightRows) wblocks.push_back({e * 3 + w, r, 0});
  const int64_t nw = static_cast<int64_t>(wblocks.size());
#pragma omp parallel if (threaded(ex))
  {
    std::vector<float> da(static_cast<size_t>(kRowTile * f));
#pragma omp for schedule(monotonic : dynamic, 1)
    for (int64_t b = 0; b < nb; ++b) {
      const Block& bl = blocks[b];
      const int64_t m = bl.r1 - bl.r0;
      gemm(false, true, m, f, h, dy + bl.r0 * h, h, ex.down[bl.e], h, 0.f, da.data(), f);
      for (int64_t i = 0; i < m; ++i) {
        const int64_t r = bl.r0 + i;
        const float* g = gate_up + r * 2 * f;
        const float* d = da.data() + i * f;
        float* a = weights ? act.data() + r * f : nullptr;
        float* dg = dgu.data() + r * 2 * f;
#pragma omp simd
        for (int64_t j = 0; j < f; ++j) {
          const float s = sigmoid(g[j]), silu = g[j] * s, u = g[f + j];
          if (weights) a[j] = silu * u;
          dg[f + j] = d[j] * silu;
          dg[j] = d[j] * u * s * (1.f + g[j] * (1.f - s));
        }
      }
      const float* dgb = dgu.data() + bl.r0 * 2 * f;
      gemm(false, true, m, h, f, dgb, 2 * f, ex.gate[bl.e], f, 0.f, dx + bl.r0 * h, h);
      gemm(false, true, m, h, f, dgb + f, 2 * f, ex.up[bl.e], f, 1.f, dx + bl.r0 * h, h);
    }
#pragma omp for schedule(monotonic : dynamic, 1)
    for (int64_t b = 0; b < nw; ++b) {
      const int64_t e = wblocks[b].e / 3, w = wblocks[b].e % 3, r0 = wblocks[b].r0;
      const int64_t n = ex.off[e + 1] - ex.off[e], o = ex.off[e];
      const int64_t width = w == 2 ? h : f, r1 = std::min(w == 2 ? f : h, r0 + kWeightRows);
      float* out = (w == 0 ? dgate[e] : w == 1 ? dup[e] : ddown[e]) + r0 * width;
      if (n == 0) {
        std::memset(out, 0, sizeof(float) * static_cast<size_t>((r1 - r0) * width));
      } else if (w == 2) {  // ddown[r0:r1] = A[:, r0:r1]^T dy
        gemm(true, false, r1 - r0, h, n, act.data() + o * f + r0, f, dy + o * h, h, 0.f, out, h);
      } else {  // dgate / dup [r0:r1] = X[:, r0:r1]^T dG / dU
        gemm(true, false, r1 - r0, f, n, x + o * h + r0, h, dgu.data() + o * 2 * f + w * f, 2 * f, 0.f, out, f);
      }
    }
  }
}

int prepare(Experts& ex, const int64_t* counts) {
  if (ex.count < 0 || ex.h <= 0 || ex.f <= 0) return BMT_ERR_SHAPE;
  ex.off.assign(static_cast<size_t>(ex.count + 1), 0);
  for (int64_t e = 0; e < ex.count; ++e) {
    if (counts[e] < 0) return BMT_ERR_SHAPE;
    ex.off[e + 1] = ex.off[e] + counts[e];
  }
  return BMT_OK;
}

}  // namespace

extern "C" {

int bmt_cpu_moe_swiglu_fwd(const float* x, const int64_t* counts, int64_t experts, const float* const* gate,
                           const float* const* up, const float* const* down, float* gate_up, float* y,
                           int64_t hidden, int64_t inter) {
  Experts ex{experts, gate, up, down, hidden, inter, {}};
  const int st = prepare(ex, counts);
  if (st != BMT_OK) return st;
  forward(ex, x, gate_up, y);
  return BMT_OK;
}

int bmt_cpu_moe_swiglu_bwd(const float* x, const int64_t* counts, int64_t experts, const float* const* gate,
                           const float* const* up, const float* const* down, const float* gate_up, const float* dy,
                           float* dx, float* const* dgate, float* const* dup, float* const* ddown, int64_t hidden,
                           int64_t inter) {
  Experts ex{experts, gate, up, down, hidden, inter, {}};
  const int st = prepare(ex, counts);
  if (st != BMT_OK) return st;
  backward(ex, x, gate_up, dy, dx, dgate, dup, ddown);
  return BMT_OK;
}

}  // extern "C"
