// Math the CPU kernels share, written so that GCC vectorises it inside `omp simd` loops
// (fused_cpu.cc, attention_cpu.cc: exp_approx, tanh_approx).
#ifndef BMT_CPU_SIMD_MATH_H_
#define BMT_CPU_SIMD_MATH_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace bmt {

// exp for fp32 without a library call (Cephes polynomial, about 2 ulp). The argument is clamped to
// [-87, 88.5]: exp_approx(-inf) is ~1.6e-38, not 0, so callers that mask set zeros themselves.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.5f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline double exp_approx(double x) { return std::exp(x); }

// tanh for fp32 without a library call (Cephes' tanhf: an odd polynomial below |x| 0.625, else
// 1 - 2 / (exp(2|x|) + 1) with the sign of x; a few ulp). Both sides are computed, so a loop vectorises.
inline float tanh_approx(float x) {
  const float a = std::fabs(x);
  const float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const float small = p * z * x + x;
  const float big = 1.0f - 2.0f / (exp_approx(2.0f * a) + 1.0f);
  return a < 0.625f ? small : std::copysign(big, x);
}

inline double tanh_approx(double x) { return std::tanh(x); }

}  // namespace bmt

#endif  // BMT_CPU_SIMD_MATH_H_
