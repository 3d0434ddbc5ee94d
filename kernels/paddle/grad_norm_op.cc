// Paddle custom operator over bmt_cpu_sum_squares (kernels/cpu/grad_norm_cpu.cc): the sum of the squares of
// every element of a list of tensors, as a float32 tensor [1] (accumulated in double).
//
// Checks that the tensors are on the CPU, of one dtype (float32 or float64) and contiguous (PD_CHECK raises
// a Python error naming the problem). bmtrain_cli/ops/grad_norm.py calls it for the global gradient norm.
#include <vector>

#include "bmt_kernels.h"
#include "paddle/extension.h"

std::vector<paddle::Tensor> SumSquares(const std::vector<paddle::Tensor>& xs) {
  const char* op = "bmt_sum_squares";
  PD_CHECK(!xs.empty(), op, ": needs at least one tensor");
  const auto dt = xs[0].dtype();
  PD_CHECK(dt == paddle::DataType::FLOAT32 || dt == paddle::DataType::FLOAT64, op,
           ": the tensors must be float32 or float64");
  std::vector<const void*> ptrs;
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < xs.size(); ++i) {
    PD_CHECK(xs[i].is_cpu(), op, ": tensor ", i, " must be on the CPU");
    PD_CHECK(xs[i].dtype() == dt, op, ": tensor ", i, " has another dtype than tensor 0");
    PD_CHECK(xs[i].is_contiguous(), op, ": tensor ", i, " must be contiguous");
    ptrs.push_back(xs[i].data());
    sizes.push_back(xs[i].numel());
  }
  double total = 0.0;
  const int st = bmt_cpu_sum_squares(dt == paddle::DataType::FLOAT32 ? BMT_F32 : BMT_F64, ptrs.data(),
                                     sizes.data(), static_cast<int64_t>(xs.size()), &total);
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
  auto out = paddle::empty({1}, paddle::DataType::FLOAT32, paddle::CPUPlace());
  *out.data<float>() = static_cast<float>(total);
  return {out};
}

std::vector<std::vector<int64_t>> SumSquaresShape(const std::vector<std::vector<int64_t>>& shapes) {
  return {{1}};
}

std::vector<paddle::DataType> SumSquaresDtype(const std::vector<paddle::DataType>& dtypes) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(bmt_sum_squares)
    .Inputs({paddle::Vec("X")})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(SumSquares))
    .SetInferShapeFn(PD_INFER_SHAPE(SumSquaresShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SumSquaresDtype));
