// Paddle custom operator over bmt_cpu_adamw (kernels/cpu/adamw_cpu.cc): the fused AdamW update, in place.
//
// Checks that the four tensors are on the CPU, float32/float64, of one dtype and one element count, and
// contiguous (PD_CHECK raises a Python error naming the problem), then updates Param, Moment1 and Moment2
// in place. The scalars (decay, step, eps_hat) are computed by the caller from the learning rate and the
// bias corrections of this step (bmtrain_cli/ops/fused_adamw.py).
#include "bmt_kernels.h"
#include "paddle/extension.h"

namespace {

void check_operand(const paddle::Tensor& param, const paddle::Tensor& t, const char* name) {
  const char* op = "bmt_adamw_";
  PD_CHECK(t.is_cpu(), op, ": ", name, " must be on the CPU (the fused AdamW is a CPU kernel)");
  PD_CHECK(t.dtype() == param.dtype(), op, ": ", name, " must have the dtype of the parameter");
  PD_CHECK(t.numel() == param.numel(), op, ": ", name, " has ", t.numel(), " elements, the parameter ",
           param.numel());
  PD_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

}  // namespace

void AdamwStep(paddle::Tensor& param, const paddle::Tensor& grad, paddle::Tensor& moment1, paddle::Tensor& moment2,
               double decay, double beta1, double beta2, double step, double eps_hat) {
  const char* op = "bmt_adamw_";
  const auto dt = param.dtype();
  PD_CHECK(dt == paddle::DataType::FLOAT32 || dt == paddle::DataType::FLOAT64, op,
           ": the parameter must be float32 or float64");
  check_operand(param, param, "the parameter");
  check_operand(param, grad, "the gradient");
  check_operand(param, moment1, "moment1");
  check_operand(param, moment2, "moment2");
  const int code = dt == paddle::DataType::FLOAT32 ? BMT_F32 : BMT_F64;
  const int st = bmt_cpu_adamw(code, param.data(), grad.data(), moment1.data(), moment2.data(), param.numel(),
                               decay, beta1, beta2, step, eps_hat);
  PD_CHECK(st == BMT_OK, op, ": kernel failed with status ", st);
}

PD_BUILD_OP(bmt_adamw_)
    .Inputs({"Param", "Grad", "Moment1", "Moment2"})
    .Outputs({"ParamOut", "Moment1Out", "Moment2Out"})
    .Attrs({"decay: double", "beta1: double", "beta2: double", "step: double", "eps_hat: double"})
    .SetInplaceMap({{"Param", "ParamOut"}, {"Moment1", "Moment1Out"}, {"Moment2", "Moment2Out"}})
    .SetKernelFn(PD_KERNEL(AdamwStep));
