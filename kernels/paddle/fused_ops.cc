// Paddle custom operators over the C ABI launchers of kernels/include/bmt_kernels.h.
//
// Each op checks shapes, dtypes and contiguity (PD_CHECK raises a Python error naming the op and the
// problem), allocates its outputs and calls the CPU launcher, or the CUDA launcher when the extension is
// built with BMT_WITH_CUDA (a GPU build of Paddle plus nvcc). Autograd: rms_norm, rotary and swiglu have
// grad ops; softmax_xent returns the logits gradient directly (the chunked linear+cross-entropy in
// bmtrain_cli/ops/custom.py drives it from a PyLayer).
#include <string>
#include <vector>

#include "bmt_kernels.h"
#include "paddle/extension.h"
#include "op_dtype.h"

namespace {

void check_float(const paddle::Tensor& t, const char* op, const char* name) {
  const int code = dtype_code(t);
  PD_CHECK(code >= 0, op, ": ", name, " must be a floating tensor");
  if (t.is_cpu()) {
    PD_CHECK(code == BMT_F32 || code == BMT_F64, op, ": ", name,
             " on CPU must be float32 or float64 (fp16/bf16 kernels are GPU only)");
  } else {
    PD_CHECK(code != BMT_F64, op, ": ", name, " on GPU must be float32, float16 or bfloat16");
  }
  PD_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (call .contiguous() first)");
}

void check_same(const paddle::Tensor& a, const paddle::Tensor& b, const char* op, const char* name) {
  PD_CHECK(a.dtype() == b.dtype(), op, ": ", name, " must have the dtype of the first input");
  PD_CHECK(a.place() == b.place(), op, ": ", name, " must be on the device of the first input");
  PD_CHECK(b.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_status(int status, const char* op) {
  PD_CHECK(status != BMT_ERR_LABEL, op, ": a label is outside [0, vocab) and is not the ignore index");
  PD_CHECK(status == BMT_OK, op, ": kernel failed with status ", status);
}

bool on_gpu(const paddle::Tensor& t) {
  if (t.is_cpu()) return false;
#ifdef BMT_WITH_CUDA
  PD_CHECK(t.is_gpu(), "bmt ops: unsupported place");
  return true;
#else
  PD_CHECK(false, "bmt ops: this build has CPU kernels only (rebuild with nvcc and a GPU build of Paddle)");
  return false;
#endif
}

#ifdef BMT_WITH_CUDA
void* stream_of(const paddle::Tensor& t) { return reinterpret_cast<void*>(t.stream()); }
#endif

int64_t last_dim(const paddle::Tensor& t) { return t.shape().empty() ? 1 : t.shape().back(); }

}  // namespace

// ------------------------------------------------------------------ RMSNorm
std::vector<paddle::Tensor> RmsNormForward(const paddle::Tensor& x, const paddle::Tensor& w, float eps) {
  const char* op = "bmt_rms_norm";
  check_float(x, op, "x");
  check_same(x, w, op, "weight");
  PD_CHECK(x.shape().size() >= 1, op, ": x must have at least one dimension");
  const int64_t cols = last_dim(x);
  PD_CHECK(w.shape().size() == 1 && w.shape()[0] == cols, op, ": weight must have shape [", cols, "]");
  const int64_t rows = cols > 0 ? x.numel() / cols : 0;
  const std::vector<int64_t> xshape = x.shape();
  auto y = paddle::empty(xshape, x.dtype(), x.place());
  std::vector<int64_t> rshape(xshape.begin(), xshape.end() - 1);
  auto rstd = paddle::empty(rshape, paddle::DataType::FLOAT32, x.place());
  int st = BMT_ERR_CUDA;
  if (on_gpu(x)) {
#ifdef BMT_WITH_CUDA
    st = bmt_cuda_rms_norm_fwd(dtype_code(x), x.data(), w.data(), y.data(), rstd.data<float>(), rows, cols, eps,
                               stream_of(x));
#endif
  } else {
    st = bmt_cpu_rms_norm_fwd(dtype_code(x), x.data(), w.data(), y.data(), rstd.data<float>(), rows, cols, eps);
  }
  check_status(st, op);
  return {y, rstd};
}

std::vector<paddle::Tensor> RmsNormBackward(const paddle::Tensor& x, const paddle::Tensor& w,
                                            const paddle::Tensor& rstd, const paddle::Tensor& dy) {
  const char* op = "bmt_rms_norm_grad";
  check_same(x, dy, op, "grad");
  const int64_t cols = last_dim(x);
  const int64_t rows = cols > 0 ? x.numel() / cols : 0;
  auto dx = paddle::empty(x.shape(), x.dtype(), x.place());
  auto dw = paddle::empty(w.shape(), w.dtype(), w.place());
  int st = BMT_ERR_CUDA;
  if (on_gpu(x)) {
#ifdef BMT_WITH_CUDA
    auto ws = paddle::empty({bmt_cuda_rms_norm_bwd_workspace(rows, cols)}, paddle::DataType::UINT8, x.place());
    st = bmt_cuda_rms_norm_bwd(dtype_code(x), dy.data(), x.data(), w.data(), rstd.data<float>(), dx.data(),
                               dw.data(), ws.data(), rows, cols, stream_of(x));
#endif
  } else {
    st = bmt_cpu_rms_norm_bwd(dtype_code(x), dy.data(), x.data(), w.data(), rstd.data<float>(), dx.data(),
                              dw.data(), rows, cols);
  }
  check_status(st, op);
  return {dx, dw};
}

std::vector<std::vector<int64_t>> RmsNormInferShape(const std::vector<int64_t>& x, const std::vector<int64_t>&) {
  return {x, std::vector<int64_t>(x.begin(), x.end() - 1)};
}

std::vector<paddle::DataType> RmsNormInferDtype(const paddle::DataType& x, const paddle::DataType&) {
  return {x, paddle::DataType::FLOAT32};
}

PD_BUILD_OP(bmt_rms_norm)
    .Inputs({"X", "W"})
    .Outputs({"Y", "Rstd"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(RmsNormForward))
    .SetInferShapeFn(PD_INFER_SHAPE(RmsNormInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RmsNormInferDtype));

// Grad ops with several inputs or outputs need their own infer functions, or paddle.jit.to_static cannot
// build the backward program (dygraph does not need them).
std::vector<std::vector<int64_t>> RmsNormGradInferShape(const std::vector<int64_t>& x, const std::vector<int64_t>& w,
                                                        const std::vector<int64_t>&, const std::vector<int64_t>&) {
  return {x, w};
}

std::vector<paddle::DataType> RmsNormGradInferDtype(const paddle::DataType& x, const paddle::DataType& w,
                                                    const paddle::DataType&, const paddle::DataType&) {
  return {x, w};
}

PD_BUILD_GRAD_OP(bmt_rms_norm)
    .Inputs({"X", "W", "Rstd", paddle::Grad("Y")})
    .Outputs({paddle::Grad("X"), paddle::Grad("W")})
    .SetKernelFn(PD_KERNEL(RmsNormBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(RmsNormGradInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RmsNormGradInferDtype));

// ------------------------------------------------------------------ rotary
namespace {

std::vector<paddle::Tensor> RotaryImpl(const paddle::Tensor& q, const paddle::Tensor& k, const paddle::Tensor& cos,
                                       const paddle::Tensor& sin, bool backward) {
  const char* op = backward ? "bmt_rotary_grad" : "bmt_rotary";
  check_float(q, op, "q");
  check_same(q, k, op, "k");
  check_same(q, cos, op, "cos");
  check_same(q, sin, op, "sin");
  const auto& qs = q.shape();
  const auto& ks = k.shape();
  const auto& cs = cos.shape();
  PD_CHECK(qs.size() == 4 && ks.size() == 4, op, ": q and k must be [batch, seq, heads, head_dim]");
  PD_CHECK(ks[0] == qs[0] && ks[1] == qs[1] && ks[3] == qs[3], op, ": k must match q in batch, seq, head_dim");
  PD_CHECK(qs[3] % 2 == 0, op, ": head_dim must be even");
  PD_CHECK(cs.size() == 3 && cs[1] == qs[1] && cs[2] == qs[3] && (cs[0] == 1 || cs[0] == qs[0]), op,
           ": cos/sin must be [batch or 1, seq, head_dim]");
  PD_CHECK(sin.shape() == cs, op, ": sin must have the shape of cos");
  auto qo = paddle::empty(qs, q.dtype(), q.place());
  auto ko = paddle::empty(ks, k.dtype(), k.place());
  int st = BMT_ERR_CUDA;
  if (on_gpu(q)) {
#ifdef BMT_WITH_CUDA
    st = bmt_cuda_rotary(dtype_code(q), q.data(), k.data(), cos.data(), sin.data(), qo.data(), ko.data(), qs[0],
                         qs[1], qs[2], ks[2], qs[3], cs[0], backward ? 1 : 0, stream_of(q));
#endif
  } else {
    st = bmt_cpu_rotary(dtype_code(q), q.data(), k.data(), cos.data(), sin.data(), qo.data(), ko.data(), qs[0],
                        qs[1], qs[2], ks[2], qs[3], cs[0], backward ? 1 : 0);
  }
  check_status(st, op);
  return {qo, ko};
}

}  // namespace

std::vector<paddle::Tensor> RotaryForward(const paddle::Tensor& q, const paddle::Tensor& k,
                                          const paddle::Tensor& cos, const paddle::Tensor& sin, int q_heads,
                                          int k_heads) {
  PD_CHECK(q.shape().size() == 4 && k.shape().size() == 4 && q.shape()[2] == q_heads && k.shape()[2] == k_heads,
           "bmt_rotary: q_heads/k_heads attributes must match q and k ([batch, seq, heads, head_dim])");
  return RotaryImpl(q, k, cos, sin, false);
}

// When only one of q_out / k_out reaches the loss, the other gradient arrives undefined: use zeros, with
// the shape rebuilt from the defined one and the head counts kept as attributes.
std::vector<paddle::Tensor> RotaryBackward(const paddle::Tensor& cos, const paddle::Tensor& sin,
                                           const paddle::Tensor& dq, const paddle::Tensor& dk, int q_heads,
                                           int k_heads) {
  PD_CHECK(dq.defined() || dk.defined(), "bmt_rotary_grad: no gradient for either output");
  const paddle::Tensor& known = dq.defined() ? dq : dk;
  std::vector<int64_t> shape = known.shape();
  auto fill = [&](const paddle::Tensor& g, int heads) {
    if (g.defined()) return g;
    std::vector<int64_t> s2 = shape;
    s2[2] = heads;
    return paddle::full(s2, 0, known.dtype(), known.place());
  };
  return RotaryImpl(fill(dq, q_heads), fill(dk, k_heads), cos, sin, true);
}

std::vector<std::vector<int64_t>> RotaryInferShape(const std::vector<int64_t>& q, const std::vector<int64_t>& k,
                                                   const std::vector<int64_t>&, const std::vector<int64_t>&) {
  return {q, k};
}

std::vector<paddle::DataType> RotaryInferDtype(const paddle::DataType& q, const paddle::DataType& k,
                                               const paddle::DataType&, const paddle::DataType&) {
  return {q, k};
}

PD_BUILD_OP(bmt_rotary)
    .Inputs({"Q", "K", "Cos", "Sin"})
    .Outputs({"QOut", "KOut"})
    .Attrs({"q_heads: int", "k_heads: int"})
    .SetKernelFn(PD_KERNEL(RotaryForward))
    .SetInferShapeFn(PD_INFER_SHAPE(RotaryInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RotaryInferDtype));

std::vector<std::vector<int64_t>> RotaryGradInferShape(const std::vector<int64_t>&, const std::vector<int64_t>&,
                                                       const std::vector<int64_t>& dq,
                                                       const std::vector<int64_t>& dk) {
  return {dq, dk};
}

std::vector<paddle::DataType> RotaryGradInferDtype(const paddle::DataType&, const paddle::DataType&,
                                                   const paddle::DataType& dq, const paddle::DataType& dk) {
  return {dq, dk};
}

PD_BUILD_GRAD_OP(bmt_rotary)
    .Inputs({"Cos", "Sin", paddle::Grad("QOut"), paddle::Grad("KOut")})
    .Outputs({paddle::Grad("Q"), paddle::Grad("K")})
    .Attrs({"q_heads: int", "k_heads: int"})
    .SetKernelFn(PD_KERNEL(RotaryBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(RotaryGradInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RotaryGradInferDtype));

// ------------------------------------------------------------------ SwiGLU
std::vector<paddle::Tensor> SwigluForward(const paddle::Tensor& gate, const paddle::Tensor& up) {
  const char* op = "bmt_swiglu";
  check_float(gate, op, "gate");
  check_same(gate, up, op, "up");
  PD_CHECK(gate.shape() == up.shape(), op, ": gate and up must have the same shape");
  auto out = paddle::empty(gate.shape(), gate.dtype(), gate.place());
  int st = BMT_ERR_CUDA;
  if (on_gpu(gate)) {
#ifdef BMT_WITH_CUDA
    st = bmt_cuda_swiglu_fwd(dtype_code(gate), gate.data(), up.data(), out.data(), gate.numel(), stream_of(gate));
#endif
  } else {
    st = bmt_cpu_swiglu_fwd(dtype_code(gate), gate.data(), up.data(), out.data(), gate.numel());
  }
  check_status(st, op);
  return {out};
}

std::vector<paddle::Tensor> SwigluBackward(const paddle::Tensor& gate, const paddle::Tensor& up,
                                           const paddle::Tensor& dout) {
  const char* op = "bmt_swiglu_grad";
  check_same(gate, dout, op, "grad");
  auto dg = paddle::empty(gate.shape(), gate.dtype(), gate.place());
  auto du = paddle::empty(up.shape(), up.dtype(), up.place());
  int st = BMT_ERR_CUDA;
  if (on_gpu(gate)) {
#ifdef BMT_WITH_CUDA
    st = bmt_cuda_swiglu_bwd(dtype_code(gate), gate.data(), up.data(), dout.data(), dg.data(), du.data(),
                             gate.numel(), stream_of(gate));
#endif
  } else {
    st = bmt_cpu_swiglu_bwd(dtype_code(gate), gate.data(), up.data(), dout.data(), dg.data(), du.data(),
                            gate.numel());
  }
  check_status(st, op);
  return {dg, du};
}

std::vector<std::vector<int64_t>> SwigluInferShape(const std::vector<int64_t>& g, const std::vector<int64_t>&) {
  return {g};
}

std::vector<paddle::DataType> SwigluInferDtype(const paddle::DataType& g, const paddle::DataType&) { return {g}; }

PD_BUILD_OP(bmt_swiglu)
    .Inputs({"Gate", "Up"})
    .Outputs({"Out"})
    .SetKernelFn(PD_KERNEL(SwigluForward))
    .SetInferShapeFn(PD_INFER_SHAPE(SwigluInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SwigluInferDtype));

std::vector<std::vector<int64_t>> SwigluGradInferShape(const std::vector<int64_t>& g, const std::vector<int64_t>& u,
                                                       const std::vector<int64_t>&) {
  return {g, u};
}

std::vector<paddle::DataType> SwigluGradInferDtype(const paddle::DataType& g, const paddle::DataType& u,
                                                   const paddle::DataType&) {
  return {g, u};
}

PD_BUILD_GRAD_OP(bmt_swiglu)
    .Inputs({"Gate", "Up", paddle::Grad("Out")})
    .Outputs({paddle::Grad("Gate"), paddle::Grad("Up")})
    .SetKernelFn(PD_KERNEL(SwigluBackward))
    .SetInferShapeFn(PD_INFER_SHAPE(SwigluGradInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(SwigluGradInferDtype));

// ------------------------------------------------------------------ softmax cross-entropy (one chunk)
namespace {

std::vector<paddle::Tensor> XentImpl(const paddle::Tensor& logits, const paddle::Tensor& labels,
                                     int64_t ignore_index, bool with_grad) {
  const char* op = with_grad ? "bmt_softmax_xent" : "bmt_softmax_xent_loss";
  check_float(logits, op, "logits");
  PD_CHECK(logits.is_cpu() || logits.dtype() == paddle::DataType::FLOAT32, op, ": logits on GPU must be float32");
  PD_CHECK(logits.shape().size() == 2, op, ": logits must be [rows, vocab]");
  PD_CHECK(labels.dtype() == paddle::DataType::INT64, op, ": labels must be int64");
  PD_CHECK(labels.place() == logits.place(), op, ": labels must be on the device of the logits");
  PD_CHECK(labels.is_contiguous(), op, ": labels must be contiguous");
  const int64_t rows = logits.shape()[0], vocab = logits.shape()[1];
  PD_CHECK(labels.numel() == rows, op, ": labels must have one entry per row of logits");
  auto loss = paddle::empty({rows}, logits.dtype(), logits.place());
  paddle::Tensor dlogits;
  if (with_grad) dlogits = paddle::empty(logits.shape(), logits.dtype(), logits.place());
  int st = BMT_ERR_CUDA;
  if (on_gpu(logits)) {
#ifdef BMT_WITH_CUDA
    st = bmt_cuda_softmax_xent(dtype_code(logits), logits.data(), labels.data<int64_t>(), loss.data(),
                               with_grad ? dlogits.data() : nullptr, rows, vocab, ignore_index, nullptr,
                               stream_of(logits));
#endif
  } else {
    st = bmt_cpu_softmax_xent(dtype_code(logits), logits.data(), labels.data<int64_t>(), loss.data(),
                              with_grad ? dlogits.data() : nullptr, rows, vocab, ignore_index);
  }
  check_status(st, op);
  if (with_grad) return {loss, dlogits};
  return {loss};
}

}  // namespace

std::vector<paddle::Tensor> XentForward(const paddle::Tensor& logits, const paddle::Tensor& labels,
                                        int64_t ignore_index) {
  return XentImpl(logits, labels, ignore_index, true);
}

std::vector<paddle::Tensor> XentLossForward(const paddle::Tensor& logits, const paddle::Tensor& labels,
                                            int64_t ignore_index) {
  return XentImpl(logits, labels, ignore_index, false);
}

std::vector<std::vector<int64_t>> XentInferShape(const std::vector<int64_t>& logits, const std::vector<int64_t>&) {
  return {{logits[0]}, logits};
}

std::vector<std::vector<int64_t>> XentLossInferShape(const std::vector<int64_t>& logits,
                                                     const std::vector<int64_t>&) {
  return {{logits[0]}};
}

std::vector<paddle::DataType> XentInferDtype(const paddle::DataType& logits, const paddle::DataType&) {
  return {logits, logits};
}

std::vector<paddle::DataType> XentLossInferDtype(const paddle::DataType& logits, const paddle::DataType&) {
  return {logits};
}

PD_BUILD_OP(bmt_softmax_xent)
    .Inputs({"Logits", "Labels"})
    .Outputs({"Loss", "DLogits"})
    .Attrs({"ignore_index: int64_t"})
    .SetKernelFn(PD_KERNEL(XentForward))
    .SetInferShapeFn(PD_INFER_SHAPE(XentInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(XentInferDtype));

PD_BUILD_OP(bmt_softmax_xent_loss)
    .Inputs({"Logits", "Labels"})
    .Outputs({"Loss"})
    .Attrs({"ignore_index: int64_t"})
    .SetKernelFn(PD_KERNEL(XentLossForward))
    .SetInferShapeFn(PD_INFER_SHAPE(XentLossInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(XentLossInferDtype));
