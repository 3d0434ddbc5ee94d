// CUDA launchers of the fused kernels (C ABI in kernels/include/bmt_kernels.h).
//
// Plain CUDA with no Paddle headers, so `nvcc -c` builds it alone (kernels/Makefile cuda-check) and
// benchmarks/gpu_check.py can test it through ctypes on a machine without a GPU build of Paddle.
// Arithmetic is fp32 for every storage dtype (fp32, fp16, bf16); reductions are deterministic (no atomics).
#include <cstdint>
#include <initializer_list>

#include "cuda_common.h"

namespace {

using bmt_cuda::clear_error;
using bmt_cuda::from_f;
using bmt_cuda::status;
using bmt_cuda::to_f;

constexpr int kThreads = 256;

// 16 bytes of T: the widest load a thread issues (4 fp32 or 8 fp16/bf16 values). Kernels take the vector
// path only when every pointer is 16-byte aligned and the row length (or, elementwise, the bulk) divides.
template <typename T>
struct alignas(16) Vec {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

template <typename T>
__device__ __forceinline__ Vec<T> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T>*>(p);
}

template <typename T>
__device__ __forceinline__ void store_vec(T* p, const Vec<T>& v) {
  *reinterpret_cast<Vec<T>*>(p) = v;
}

// VEC values of T: one plain access (VEC 1) or one 16-byte access (VEC Vec<T>::N, p aligned).
template <typename T, int VEC>
__device__ __forceinline__ void load_n(const T* p, T* out) {
  if constexpr (VEC == 1) out[0] = p[0]; else *reinterpret_cast<Vec<T>*>(out) = load_vec(p);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_n(T* p, const T* in) {
  if constexpr (VEC == 1) p[0] = in[0]; else store_vec(p, *reinterpret_cast<const Vec<T>*>(in));
}

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
// VEC values per access: 1 (any shape) or Vec<T>::N (cols divisible, pointers aligned).
template <typename T, int VEC>
__global__ void rms_fwd_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                               float* __restrict__ rstd, int64_t cols, float eps) {
  const int64_t r = blockIdx.x;
  const T* xr = x + r * cols;
  T* yr = y + r * cols;
  float ss = 0.f;
  for (int64_t c = threadIdx.x * VEC; c < cols; c += blockDim.x * VEC) {
    T xv[VEC];
    load_n<T, VEC>(xr + c, xv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) ss += to_f(xv[i]) * to_f(xv[i]);
  }
  const float inv = rsqrtf(block_sum(ss) / static_cast<float>(cols) + eps);
  if (threadIdx.x == 0) rstd[r] = inv;
  for (int64_t c = threadIdx.x * VEC; c < cols; c += blockDim.x * VEC) {
    T xv[VEC], wv[VEC], yv[VEC];
    load_n<T, VEC>(xr + c, xv);
    load_n<T, VEC>(w + c, wv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      const float normed = to_f(from_f<T>(to_f(xv[i]) * inv));  // rounded like the reference's cast
      yv[i] = from_f<T>(normed * to_f(wv[i]));
    }
    store_n<T, VEC>(yr + c, yv);
  }
}

template <typename T, int VEC>
__global__ void rms_bwd_dx_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                                  const float* __restrict__ rstd, T* __restrict__ dx, int64_t cols) {
  const int64_t r = blockIdx.x;
  const T* xr = x + r * cols;
  const T* dyr = dy + r * cols;
  T* dxr = dx + r * cols;
  const float inv = rstd[r];
  float dot = 0.f;
  for (int64_t c = threadIdx.x * VEC; c < cols; c += blockDim.x * VEC) {
    T xv[VEC], wv[VEC], dv[VEC];
    load_n<T, VEC>(xr + c, xv);
    load_n<T, VEC>(w + c, wv);
    load_n<T, VEC>(dyr + c, dv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) dot += to_f(dv[i]) * to_f(wv[i]) * to_f(xv[i]);
  }
  const float k = block_sum(dot) * inv * inv / static_cast<float>(cols);
  for (int64_t c = threadIdx.x * VEC; c < cols; c += blockDim.x * VEC) {
    T xv[VEC], wv[VEC], dv[VEC], ov[VEC];
    load_n<T, VEC>(xr + c, xv);
    load_n<T, VEC>(w + c, wv);
    load_n<T, VEC>(dyr + c, dv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) ov[i] = from_f<T>(inv * (to_f(dv[i]) * to_f(wv[i]) - to_f(xv[i]) * k));
    store_n<T, VEC>(dxr + c, ov);
  }
}

constexpr int kDwRows = 8;  // threadIdx.y extent of the dw partial-sum kernel

int64_t dw_splits(int64_t rows) {
  int64_t s = (rows + kDwRows - 1) / kDwRows;
  if (s > 128) s = 128;
  return s < 1 ? 1 : s;
}

// Each thread sums VEC consecutive columns over its rows, so a warp reads 32 * VEC contiguous values a row.
template <typename T, int VEC>
__global__ void rms_bwd_dw_partial(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ rstd,
                                   float* __restrict__ part, int64_t rows, int64_t cols) {
  __shared__ float buf[kDwRows][32 * VEC + 1];
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x) * VEC;
  float acc[VEC] = {};
  if (c < cols) {
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * kDwRows + threadIdx.y; r < rows;
         r += static_cast<int64_t>(gridDim.y) * kDwRows) {
      T dv[VEC], xv[VEC];
      load_n<T, VEC>(dy + r * cols + c, dv);
      load_n<T, VEC>(x + r * cols + c, xv);
      const float inv = rstd[r];
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += to_f(dv[i]) * to_f(xv[i]) * inv;
    }
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) buf[threadIdx.y][threadIdx.x * VEC + i] = acc[i];
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      float sum = 0.f;
      for (int k = 0; k < kDwRows; ++k) sum += buf[k][threadIdx.x * VEC + i];
      part[static_cast<int64_t>(blockIdx.y) * cols + c + i] = sum;
    }
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
// Each thread rotates VEC consecutive pairs (j, j + half) of one head (VEC divides half).
template <typename T, int VEC>
__global__ void rotary_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ cos,
                              const T* __restrict__ sin, T* __restrict__ qo, T* __restrict__ ko, int64_t seq,
                              int64_t qh, int64_t kh, int64_t dim, int64_t cos_batch, int backward) {
  const int64_t t = blockIdx.x;  // token = b * seq + p
  const int64_t b = t / seq, p = t % seq;
  const int64_t crow = ((cos_batch == 1) ? p : b * seq + p) * dim;
  const T* c = cos + crow;
  const T* s = sin + crow;
  const int64_t half = dim / 2;
  const int64_t groups = half / VEC;
  for (int64_t i = threadIdx.x; i < (qh + kh) * groups; i += blockDim.x) {
    const int64_t h = i / groups, j = (i % groups) * VEC;
    const T* a;
    T* o;
    if (h < qh) {
      a = q + (t * qh + h) * dim;
      o = qo + (t * qh + h) * dim;
    } else {
      a = k + (t * kh + (h - qh)) * dim;
      o = ko + (t * kh + (h - qh)) * dim;
    }
    T lo[VEC], hi[VEC], clo[VEC], chi[VEC], slo[VEC], shi[VEC], olo[VEC], ohi[VEC];
    load_n<T, VEC>(a + j, lo);
    load_n<T, VEC>(a + j + half, hi);
    load_n<T, VEC>(c + j, clo);
    load_n<T, VEC>(c + j + half, chi);
    load_n<T, VEC>(s + j, slo);
    load_n<T, VEC>(s + j + half, shi);
#pragma unroll
    for (int m = 0; m < VEC; ++m) {
      const float l = to_f(lo[m]), r = to_f(hi[m]);
      if (!backward) {
        olo[m] = from_f<T>(l * to_f(clo[m]) - r * to_f(slo[m]));
        ohi[m] = from_f<T>(r * to_f(chi[m]) + l * to_f(shi[m]));
      } else {
        olo[m] = from_f<T>(l * to_f(clo[m]) + r * to_f(shi[m]));
        ohi[m] = from_f<T>(r * to_f(chi[m]) - l * to_f(slo[m]));
      }
    }
    store_n<T, VEC>(o + j, olo);
    store_n<T, VEC>(o + j + half, ohi);
  }
}

// ---------------------------------------------------------------- SwiGLU
template <typename T>
__device__ __forceinline__ T swiglu_out(T g, T u) {
  const float a = to_f(g);
  return from_f<T>(a * (1.f / (1.f + __expf(-a))) * to_f(u));
}

// Elements [0, bulk) in VEC-wide accesses (bulk a multiple of VEC), then [bulk, n) one at a time.
template <typename T, int VEC>
__global__ void swiglu_fwd_kernel(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ out, int64_t n,
                                  int64_t bulk) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first * VEC; i < bulk; i += stride * VEC) {
    T gv[VEC], uv[VEC], ov[VEC];
    load_n<T, VEC>(g + i, gv);
    load_n<T, VEC>(u + i, uv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) ov[k] = swiglu_out(gv[k], uv[k]);
    store_n<T, VEC>(out + i, ov);
  }
  for (int64_t i = bulk + first; i < n; i += stride) out[i] = swiglu_out(g[i], u[i]);
}

template <typename T>
__device__ __forceinline__ void swiglu_grad(T g, T u, T d, T* dg, T* du) {
  const float gv = to_f(g), uv = to_f(u), dv = to_f(d);
  const float sg = 1.f / (1.f + __expf(-gv));
  const float silu = gv * sg;
  *du = from_f<T>(dv * silu);
  *dg = from_f<T>(dv * uv * (sg + silu * (1.f - sg)));
}

template <typename T, int VEC>
__global__ void swiglu_bwd_kernel(const T* __restrict__ g, const T* __restrict__ u, const T* __restrict__ dout,
                                  T* __restrict__ dg, T* __restrict__ du, int64_t n, int64_t bulk) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first * VEC; i < bulk; i += stride * VEC) {
    T gv[VEC], uv[VEC], dv[VEC], dgv[VEC], duv[VEC];
    load_n<T, VEC>(g + i, gv);
    load_n<T, VEC>(u + i, uv);
    load_n<T, VEC>(dout + i, dv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) swiglu_grad(gv[k], uv[k], dv[k], &dgv[k], &duv[k]);
    store_n<T, VEC>(dg + i, dgv);
    store_n<T, VEC>(du + i, duv);
  }
  for (int64_t i = bulk + first; i < n; i += stride) swiglu_grad(g[i], u[i], dout[i], &dg[i], &du[i]);
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

bool aligned16(std::initializer_list<const void*> ptrs) {
  for (const void* q : ptrs)
    if (reinterpret_cast<uintptr_t>(q) % 16 != 0) return false;
  return true;
}

unsigned elem_blocks(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  if (b > 65535 * 16) b = 65535 * 16;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

template <typename T, int VEC>
void rms_bwd_launch(const T* dy, const T* x, const T* w, const float* rstd, T* dx, T* dw, float* part, int64_t rows,
                    int64_t cols, cudaStream_t st) {
  const int64_t splits = dw_splits(rows);
  const dim3 pgrid(static_cast<unsigned>((cols + 32 * VEC - 1) / (32 * VEC)), static_cast<unsigned>(splits));
  const dim3 pblock(32, kDwRows);
  const unsigned fgrid = static_cast<unsigned>((cols + kThreads - 1) / kThreads);
  if (rows > 0) rms_bwd_dx_kernel<T, VEC><<<static_cast<unsigned>(rows), kThreads, 0, st>>>(dy, x, w, rstd, dx, cols);
  rms_bwd_dw_partial<T, VEC><<<pgrid, pblock, 0, st>>>(dy, x, rstd, part, rows, cols);
  rms_bwd_dw_final<T><<<fgrid, kThreads, 0, st>>>(part, dw, splits, cols);
}

}  // namespace

extern "C" {

int bmt_cuda_rms_norm_fwd(int dtype, const void* x, const void* w, void* y, float* rstd, int64_t rows,
                          int64_t cols, float eps, void* stream) {
  if (rows < 0 || cols <= 0) return BMT_ERR_SHAPE;
  if (rows == 0) return BMT_OK;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const unsigned grid = static_cast<unsigned>(rows);
  BMT_DISPATCH(
      dtype, constexpr int N = Vec<T>::N; const T* xt = static_cast<const T*>(x);
      const T* wt = static_cast<const T*>(w); T* yt = static_cast<T*>(y);
      if (cols % N == 0 && aligned16({x, w, y})) rms_fwd_kernel<T, N><<<grid, kThreads, 0, st>>>(xt, wt, yt, rstd, cols, eps);
      else rms_fwd_kernel<T, 1><<<grid, kThreads, 0, st>>>(xt, wt, yt, rstd, cols, eps));
  return status();
}

int64_t bmt_cuda_rms_norm_bwd_workspace(int64_t rows, int64_t cols) {
  return dw_splits(rows) * cols * static_cast<int64_t>(sizeof(float));
}

int bmt_cuda_rms_norm_bwd(int dtype, const void* dy, const void* x, const void* w, const float* rstd, void* dx,
                          void* dw, void* workspace, int64_t rows, int64_t cols, void* stream) {
  if (rows < 0 || cols <= 0) return BMT_ERR_SHAPE;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  float* part = static_cast<float*>(workspace);
  BMT_DISPATCH(
      dtype, constexpr int N = Vec<T>::N; const T* dyt = static_cast<const T*>(dy);
      const T* xt = static_cast<const T*>(x); const T* wt = static_cast<const T*>(w); T* dxt = static_cast<T*>(dx);
      T* dwt = static_cast<T*>(dw);
      if (cols % N == 0 && aligned16({dy, x, w, dx}))
          rms_bwd_launch<T, N>(dyt, xt, wt, rstd, dxt, dwt, part, rows, cols, st);
      else rms_bwd_launch<T, 1>(dyt, xt, wt, rstd, dxt, dwt, part, rows, cols, st));
  return status();
}

int bmt_cuda_rotary(int dtype, const void* q, const void* k, const void* cos, const void* sin, void* q_out,
                    void* k_out, int64_t batch, int64_t seq, int64_t q_heads, int64_t k_heads, int64_t dim,
                    int64_t cos_batch, int backward, void* stream) {
  if (dim % 2 != 0 || (cos_batch != 1 && cos_batch != batch)) return BMT_ERR_SHAPE;
  const int64_t tokens = batch * seq;
  if (tokens == 0) return BMT_OK;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const unsigned grid = static_cast<unsigned>(tokens);
  BMT_DISPATCH(
      dtype, constexpr int N = Vec<T>::N; const T* qt = static_cast<const T*>(q);
      const T* kt = static_cast<const T*>(k); const T* ct = static_cast<const T*>(cos);
      const T* stt = static_cast<const T*>(sin); T* qot = static_cast<T*>(q_out); T* kot = static_cast<T*>(k_out);
      if ((dim / 2) % N == 0 && aligned16({q, k, cos, sin, q_out, k_out}))
          rotary_kernel<T, N><<<grid, 128, 0, st>>>(qt, kt, ct, stt, qot, kot, seq, q_heads, k_heads, dim, cos_batch, backward);
      else rotary_kernel<T, 1><<<grid, 128, 0, st>>>(qt, kt, ct, stt, qot, kot, seq, q_heads, k_heads, dim, cos_batch,
                                                     backward));
  return status();
}

int bmt_cuda_swiglu_fwd(int dtype, const void* gate, const void* up, void* out, int64_t n, void* stream) {
  if (n == 0) return BMT_OK;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  BMT_DISPATCH(
      dtype, constexpr int N = Vec<T>::N; const T* g = static_cast<const T*>(gate);
      const T* u = static_cast<const T*>(up); T* o = static_cast<T*>(out);
      if (aligned16({gate, up, out})) swiglu_fwd_kernel<T, N><<<elem_blocks(n / N + 1), kThreads, 0, st>>>(g, u, o, n, n / N * N);
      else swiglu_fwd_kernel<T, 1><<<elem_blocks(n), kThreads, 0, st>>>(g, u, o, n, n));
  return status();
}

int bmt_cuda_swiglu_bwd(int dtype, const void* gate, const void* up, const void* dout, void* dgate, void* dup,
                        int64_t n, void* stream) {
  if (n == 0) return BMT_OK;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  BMT_DISPATCH(
      dtype, constexpr int N = Vec<T>::N; const T* g = static_cast<const T*>(gate);
      const T* u = static_cast<const T*>(up); const T* d = static_cast<const T*>(dout); T* dg = static_cast<T*>(dgate);
      T* du = static_cast<T*>(dup);
      if (aligned16({gate, up, dout, dgate, dup}))
          swiglu_bwd_kernel<T, N><<<elem_blocks(n / N + 1), kThreads, 0, st>>>(g, u, d, dg, du, n, n / N * N);
      else swiglu_bwd_kernel<T, 1><<<elem_blocks(n), kThreads, 0, st>>>(g, u, d, dg, du, n, n));
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
