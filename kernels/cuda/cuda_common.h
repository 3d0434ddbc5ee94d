// What the CUDA launchers of kernels/cuda share (included by the .cu files only): fp32 conversion of each
// storage dtype, the dtype dispatch of a C ABI entry point and its launch status. Plain CUDA, no Paddle.
#ifndef BMT_CUDA_COMMON_H_
#define BMT_CUDA_COMMON_H_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "bmt_kernels.h"

namespace bmt_cuda {

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

// cudaGetLastError returns (and resets) the last error of any earlier call on this thread, not only of
// our launch: each launcher clears it right before launching, so status() reports its own launch.
inline void clear_error() { (void)cudaGetLastError(); }

inline int status() { return cudaGetLastError() == cudaSuccess ? BMT_OK : BMT_ERR_CUDA; }

}  // namespace bmt_cuda

// Runs the statements with T the storage type of `dtype` (fp32, fp16, bf16); BMT_ERR_DTYPE otherwise.
#define BMT_DISPATCH(dtype, ...)   \
  bmt_cuda::clear_error();         \
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

#endif  // BMT_CUDA_COMMON_H_
