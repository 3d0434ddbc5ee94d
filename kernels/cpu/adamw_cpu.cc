// Multi-tensor fused AdamW update on the CPU (C ABI in kernels/include/bmt_kernels.h).
//
// One call updates a list of tensors (param, grad, moment1, moment2 and the two beta-power scalars of each)
// in one pass over their memory and ONE OpenMP region: the tensors are cut into chunks of at most kChunk
// elements and the threads share the chunks of all of them, so the few hundred small tensors of a model
// (most below kParallelMin on their own) use every thread, and the parallel threshold applies to the total.
// The gradient is read times `grad_scale` (the global-norm clip factor), which replaces a separate scaling
// pass over every gradient. Each tensor's bias corrections come from its own beta powers, which the call
// then advances (beta^t -> beta^(t+1)); nothing is written before every power was checked.
// It reads 4 and writes 3 values per element, where the same update in elementwise framework ops makes ~10
// passes over memory. GCC ends every function that used AVX registers with vzeroupper, unlike the JIT
// kernel of Paddle's CPU adamw (see bmtrain_cli/train/cpu_adamw.py for why that matters here).
#include <cmath>
#include <cstdint>
#include <vector>

#include "bmt_kernels.h"
#include "parallel.h"

namespace {

constexpr int64_t kChunk = int64_t(1) << 16;
using bmt::kParallelMin;  // parallel.h: one thread below it (counted over all the tensors)

template <typename T>
struct Chunk {
  T* p;
  const T* g;
  T* m;
  T* v;
  int64_t n;
  T step, eps_hat;  // of the chunk's tensor: lr sqrt(1-b2^t) / (1-b1^t), eps sqrt(1-b2^t)
};

template <typename T>
void update_chunk(const Chunk<T>& c, T decay, T beta1, T beta2, T scale) {
  const T one_b1 = T(1) - beta1, one_b2 = T(1) - beta2;
#pragma omp simd
  for (int64_t i = 0; i < c.n; ++i) {
    const T gi = c.g[i] * scale;
    const T mi = beta1 * c.m[i] + one_b1 * gi;
    const T vi = beta2 * c.v[i] + one_b2 * (gi * gi);
    c.m[i] = mi;
    c.v[i] = vi;
    c.p[i] = c.p[i] * decay - c.step * (mi / (std::sqrt(vi) + c.eps_hat));
  }
}

template <typename T>
int adamw_multi(int64_t count, void* const* params, const void* const* grads, void* const* moment1,
                void* const* moment2, void* const* beta1_pow, void* const* beta2_pow, const int64_t* sizes,
                double lr, double weight_decay, double beta1, double beta2, double epsilon, double grad_scale) {
  std::vector<Chunk<T>> chunks;
  int64_t total = 0;
  for (int64_t t = 0; t < count; ++t) {
    const double b1p = *static_cast<const T*>(beta1_pow[t]), b2p = *static_cast<const T*>(beta2_pow[t]);
    if (!(b1p >= 0.0 && b1p < 1.0 && b2p >= 0.0 && b2p < 1.0)) return BMT_ERR_VALUE;
    const double correction2 = std::sqrt(1.0 - b2p);
    const T step = static_cast<T>(lr * correction2 / (1.0 - b1p)), eps_hat = static_cast<T>(epsilon * correction2);
    T* p = static_cast<T*>(params[t]);
    const T* g = static_cast<const T*>(grads[t]);
    T* m = static_cast<T*>(moment1[t]);
    T* v = static_cast<T*>(moment2[t]);
    for (int64_t i = 0; i < sizes[t]; i += kChunk)
      chunks.push_back({p + i, g + i, m + i, v + i, sizes[t] - i < kChunk ? sizes[t] - i : kChunk, step, eps_hat});
    total += sizes[t];
  }
  const T decay = static_cast<T>(1.0 - lr * weight_decay), b1 = static_cast<T>(beta1), b2 = static_cast<T>(beta2);
  const T scale = static_cast<T>(grad_scale);
  const int64_t nchunks = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(static) if (total >= kParallelMin)
  for (int64_t c = 0; c < nchunks; ++c) update_chunk(chunks[c], decay, b1, b2, scale);
  for (int64_t t = 0; t < count; ++t) {  // beta^t -> beta^(t+1), in the tensors' precision
    *static_cast<T*>(beta1_pow[t]) *= b1;
    *static_cast<T*>(beta2_pow[t]) *= b2;
  }
  return BMT_OK;
}

}  // namespace

extern "C" {

int bmt_cpu_adamw_multi(int dtype, int64_t count, void* const* params, const void* const* grads,
                        void* const* moment1, void* const* moment2, void* const* beta1_pow, void* const* beta2_pow,
                        const int64_t* sizes, double lr, double weight_decay, double beta1, double beta2,
                        double epsilon, double grad_scale) {
  if (count < 0) return BMT_ERR_SHAPE;
  for (int64_t t = 0; t < count; ++t)
    if (sizes[t] < 0) return BMT_ERR_SHAPE;
  if (dtype == BMT_F32)
    return adamw_multi<float>(count, params, grads, moment1, moment2, beta1_pow, beta2_pow, sizes, lr, weight_decay,
                              beta1, beta2, epsilon, grad_scale);
  if (dtype == BMT_F64)
    return adamw_multi<double>(count, params, grads, moment1, moment2, beta1_pow, beta2_pow, sizes, lr,
                               weight_decay, beta1, beta2, epsilon, grad_scale);
  return BMT_ERR_DTYPE;
}

}  // extern "C"
