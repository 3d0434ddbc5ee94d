// Fused AdamW update on the CPU (C ABI in kernels/include/bmt_kernels.h).
//
// One pass over param/grad/moment1/moment2, in place, OpenMP over the elements: it reads 4 and writes 3
// values per element, where the same update in elementwise framework ops makes ~10 passes over memory.
// GCC ends every function that used AVX registers with vzeroupper, unlike the JIT kernel of Paddle's CPU
// adamw (see bmtrain_cli/train/cpu_adamw.py for why that matters here).
#include <cmath>
#include <cstdint>

#include "bmt_kernels.h"
#include "parallel.h"

namespace {

using bmt::kParallelMin;  // parallel.h: one thread below it

template <typename T>
void adamw(T* p, const T* g, T* m, T* v, int64_t n, T decay, T beta1, T beta2, T step, T eps_hat) {
  const T one_b1 = T(1) - beta1, one_b2 = T(1) - beta2;
#pragma omp parallel for simd schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    const T gi = g[i];
    const T mi = beta1 * m[i] + one_b1 * gi;
    const T vi = beta2 * v[i] + one_b2 * (gi * gi);
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step * (mi / (std::sqrt(vi) + eps_hat));
  }
}

}  // namespace

extern "C" {

int bmt_cpu_adamw(int dtype, void* param, const void* grad, void* moment1, void* moment2, int64_t n, double decay,
                  double beta1, double beta2, double step, double eps_hat) {
  if (n < 0) return BMT_ERR_SHAPE;
  if (dtype == BMT_F32)
    adamw(static_cast<float*>(param), static_cast<const float*>(grad), static_cast<float*>(moment1),
          static_cast<float*>(moment2), n, static_cast<float>(decay), static_cast<float>(beta1),
          static_cast<float>(beta2), static_cast<float>(step), static_cast<float>(eps_hat));
  else if (dtype == BMT_F64)
    adamw(static_cast<double*>(param), static_cast<const double*>(grad), static_cast<double*>(moment1),
          static_cast<double*>(moment2), n, decay, beta1, beta2, step, eps_hat);
  else
    return BMT_ERR_DTYPE;
  return BMT_OK;
}

}  // extern "C"
