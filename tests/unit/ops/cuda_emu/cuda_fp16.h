// Host emulation (tests/unit/ops/cuda_emu/cuda_runtime.h): a 16-bit float type held as a float.
#pragma once
struct __half {
  float v;
};
inline float __half2float(__half h) { return h.v; }
inline __half __float2half(float f) { return {f}; }
