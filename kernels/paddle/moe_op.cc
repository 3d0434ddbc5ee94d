// Paddle custom operators over bmt_cpu_moe_swiglu_fwd / _bwd (kernels/cpu/moe_cpu.cc): the routed SwiGLU
// experts of an MoE layer as one grouped GEMM on a CPU. X [rows, h] fp32, sorted by expert; Gate, Up
// (each expert's [h, f]) and Down ([f, h]) are lists with one tensor per expert; the attribute counts
// holds each expert's number of rows (they sum to rows).
//
// bmt_moe_swiglu_fwd returns Y [rows, h] and GateUp [rows, 2f] (the pre-activations, for the backward);
// bmt_moe_swiglu_bwd takes them with DY, returns DX and writes every expert's weight gradients into the
// lists DGate, DUp, DDown in place (allocated by the caller, shaped as the weights); bmt_moe_swiglu_dx
// returns DX only (frozen experts: no weight gradient is computed). Autograd is the
// PyLayer of bmtrain_cli/ops/moe_experts.py, which checks first with a clearer message.
#include <vector>

#include "bmt_kernels.h"
#include "paddle/extension.h"

namespace {

void check_f32(const paddle::Tensor& t, const char* op, const char* name, int64_t index = -1) {
  PD_CHECK(t.is_cpu() && t.is_contiguous(), op, ": ", name, index >= 0 ? " of an expert" : "",
           " must be contiguous on the CPU");
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT32, op, ": ", name, " must be float32");
}

void check_list(const std::vector<paddle::Tensor>& ws, size_t experts, int64_t rows, int64_t cols, const char* op,
                const char* name) {
  PD_CHECK(ws.size() == experts, op, ": ", ws.size(), " ", name, " weights for ", experts, " experts");
  for (size_t e = 0; e < ws.size(); ++e) {
    check_f32(ws[e], op, name, static_cast<int64_t>(e));
    PD_CHECK(ws[e].shape().size() == 2 && ws[e].shape()[0] == rows && ws[e].shape()[1] == cols, op, ": ", name,
             " weight of expert ", e, " must be [", rows, ", ", cols, "]");
  }
}

// h and f, after checking x, the three weight lists and the counts.
std::pair<int64_t, int64_t> check_all(const paddle::Tensor& x, const std::vector<paddle::Tensor>& gate,
                                      const std::vector<paddle::Tensor>& up, const std::vector<paddle::Tensor>& down,
                                      const std::vector<int64_t>& counts, const char* op) {
  check_f32(x, op, "x");
  PD_CHECK(x.shape().size() == 2, op, ": x must be [rows, hidden]");
  PD_CHECK(!gate.empty(), op, ": needs at least one expert");
  const int64_t h = x.shape()[1];
  PD_CHECK(gate[0].shape().size() == 2, op, ": the gate weights must be [hidden, inter]");
  const int64_t f = gate[0].shape()[1];
  check_list(gate, counts.size(), h, f, op, "gate");
  check_list(up, counts.size(), h, f, op, "up");
  check_list(down, counts.size(), f, h, op, "down");
  int64_t total = 0;
  for (int64_t c : counts) {
    PD_CHECK(c >= 0, op, ": negative expert count");
    total += c;
  }
  PD_CHECK(total == x.shape()[0], op, ": the expert counts sum to ", total, " but x has ", x.shape()[0], " rows");
  return {h, f};
}

std::vector<const float*> ptrs(const std::vector<paddle::Tensor>& ts) {
  std::vector<const float*> out;
  for (const auto& t : ts) out.push_back(t.data<float>());
  return out;
}

}  // namespace

std::vector<paddle::Tensor> MoeSwigluForward(const paddle::Tensor& x, const std::vector<paddle::Tensor>& gate,
                                             const std::vector<paddle::Tensor>& up,
                                             const std::vector<paddle::Tensor>& down,
                                             const std::vector<int64_t>& counts) {
  const char* op = "bmt_moe_swiglu_fwd";
  const auto [h, f] = check_all(x, gate, up, down, counts, op);
  const int64_t rows = x.shape()[0];
  auto y = paddle::empty({rows, h}, x.dtype(), x.place());
  auto gate_up = paddle::empty({rows, 2 * f}, x.dtype(), x.place());
  const auto g = ptrs(gate), u = ptrs(up), d = ptrs(down);
  const int st = bmt_cpu_moe_swiglu_fwd(x.data<float>(), counts.data(), static_cast<int64_t>(counts.size()), g.data(),
                                        u.data(), d.data(), gate_up.data<float>(), y.data<float>(), h, f);
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
  return {y, gate_up};
}

namespace {

// dx, and the weight gradients into dgate / dup / ddown when they are given (else the input gradient only)
paddle::Tensor backward(const paddle::Tensor& x, const std::vector<paddle::Tensor>& gate,
                        const std::vector<paddle::Tensor>& up, const std::vector<paddle::Tensor>& down,
                        const paddle::Tensor& gate_up, const paddle::Tensor& dy, std::vector<paddle::Tensor>* dgate,
                        std::vector<paddle::Tensor>* dup, std::vector<paddle::Tensor>* ddown,
                        const std::vector<int64_t>& counts, const char* op) {
  const auto [h, f] = check_all(x, gate, up, down, counts, op);
  const int64_t rows = x.shape()[0];
  check_f32(gate_up, op, "gate_up");
  PD_CHECK(gate_up.numel() == rows * 2 * f, op, ": gate_up must be [rows, 2 * inter]");
  check_f32(dy, op, "the output's gradient");
  PD_CHECK(dy.numel() == rows * h, op, ": dy must be [rows, hidden]");
  auto dx = paddle::empty({rows, h}, x.dtype(), x.place());
  std::vector<float*> dg, du, dd;
  if (dgate != nullptr) {
    check_list(*dgate, counts.size(), h, f, op, "dgate");
    check_list(*dup, counts.size(), h, f, op, "dup");
    check_list(*ddown, counts.size(), f, h, op, "ddown");
    for (size_t e = 0; e < counts.size(); ++e) {
      dg.push_back((*dgate)[e].data<float>());
      du.push_back((*dup)[e].data<float>());
      dd.push_back((*ddown)[e].data<float>());
    }
  }
  const auto g = ptrs(gate), u = ptrs(up), d = ptrs(down);
  const bool w = dgate != nullptr;
  const int st = bmt_cpu_moe_swiglu_bwd(x.data<float>(), counts.data(), static_cast<int64_t>(counts.size()), g.data(),
                                        u.data(), d.data(), gate_up.data<float>(), dy.data<float>(), dx.data<float>(),
                                        w ? dg.data() : nullptr, w ? du.data() : nullptr, w ? dd.data() : nullptr, h,
                                        f);
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
  return dx;
}

}  // namespace

std::vector<paddle::Tensor> MoeSwigluBackward(const paddle::Tensor& x, const std::vector<paddle::Tensor>& gate,
                                              const std::vector<paddle::Tensor>& up,
                                              const std::vector<paddle::Tensor>& down, const paddle::Tensor& gate_up,
                                              const paddle::Tensor& dy, std::vector<paddle::Tensor>& dgate,
                                              std::vector<paddle::Tensor>& dup, std::vector<paddle::Tensor>& ddown,
                                              const std::vector<int64_t>& counts) {
  return {backward(x, gate, up, down, gate_up, dy, &dgate, &dup, &ddown, counts, "bmt_moe_swiglu_bwd")};
}

std::vector<paddle::Tensor> MoeSwigluInputGrad(const paddle::Tensor& x, const std::vector<paddle::Tensor>& gate,
                                               const std::vector<paddle::Tensor>& up,
                                               const std::vector<paddle::Tensor>& down, const paddle::Tensor& gate_up,
                                               const paddle::Tensor& dy, const std::vector<int64_t>& counts) {
  return {backward(x, gate, up, down, gate_up, dy, nullptr, nullptr, nullptr, counts, "bmt_moe_swiglu_dx")};
}

PD_BUILD_OP(bmt_moe_swiglu_fwd)
    .Inputs({"X", paddle::Vec("Gate"), paddle::Vec("Up"), paddle::Vec("Down")})
    .Outputs({"Y", "GateUp"})
    .Attrs({"counts: std::vector<int64_t>"})
    .SetKernelFn(PD_KERNEL(MoeSwigluForward));

PD_BUILD_OP(bmt_moe_swiglu_bwd)
    .Inputs({"X", paddle::Vec("Gate"), paddle::Vec("Up"), paddle::Vec("Down"), "GateUp", "DY", paddle::Vec("DGate"),
             paddle::Vec("DUp"), paddle::Vec("DDown")})
    .Outputs({"DX", paddle::Vec("DGateOut"), paddle::Vec("DUpOut"), paddle::Vec("DDownOut")})
    .Attrs({"counts: std::vector<int64_t>"})
    .SetInplaceMap({{paddle::Vec("DGate"), paddle::Vec("DGateOut")},
                    {paddle::Vec("DUp"), paddle::Vec("DUpOut")},
                    {paddle::Vec("DDown"), paddle::Vec("DDownOut")}})
    .SetKernelFn(PD_KERNEL(MoeSwigluBackward));

PD_BUILD_OP(bmt_moe_swiglu_dx)
    .Inputs({"X", paddle::Vec("Gate"), paddle::Vec("Up"), paddle::Vec("Down"), "GateUp", "DY"})
    .Outputs({"DX"})
    .Attrs({"counts: std::vector<int64_t>"})
    .SetKernelFn(PD_KERNEL(MoeSwigluInputGrad));
