// Paddle custom operator over bmt_cpu_adamw_multi (kernels/cpu/adamw_cpu.cc): the fused AdamW update of a
// list of tensors, in place, in one OpenMP region.
//
// Checks that the six lists have one length, that every tensor is on the CPU, float32/float64 of one dtype,
// and contiguous, that grad and both moments have their parameter's element count and each beta power one
// element (PD_CHECK raises a Python error naming the list and the index), then updates Params, Moment1,
// Moment2, Beta1Pow and Beta2Pow in place. bmtrain_cli/ops/fused_adamw.py calls it.
#include <vector>

#include "bmt_kernels.h"
#include "paddle/extension.h"

namespace {

constexpr const char* kOp = "bmt_adamw_multi_";

void check_list(const std::vector<paddle::Tensor>& params, const std::vector<paddle::Tensor>& ts, const char* name,
                bool scalar) {
  PD_CHECK(ts.size() == params.size(), kOp, ": ", ts.size(), " ", name, " for ", params.size(), " parameters");
  const auto dt = params[0].dtype();
  for (size_t i = 0; i < ts.size(); ++i) {
    const auto& t = ts[i];
    PD_CHECK(t.is_cpu(), kOp, ": ", name, "[", i, "] must be on the CPU (the fused AdamW is a CPU kernel)");
    PD_CHECK(t.dtype() == dt, kOp, ": ", name, "[", i, "] must have the dtype of the parameters");
    const int64_t want = scalar ? 1 : params[i].numel();
    PD_CHECK(t.numel() == want, kOp, ": ", name, "[", i, "] has ", t.numel(), " elements, expected ", want);
    PD_CHECK(t.is_contiguous(), kOp, ": ", name, "[", i, "] must be contiguous");
  }
}

std::vector<void*> pointers(std::vector<paddle::Tensor>& ts) {
  std::vector<void*> out;
  out.reserve(ts.size());
  for (auto& t : ts) out.push_back(t.data());
  return out;
}

}  // namespace

void AdamwMulti(std::vector<paddle::Tensor>& params, const std::vector<paddle::Tensor>& grads,
                std::vector<paddle::Tensor>& moment1, std::vector<paddle::Tensor>& moment2,
                std::vector<paddle::Tensor>& beta1_pow, std::vector<paddle::Tensor>& beta2_pow, double lr,
                double weight_decay, double beta1, double beta2, double epsilon, double grad_scale) {
  PD_CHECK(!params.empty(), kOp, ": needs at least one parameter");
  const auto dt = params[0].dtype();
  PD_CHECK(dt == paddle::DataType::FLOAT32 || dt == paddle::DataType::FLOAT64, kOp,
           ": the parameters must be float32 or float64");
  check_list(params, params, "params", false);
  check_list(params, grads, "grads", false);
  check_list(params, moment1, "moment1", false);
  check_list(params, moment2, "moment2", false);
  check_list(params, beta1_pow, "beta1_pow", true);
  check_list(params, beta2_pow, "beta2_pow", true);
  std::vector<const void*> g;
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < params.size(); ++i) {
    g.push_back(grads[i].data());
    sizes.push_back(params[i].numel());
  }
  const auto p = pointers(params), m = pointers(moment1), v = pointers(moment2);
  const auto b1p = pointers(beta1_pow), b2p = pointers(beta2_pow);
  const int st = bmt_cpu_adamw_multi(dt == paddle::DataType::FLOAT32 ? BMT_F32 : BMT_F64,
                                     static_cast<int64_t>(params.size()), p.data(), g.data(), m.data(), v.data(),
                                     b1p.data(), b2p.data(), sizes.data(), lr, weight_decay, beta1, beta2, epsilon,
                                     grad_scale);
  PD_CHECK(st != BMT_ERR_VALUE, kOp, ": a beta power lies outside [0, 1)");
  PD_CHECK(st == BMT_OK, kOp, ": kernel failed with status ", st);
}

PD_BUILD_OP(bmt_adamw_multi_)
    .Inputs({paddle::Vec("Params"), paddle::Vec("Grads"), paddle::Vec("Moment1"), paddle::Vec("Moment2"),
             paddle::Vec("Beta1Pow"), paddle::Vec("Beta2Pow")})
    .Outputs({paddle::Vec("ParamsOut"), paddle::Vec("Moment1Out"), paddle::Vec("Moment2Out"),
              paddle::Vec("Beta1PowOut"), paddle::Vec("Beta2PowOut")})
    .Attrs({"lr: double", "weight_decay: double", "beta1: double", "beta2: double", "epsilon: double",
            "grad_scale: double"})
    .SetInplaceMap({{paddle::Vec("Params"), paddle::Vec("ParamsOut")},
                    {paddle::Vec("Moment1"), paddle::Vec("Moment1Out")},
                    {paddle::Vec("Moment2"), paddle::Vec("Moment2Out")},
                    {paddle::Vec("Beta1Pow"), paddle::Vec("Beta1PowOut")},
                    {paddle::Vec("Beta2Pow"), paddle::Vec("Beta2PowOut")}})
    .SetKernelFn(PD_KERNEL(AdamwMulti));
