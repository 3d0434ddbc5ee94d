// The quantised linear layer on the CPU (C ABI in kernels/include/bmt_kernels.h): y = x @ w^T and
// dx = dy @ w for a weight w [n, k] stored as 4- or 8-bit codes with fp32 scales (bmtrain_cli/quant/).
//
// The weight is never dequantised whole: each task dequantises one tile into its own buffer and multiplies
// it at once. Forward: a task is a tile of kRowsFwd output rows of w (all of k) times every row of x, so
// the tasks write disjoint columns of y. Backward: a task is a chunk of kColsBwd inputs (columns of w,
// dx) times a block of kRowsBwd rows of dy, walking w's rows tile by tile, so the tasks write disjoint
// pieces of dx and none adds into another's (the result does not depend on the thread count).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "bmt_kernels.h"
#include "parallel.h"

namespace {

constexpr int64_t kRowsFwd = 16;   // rows of w per forward tile (dequantised: 16 x k floats)
constexpr int64_t kColsBwd = 256;  // columns of w (inputs) per backward task
constexpr int64_t kRowsBwd = 128;  // rows of dy per backward task
constexpr int64_t kTileBwd = 64;   // rows of w per backward tile (64 x 256 floats)
using bmt::kParallelMin;

struct Weight {
  const uint8_t* codes;
  int bits;
  const float* levels;
  const float* scales;
  int64_t block, n, k;
  int row_groups;
};

inline int code_at(const Weight& w, int64_t e) {
  if (w.bits == 8) return w.codes[e];
  const uint8_t byte = w.codes[e >> 1];
  return (e & 1) ? (byte & 15) : (byte >> 4);
}

// w[r0:r1, c0:c1] into buf (row stride c1 - c0), one run of equal scale at a time.
void dequant_tile(const Weight& w, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float* buf) {
  const int64_t width = c1 - c0;
  const int64_t groups = (w.k + w.block - 1) / w.block;
  for (int64_t r = r0; r < r1; ++r) {
    float* out = buf + (r - r0) * width;
    int64_t c = c0;
    while (c < c1) {
      const int64_t e = r * w.k + c;
      int64_t run_end;
      float scale;
      if (w.row_groups) {
        run_end = std::min(c1, (c / w.block + 1) * w.block);
        scale = w.scales[r * groups + c / w.block];
      } else {
        run_end = std::min(c1, c + (w.block - e % w.block));
        scale = w.scales[e / w.block];
      }
      for (int64_t j = c; j < run_end; ++j) out[j - c0] = w.levels[code_at(w, e + (j - c))] * scale;
      c = run_end;
    }
  }
}

inline float dot(const float* a, const float* b, int64_t k) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < k; ++i) acc += a[i] * b[i];
  return acc;
}

void forward(const Weight& w, const float* x, float* y, int64_t m) {
  const int64_t n = w.n, k = w.k;
  const int64_t tiles = (n + kRowsFwd - 1) / kRowsFwd;
#pragma omp parallel if (m * n * k >= kParallelMin)
  {
    std::vector<float> buf(static_cast<size_t>(kRowsFwd * k));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r0 = t * kRowsFwd, r1 = std::min(n, r0 + kRowsFwd);
      dequant_tile(w, r0, r1, 0, k, buf.data());
      for (int64_t i = 0; i < m; ++i) {
        const float* xi = x + i * k;
        float* yi = y + i * n;
        for (int64_t r = r0; r < r1; ++r) yi[r] = dot(xi, buf.data() + (r - r0) * k, k);
      }
    }
  }
}

void backward(const Weight& w, const float* dy, float* dx, int64_t m) {
  const int64_t n = w.n, k = w.k;
  const int64_t chunks = (k + kColsBwd - 1) / kColsBwd, blocks = (m + kRowsBwd - 1) / kRowsBwd;
#pragma omp parallel if (m * n * k >= kParallelMin)
  {
    std::vector<float> buf(static_cast<size_t>(kTileBwd * kColsBwd));
#pragma omp for schedule(static) collapse(2)
    for (int64_t ch = 0; ch < chunks; ++ch) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t c0 = ch * kColsBwd, c1 = std::min(k, c0 + kColsBwd), width = c1 - c0;
        const int64_t i0 = b * kRowsBwd, i1 = std::min(m, i0 + kRowsBwd);
        for (int64_t i = i0; i < i1; ++i) std::fill(dx + i * k + c0, dx + i * k + c1, 0.f);
        for (int64_t r0 = 0; r0 < n; r0 += kTileBwd) {
          const int64_t r1 = std::min(n, r0 + kTileBwd);
          dequant_tile(w, r0, r1, c0, c1, buf.data());
          for (int64_t i = i0; i < i1; ++i) {
            float* out = dx + i * k + c0;
            const float* g = dy + i * n;
            for (int64_t r = r0; r < r1; ++r) {
              const float a = g[r];
              const float* row = buf.data() + (r - r0) * width;
#pragma omp simd
              for (int64_t j = 0; j < width; ++j) out[j] += a * row[j];
            }
          }
        }
      }
    }
  }
}

int check(int bits, int64_t block, int64_t m, int64_t n, int64_t k) {
  if (bits != 4 && bits != 8) return BMT_ERR_VALUE;
  if (block <= 0 || m < 0 || n < 0 || k < 0) return BMT_ERR_SHAPE;
  return BMT_OK;
}

}  // namespace

extern "C" {

int bmt_cpu_quant_linear_fwd(const uint8_t* codes, int bits, const float* levels, const float* scales,
                             int64_t block, int row_groups, const float* x, float* y, int64_t m, int64_t n,
                             int64_t k) {
  const int st = check(bits, block, m, n, k);
  if (st != BMT_OK) return st;
  forward(Weight{codes, bits, levels, scales, block, n, k, row_groups}, x, y, m);
  return BMT_OK;
}

int bmt_cpu_quant_linear_bwd(const uint8_t* codes, int bits, const float* levels, const float* scales,
                             int64_t block, int row_groups, const float* dy, float* dx, int64_t m, int64_t n,
                             int64_t k) {
  const int st = check(bits, block, m, n, k);
  if (st != BMT_OK) return st;
  backward(Weight{codes, bits, levels, scales, block, n, k, row_groups}, dy, dx, m);
  return BMT_OK;
}

}  // extern "C"
