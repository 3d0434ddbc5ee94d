// The kernels' dtype code (bmt_kernels.h) of a Paddle tensor, -1 for a dtype no kernel takes; shared by
// the Paddle operators of kernels/paddle.
#pragma once

#include "bmt_kernels.h"
#include "paddle/extension.h"

inline int dtype_code(const paddle::Tensor& t) {
  switch (t.dtype()) {
    case paddle::DataType::FLOAT32:
      return BMT_F32;
    case paddle::DataType::FLOAT64:
      return BMT_F64;
    case paddle::DataType::FLOAT16:
      return BMT_F16;
    case paddle::DataType::BFLOAT16:
      return BMT_BF16;
    default:
      return -1;
  }
}
