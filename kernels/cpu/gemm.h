// Single-precision GEMM for the CPU launchers that multiply inside their own OpenMP regions (moe_cpu.cc's
// grouped expert GEMM, quant_cpu.cc's grouped quantised experts): MKL's sgemm (the libmklml_intel Paddle
// ships, BMT_WITH_MKL) where the build links it, single-threaded inside a parallel region, else the blocked
// loops below.
#ifndef BMT_CPU_GEMM_H_
#define BMT_CPU_GEMM_H_

#include <algorithm>
#include <cstdint>

#ifdef BMT_WITH_MKL
extern "C" void cblas_sgemm(int layout, int transa, int transb, int m, int n, int k, float alpha, const float* a,
                            int lda, const float* b, int ldb, float beta, float* c, int ldc);
#endif

namespace bmt {

// C [m, n] = beta C + op(A) op(B), row-major; op(A) is [m, k] (ta: A is stored [k, m]), op(B) is [k, n]
// (tb: B is stored [n, k]). beta is 0 or 1.
inline void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                 int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
#ifdef BMT_WITH_MKL
  cblas_sgemm(101, ta ? 112 : 111, tb ? 112 : 111, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
              1.f, a, static_cast<int>(lda), b, static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
#else
  for (int64_t i = 0; i < m; ++i) {
    float* ci = c + i * ldc;
    if (beta == 0.f) std::fill(ci, ci + n, 0.f);
    if (tb) {
      for (int64_t j = 0; j < n; ++j) {
        const float* bj = b + j * ldb;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t p = 0; p < k; ++p) acc += (ta ? a[p * lda + i] : a[i * lda + p]) * bj[p];
        ci[j] += acc;
      }
      continue;
    }
    for (int64_t p = 0; p < k; ++p) {
      const float av = ta ? a[p * lda + i] : a[i * lda + p];
      const float* bp = b + p * ldb;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) ci[j] += av * bp[j];
    }
  }
#endif
}

}  // namespace bmt

#endif  // BMT_CPU_GEMM_H_
