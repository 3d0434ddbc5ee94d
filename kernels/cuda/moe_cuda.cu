// The grouped GEMM of a mixture-of-experts layer's routed experts on a GPU (C ABI in
// kernels/include/bmt_kernels.h): the rows x [rows, k] are sorted by expert, expert e owning the counts[e]
// rows from offset off_e = counts[0] + ... + counts[e-1], and each expert has its own weight w_e, [k, n]
// (Paddle's [in, out] layout, trans_w 0) or [n, k] (trans_w 1). One launch per product, over every expert:
//   fwd: y_e [m_e, n] = x_e w_e             (trans_w 1: x_e w_e^T)
//   dx:  dx_e [m_e, k] = dy_e w_e^T         (trans_w 1: dy_e w_e)
//   dw:  dw_e [k, n] = x_e^T dy_e           (trans_w 1: dw_e [n, k] = dy_e^T x_e); zeros for m_e = 0
// Storage fp32, fp16 or bf16, arithmetic and accumulation in fp32, each output element summed by one thread
// in a fixed order (deterministic, no atomics).
//
// The kernel is one tiled GEMM, C [M, N] = op(A) [M, K] op(B) [K, N], whose operands are addressed through
// element strides, so the three products (and both weight layouts) are the same code: a grid of
// (N tiles, M tiles, experts) blocks (at most 65535 M tiles: a block then takes every gridDim.y-th row
// tile in turn), each computing a kTile x kTile tile of one expert's C in fp32 registers from kDepth-deep
// slices of op(A) and op(B) staged in shared memory. The row-grouped operands start at off_e rows; the
// per-expert ones are read from a device array of pointers. The launcher copies the offsets and the
// pointers into a caller-provided device workspace (bmt_cuda_grouped_gemm_workspace) with an asynchronous
// copy on the stream, so a launch needs no allocation and no synchronisation.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda_common.h"

namespace {

using bmt_cuda::from_f;
using bmt_cuda::status;
using bmt_cuda::to_f;

constexpr int kTile = 64;   // rows and columns of C per block
constexpr int kDepth = 16;  // reduction slice staged in shared memory
constexpr int kSide = 16;   // threads per block side: kSide x kSide threads, each 4 x 4 outputs
constexpr int kPer = kTile / kSide;

// CUDA's limit on gridDim.y (and z); a build may lower it (the host emulation of the tests does, to reach
// the loop over row tiles below with small inputs)
#ifndef BMT_GRID_Y_MAX
#define BMT_GRID_Y_MAX 65535
#endif
constexpr int64_t kGridYMax = BMT_GRID_Y_MAX;

// One operand as the kernel reads it: op(X)[i, p] = base[i * si + p * sp], where base is list[e] for a
// per-expert operand (list set) or ptr + off[e] * row for a row-grouped one.
template <typename T>
struct Operand {
  const T* ptr;
  const T* const* list;
  int64_t row, si, sp;
};

template <typename T>
struct Problem {
  Operand<T> a, b;  // op(A) [M, K] (si: M stride, sp: K stride), op(B) [K, N] (si: K stride, sp: N stride)
  T* c;             // row-grouped C (ldc elements per row), or
  T* const* c_list;  // per-expert C
  int64_t ldc;
  const int64_t* off;  // experts + 1 row offsets (device)
  int64_t m, n, k;     // sizes; -1: the expert's row count
};

template <typename T>
__device__ __forceinline__ const T* base_of(const Operand<T>& o, int64_t e, int64_t first) {
  return o.list != nullptr ? o.list[e] : o.ptr + first * o.row;
}

// Stages the kDepth x kTile slice op(X)[i0 .. i0 + kTile, p0 .. p0 + kDepth] into s[p][i] (zeros outside
// [0, rows) x [0, depth)); the index that is contiguous in memory varies fastest across the threads.
template <typename T>
__device__ __forceinline__ void stage(float (*s)[kTile + 1], const T* x, int64_t si, int64_t sp, int64_t i0,
                                      int64_t p0, int64_t rows, int64_t depth) {
  const int tid = threadIdx.y * kSide + threadIdx.x;
  for (int idx = tid; idx < kTile * kDepth; idx += kSide * kSide) {
    const int i = sp == 1 ? idx / kDepth : idx % kTile;
    const int p = sp == 1 ? idx % kDepth : idx / kTile;
    const int64_t gi = i0 + i, gp = p0 + p;
    s[p][i] = (gi < rows && gp < depth) ? to_f(x[gi * si + gp * sp]) : 0.f;
  }
}

template <typename T>
__global__ void grouped_gemm_kernel(Problem<T> pr) {
  __shared__ float sa[kDepth][kTile + 1];
  __shared__ float sb[kDepth][kTile + 1];
  const int64_t e = blockIdx.z;
  const int64_t first = pr.off[e], count = pr.off[e + 1] - first;
  const int64_t m = pr.m < 0 ? count : pr.m, n = pr.n, k = pr.k < 0 ? count : pr.k;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const T* a = base_of(pr.a, e, first);
  const T* b = base_of(pr.b, e, first);
  T* out = pr.c_list != nullptr ? pr.c_list[e] : pr.c + first * pr.ldc;
  // row tiles i0 = blockIdx.y, + gridDim.y, ...: more row tiles than the grid's rows (capped at kGridYMax)
  // are taken in turn; the bounds are the same for the whole block (an expert with fewer row tiles than
  // the grid runs none), so every thread meets the same __syncthreads
  for (int64_t i0 = static_cast<int64_t>(blockIdx.y) * kTile; i0 < m;
       i0 += static_cast<int64_t>(gridDim.y) * kTile) {
    float acc[kPer][kPer] = {};
    for (int64_t p0 = 0; p0 < k; p0 += kDepth) {
      stage(sa, a, pr.a.si, pr.a.sp, i0, p0, m, k);
      // op(B)[p, j] = b[p * si + j * sp]: staged as sb[p][j], i.e. the transposed slice of the N x K view
      stage(sb, b, pr.b.sp, pr.b.si, j0, p0, n, k);
      __syncthreads();
#pragma unroll
      for (int p = 0; p < kDepth; ++p) {
        float av[kPer], bv[kPer];
#pragma unroll
        for (int r = 0; r < kPer; ++r) av[r] = sa[p][threadIdx.y + r * kSide];
#pragma unroll
        for (int c = 0; c < kPer; ++c) bv[c] = sb[p][threadIdx.x + c * kSide];
#pragma unroll
        for (int r = 0; r < kPer; ++r)
#pragma unroll
          for (int c = 0; c < kPer; ++c) acc[r][c] += av[r] * bv[c];
      }
      __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < kPer; ++r) {
      const int64_t i = i0 + threadIdx.y + r * kSide;
#pragma unroll
      for (int cc = 0; cc < kPer; ++cc) {
        const int64_t j = j0 + threadIdx.x + cc * kSide;
        if (i < m && j < n) out[i * pr.ldc + j] = from_f<T>(acc[r][cc]);
      }
    }
  }
}

// The host side of a launch: the row offsets of the experts and the largest count, from counts.
struct Groups {
  std::vector<int64_t> off;
  int64_t max_rows = 0;
};

int make_groups(const int64_t* counts, int64_t experts, int64_t k, int64_t n, Groups* g) {
  if (experts <= 0 || k <= 0 || n <= 0 || counts == nullptr) return BMT_ERR_SHAPE;
  g->off.assign(static_cast<size_t>(experts) + 1, 0);
  for (int64_t e = 0; e < experts; ++e) {
    if (counts[e] < 0) return BMT_ERR_SHAPE;
    g->off[e + 1] = g->off[e] + counts[e];
    if (counts[e] > g->max_rows) g->max_rows = counts[e];
  }
  return BMT_OK;
}

// Copies the offsets and the experts' pointers into the workspace (offsets first, then the pointers) on
// the stream; returns the device addresses of both. The host vectors may go right after: a copy from
// pageable memory has been staged when cudaMemcpyAsync returns.
int upload(const Groups& g, const void* const* ptrs, int64_t experts, void* workspace, cudaStream_t st,
           const int64_t** off, void** list) {
  std::vector<int64_t> host(g.off);
  for (int64_t e = 0; e < experts; ++e) host.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(ptrs[e])));
  bmt_cuda::clear_error();
  if (cudaMemcpyAsync(workspace, host.data(), host.size() * sizeof(int64_t), cudaMemcpyHostToDevice, st) !=
      cudaSuccess)
    return BMT_ERR_CUDA;
  *off = static_cast<const int64_t*>(workspace);
  *list = static_cast<int64_t*>(workspace) + experts + 1;
  return BMT_OK;
}

template <typename T>
int launch(Problem<T> pr, int64_t experts, int64_t m_tiles_of, cudaStream_t st) {
  const int64_t n_tiles = (pr.n + kTile - 1) / kTile, m_tiles = (m_tiles_of + kTile - 1) / kTile;
  if (m_tiles == 0) return BMT_OK;  // no expert has rows: nothing to write
  if (n_tiles > 2147483647 || experts > 65535) return BMT_ERR_SHAPE;
  const dim3 grid(static_cast<unsigned>(n_tiles), static_cast<unsigned>(std::min(m_tiles, kGridYMax)),
                  static_cast<unsigned>(experts));
  grouped_gemm_kernel<T><<<grid, dim3(kSide, kSide), 0, st>>>(pr);
  return status();
}

// fwd (dx false) or dx (dx true): row-grouped A and C, per-expert B.
template <typename T>
int rows_product(bool dx, const void* a, const void* const* w, void* c, const int64_t* counts, int64_t experts,
                 int64_t k, int64_t n, int trans_w, void* workspace, cudaStream_t st) {
  Groups g;
  int rc = make_groups(counts, experts, k, n, &g);
  const int64_t in = dx ? n : k, out = dx ? k : n;  // columns of A and of C
  const int64_t* off = nullptr;
  void* list = nullptr;
  if (rc == BMT_OK && g.off[experts] > 0) rc = upload(g, w, experts, workspace, st, &off, &list);
  if (rc != BMT_OK || g.off[experts] == 0) return rc;
  // op(B) [in, out]: w_e [k, n] read as is (fwd) or transposed (dx); w_e [n, k] the other way round
  const bool b_rows = dx == (trans_w != 0);  // op(B)[p, j] = w[p * out + j]
  Operand<T> ao{static_cast<const T*>(a), nullptr, in, in, 1};
  Operand<T> bo{nullptr, static_cast<const T* const*>(list), 0, b_rows ? out : 1, b_rows ? 1 : in};
  Problem<T> pr{ao, bo, static_cast<T*>(c), nullptr, out, off, -1, out, in};
  return launch(pr, experts, g.max_rows, st);
}

template <typename T>
int weight_product(const void* x, const void* dy, void* const* dw, const int64_t* counts, int64_t experts,
                   int64_t k, int64_t n, int trans_w, void* workspace, cudaStream_t st) {
  Groups g;
  int rc = make_groups(counts, experts, k, n, &g);
  const int64_t* off = nullptr;
  void* list = nullptr;
  if (rc == BMT_OK) rc = upload(g, const_cast<const void* const*>(dw), experts, workspace, st, &off, &list);
  if (rc != BMT_OK) return rc;
  // dw_e [k, n] = x_e^T dy_e, or [n, k] = dy_e^T x_e: op(A) is the transposed rows of one, op(B) the other's
  const T* first = static_cast<const T*>(trans_w ? dy : x);
  const T* second = static_cast<const T*>(trans_w ? x : dy);
  const int64_t rows_c = trans_w ? n : k, cols_c = trans_w ? k : n;
  Operand<T> ao{first, nullptr, rows_c, 1, rows_c};
  Operand<T> bo{second, nullptr, cols_c, cols_c, 1};
  Problem<T> pr{ao, bo, nullptr, static_cast<T* const*>(list), cols_c, off, rows_c, cols_c, -1};
  return launch(pr, experts, rows_c, st);
}

}  // namespace

extern "C" {

int64_t bmt_cuda_grouped_gemm_workspace(int64_t experts) {
  return (2 * (experts < 0 ? 0 : experts) + 1) * static_cast<int64_t>(sizeof(int64_t));
}

int bmt_cuda_grouped_gemm_fwd(int dtype, const void* x, const void* const* w, void* y, const int64_t* counts,
                              int64_t experts, int64_t k, int64_t n, int trans_w, void* workspace, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  BMT_DISPATCH(dtype, return rows_product<T>(false, x, w, y, counts, experts, k, n, trans_w, workspace, st));
  return BMT_OK;
}

int bmt_cuda_grouped_gemm_dx(int dtype, const void* dy, const void* const* w, void* dx, const int64_t* counts,
                             int64_t experts, int64_t k, int64_t n, int trans_w, void* workspace, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  BMT_DISPATCH(dtype, return rows_product<T>(true, dy, w, dx, counts, experts, k, n, trans_w, workspace, st));
  return BMT_OK;
}

int bmt_cuda_grouped_gemm_dw(int dtype, const void* x, const void* dy, void* const* dw, const int64_t* counts,
                             int64_t experts, int64_t k, int64_t n, int trans_w, void* workspace, void* stream) {
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  BMT_DISPATCH(dtype, return weight_product<T>(x, dy, dw, counts, experts, k, n, trans_w, workspace, st));
  return BMT_OK;
}

}  // extern "C"
