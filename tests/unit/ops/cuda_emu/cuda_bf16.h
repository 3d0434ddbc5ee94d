// Host emulation (tests/unit/ops/cuda_emu/cuda_runtime.h): bfloat16 held as a float.
#pragma once
struct __nv_bfloat16 {
  float v;
};
inline float __bfloat162float(__nv_bfloat16 h) { return h.v; }
inline __nv_bfloat16 __float2bfloat16(float f) { return {f}; }
