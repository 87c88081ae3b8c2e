// mtp_rms_norm: y = x / sqrt(mean(x^2) + eps) * weight over the last axis, float32, on CPU hosts.
//
// WHY: at serving sizes on CPU a norm is dispatch-bound: written as Paddle ops it is six kernels
// (~60 us a norm on a 2-core host), and a speculative step runs 17 of them at k=2. Paddle's own fused
// CPU kernel (RmsNormAvxKernel) uses AVX-512 instructions whatever the host and dies of SIGILL on a
// CPU without them, so it cannot be the answer on every x86 host.
//
// Python wrapper: mtpserve.model.norm (RMSNorm.forward, eval mode).
#include <cmath>
#include <cstdint>
#include <vector>

#include "paddle/extension.h"
#include "rms_norm.h"

void mtp::RmsNormRows(const float* x, const float* w, float* y, int64_t rows, int64_t h, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * h;
    float* yr = y + r * h;
    float sum = 0.0f;
    for (int64_t j = 0; j < h; ++j) sum += xr[j] * xr[j];
    const float scale = 1.0f / std::sqrt(sum / static_cast<float>(h) + eps);
    for (int64_t j = 0; j < h; ++j) yr[j] = xr[j] * scale * w[j];
  }
}

namespace {

std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x, const paddle::Tensor& weight, float eps) {
  PD_CHECK(x.is_cpu() && weight.is_cpu(), "mtp_rms_norm runs on CPU tensors");
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && weight.dtype() == paddle::DataType::FLOAT32,
           "mtp_rms_norm takes float32");
  const auto& shape = x.shape();
  PD_CHECK(!shape.empty() && weight.numel() == shape.back(), "weight must have x's last dimension");
  const int64_t h = shape.back();
  const paddle::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  paddle::Tensor y = paddle::empty(shape, paddle::DataType::FLOAT32, x.place());
  mtp::RmsNormRows(xc.data<float>(), weight.data<float>(), y.data<float>(), h ? x.numel() / h : 0, h, eps);
  return {y};
}

std::vector<std::vector<int64_t>> RmsNormShape(const std::vector<int64_t>& x,
                                               const std::vector<int64_t>& weight) {
  return {x};
}

std::vector<paddle::DataType> RmsNormDtype(const paddle::DataType& x, const paddle::DataType& weight) {
  return {x};
}

}  // namespace

PD_BUILD_OP(mtp_rms_norm)
    .Inputs({"x", "weight"})
    .Outputs({"y"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(RmsNorm))
    .SetInferShapeFn(PD_INFER_SHAPE(RmsNormShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(RmsNormDtype));
