// Paddle custom operator over bmt_cpu_quant_dequant_rows (kernels/cpu/quant_cpu.cc): rows r0..r1 of a
// quantised weight w [n, k] written as fp32 [r1 - r0, k], row-major, into the first (r1 - r0) * k values of
// a workspace the caller keeps and reuses for every tile (in place: no allocation, no fresh pages per
// tile). codes uint8 (the packed nibbles or the bytes of w); levels fp32 [2^bits]; scales fp32 (per block
// of the flattened weight, or per group of each row with row_groups). The quantised linear layer of
// bmtrain_cli/ops/quant_linear.py multiplies each such tile with Paddle's matmul before asking for the
// next; the weight is frozen (no gradient), so the op has none.
#include <vector>

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

// The routed experts of an MoE layer with a quantised base (bmt_cpu_quant_grouped_fwd / _dx): X [rows, k]
// fp32 sorted by expert (the attribute counts: each expert's rows), Codes and Scales one tensor per expert
// (the layout of bmt_quant_dequant_rows_, every expert's weight [n, k] alike), Levels shared.
// bmt_quant_grouped_fwd returns Y [rows, n] = X_e W_e^T; bmt_quant_grouped_dx takes DY [rows, n] and
// returns DX [rows, k] = DY_e W_e (the weights are frozen: no weight gradient). Autograd is the PyLayer of
// bmtrain_cli/ops/quant_experts.py.
namespace {

struct GroupedArgs {
  std::vector<const uint8_t*> codes;
  std::vector<const float*> scales;
};

GroupedArgs check_grouped(const paddle::Tensor& x, int64_t width, const std::vector<paddle::Tensor>& codes,
                          const std::vector<paddle::Tensor>& scales, const paddle::Tensor& levels,
                          const std::vector<int64_t>& counts, int bits, int64_t block, int row_groups, int64_t n,
                          int64_t k, const char* op) {
  check_float(x, op, "x");
  PD_CHECK(x.shape().size() == 2 && x.shape()[1] == width, op, ": x must be [rows, ", width, "]");
  PD_CHECK(bits == 4 || bits == 8, op, ": bits must be 4 or 8");
  PD_CHECK(n > 0 && k > 0 && block > 0, op, ": the weights must be non-empty with a positive block");
  check_float(levels, op, "levels");
  PD_CHECK(levels.numel() == (int64_t(1) << bits), op, ": levels must hold 2^bits values");
  PD_CHECK(codes.size() == counts.size() && scales.size() == counts.size(), op, ": ", codes.size(), " codes and ",
           scales.size(), " scales for ", counts.size(), " experts");
  const int64_t want = bits == 8 ? n * k : (n * k + 1) / 2;
  const int64_t groups = row_groups ? n * ((k + block - 1) / block) : (n * k + block - 1) / block;
  GroupedArgs out;
  int64_t total = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    PD_CHECK(codes[e].is_cpu() && codes[e].is_contiguous() && codes[e].dtype() == paddle::DataType::UINT8, op,
             ": the codes of expert ", e, " must be contiguous uint8 on the CPU");
    PD_CHECK(codes[e].numel() == want, op, ": the codes of expert ", e, " hold ", codes[e].numel(), " bytes, not ",
             want);
    check_float(scales[e], op, "scales");
    PD_CHECK(scales[e].numel() == groups, op, ": the scales of expert ", e, " hold ", scales[e].numel(),
             " values, not ", groups);
    PD_CHECK(counts[e] >= 0, op, ": negative expert count");
    total += counts[e];
    out.codes.push_back(codes[e].data<uint8_t>());
    out.scales.push_back(scales[e].data<float>());
  }
  PD_CHECK(total == x.shape()[0], op, ": the expert counts sum to ", total, " but x has ", x.shape()[0], " rows");
  return out;
}

}  // namespace

std::vector<paddle::Tensor> QuantGroupedForward(const paddle::Tensor& x, const std::vector<paddle::Tensor>& codes,
                                                const std::vector<paddle::Tensor>& scales,
                                                const paddle::Tensor& levels, const std::vector<int64_t>& counts,
                                                int bits, int64_t block, int row_groups, int64_t n, int64_t k) {
  const char* op = "bmt_quant_grouped_fwd";
  const GroupedArgs a = check_grouped(x, k, codes, scales, levels, counts, bits, block, row_groups, n, k, op);
  auto y = paddle::empty({x.shape()[0], n}, x.dtype(), x.place());
  const int st =
      bmt_cpu_quant_grouped_fwd(x.data<float>(), counts.data(), static_cast<int64_t>(counts.size()), a.codes.data(),
                                a.scales.data(), levels.data<float>(), bits, block, row_groups, n, k, y.data<float>());
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
  return {y};
}

std::vector<paddle::Tensor> QuantGroupedInputGrad(const paddle::Tensor& dy, const std::vector<paddle::Tensor>& codes,
                                                  const std::vector<paddle::Tensor>& scales,
                                                  const paddle::Tensor& levels, const std::vector<int64_t>& counts,
                                                  int bits, int64_t block, int row_groups, int64_t n, int64_t k) {
  const char* op = "bmt_quant_grouped_dx";
  const GroupedArgs a = check_grouped(dy, n, codes, scales, levels, counts, bits, block, row_groups, n, k, op);
  auto dx = paddle::empty({dy.shape()[0], k}, dy.dtype(), dy.place());
  const int st =
      bmt_cpu_quant_grouped_dx(dy.data<float>(), counts.data(), static_cast<int64_t>(counts.size()), a.codes.data(),
                               a.scales.data(), levels.data<float>(), bits, block, row_groups, n, k, dx.data<float>());
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
  return {dx};
}

PD_BUILD_OP(bmt_quant_grouped_fwd)
    .Inputs({"X", paddle::Vec("Codes"), paddle::Vec("Scales"), "Levels"})
    .Outputs({"Y"})
    .Attrs({"counts: std::vector<int64_t>", "bits: int", "block: int64_t", "row_groups: int", "n: int64_t",
            "k: int64_t"})
    .SetKernelFn(PD_KERNEL(QuantGroupedForward));

PD_BUILD_OP(bmt_quant_grouped_dx)
    .Inputs({"DY", paddle::Vec("Codes"), paddle::Vec("Scales"), "Levels"})
    .Outputs({"DX"})
    .Attrs({"counts: std::vector<int64_t>", "bits: int", "block: int64_t", "row_groups: int", "n: int64_t",
            "k: int64_t"})
    .SetKernelFn(PD_KERNEL(QuantGroupedInputGrad));
