// Paddle custom operators over bmt_cpu_delta_rule_fwd / _bwd (kernels/cpu/delta_rule_cpu.cc): the gated
// delta rule of Gated DeltaNet on a CPU, from a zero state, in the model's layout q, k [b, s, h, dk],
// v [b, s, h, dv], g and beta [b, s, h] (float32 or float64, one dtype).
//
// bmt_delta_rule_fwd returns the output [b, s, h, dv], the states before each chunk [b, h, chunks, dk, dv]
// (for the backward) and the final state [b, h, dk, dv]; bmt_delta_rule_bwd takes the inputs, the saved
// states, the output's and the final state's gradients and returns the gradients of q, k, v, g and beta.
// Autograd is the PyLayer of bmtrain_cli/ops/delta_rule.py, which checks first with a clearer message.
#include <vector>

#include "bmt_kernels.h"
#include "paddle/extension.h"

namespace {

int float_code(const paddle::Tensor& t, const char* op, const char* name) {
  PD_CHECK(t.is_cpu() && t.is_contiguous(), op, ": ", name, " must be contiguous on the CPU");
  if (t.dtype() == paddle::DataType::FLOAT32) return BMT_F32;
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT64, op, ": ", name, " must be float32 or float64");
  return BMT_F64;
}

void check(const paddle::Tensor& q, const paddle::Tensor& t, const std::vector<int64_t>& shape, const char* op,
           const char* name) {
  float_code(t, op, name);
  PD_CHECK(t.dtype() == q.dtype(), op, ": ", name, " must have the dtype of q");
  PD_CHECK(t.shape() == shape, op, ": ", name, " has the wrong shape");
}

struct Dims {
  int64_t b, s, h, dk, dv, chunks;
};

Dims check_inputs(const paddle::Tensor& q, const paddle::Tensor& k, const paddle::Tensor& v, const paddle::Tensor& g,
                  const paddle::Tensor& beta, int64_t chunk, const char* op) {
  float_code(q, op, "q");
  PD_CHECK(q.shape().size() == 4 && v.shape().size() == 4, op, ": q and v must be [batch, seq, heads, dim]");
  PD_CHECK(chunk > 0, op, ": chunk must be positive");
  const auto& s = q.shape();
  const Dims d{s[0], s[1], s[2], s[3], v.shape()[3], (s[1] + chunk - 1) / chunk};
  check(q, k, s, op, "k");
  check(q, v, {d.b, d.s, d.h, d.dv}, op, "v");
  check(q, g, {d.b, d.s, d.h}, op, "g");
  check(q, beta, {d.b, d.s, d.h}, op, "beta");
  return d;
}

}  // namespace

std::vector<paddle::Tensor> DeltaRuleForward(const paddle::Tensor& q, const paddle::Tensor& k, const paddle::Tensor& v,
                                             const paddle::Tensor& g, const paddle::Tensor& beta, int64_t chunk) {
  const char* op = "bmt_delta_rule_fwd";
  const Dims d = check_inputs(q, k, v, g, beta, chunk, op);
  auto out = paddle::empty({d.b, d.s, d.h, d.dv}, q.dtype(), q.place());
  auto states = paddle::empty({d.b, d.h, d.chunks, d.dk, d.dv}, q.dtype(), q.place());
  auto final_state = paddle::empty({d.b, d.h, d.dk, d.dv}, q.dtype(), q.place());
  const int st = bmt_cpu_delta_rule_fwd(float_code(q, op, "q"), q.data(), k.data(), v.data(), g.data(), beta.data(),
                                        out.data(), states.data(), final_state.data(), d.b, d.s, d.h, d.dk, d.dv,
                                        chunk);
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
  return {out, states, final_state};
}

std::vector<paddle::Tensor> DeltaRuleBackward(const paddle::Tensor& q, const paddle::Tensor& k,
                                              const paddle::Tensor& v, const paddle::Tensor& g,
                                              const paddle::Tensor& beta, const paddle::Tensor& states,
                                              const paddle::Tensor& dout, const paddle::Tensor& dfinal,
                                              int64_t chunk) {
  const char* op = "bmt_delta_rule_bwd";
  const Dims d = check_inputs(q, k, v, g, beta, chunk, op);
  check(q, states, {d.b, d.h, d.chunks, d.dk, d.dv}, op, "states");
  check(q, dout, {d.b, d.s, d.h, d.dv}, op, "the output's gradient");
  check(q, dfinal, {d.b, d.h, d.dk, d.dv}, op, "the final state's gradient");
  auto dq = paddle::empty(q.shape(), q.dtype(), q.place());
  auto dk = paddle::empty(k.shape(), q.dtype(), q.place());
  auto dv = paddle::empty(v.shape(), q.dtype(), q.place());
  auto dg = paddle::empty(g.shape(), q.dtype(), q.place());
  auto dbeta = paddle::empty(beta.shape(), q.dtype(), q.place());
  const int st = bmt_cpu_delta_rule_bwd(float_code(q, op, "q"), q.data(), k.data(), v.data(), g.data(), beta.data(),
                                        states.data(), dout.data(), dfinal.data(), dq.data(), dk.data(), dv.data(),
                                        dg.data(), dbeta.data(), d.b, d.s, d.h, d.dk, d.dv, chunk);
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
  return {dq, dk, dv, dg, dbeta};
}

std::vector<std::vector<int64_t>> DeltaRuleForwardShape(const std::vector<int64_t>& q, const std::vector<int64_t>&,
                                                        const std::vector<int64_t>& v, const std::vector<int64_t>&,
                                                        const std::vector<int64_t>&, int64_t chunk) {
  const int64_t chunks = q[1] < 0 ? -1 : (q[1] + chunk - 1) / chunk;
  return {{q[0], q[1], q[2], v[3]}, {q[0], q[2], chunks, q[3], v[3]}, {q[0], q[2], q[3], v[3]}};
}

std::vector<std::vector<int64_t>> DeltaRuleBackwardShape(const std::vector<int64_t>& q, const std::vector<int64_t>& k,
                                                         const std::vector<int64_t>& v, const std::vector<int64_t>& g,
                                                         const std::vector<int64_t>& beta, const std::vector<int64_t>&,
                                                         const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                         int64_t) {
  return {q, k, v, g, beta};
}

std::vector<paddle::DataType> DeltaRuleForwardDtype(const paddle::DataType& q, const paddle::DataType&,
                                                    const paddle::DataType&, const paddle::DataType&,
                                                    const paddle::DataType&) {
  return {q, q, q};
}

std::vector<paddle::DataType> DeltaRuleBackwardDtype(const paddle::DataType& q, const paddle::DataType&,
                                                     const paddle::DataType&, const paddle::DataType&,
                                                     const paddle::DataType&, const paddle::DataType&,
                                                     const paddle::DataType&, const paddle::DataType&) {
  return {q, q, q, q, q};
}

PD_BUILD_OP(bmt_delta_rule_fwd)
    .Inputs({"Q", "K", "V", "G", "Beta"})
    .Outputs({"Out", "States", "FinalState"})
    .Attrs({"chunk: int64_t"})
    .SetKernelFn(PD_KERNEL(DeltaRuleForward))
    .SetInferShapeFn(PD_INFER_SHAPE(DeltaRuleForwardShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(DeltaRuleForwardDtype));

PD_BUILD_OP(bmt_delta_rule_bwd)
    .Inputs({"Q", "K", "V", "G", "Beta", "States", "DOut", "DFinal"})
    .Outputs({"DQ", "DK", "DV", "DG", "DBeta"})
    .Attrs({"chunk: int64_t"})
    .SetKernelFn(PD_KERNEL(DeltaRuleBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(DeltaRuleBackwardShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(DeltaRuleBackwardDtype));
