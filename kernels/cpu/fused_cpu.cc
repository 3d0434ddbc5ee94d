// CPU implementations of the fused kernels (C ABI in kernels/include/bmt_kernels.h).
//
// Loops are written so that GCC vectorises them (-O3, `omp simd`), and the outer loops run in parallel
// over rows with OpenMP (threads: OMP_NUM_THREADS, like Paddle's own CPU kernels). fp32 uses a
// vectorisable exp (simd_math.h); fp64 uses std::exp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bmt_kernels.h"
#include "parallel.h"
#include "simd_math.h"

namespace {

constexpr int64_t kBlock = 4096;
using bmt::kParallelMin;  // parallel.h: one thread below it

using bmt::exp_approx;  // simd_math.h

template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

// ---------------------------------------------------------------- RMSNorm
template <typename T>
void rms_norm_fwd(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t cols, float eps) {
  using A = typename Acc<T>::type;
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    A ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < cols; ++c) ss += static_cast<A>(xr[c]) * static_cast<A>(xr[c]);
    const A inv = static_cast<A>(1) / std::sqrt(ss / static_cast<A>(cols) + static_cast<A>(eps));
    rstd[r] = static_cast<float>(inv);
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) yr[c] = static_cast<T>(xr[c] * inv) * w[c];
  }
}

// The weight gradient sums dy * x * rstd over the rows. The rows are cut into kDwBlocks blocks fixed by
// the row count alone; each block is summed in row order into its own slot, and the slots are added in
// block order: the result is the same for any thread count and any scheduling (bit-reproducible runs).
constexpr int64_t kDwBlocks = 64;

template <typename T>
void rms_norm_bwd(const T* dy, const T* x, const T* w, const float* rstd, T* dx, T* dw, int64_t rows,
                  int64_t cols) {
  using A = typename Acc<T>::type;
  const bool par = rows * cols >= kParallelMin;
  const int64_t nblocks = std::max<int64_t>(1, std::min<int64_t>(kDwBlocks, rows));
  const int64_t per = (rows + nblocks - 1) / nblocks;
  std::vector<A> parts(static_cast<size_t>(nblocks) * cols, static_cast<A>(0));
#pragma omp parallel for schedule(static) if (par)
  for (int64_t b = 0; b < nblocks; ++b) {
    A* dwp = parts.data() + b * cols;
    const int64_t end = std::min(rows, (b + 1) * per);
    for (int64_t r = b * per; r < end; ++r) {
      const T* xr = x + r * cols;
      const T* dyr = dy + r * cols;
      T* dxr = dx + r * cols;
      const A inv = static_cast<A>(rstd[r]);
      A dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < cols; ++c) dot += static_cast<A>(dyr[c]) * w[c] * xr[c];
      const A k = dot * inv * inv / static_cast<A>(cols);
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) {
        dxr[c] = static_cast<T>(inv * (static_cast<A>(dyr[c]) * w[c] - xr[c] * k));
        dwp[c] += static_cast<A>(dyr[c]) * xr[c] * inv;
      }
    }
  }
#pragma omp parallel for schedule(static) if (par && cols >= 4096)
  for (int64_t c = 0; c < cols; ++c) {
    A s = 0;
    for (int64_t b = 0; b < nblocks; ++b) s += parts[b * cols + c];
    dw[c] = static_cast<T>(s);
  }
}

// ---------------------------------------------------------------- rotary
template <typename T>
inline void rotate_heads(const T* in, T* out, const T* c, const T* s, int64_t heads, int64_t dim, bool bwd) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* a = in + h * dim;
    T* o = out + h * dim;
    if (!bwd) {
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        o[j] = a[j] * c[j] - a[j + half] * s[j];
        o[j + half] = a[j + half] * c[j + half] + a[j] * s[j + half];
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        o[j] = a[j] * c[j] + a[j + half] * s[j + half];
        o[j + half] = a[j + half] * c[j + half] - a[j] * s[j];
      }
    }
  }
}

template <typename T>
void rotary(const T* q, const T* k, const T* cos, const T* sin, T* q_out, T* k_out, int64_t batch, int64_t seq,
            int64_t qh, int64_t kh, int64_t dim, int64_t cos_batch, bool bwd) {
  const int64_t tokens = batch * seq;
#pragma omp parallel for schedule(static) if (tokens * (qh + kh) * dim >= kParallelMin)
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t b = t / seq, p = t % seq;
    const int64_t crow = ((cos_batch == 1) ? p : b * seq + p) * dim;
    rotate_heads(q + t * qh * dim, q_out + t * qh * dim, cos + crow, sin + crow, qh, dim, bwd);
    rotate_heads(k + t * kh * dim, k_out + t * kh * dim, cos + crow, sin + crow, kh, dim, bwd);
  }
}

// ---------------------------------------------------------------- SwiGLU

template <typename T>
inline void swiglu_fwd_block(const T* __restrict g, const T* __restrict u, T* __restrict out, int64_t len) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    const T sg = static_cast<T>(1) / (static_cast<T>(1) + exp_approx(-g[i]));
    out[i] = g[i] * sg * u[i];
  }
}

template <typename T>
inline void swiglu_bwd_block(const T* __restrict g, const T* __restrict u, const T* __restrict dout,
                             T* __restrict dg, T* __restrict du, int64_t len) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) {
    const T sg = static_cast<T>(1) / (static_cast<T>(1) + exp_approx(-g[i]));
    const T silu = g[i] * sg;
    du[i] = dout[i] * silu;
    dg[i] = dout[i] * u[i] * (sg + silu * (static_cast<T>(1) - sg));
  }
}

template <typename T>
void swiglu_fwd(const T* g, const T* u, T* out, int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t bi = 0; bi < blocks; ++bi) {
    const int64_t lo = bi * kBlock, len = std::min(n - lo, kBlock);
    swiglu_fwd_block(g + lo, u + lo, out + lo, len);
  }
}

template <typename T>
void swiglu_bwd(const T* g, const T* u, const T* dout, T* dg, T* du, int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t bi = 0; bi < blocks; ++bi) {
    const int64_t lo = bi * kBlock, len = std::min(n - lo, kBlock);
    swiglu_bwd_block(g + lo, u + lo, dout + lo, dg + lo, du + lo, len);
  }
}

// ---------------------------------------------------------------- softmax cross-entropy
template <typename T>
int softmax_xent(const T* logits, const int64_t* labels, T* loss, T* dlogits, int64_t rows, int64_t vocab,
                 int64_t ignore_index) {
  int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) if (rows * vocab >= kParallelMin)
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = logits + r * vocab;
    T* d = dlogits ? dlogits + r * vocab : nullptr;
    const int64_t lab = labels[r];
    if (lab == ignore_index) {
      loss[r] = 0;
      if (d) std::fill(d, d + vocab, static_cast<T>(0));
      continue;
    }
    if (lab < 0 || lab >= vocab) {
      bad = 1;
      loss[r] = 0;
      if (d) std::fill(d, d + vocab, static_cast<T>(0));
      continue;
    }
    T m = x[0];
#pragma omp simd reduction(max : m)
    for (int64_t v = 0; v < vocab; ++v) m = std::max(m, x[v]);
    T s = 0;
    if (d) {
#pragma omp simd reduction(+ : s)
      for (int64_t v = 0; v < vocab; ++v) {
        const T e = exp_approx(x[v] - m);
        d[v] = e;
        s += e;
      }
      const T inv = static_cast<T>(1) / s;
#pragma omp simd
      for (int64_t v = 0; v < vocab; ++v) d[v] *= inv;
      d[lab] -= static_cast<T>(1);
    } else {
#pragma omp simd reduction(+ : s)
      for (int64_t v = 0; v < vocab; ++v) s += exp_approx(x[v] - m);
    }
    loss[r] = std::log(s) + m - x[lab];
  }
  return bad ? BMT_ERR_LABEL : BMT_OK;
}

}  // namespace

extern "C" {

int bmt_cpu_rms_norm_fwd(int dtype, const void* x, const void* w, void* y, float* rstd, int64_t rows,
                         int64_t cols, float eps) {
  if (rows < 0 || cols <= 0) return BMT_ERR_SHAPE;
  if (dtype == BMT_F32)
    rms_norm_fwd(static_cast<const float*>(x), static_cast<const float*>(w), static_cast<float*>(y), rstd, rows,
                 cols, eps);
  else if (dtype == BMT_F64)
    rms_norm_fwd(static_cast<const double*>(x), static_cast<const double*>(w), static_cast<double*>(y), rstd,
                 rows, cols, eps);
  else
    return BMT_ERR_DTYPE;
  return BMT_OK;
}

int bmt_cpu_rms_norm_bwd(int dtype, const void* dy, const void* x, const void* w, const float* rstd, void* dx,
                         void* dw, int64_t rows, int64_t cols) {
  if (rows < 0 || cols <= 0) return BMT_ERR_SHAPE;
  if (dtype == BMT_F32)
    rms_norm_bwd(static_cast<const float*>(dy), static_cast<const float*>(x), static_cast<const float*>(w), rstd,
                 static_cast<float*>(dx), static_cast<float*>(dw), rows, cols);
  else if (dtype == BMT_F64)
    rms_norm_bwd(static_cast<const double*>(dy), static_cast<const double*>(x), static_cast<const double*>(w),
                 rstd, static_cast<double*>(dx), static_cast<double*>(dw), rows, cols);
  else
    return BMT_ERR_DTYPE;
  return BMT_OK;
}

int bmt_cpu_rotary(int dtype, const void* q, const void* k, const void* cos, const void* sin, void* q_out,
                   void* k_out, int64_t batch, int64_t seq, int64_t q_heads, int64_t k_heads, int64_t dim,
                   int64_t cos_batch, int backward) {
  if (dim % 2 != 0 || (cos_batch != 1 && cos_batch != batch)) return BMT_ERR_SHAPE;
  if (dtype == BMT_F32)
    rotary(static_cast<const float*>(q), static_cast<const float*>(k), static_cast<const float*>(cos),
           static_cast<const float*>(sin), static_cast<float*>(q_out), static_cast<float*>(k_out), batch, seq,
           q_heads, k_heads, dim, cos_batch, backward != 0);
  else if (dtype == BMT_F64)
    rotary(static_cast<const double*>(q), static_cast<const double*>(k), static_cast<const double*>(cos),
           static_cast<const double*>(sin), static_cast<double*>(q_out), static_cast<double*>(k_out), batch, seq,
           q_heads, k_heads, dim, cos_batch, backward != 0);
  else
    return BMT_ERR_DTYPE;
  return BMT_OK;
}

int bmt_cpu_swiglu_fwd(int dtype, const void* gate, const void* up, void* out, int64_t n) {
  if (dtype == BMT_F32)
    swiglu_fwd(static_cast<const float*>(gate), static_cast<const float*>(up), static_cast<float*>(out), n);
  else if (dtype == BMT_F64)
    swiglu_fwd(static_cast<const double*>(gate), static_cast<const double*>(up), static_cast<double*>(out), n);
  else
    return BMT_ERR_DTYPE;
  return BMT_OK;
}

int bmt_cpu_swiglu_bwd(int dtype, const void* gate, const void* up, const void* dout, void* dgate, void* dup,
                       int64_t n) {
  if (dtype == BMT_F32)
    swiglu_bwd(static_cast<const float*>(gate), static_cast<const float*>(up), static_cast<const float*>(dout),
               static_cast<float*>(dgate), static_cast<float*>(dup), n);
  else if (dtype == BMT_F64)
    swiglu_bwd(static_cast<const double*>(gate), static_cast<const double*>(up), static_cast<const double*>(dout),
               static_cast<double*>(dgate), static_cast<double*>(dup), n);
  else
    return BMT_ERR_DTYPE;
  return BMT_OK;
}

int bmt_cpu_softmax_xent(int dtype, const void* logits, const int64_t* labels, void* loss, void* dlogits,
                         int64_t rows, int64_t vocab, int64_t ignore_index) {
  if (vocab <= 0) return BMT_ERR_SHAPE;
  if (dtype == BMT_F32)
    return softmax_xent(static_cast<const float*>(logits), labels, static_cast<float*>(loss),
                        static_cast<float*>(dlogits), rows, vocab, ignore_index);
  if (dtype == BMT_F64)
    return softmax_xent(static_cast<const double*>(logits), labels, static_cast<double*>(loss),
                        static_cast<double*>(dlogits), rows, vocab, ignore_index);
  return BMT_ERR_DTYPE;
}

}  // extern "C"
