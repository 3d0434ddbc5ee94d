// Paddle custom operator over bmt_cpu_quant_dequant_rows (kernels/cpu/quant_cpu.cc): rows r0..r1 of a
// quantised weight w [n, k] as fp32 [r1 - r0, k]. codes uint8 (the packed nibbles or the bytes of w);
// levels fp32 [2^bits]; scales fp32 (per block of the flattened weight, or per group of each row with
// row_groups). The quantised linear layer of bmtrain_cli/ops/quant_linear.py multiplies each such tile with
// Paddle's matmul and drops it; the weight is frozen (no gradient), so the op has none.
#include <vector>

#include "bmt_kernels.h"
#include "paddle/extension.h"

namespace {

void check_float(const paddle::Tensor& t, const char* op, const char* name) {
  PD_CHECK(t.is_cpu() && t.is_contiguous(), op, ": ", name, " must be contiguous on the CPU");
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT32, op, ": ", name, " must be float32");
}

}  // namespace

std::vector<paddle::Tensor> QuantDequantRows(const paddle::Tensor& codes, const paddle::Tensor& levels,
                                             const paddle::Tensor& scales, int bits, int64_t block, int row_groups,
                                             int64_t n, int64_t k, int64_t r0, int64_t r1) {
  const char* op = "bmt_quant_dequant_rows";
  PD_CHECK(codes.is_cpu() && codes.is_contiguous(), op, ": codes must be contiguous on the CPU");
  PD_CHECK(codes.dtype() == paddle::DataType::UINT8, op, ": codes must be uint8");
  PD_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8");
  const int64_t want = bits == 8 ? n * k : (n * k + 1) / 2;
  PD_CHECK(codes.numel() == want, op, ": codes hold ", codes.numel(), " bytes, the weight needs ", want);
  check_float(levels, op, "levels");
  PD_CHECK(levels.numel() == (int64_t(1) << bits), op, ": levels must hold 2^bits values");
  check_float(scales, op, "scales");
  const int64_t groups = row_groups ? n * ((k + block - 1) / block) : (n * k + block - 1) / block;
  PD_CHECK(scales.numel() == groups, op, ": scales hold ", scales.numel(), " values, the weight needs ", groups);
  PD_CHECK(0 <= r0 && r0 <= r1 && r1 <= n, op, ": rows ", r0, "..", r1, " are not within the weight's ", n);
  auto out = paddle::empty({r1 - r0, k}, paddle::DataType::FLOAT32, codes.place());
  const int st = bmt_cpu_quant_dequant_rows(codes.data<uint8_t>(), bits, levels.data<float>(), scales.data<float>(),
                                            block, row_groups, out.data<float>(), n, k, r0, r1);
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
  return {out};
}

std::vector<std::vector<int64_t>> QuantDequantRowsInferShape(const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                             const std::vector<int64_t>&, int, int64_t, int, int64_t,
                                                             int64_t k, int64_t r0, int64_t r1) {
  return {{r1 - r0, k}};
}

std::vector<paddle::DataType> QuantDequantRowsInferDtype(const paddle::DataType&, const paddle::DataType&,
                                                         const paddle::DataType&) {
  return {paddle::DataType::FLOAT32};
}

PD_BUILD_OP(bmt_quant_dequant_rows)
    .Inputs({"Codes", "Levels", "Scales"})
    .Outputs({"Out"})
    .Attrs({"bits: int", "block: int64_t", "row_groups: int", "n: int64_t", "k: int64_t", "r0: int64_t",
            "r1: int64_t"})
    .SetKernelFn(PD_KERNEL(QuantDequantRows))
    .SetInferShapeFn(PD_INFER_SHAPE(QuantDequantRowsInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(QuantDequantRowsInferDtype));
