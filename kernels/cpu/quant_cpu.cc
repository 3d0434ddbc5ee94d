// The quantised linear layer on the CPU (C ABI in kernels/include/bmt_kernels.h): rows r0..r1 of a weight
// w [n, k] stored as 4- or 8-bit codes with fp32 scales (bmtrain_cli/quant/), dequantised into fp32.
//
// The layer never dequantises its whole weight: bmtrain_cli/ops/quant_linear.py asks for one tile of rows
// at a time (at most TILE_ELEMENTS of bmtrain_cli/ops/quant_tiles.py), written into one workspace that every
// tile reuses, and multiplies it at once with Paddle's matmul (MKL on a CPU), y[:, r0:r1] = x @ tile^T
// forward and dx += dy[:, r0:r1] @ tile backward.
// Element e = r * k + c is levels[code(e)] * scale: per block of the flattened weight (nf4), or per group
// of each row (int4; int8 has one group, the whole row).
//
// The routed experts of a mixture-of-experts layer with a quantised base (bmtrain_cli/quant/experts.py)
// run as one grouped call per projection over the rows sorted by expert: forward y_e = X_e W_e^T in blocks
// of (expert, rows of W_e), input gradient dx_e = dY_e W_e in blocks of (expert, columns of W_e); each
// block dequantises its piece of W_e (at most kGroupTile weights) into its thread's tile and multiplies it
// with gemm.h's sgemm, so no expert's whole weight is dequantised; an expert without rows is skipped.
//
// 4-bit codes go two at a time through a 256-entry table of value pairs (the byte's high nibble first),
// so the inner loop is one load, two multiplies and two stores per byte; the rows are split over threads.
#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "bmt_kernels.h"
#include "gemm.h"
#include "parallel.h"

namespace {

using bmt::gemm;
using bmt::kParallelMin;

// dequantised weights per block of the grouped experts, in each thread's own tile (128 KiB)
constexpr int64_t kGroupTile = int64_t(1) << 15;

struct Weight {
  const uint8_t* codes;
  int bits;
  const float* levels;
  const float* scales;
  int64_t block, n, k;
  int row_groups;
};

using PairTable = std::array<std::array<float, 2>, 256>;

PairTable pairs_of(const float* levels) {
  PairTable t;
  for (int b = 0; b < 256; ++b) t[b] = {levels[b >> 4], levels[b & 15]};
  return t;
}

inline int code_at(const Weight& w, int64_t e) {
  if (w.bits == 8) return w.codes[e];
  const uint8_t byte = w.codes[e >> 1];
  return (e & 1) ? (byte & 15) : (byte >> 4);
}

// Elements e0..e1 of the flattened weight (one run of a single scale) into out.
inline void dequant_run(const Weight& w, const PairTable& pairs, int64_t e0, int64_t e1, float scale,
                        float* out) {
  int64_t e = e0;
  if (w.bits == 8) {
    for (; e < e1; ++e) out[e - e0] = w.levels[w.codes[e]] * scale;
    return;
  }
  if (e < e1 && (e & 1)) {  // a run starting on a low nibble
    out[0] = w.levels[code_at(w, e)] * scale;
    ++e;
  }
  const uint8_t* bytes = w.codes + (e >> 1);
  float* dst = out + (e - e0);
  const int64_t whole = (e1 - e) / 2;
  for (int64_t b = 0; b < whole; ++b) {
    const std::array<float, 2>& p = pairs[bytes[b]];
    dst[2 * b] = p[0] * scale;
    dst[2 * b + 1] = p[1] * scale;
  }
  e += 2 * whole;
  if (e < e1) out[e - e0] = w.levels[code_at(w, e)] * scale;
}

// Columns c0..c1 of row r of w into out[0..c1 - c0).
void dequant_segment(const Weight& w, const PairTable& pairs, int64_t r, int64_t c0, int64_t c1, float* out) {
  const int64_t k = w.k;
  if (w.row_groups) {
    const int64_t groups = (k + w.block - 1) / w.block;
    for (int64_t g = c0 / w.block; g * w.block < c1; ++g) {
      const int64_t a = std::max(c0, g * w.block), b = std::min(c1, (g + 1) * w.block);
      dequant_run(w, pairs, r * k + a, r * k + b, w.scales[r * groups + g], out + (a - c0));
    }
    return;
  }
  const int64_t first = r * k + c0;
  int64_t e = first;
  const int64_t end = r * k + c1;
  while (e < end) {
    const int64_t run_end = std::min(end, (e / w.block + 1) * w.block);
    dequant_run(w, pairs, e, run_end, w.scales[e / w.block], out + (e - first));
    e = run_end;
  }
}

void dequant_rows(const Weight& w, int64_t r0, int64_t r1, float* out) {
  const PairTable pairs = pairs_of(w.levels);
  const int64_t rows = r1 - r0;
#pragma omp parallel for schedule(static) if (rows * w.k >= kParallelMin / 16)
  for (int64_t i = 0; i < rows; ++i) dequant_segment(w, pairs, r0 + i, 0, w.k, out + i * w.k);
}

// The routed experts' quantised weights W_e [n, k], one layout for all, over rows x [rows, k] sorted by
// expert (counts[e] rows each).
struct Grouped {
  int64_t count;
  const uint8_t* const* codes;
  const float* const* scales;
  const float* levels;
  int bits;
  int64_t block, n, k;
  int row_groups;
  std::vector<int64_t> off;  // count + 1 row offsets
  Weight expert(int64_t e) const { return Weight{codes[e], bits, levels, scales[e], block, n, k, row_groups}; }
};

struct Span {
  int64_t e, a, b;  // an expert and a range of its weight's rows (forward) or columns (input gradient)
};

// The spans [a, b) of 0..extent in steps of step, for every expert that has rows.
std::vector<Span> spans(const Grouped& g, int64_t extent, int64_t step) {
  std::vector<Span> out;
  for (int64_t e = 0; e < g.count; ++e)
    for (int64_t a = 0; g.off[e + 1] > g.off[e] && a < extent; a += step) out.push_back({e, a, std::min(extent, a + step)});
  return out;
}

bool grouped_threaded(const Grouped& g) { return g.off[g.count] * g.n * g.k >= kParallelMin; }

// y [rows, n] = X_e W_e^T: each block dequantises rows a..b of W_e into its thread's tile, then multiplies
// them over the expert's rows into columns a..b of y.
void grouped_forward(const Grouped& g, const float* x, float* y) {
  const PairTable pairs = pairs_of(g.levels);
  const int64_t step = std::max<int64_t>(1, kGroupTile / g.k);
  const std::vector<Span> blocks = spans(g, g.n, step);
  const int64_t nb = static_cast<int64_t>(blocks.size());
#pragma omp parallel if (grouped_threaded(g))
  {
    std::vector<float> tile(static_cast<size_t>(step * g.k));
#pragma omp for schedule(monotonic : dynamic, 1)
    for (int64_t i = 0; i < nb; ++i) {
      const Span& s = blocks[i];
      const Weight w = g.expert(s.e);
      for (int64_t r = s.a; r < s.b; ++r) dequant_segment(w, pairs, r, 0, g.k, tile.data() + (r - s.a) * g.k);
      const int64_t o = g.off[s.e], m = g.off[s.e + 1] - o;
      gemm(false, true, m, s.b - s.a, g.k, x + o * g.k, g.k, tile.data(), g.k, 0.f, y + o * g.n + s.a, g.n);
    }
  }
}

// dx [rows, k] = dY_e W_e: each block dequantises columns a..b of W_e into its thread's tile [n, b - a],
// then multiplies the expert's rows of dy by it into columns a..b of dx.
void grouped_input_grad(const Grouped& g, const float* dy, float* dx) {
  const PairTable pairs = pairs_of(g.levels);
  const int64_t step = std::max<int64_t>(1, kGroupTile / g.n);
  const std::vector<Span> blocks = spans(g, g.k, step);
  const int64_t nb = static_cast<int64_t>(blocks.size());
#pragma omp parallel if (grouped_threaded(g))
  {
    std::vector<float> tile(static_cast<size_t>(step * g.n));
#pragma omp for schedule(monotonic : dynamic, 1)
    for (int64_t i = 0; i < nb; ++i) {
      const Span& s = blocks[i];
      const Weight w = g.expert(s.e);
      const int64_t width = s.b - s.a;
      for (int64_t r = 0; r < g.n; ++r) dequant_segment(w, pairs, r, s.a, s.b, tile.data() + r * width);
      const int64_t o = g.off[s.e], m = g.off[s.e + 1] - o;
      gemm(false, false, m, width, g.n, dy + o * g.n, g.n, tile.data(), width, 0.f, dx + o * g.k + s.a, g.k);
    }
  }
}

int prepare(Grouped& g, const int64_t* counts) {
  if (g.bits != 4 && g.bits != 8) return BMT_ERR_VALUE;
  if (g.count < 0 || g.block <= 0 || g.n <= 0 || g.k <= 0) return BMT_ERR_SHAPE;
  g.off.assign(static_cast<size_t>(g.count + 1), 0);
  for (int64_t e = 0; e < g.count; ++e) {
    if (counts[e] < 0) return BMT_ERR_SHAPE;
    g.off[e + 1] = g.off[e] + counts[e];
  }
  return BMT_OK;
}

}  // namespace

extern "C" {

int bmt_cpu_quant_dequant_rows(const uint8_t* codes, int bits, const float* levels, const float* scales,
                               int64_t block, int row_groups, float* out, int64_t n, int64_t k, int64_t r0,
                               int64_t r1) {
  if (bits != 4 && bits != 8) return BMT_ERR_VALUE;
  if (block <= 0 || n < 0 || k < 0 || r0 < 0 || r1 < r0 || r1 > n) return BMT_ERR_SHAPE;
  dequant_rows(Weight{codes, bits, levels, scales, block, n, k, row_groups}, r0, r1, out);
  return BMT_OK;
}

int bmt_cpu_quant_grouped_fwd(const float* x, const int64_t* counts, int64_t experts, const uint8_t* const* codes,
                              const float* const* scales, const float* levels, int bits, int64_t block,
                              int row_groups, int64_t n, int64_t k, float* y) {
  Grouped g{experts, codes, scales, levels, bits, block, n, k, row_groups, {}};
  const int st = prepare(g, counts);
  if (st != BMT_OK) return st;
  grouped_forward(g, x, y);
  return BMT_OK;
}

int bmt_cpu_quant_grouped_dx(const float* dy, const int64_t* counts, int64_t experts, const uint8_t* const* codes,
                             const float* const* scales, const float* levels, int bits, int64_t block,
                             int row_groups, int64_t n, int64_t k, float* dx) {
  Grouped g{experts, codes, scales, levels, bits, block, n, k, row_groups, {}};
  const int st = prepare(g, counts);
  if (st != BMT_OK) return st;
  grouped_input_grad(g, dy, dx);
  return BMT_OK;
}

}  // extern "C"
