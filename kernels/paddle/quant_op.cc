// Paddle custom operators over bmt_cpu_quant_linear_fwd / _bwd (kernels/cpu/quant_cpu.cc): the quantised
// linear layer on a CPU. x [..., k] fp32; codes uint8 (the packed nibbles or the bytes of the weight
// w [n, k]); levels fp32 [2^bits]; scales fp32 (see bmt_kernels.h for their layout).
//
// bmt_quant_linear_fwd returns y [..., n] = x @ w^T; bmt_quant_linear_bwd takes dy [..., n] and returns
// dx [..., k] = dy @ w. The weight is frozen (no gradient). Autograd is the PyLayer of
// bmtrain_cli/ops/quant_linear.py, which checks first with a clearer message.
#include <vector>

#include "bmt_kernels.h"
#include "paddle/extension.h"

namespace {

void check_float(const paddle::Tensor& t, const char* op, const char* name) {
  PD_CHECK(t.is_cpu() && t.is_contiguous(), op, ": ", name, " must be contiguous on the CPU");
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT32, op, ": ", name, " must be float32");
}

void check_weight(const paddle::Tensor& codes, const paddle::Tensor& levels, const paddle::Tensor& scales,
                  int bits, int64_t n, int64_t k, const char* op) {
  PD_CHECK(codes.is_cpu() && codes.is_contiguous(), op, ": codes must be contiguous on the CPU");
  PD_CHECK(codes.dtype() == paddle::DataType::UINT8, op, ": codes must be uint8");
  PD_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8");
  const int64_t want = bits == 8 ? n * k : (n * k + 1) / 2;
  PD_CHECK(codes.numel() == want, op, ": codes hold ", codes.numel(), " bytes, the weight needs ", want);
  check_float(levels, op, "levels");
  PD_CHECK(levels.numel() == (int64_t(1) << bits), op, ": levels must hold 2^bits values");
  check_float(scales, op, "scales");
}

int64_t rows_of(const paddle::Tensor& x, int64_t width) {
  return width == 0 ? 0 : x.numel() / width;
}

std::vector<int64_t> with_last(std::vector<int64_t> shape, int64_t last) {
  shape.back() = last;
  return shape;
}

}  // namespace

std::vector<paddle::Tensor> QuantLinearForward(const paddle::Tensor& x, const paddle::Tensor& codes,
                                               const paddle::Tensor& levels, const paddle::Tensor& scales,
                                               int bits, int64_t block, int row_groups, int64_t out_features) {
  const char* op = "bmt_quant_linear_fwd";
  check_float(x, op, "x");
  PD_CHECK(!x.shape().empty(), op, ": x must have a last (input) dimension");
  const int64_t k = x.shape().back();
  check_weight(codes, levels, scales, bits, out_features, k, op);
  auto y = paddle::empty(with_last(x.shape(), out_features), x.dtype(), x.place());
  const int st = bmt_cpu_quant_linear_fwd(codes.data<uint8_t>(), bits, levels.data<float>(), scales.data<float>(),
                                          block, row_groups, x.data<float>(), y.data<float>(), rows_of(x, k),
                                          out_features, k);
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
  return {y};
}

std::vector<paddle::Tensor> QuantLinearBackward(const paddle::Tensor& dy, const paddle::Tensor& codes,
                                                const paddle::Tensor& levels, const paddle::Tensor& scales,
                                                int bits, int64_t block, int row_groups, int64_t in_features) {
  const char* op = "bmt_quant_linear_bwd";
  check_float(dy, op, "the output's gradient");
  PD_CHECK(!dy.shape().empty(), op, ": dy must have a last (output) dimension");
  const int64_t n = dy.shape().back();
  check_weight(codes, levels, scales, bits, n, in_features, op);
  auto dx = paddle::empty(with_last(dy.shape(), in_features), dy.dtype(), dy.place());
  const int st = bmt_cpu_quant_linear_bwd(codes.data<uint8_t>(), bits, levels.data<float>(), scales.data<float>(),
                                          block, row_groups, dy.data<float>(), dx.data<float>(), rows_of(dy, n), n,
                                          in_features);
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
  return {dx};
}

std::vector<std::vector<int64_t>> QuantLinearInferShape(const std::vector<int64_t>& x, const std::vector<int64_t>&,
                                                        const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                        int, int64_t, int, int64_t features) {
  return {with_last(x, features)};
}

std::vector<paddle::DataType> QuantLinearInferDtype(const paddle::DataType& x, const paddle::DataType&,
                                                    const paddle::DataType&, const paddle::DataType&) {
  return {x};
}

PD_BUILD_OP(bmt_quant_linear_fwd)
    .Inputs({"X", "Codes", "Levels", "Scales"})
    .Outputs({"Y"})
    .Attrs({"bits: int", "block: int64_t", "row_groups: int", "out_features: int64_t"})
    .SetKernelFn(PD_KERNEL(QuantLinearForward))
    .SetInferShapeFn(PD_INFER_SHAPE(QuantLinearInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(QuantLinearInferDtype));

PD_BUILD_OP(bmt_quant_linear_bwd)
    .Inputs({"DY", "Codes", "Levels", "Scales"})
    .Outputs({"DX"})
    .Attrs({"bits: int", "block: int64_t", "row_groups: int", "in_features: int64_t"})
    .SetKernelFn(PD_KERNEL(QuantLinearBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(QuantLinearInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(QuantLinearInferDtype));
