// CUDA launchers of the fused kernels (C ABI in kernels/include/bmt_kernels.h).
//
// Plain CUDA with no Paddle headers, so `nvcc -c` builds it alone (kernels/Makefile cuda-check) and
// benchmarks/gpu_check.py can test it through ctypes on a machine without a GPU build of Paddle.
// Arithmetic is fp32 for every storage dtype (fp32, fp16, bf16); reductions are deterministic (no atomics).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "bmt_kernels.h"

namespace {

template <typename T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_f<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}

constexpr int kThreads = 256;

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reductions (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v) {
  __shared__ float buf[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  const int nw = blockDim.x >> 5;
  v = (threadIdx.x < nw) ? buf[threadIdx.x] : 0.f;
  if (warp == 0) v = warp_sum(v);
  if (threadIdx.x == 0) buf[0] = v;
  __syncthreads();
  return buf[0];
}

__device__ float block_max(float v) {
  __shared__ float buf[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) buf[warp] = v;
  __syncthreads();
  const int nw = blockDim.x >> 5;
  v = (threadIdx.x < nw) ? buf[threadIdx.x] : -INFINITY;
  if (warp == 0) v = warp_max(v);
  if (threadIdx.x == 0) buf[0] = v;
  __syncthreads();
  return buf[0];
}

// ---------------------------------------------------------------- RMSNorm
template <typename T>
__global__ void rms_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                               float* __restrict__ rstd, int64_t cols, float eps) {
  const int64_t r = blockIdx.x;
  const T* xr = x + r * cols;
  T* yr = y + r * cols;
  float ss = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = to_f(xr[c]);
    ss += v * v;
  }
  const float inv = rsqrtf(block_sum(ss) / static_cast<float>(cols) + eps);
  if (threadIdx.x == 0) rstd[r] = inv;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float normed = to_f(from_f<T>(to_f(xr[c]) * inv));  // rounded like the reference's cast
    yr[c] = from_f<T>(normed * to_f(w[c]));
  }
}

template <typename T>
__global__ void rms_bwd_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                                  const float* __restrict__ rstd, T* __restrict__ dx, int64_t cols) {
  const int64_t r = blockIdx.x;
  const T* xr = x + r * cols;
  const T* dyr = dy + r * cols;
  T* dxr = dx + r * cols;
  const float inv = rstd[r];
  float dot = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dot += to_f(dyr[c]) * to_f(w[c]) * to_f(xr[c]);
  const float k = block_sum(dot) * inv * inv / static_cast<float>(cols);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    dxr[c] = from_f<T>(inv * (to_f(dyr[c]) * to_f(w[c]) - to_f(xr[c]) * k));
}

constexpr int kDwRows = 8;  // threadIdx.y extent of the dw partial-sum kernel

int64_t dw_splits(int64_t rows) {
  int64_t s = (rows + kDwRows - 1) / kDwRows;
  if (s > 128) s = 128;
  return s < 1 ? 1 : s;
}

template <typename T>
__global__ void rms_bwd_dw_partial(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ rstd,
                                   float* __restrict__ part, int64_t rows, int64_t cols) {
  __shared__ float buf[kDwRows][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float acc = 0.f;
  if (c < cols) {
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * kDwRows + threadIdx.y; r < rows;
         r += static_cast<int64_t>(gridDim.y) * kDwRows)
      acc += to_f(dy[r * cols + c]) * to_f(x[r * cols + c]) * rstd[r];
  }
  buf[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float s = 0.f;
    for (int i = 0; i < kDwRows; ++i) s += buf[i][threadIdx.x];
    part[static_cast<int64_t>(blockIdx.y) * cols + c] = s;
  }
}

template <typename T>
__global__ void rms_bwd_dw_final(const float* __restrict__ part, T* __restrict__ dw, int64_t splits, int64_t cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.f;
  for (int64_t i = 0; i < splits; ++i) s += part[i * cols + c];
  dw[c] = from_f<T>(s);
}

// ---------------------------------------------------------------- rotary
template <typename T>
__global__ void rotary_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ cos,
                              const T* __restrict__ sin, T* __restrict__ qo, T* __restrict__ ko, int64_t seq,
                              int64_t qh, int64_t kh, int64_t dim, int64_t cos_batch, int backward) {
  const int64_t t = blockIdx.x;  // token = b * seq + p
  const int64_t b = t / seq, p = t % seq;
  const int64_t crow = ((cos_batch == 1) ? p : b * seq + p) * dim;
  const T* c = cos + crow;
  const T* s = sin + crow;
  const int64_t half = dim / 2;
  const int64_t pairs = (qh + kh) * half;
  for (int64_t i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int64_t h = i / half, j = i % half;
    const T* a;
    T* o;
    if (h < qh) {
      a = q + (t * qh + h) * dim;
      o = qo + (t * qh + h) * dim;
    } else {
      a = k + (t * kh + (h - qh)) * dim;
      o = ko + (t * kh + (h - qh)) * dim;
    }
    const float lo = to_f(a[j]), hi = to_f(a[j + half]);
    const float clo = to_f(c[j]), chi = to_f(c[j + half]), slo = to_f(s[j]), shi = to_f(s[j + half]);
    if (!backward) {
      o[j] = from_f<T>(lo * clo - hi * slo);
      o[j + half] = from_f<T>(hi * chi + lo * shi);
    } else {
      o[j] = from_f<T>(lo * clo + hi * shi);
      o[j + half] = from_f<T>(hi * chi - lo * slo);
    }
  }
}

// ---------------------------------------------------------------- SwiGLU
template <typename T>
__global__ void swiglu_fwd_kernel(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ out, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gv = to_f(g[i]);
    const float sg = 1.f / (1.f + __expf(-gv));
    out[i] = from_f<T>(gv * sg * to_f(u[i]));
  }
}

template <typename T>
__global__ void swiglu_bwd_kernel(const T* __restrict__ g, const T* __restrict__ u, const T* __restrict__ dout,
                                  T* __restrict__ dg, T* __restrict__ du, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float gv = to_f(g[i]), uv = to_f(u[i]), d = to_f(dout[i]);
    const float sg = 1.f / (1.f + __expf(-gv));
    const float silu = gv * sg;
    du[i] = from_f<T>(d * silu);
    dg[i] = from_f<T>(d * uv * (sg + silu * (1.f - sg)));
  }
}

// ---------------------------------------------------------------- softmax cross-entropy
__global__ void xent_kernel(const float* __restrict__ logits, const int64_t* __restrict__ labels,
                            float* __restrict__ loss, float* __restrict__ dlogits, int64_t vocab,
                            int64_t ignore_index, int* bad_label) {
  const int64_t r = blockIdx.x;
  const float* x = logits + r * vocab;
  float* d = dlogits ? dlogits + r * vocab : nullptr;
  const int64_t lab = labels[r];
  const bool ignored = lab == ignore_index;
  const bool bad = !ignored && (lab < 0 || lab >= vocab);
  if (ignored || bad) {
    if (threadIdx.x == 0) {
      loss[r] = bad ? NAN : 0.f;  // NaN makes a bad label visible even without the flag
      if (bad && bad_label) *bad_label = 1;
    }
    if (d)
      for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) d[v] = 0.f;
    return;
  }
  float m = -INFINITY;
  for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) m = fmaxf(m, x[v]);
  m = block_max(m);
  float s = 0.f;
  for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) s += __expf(x[v] - m);
  s = block_sum(s);
  if (threadIdx.x == 0) loss[r] = logf(s) + m - x[lab];
  if (d) {
    const float inv = 1.f / s;
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x)
      d[v] = __expf(x[v] - m) * inv - (v == lab ? 1.f : 0.f);
  }
}

// cudaGetLastError returns (and resets) the last error of any earlier call on this thread, not only of
// our launch: each launcher clears it right before launching, so status() reports its own launch.
void clear_error() { (void)cudaGetLastError(); }

int status() { return cudaGetLastError() == cudaSuccess ? BMT_OK : BMT_ERR_CUDA; }

unsigned elem_blocks(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  if (b > 65535 * 16) b = 65535 * 16;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

}  // namespace

#define BMT_DISPATCH(dtype, ...)   \
  clear_error();                   \
  switch (dtype) {                 \
    case BMT_F32: {                \
      using T = float;             \
      __VA_ARGS__;                 \
      break;                       \
    }                              \
    case BMT_F16: {                \
      using T = __half;            \
      __VA_ARGS__;                 \
      break;                       \
    }                              \
    case BMT_BF16: {               \
      using T = __nv_bfloat16;     \
      __VA_ARGS__;                 \
      break;                       \
    }                              \
    default:                       \
      return BMT_ERR_DTYPE;        \
  }

extern "C" {

int bmt_cuda_rms_norm_fwd(int dtype, const void* x, const void* w, void* y, float* rstd, int64_t rows,
                          int64_t cols, float eps, void* stream) {
  if (rows < 0 || cols <= 0) return BMT_ERR_SHAPE;
  if (rows == 0) return BMT_OK;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  BMT_DISPATCH(dtype, rms_fwd_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, st>>>(
                          static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y), rstd, cols, eps));
  return status();
}

int64_t bmt_cuda_rms_norm_bwd_workspace(int64_t rows, int64_t cols) {
  return dw_splits(rows) * cols * static_cast<int64_t>(sizeof(float));
}

int bmt_cuda_rms_norm_bwd(int dtype, const void* dy, const void* x, const void* w, const float* rstd, void* dx,
                          void* dw, void* workspace, int64_t rows, int64_t cols, void* stream) {
  if (rows < 0 || cols <= 0) return BMT_ERR_SHAPE;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t splits = dw_splits(rows);
  float* part = static_cast<float*>(workspace);
  const dim3 pgrid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(splits));
  const dim3 pblock(32, kDwRows);
  const unsigned fgrid = static_cast<unsigned>((cols + kThreads - 1) / kThreads);
  BMT_DISPATCH(
      dtype,
      if (rows > 0) rms_bwd_dx_kernel<T><<<static_cast<unsigned>(rows), kThreads, 0, st>>>(
          static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w), rstd, static_cast<T*>(dx),
          cols);
      rms_bwd_dw_partial<T><<<pgrid, pblock, 0, st>>>(static_cast<const T*>(dy), static_cast<const T*>(x), rstd,
                                                      part, rows, cols);
      rms_bwd_dw_final<T><<<fgrid, kThreads, 0, st>>>(part, static_cast<T*>(dw), splits, cols));
  return status();
}

int bmt_cuda_rotary(int dtype, const void* q, const void* k, const void* cos, const void* sin, void* q_out,
                    void* k_out, int64_t batch, int64_t seq, int64_t q_heads, int64_t k_heads, int64_t dim,
                    int64_t cos_batch, int backward, void* stream) {
  if (dim % 2 != 0 || (cos_batch != 1 && cos_batch != batch)) return BMT_ERR_SHAPE;
  const int64_t tokens = batch * seq;
  if (tokens == 0) return BMT_OK;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  BMT_DISPATCH(dtype, rotary_kernel<T><<<static_cast<unsigned>(tokens), 128, 0, st>>>(
                          static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(cos),
                          static_cast<const T*>(sin), static_cast<T*>(q_out), static_cast<T*>(k_out), seq, q_heads,
                          k_heads, dim, cos_batch, backward));
  return status();
}

int bmt_cuda_swiglu_fwd(int dtype, const void* gate, const void* up, void* out, int64_t n, void* stream) {
  if (n == 0) return BMT_OK;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  BMT_DISPATCH(dtype, swiglu_fwd_kernel<T><<<elem_blocks(n), kThreads, 0, st>>>(
                          static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<T*>(out), n));
  return status();
}

int bmt_cuda_swiglu_bwd(int dtype, const void* gate, const void* up, const void* dout, void* dgate, void* dup,
                        int64_t n, void* stream) {
  if (n == 0) return BMT_OK;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  BMT_DISPATCH(dtype, swiglu_bwd_kernel<T><<<elem_blocks(n), kThreads, 0, st>>>(
                          static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<const T*>(dout),
                          static_cast<T*>(dgate), static_cast<T*>(dup), n));
  return status();
}

int bmt_cuda_softmax_xent(int dtype, const void* logits, const int64_t* labels, void* loss, void* dlogits,
                          int64_t rows, int64_t vocab, int64_t ignore_index, int* bad_label, void* stream) {
  if (dtype != BMT_F32) return BMT_ERR_DTYPE;
  if (vocab <= 0) return BMT_ERR_SHAPE;
  if (rows == 0) return BMT_OK;
  const int threads = vocab >= 8192 ? 1024 : (vocab >= 1024 ? 512 : 128);
  clear_error();
  xent_kernel<<<static_cast<unsigned>(rows), threads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const float*>(logits), labels, static_cast<float*>(loss), static_cast<float*>(dlogits), vocab,
      ignore_index, bad_label);
  return status();
}

}  // extern "C"
