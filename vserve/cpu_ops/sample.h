// The fused sampling kernels of sample.cpp (semantics documented there), for bindings.cpp,
// which binds them as the extension's `sample` submodule.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace vserve_sample {

// logits [R, V] bf16 or fp32; temperature [R] fp32; u [R] fp64; num_candidates [R] int64
std::vector<at::Tensor> sample(const at::Tensor& logits, const at::Tensor& temperature,
                               const at::Tensor& u, const at::Tensor& num_candidates);
std::vector<at::Tensor> logprobs(const at::Tensor& logits, const at::Tensor& token_ids,
                                 int64_t k);
at::Tensor argmax(const at::Tensor& logits);
at::Tensor exp_for_test(const at::Tensor& x);

}  // namespace vserve_sample
