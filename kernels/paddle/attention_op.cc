// Paddle custom operators over bmt_cpu_attention_fwd / _bwd (kernels/cpu/attention_cpu.cc): the fused
// causal attention core on a CPU, in the model's layout q [b, s, h, d], k/v [b, s, hk, d], with optional
// int64 segment ids [b, s].
//
// bmt_attention_fwd returns the output and the per-query log-sum-exp [b, h, s]; bmt_attention_bwd takes
// them back with the output's gradient and returns the gradients of q, k and v. Autograd is the PyLayer of
// bmtrain_cli/ops/fused_attention.py (which also keeps its own copy of the segment ids). The checks raise a
// Python error naming the op and the problem; the Python wrapper checks first with a clearer message.
//
// bmt_attention_pair_fwd / _bwd: one (query chunk, key chunk) pair of a ring attention
// (bmt_cpu_attention_pair_*): q [b, sq, h, d] over k/v [b, sk, hk, d], causal or not, with query and key
// segment ids, a sliding window (window > 0; query i sits offset positions after key 0) and a soft cap of the
// scaled scores (softcap > 0: cap * tanh(s / cap) before the mask); the backward
// takes the merged log-sum-exp and D = rowsum(dO * O) [b, h, sq]. Autograd is the ring's
// (parallel/ring_attention.py), which merges the pairs.
#include <vector>

#include "bmt_kernels.h"
#include "paddle/extension.h"

namespace {

int float_code(const paddle::Tensor& t, const char* op, const char* name) {
  PD_CHECK(t.is_cpu(), op, ": ", name, " must be on the CPU (the fused attention is a CPU kernel)");
  PD_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  if (t.dtype() == paddle::DataType::FLOAT32) return BMT_F32;
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT64, op, ": ", name, " must be float32 or float64");
  return BMT_F64;
}

void check_like(const paddle::Tensor& ref, const paddle::Tensor& t, const std::vector<int64_t>& shape,
                const char* op, const char* name) {
  float_code(t, op, name);
  PD_CHECK(t.dtype() == ref.dtype(), op, ": ", name, " must have the dtype of q");
  PD_CHECK(t.shape() == shape, op, ": ", name, " has the wrong shape");
}

struct Dims {
  int64_t b, s, h, hk, d;
};

// q [b, s, h, d], k and v [b, s, hk, d] with hk dividing h; segment ids int64 [b, s] when given.
Dims check_inputs(const paddle::Tensor& q, const paddle::Tensor& k, const paddle::Tensor& v,
                  const paddle::optional<paddle::Tensor>& seg, const char* op) {
  float_code(q, op, "q");
  PD_CHECK(q.shape().size() == 4 && k.shape().size() == 4, op, ": q and k must be [batch, seq, heads, head_dim]");
  const Dims n{q.shape()[0], q.shape()[1], q.shape()[2], k.shape()[2], q.shape()[3]};
  PD_CHECK(n.hk > 0 && n.h % n.hk == 0, op, ": the kv heads must divide the query heads");
  check_like(q, k, {n.b, n.s, n.hk, n.d}, op, "k");
  check_like(q, v, {n.b, n.s, n.hk, n.d}, op, "v");
  if (seg) {
    PD_CHECK(seg->dtype() == paddle::DataType::INT64, op, ": segment ids must be int64");
    PD_CHECK(seg->is_cpu() && seg->is_contiguous(), op, ": segment ids must be contiguous on the CPU");
    PD_CHECK(seg->shape() == std::vector<int64_t>({n.b, n.s}), op, ": segment ids must be [batch, seq]");
  }
  return n;
}

const int64_t* seg_data(const paddle::optional<paddle::Tensor>& seg) {
  return seg ? seg->data<int64_t>() : nullptr;
}

}  // namespace

std::vector<paddle::Tensor> AttentionForward(const paddle::Tensor& q, const paddle::Tensor& k,
                                             const paddle::Tensor& v, const paddle::optional<paddle::Tensor>& seg,
                                             double scale) {
  const char* op = "bmt_attention_fwd";
  const Dims n = check_inputs(q, k, v, seg, op);
  auto out = paddle::empty(q.shape(), q.dtype(), q.place());
  auto lse = paddle::empty({n.b, n.h, n.s}, q.dtype(), q.place());
  const int st = bmt_cpu_attention_fwd(float_code(q, op, "q"), q.data(), k.data(), v.data(), seg_data(seg),
                                       out.data(), lse.data(), n.b, n.s, n.h, n.hk, n.d, scale);
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
  return {out, lse};
}

std::vector<paddle::Tensor> AttentionBackward(const paddle::Tensor& q, const paddle::Tensor& k,
                                              const paddle::Tensor& v, const paddle::optional<paddle::Tensor>& seg,
                                              const paddle::Tensor& out, const paddle::Tensor& lse,
                                              const paddle::Tensor& dout, double scale) {
  const char* op = "bmt_attention_bwd";
  const Dims n = check_inputs(q, k, v, seg, op);
  check_like(q, out, q.shape(), op, "out");
  check_like(q, dout, q.shape(), op, "the output's gradient");
  check_like(q, lse, {n.b, n.h, n.s}, op, "lse");
  auto dq = paddle::empty(q.shape(), q.dtype(), q.place());
  auto dk = paddle::empty(k.shape(), k.dtype(), k.place());
  auto dv = paddle::empty(v.shape(), v.dtype(), v.place());
  const int st = bmt_cpu_attention_bwd(float_code(q, op, "q"), q.data(), k.data(), v.data(), seg_data(seg),
                                       out.data(), lse.data(), dout.data(), dq.data(), dk.data(), dv.data(), n.b,
                                       n.s, n.h, n.hk, n.d, scale);
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
  return {dq, dk, dv};
}

std::vector<std::vector<int64_t>> AttentionInferShape(const std::vector<int64_t>& q, const std::vector<int64_t>&,
                                                      const std::vector<int64_t>&,
                                                      const paddle::optional<std::vector<int64_t>>&) {
  return {q, {q[0], q[2], q[1]}};
}

std::vector<paddle::DataType> AttentionInferDtype(const paddle::DataType& q, const paddle::DataType&,
                                                  const paddle::DataType&,
                                                  const paddle::optional<paddle::DataType>&) {
  return {q, q};
}

PD_BUILD_OP(bmt_attention_fwd)
    .Inputs({"Q", "K", "V", paddle::Optional("Seg")})
    .Outputs({"Out", "Lse"})
    .Attrs({"scale: double"})
    .SetKernelFn(PD_KERNEL(AttentionForward))
    .SetInferShapeFn(PD_INFER_SHAPE(AttentionInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(AttentionInferDtype));

std::vector<std::vector<int64_t>> AttentionGradInferShape(
    const std::vector<int64_t>& q, const std::vector<int64_t>& k, const std::vector<int64_t>& v,
    const paddle::optional<std::vector<int64_t>>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&) {
  return {q, k, v};
}

std::vector<paddle::DataType> AttentionGradInferDtype(const paddle::DataType& q, const paddle::DataType&,
                                                      const paddle::DataType&,
                                                      const paddle::optional<paddle::DataType>&,
                                                      const paddle::DataType&, const paddle::DataType&,
                                                      const paddle::DataType&) {
  return {q, q, q};
}

PD_BUILD_OP(bmt_attention_bwd)
    .Inputs({"Q", "K", "V", paddle::Optional("Seg"), "Out", "Lse", "DOut"})
    .Outputs({"DQ", "DK", "DV"})
    .Attrs({"scale: double"})
    .SetKernelFn(PD_KERNEL(AttentionBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(AttentionGradInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(AttentionGradInferDtype));

namespace {

struct PairDims {
  int64_t b, sq, sk, h, hk, d;
};

// q [b, sq, h, d], k and v [b, sk, hk, d]; segment ids int64 [b, sq] and [b, sk], both or neither.
PairDims check_pair(const paddle::Tensor& q, const paddle::Tensor& k, const paddle::Tensor& v,
                    const paddle::optional<paddle::Tensor>& qseg, const paddle::optional<paddle::Tensor>& kseg,
                    bool causal, int64_t window, double softcap, const char* op) {
  float_code(q, op, "q");
  PD_CHECK(q.shape().size() == 4 && k.shape().size() == 4, op, ": q and k must be [batch, seq, heads, head_dim]");
  const PairDims n{q.shape()[0], q.shape()[1], k.shape()[1], q.shape()[2], k.shape()[2], q.shape()[3]};
  PD_CHECK(n.hk > 0 && n.h % n.hk == 0, op, ": the kv heads must divide the query heads");
  PD_CHECK(!causal || n.sq == n.sk, op, ": a causal pair needs as many queries as keys");
  PD_CHECK(window >= 0, op, ": the window must be positive (0: none)");
  PD_CHECK(softcap >= 0, op, ": the soft cap must be positive (0: none)");
  check_like(q, k, {n.b, n.sk, n.hk, n.d}, op, "k");
  check_like(q, v, {n.b, n.sk, n.hk, n.d}, op, "v");
  PD_CHECK(bool(qseg) == bool(kseg), op, ": give both query and key segment ids or neither");
  if (qseg) {
    for (const auto* s : {&*qseg, &*kseg}) {
      PD_CHECK(s->dtype() == paddle::DataType::INT64, op, ": segment ids must be int64");
      PD_CHECK(s->is_cpu() && s->is_contiguous(), op, ": segment ids must be contiguous on the CPU");
    }
    PD_CHECK(qseg->shape() == std::vector<int64_t>({n.b, n.sq}), op, ": query segment ids must be [batch, q_len]");
    PD_CHECK(kseg->shape() == std::vector<int64_t>({n.b, n.sk}), op, ": key segment ids must be [batch, k_len]");
  }
  return n;
}

}  // namespace

std::vector<paddle::Tensor> AttentionPairForward(const paddle::Tensor& q, const paddle::Tensor& k,
                                                 const paddle::Tensor& v, const paddle::optional<paddle::Tensor>& qseg,
                                                 const paddle::optional<paddle::Tensor>& kseg, bool causal,
                                                 double scale, int64_t window, int64_t offset, double softcap) {
  const char* op = "bmt_attention_pair_fwd";
  const PairDims n = check_pair(q, k, v, qseg, kseg, causal, window, softcap, op);
  auto out = paddle::empty(q.shape(), q.dtype(), q.place());
  auto lse = paddle::empty({n.b, n.h, n.sq}, q.dtype(), q.place());
  const int st = bmt_cpu_attention_pair_fwd(float_code(q, op, "q"), q.data(), k.data(), v.data(), seg_data(qseg),
                                            seg_data(kseg), causal ? 1 : 0, window, offset, softcap, out.data(), lse.data(),
                                            n.b, n.sq, n.sk, n.h, n.hk, n.d, scale);
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
  return {out, lse};
}

std::vector<paddle::Tensor> AttentionPairBackward(const paddle::Tensor& q, const paddle::Tensor& k,
                                                  const paddle::Tensor& v, const paddle::optional<paddle::Tensor>& qseg,
                                                  const paddle::optional<paddle::Tensor>& kseg,
                                                  const paddle::Tensor& lse, const paddle::Tensor& delta,
                                                  const paddle::Tensor& dout, bool causal, double scale,
                                                  int64_t window, int64_t offset, double softcap) {
  const char* op = "bmt_attention_pair_bwd";
  const PairDims n = check_pair(q, k, v, qseg, kseg, causal, window, softcap, op);
  check_like(q, lse, {n.b, n.h, n.sq}, op, "lse");
  check_like(q, delta, {n.b, n.h, n.sq}, op, "delta");
  check_like(q, dout, q.shape(), op, "the output's gradient");
  auto dq = paddle::empty(q.shape(), q.dtype(), q.place());
  auto dk = paddle::empty(k.shape(), k.dtype(), k.place());
  auto dv = paddle::empty(v.shape(), v.dtype(), v.place());
  const int st = bmt_cpu_attention_pair_bwd(float_code(q, op, "q"), q.data(), k.data(), v.data(), seg_data(qseg),
                                            seg_data(kseg), causal ? 1 : 0, window, offset, softcap, lse.data(), delta.data(),
                                            dout.data(), dq.data(), dk.data(), dv.data(), n.b, n.sq, n.sk, n.h, n.hk,
                                            n.d, scale);
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
  return {dq, dk, dv};
}

std::vector<std::vector<int64_t>> AttentionPairInferShape(const std::vector<int64_t>& q,
                                                          const std::vector<int64_t>&,
                                                          const std::vector<int64_t>&,
                                                          const paddle::optional<std::vector<int64_t>>&,
                                                          const paddle::optional<std::vector<int64_t>>&) {
  return {q, {q[0], q[2], q[1]}};
}

std::vector<paddle::DataType> AttentionPairInferDtype(const paddle::DataType& q, const paddle::DataType&,
                                                      const paddle::DataType&,
                                                      const paddle::optional<paddle::DataType>&,
                                                      const paddle::optional<paddle::DataType>&) {
  return {q, q};
}

PD_BUILD_OP(bmt_attention_pair_fwd)
    .Inputs({"Q", "K", "V", paddle::Optional("QSeg"), paddle::Optional("KSeg")})
    .Outputs({"Out", "Lse"})
    .Attrs({"causal: bool", "scale: double", "window: int64_t", "offset: int64_t", "softcap: double"})
    .SetKernelFn(PD_KERNEL(AttentionPairForward))
    .SetInferShapeFn(PD_INFER_SHAPE(AttentionPairInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(AttentionPairInferDtype));

std::vector<std::vector<int64_t>> AttentionPairGradInferShape(
    const std::vector<int64_t>& q, const std::vector<int64_t>& k, const std::vector<int64_t>& v,
    const paddle::optional<std::vector<int64_t>>&, const paddle::optional<std::vector<int64_t>>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&) {
  return {q, k, v};
}

std::vector<paddle::DataType> AttentionPairGradInferDtype(
    const paddle::DataType& q, const paddle::DataType&, const paddle::DataType&,
    const paddle::optional<paddle::DataType>&, const paddle::optional<paddle::DataType>&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&) {
  return {q, q, q};
}

PD_BUILD_OP(bmt_attention_pair_bwd)
    .Inputs({"Q", "K", "V", paddle::Optional("QSeg"), paddle::Optional("KSeg"), "Lse", "Delta", "DOut"})
    .Outputs({"DQ", "DK", "DV"})
    .Attrs({"causal: bool", "scale: double", "window: int64_t", "offset: int64_t", "softcap: double"})
    .SetKernelFn(PD_KERNEL(AttentionPairBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(AttentionPairGradInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(AttentionPairGradInferDtype));
