// Sum of squares over many tensors on the CPU (C ABI in kernels/include/bmt_kernels.h): the fp32 global
// gradient norm's one pass.
//
// The tensors are cut into chunks of at most kChunk elements and one OpenMP region sums the chunks (in
// double), so a model's few hundred gradients cost one parallel region, not one per tensor, and no squared
// copy is allocated (Paddle's square + sum writes a temporary the size of every gradient).
//
// Deterministic: each chunk's sum goes to its own slot and the slots are added in chunk order on one
// thread, so the result depends only on the tensors, never on the thread count or on which thread
// finishes first (an OpenMP `reduction` combines the threads' sums in an unspecified order).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "bmt_kernels.h"
#include "parallel.h"

namespace {

constexpr int64_t kChunk = 1 << 16;
using bmt::kParallelMin;  // parallel.h: one thread below it (counted over all the tensors)

template <typename T>
double sum_squares(const void* const* ptrs, const int64_t* sizes, int64_t count) {
  struct Chunk {
    const T* p;
    int64_t n;
  };
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (int64_t t = 0; t < count; ++t) {
    const T* p = static_cast<const T*>(ptrs[t]);
    for (int64_t i = 0; i < sizes[t]; i += kChunk)
      chunks.push_back({p + i, sizes[t] - i < kChunk ? sizes[t] - i : kChunk});
    total += sizes[t];
  }
  const int64_t nchunks = static_cast<int64_t>(chunks.size());
  std::vector<double> slots(static_cast<size_t>(nchunks), 0.0);
#pragma omp parallel for schedule(static) if (total >= kParallelMin)
  for (int64_t c = 0; c < nchunks; ++c) {
    const T* p = chunks[c].p;
    const int64_t n = chunks[c].n;
    T part = T(0);  // a chunk in the tensor's own precision (vectorised), the chunks in double
#pragma omp simd reduction(+ : part)
    for (int64_t i = 0; i < n; ++i) part += p[i] * p[i];
    slots[c] = static_cast<double>(part);
  }
  double acc = 0.0;
  for (int64_t c = 0; c < nchunks; ++c) acc += slots[c];
  return acc;
}

}  // namespace

extern "C" {

int bmt_cpu_sum_squares(int dtype, const void* const* ptrs, const int64_t* sizes, int64_t count, double* out) {
  if (count < 0) return BMT_ERR_SHAPE;
  for (int64_t t = 0; t < count; ++t)
    if (sizes[t] < 0) return BMT_ERR_SHAPE;
  if (dtype == BMT_F32)
    *out = sum_squares<float>(ptrs, sizes, count);
  else if (dtype == BMT_F64)
    *out = sum_squares<double>(ptrs, sizes, count);
  else
    return BMT_ERR_DTYPE;
  return BMT_OK;
}

}  // extern "C"
