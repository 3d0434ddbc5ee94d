// Paddle custom operator over bmt_cpu_quant_dequant_rows (kernels/cpu/quant_cpu.cc): rows r0..r1 of a
// quantised weight w [n, k] written as fp32 [r1 - r0, k], row-major, into the first (r1 - r0) * k values of
// a workspace the caller keeps and reuses for every tile (in place: no allocation, no fresh pages per
// tile). codes uint8 (the packed nibbles or the bytes of w); levels fp32 [2^bits]; scales fp32 (per block
// of the flattened weight, or per group of each row with row_groups). The quantised linear layer of
// bmtrain_cli/ops/quant_linear.py multiplies each such tile with Paddle's matmul before asking for the
// next; the weight is frozen (no gradient), so the op has none.
#include "bmt_kernels.h"
#include "paddle/extension.h"

namespace {

void check_float(const paddle::Tensor& t, const char* op, const char* name) {
  PD_CHECK(t.is_cpu() && t.is_contiguous(), op, ": ", name, " must be contiguous on the CPU");
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT32, op, ": ", name, " must be float32");
}

}  // namespace

void QuantDequantRows(const paddle::Tensor& codes, const paddle::Tensor& levels, const paddle::Tensor& scales,
                      paddle::Tensor& workspace, int bits, int64_t block, int row_groups, int64_t n, int64_t k,
                      int64_t r0, int64_t r1) {
  const char* op = "bmt_quant_dequant_rows_";
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
  check_float(workspace, op, "workspace");
  PD_CHECK(workspace.numel() >= (r1 - r0) * k, op, ": the workspace holds ", workspace.numel(),
           " values, the tile needs ", (r1 - r0) * k);
  const int st = bmt_cpu_quant_dequant_rows(codes.data<uint8_t>(), bits, levels.data<float>(), scales.data<float>(),
                                            block, row_groups, workspace.data<float>(), n, k, r0, r1);
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
}

PD_BUILD_OP(bmt_quant_dequant_rows_)
    .Inputs({"Codes", "Levels", "Scales", "Workspace"})
    .Outputs({"WorkspaceOut"})
    .Attrs({"bits: int", "block: int64_t", "row_groups: int", "n: int64_t", "k: int64_t", "r0: int64_t",
            "r1: int64_t"})
    .SetInplaceMap({{"Workspace", "WorkspaceOut"}})
    .SetKernelFn(PD_KERNEL(QuantDequantRows));
