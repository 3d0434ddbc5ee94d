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
// 4-bit codes go two at a time through a 256-entry table of value pairs (the byte's high nibble first),
// so the inner loop is one load, two multiplies and two stores per byte; the rows are split over threads.
#include <algorithm>
#include <array>
#include <cstdint>

#include "bmt_kernels.h"
#include "parallel.h"

namespace {

using bmt::kParallelMin;

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

// Row r of w into out[0..k).
void dequant_row(const Weight& w, const PairTable& pairs, int64_t r, float* out) {
  const int64_t k = w.k;
  if (w.row_groups) {
    const int64_t groups = (k + w.block - 1) / w.block;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * w.block, c1 = std::min(k, c0 + w.block);
      dequant_run(w, pairs, r * k + c0, r * k + c1, w.scales[r * groups + g], out + c0);
    }
    return;
  }
  int64_t e = r * k;
  const int64_t end = e + k;
  while (e < end) {
    const int64_t run_end = std::min(end, (e / w.block + 1) * w.block);
    dequant_run(w, pairs, e, run_end, w.scales[e / w.block], out + (e - r * k));
    e = run_end;
  }
}

void dequant_rows(const Weight& w, int64_t r0, int64_t r1, float* out) {
  const PairTable pairs = pairs_of(w.levels);
  const int64_t rows = r1 - r0;
#pragma omp parallel for schedule(static) if (rows * w.k >= kParallelMin / 16)
  for (int64_t i = 0; i < rows; ++i) dequant_row(w, pairs, r0 + i, out + i * w.k);
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

}  // extern "C"
