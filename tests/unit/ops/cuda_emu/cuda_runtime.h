// A host emulation of the CUDA pieces kernels/cuda/moe_cuda.cu uses, for tests/unit/ops/test_moe_cuda.py: its
// kernels run on the CPU, each block's threads as std::threads that meet at a std::barrier for
// __syncthreads, the blocks one after another (so a __shared__ array, a static local here, serves one block
// at a time). The test rewrites the source's one `kernel<<<grid, block, 0, st>>>(args)` into
// bmt_emu::launch(grid, block, [&] { kernel(args); }). Copies are memcpy. A launch fails as on a GPU where
// the grid has more than BMT_GRID_Y_MAX rows (CUDA's 65535 unless the build lowers it, as the test does)
// or the block more than 1024 threads: cudaGetLastError then reports it once.
#pragma once

#include <barrier>
#include <cstddef>
#include <cstring>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

using cudaStream_t = void*;
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidConfiguration = 9 };

#ifndef BMT_GRID_Y_MAX
#define BMT_GRID_Y_MAX 65535
#endif

namespace bmt_emu {
inline cudaError_t last_error = cudaSuccess;
}
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1 };

inline cudaError_t cudaGetLastError() {
  const cudaError_t e = bmt_emu::last_error;
  bmt_emu::last_error = cudaSuccess;
  return e;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t) {
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}

namespace bmt_emu {
inline thread_local dim3 thread_idx, block_idx;
inline dim3 grid_dim;
inline std::barrier<>* block_barrier = nullptr;

template <typename Body>
void launch(dim3 grid, dim3 block, Body body) {
  if (grid.y > BMT_GRID_Y_MAX || grid.z > 65535 || block.x * block.y * block.z > 1024) {
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  grid_dim = grid;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        std::barrier<> bar(static_cast<std::ptrdiff_t>(block.x * block.y * block.z));
        block_barrier = &bar;
        std::vector<std::thread> threads;
        for (unsigned tz = 0; tz < block.z; ++tz)
          for (unsigned ty = 0; ty < block.y; ++ty)
            for (unsigned tx = 0; tx < block.x; ++tx)
              threads.emplace_back([=, &body] {
                block_idx = dim3(x, y, z);
                thread_idx = dim3(tx, ty, tz);
                body();
              });
        for (auto& t : threads) t.join();
      }
}
}  // namespace bmt_emu

#define threadIdx bmt_emu::thread_idx
#define blockIdx bmt_emu::block_idx
#define gridDim bmt_emu::grid_dim
inline void __syncthreads() { bmt_emu::block_barrier->arrive_and_wait(); }
