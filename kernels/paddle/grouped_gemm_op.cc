// Paddle custom operators over bmt_cuda_grouped_gemm_fwd / _dx / _dw (kernels/cuda/moe_cuda.cu): one
// projection of an MoE layer's routed experts as one grouped GEMM on a GPU. X [rows, k] is sorted by
// expert; W is a list with one weight per expert, [k, n] (Paddle's [in, out]; trans_w false) or [n, k]
// (trans_w true); the attribute counts holds each expert's number of rows (they sum to rows).
//
// bmt_grouped_gemm returns Y [rows, n]; bmt_grouped_gemm_dx takes DY [rows, n] and returns DX [rows, k];
// bmt_grouped_gemm_dw takes X and DY and writes every expert's weight gradient into the list DW in place
// (allocated by the caller, shaped as the weights; zeros for an expert without rows). Float32, float16 or
// bfloat16 on a GPU; the ops exist in every build and say so when the extension has no CUDA part.
// Autograd is the PyLayer of bmtrain_cli/ops/moe_experts.py.
#include <vector>

#include "bmt_kernels.h"
#include "paddle/extension.h"
#include "op_dtype.h"

namespace {

void check_gpu(const paddle::Tensor& t, const paddle::Tensor& first, const char* op, const char* name) {
  PD_CHECK(!t.is_cpu(), op, ": ", name, " is on the CPU; this op is GPU only (the CPU experts run bmt_moe_swiglu_*)");
  PD_CHECK(dtype_code(t) >= 0 && dtype_code(t) != BMT_F64, op, ": ", name, " must be float32, float16 or bfloat16");
  PD_CHECK(t.dtype() == first.dtype() && t.place() == first.place(), op, ": ", name,
           " must have the dtype and device of the rows");
  PD_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// (k, n) after checking the rows, the weights (or weight gradients) and the counts.
std::pair<int64_t, int64_t> check_all(const paddle::Tensor& x, int64_t x_cols_is_k,
                                      const std::vector<paddle::Tensor>& ws, const std::vector<int64_t>& counts,
                                      bool trans_w, const char* op) {
  check_gpu(x, x, op, "x");
  PD_CHECK(x.shape().size() == 2, op, ": the rows must be [rows, features]");
  PD_CHECK(!ws.empty() && ws.size() == counts.size(), op, ": ", ws.size(), " weights for ", counts.size(),
           " expert counts");
  PD_CHECK(ws[0].shape().size() == 2, op, ": the weights must be 2-D");
  const int64_t k = trans_w ? ws[0].shape()[1] : ws[0].shape()[0];
  const int64_t n = trans_w ? ws[0].shape()[0] : ws[0].shape()[1];
  PD_CHECK(x.shape()[1] == (x_cols_is_k ? k : n), op, ": the rows have ", x.shape()[1], " features, the weights ",
           k, " in and ", n, " out");
  for (size_t e = 0; e < ws.size(); ++e) {
    check_gpu(ws[e], x, op, "a weight");
    PD_CHECK(ws[e].shape() == ws[0].shape(), op, ": the weight of expert ", e, " differs in shape from expert 0's");
  }
  int64_t total = 0;
  for (int64_t c : counts) {
    PD_CHECK(c >= 0, op, ": negative expert count");
    total += c;
  }
  PD_CHECK(total == x.shape()[0], op, ": the expert counts sum to ", total, " but there are ", x.shape()[0], " rows");
  return {k, n};
}

template <typename P>
std::vector<P> ptrs(const std::vector<paddle::Tensor>& ts) {
  std::vector<P> out;
  for (const auto& t : ts) out.push_back(const_cast<P>(t.data()));
  return out;
}

paddle::Tensor workspace(const paddle::Tensor& like, size_t experts) {
#ifdef BMT_WITH_CUDA
  const int64_t bytes = bmt_cuda_grouped_gemm_workspace(static_cast<int64_t>(experts));
#else
  const int64_t bytes = 1;
  PD_CHECK(false, "bmt_grouped_gemm: this build has CPU kernels only (rebuild with nvcc and a GPU build of Paddle)");
#endif
  return paddle::empty({bytes}, paddle::DataType::UINT8, like.place());
}

void check_status(int st, const char* op) { PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st); }

}  // namespace

std::vector<paddle::Tensor> GroupedGemmForward(const paddle::Tensor& x, const std::vector<paddle::Tensor>& w,
                                               const std::vector<int64_t>& counts, bool trans_w) {
  const char* op = "bmt_grouped_gemm";
  const auto [k, n] = check_all(x, 1, w, counts, trans_w, op);
  auto y = paddle::empty({x.shape()[0], n}, x.dtype(), x.place());
  auto ws = workspace(x, w.size());
  int st = BMT_ERR_CUDA;
#ifdef BMT_WITH_CUDA
  const auto wp = ptrs<const void*>(w);
  st = bmt_cuda_grouped_gemm_fwd(dtype_code(x), x.data(), wp.data(), y.data(), counts.data(),
                                 static_cast<int64_t>(counts.size()), k, n, trans_w ? 1 : 0, ws.data(),
                                 reinterpret_cast<void*>(x.stream()));
#endif
  check_status(st, op);
  return {y};
}

std::vector<paddle::Tensor> GroupedGemmInputGrad(const paddle::Tensor& dy, const std::vector<paddle::Tensor>& w,
                                                 const std::vector<int64_t>& counts, bool trans_w) {
  const char* op = "bmt_grouped_gemm_dx";
  const auto [k, n] = check_all(dy, 0, w, counts, trans_w, op);
  auto dx = paddle::empty({dy.shape()[0], k}, dy.dtype(), dy.place());
  auto ws = workspace(dy, w.size());
  int st = BMT_ERR_CUDA;
#ifdef BMT_WITH_CUDA
  const auto wp = ptrs<const void*>(w);
  st = bmt_cuda_grouped_gemm_dx(dtype_code(dy), dy.data(), wp.data(), dx.data(), counts.data(),
                                static_cast<int64_t>(counts.size()), k, n, trans_w ? 1 : 0, ws.data(),
                                reinterpret_cast<void*>(dy.stream()));
#endif
  check_status(st, op);
  return {dx};
}

void GroupedGemmWeightGrad(const paddle::Tensor& x, const paddle::Tensor& dy, std::vector<paddle::Tensor>& dw,
                           const std::vector<int64_t>& counts, bool trans_w) {
  const char* op = "bmt_grouped_gemm_dw";
  const auto [k, n] = check_all(x, 1, dw, counts, trans_w, op);
  check_gpu(dy, x, op, "dy");
  PD_CHECK(dy.shape().size() == 2 && dy.shape()[0] == x.shape()[0] && dy.shape()[1] == n, op,
           ": dy must be [rows, ", n, "]");
  auto ws = workspace(x, dw.size());
  int st = BMT_ERR_CUDA;
#ifdef BMT_WITH_CUDA
  const auto dp = ptrs<void*>(dw);
  st = bmt_cuda_grouped_gemm_dw(dtype_code(x), x.data(), dy.data(), dp.data(), counts.data(),
                                static_cast<int64_t>(counts.size()), k, n, trans_w ? 1 : 0, ws.data(),
                                reinterpret_cast<void*>(x.stream()));
#endif
  check_status(st, op);
}

PD_BUILD_OP(bmt_grouped_gemm)
    .Inputs({"X", paddle::Vec("W")})
    .Outputs({"Y"})
    .Attrs({"counts: std::vector<int64_t>", "trans_w: bool"})
    .SetKernelFn(PD_KERNEL(GroupedGemmForward));

PD_BUILD_OP(bmt_grouped_gemm_dx)
    .Inputs({"DY", paddle::Vec("W")})
    .Outputs({"DX"})
    .Attrs({"counts: std::vector<int64_t>", "trans_w: bool"})
    .SetKernelFn(PD_KERNEL(GroupedGemmInputGrad));

PD_BUILD_OP(bmt_grouped_gemm_dw)
    .Inputs({"X", "DY", paddle::Vec("DW")})
    .Outputs({paddle::Vec("DWOut")})
    .Attrs({"counts: std::vector<int64_t>", "trans_w: bool"})
    .SetInplaceMap({{paddle::Vec("DW"), paddle::Vec("DWOut")}})
    .SetKernelFn(PD_KERNEL(GroupedGemmWeightGrad));
