// The GGUF block-format kernels of quant.cpp (formats and semantics documented there), for
// decode.cpp, which builds with it into one extension: its `quant` submodule and its fused
// decoder layer on quantized weights call them.
#pragma once

#include <torch/extension.h>

namespace vserve_quant {

// data [N, row_bytes] uint8, qtype: the GGML type id, k: inputs per row
at::Tensor dequantize(const at::Tensor& data, int64_t qtype, int64_t k, at::ScalarType dtype);
at::Tensor gemv(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k);
at::Tensor matmul(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k);
at::Tensor embedding(const at::Tensor& data, int64_t qtype, int64_t k, const at::Tensor& ids,
                     at::ScalarType dtype);

}  // namespace vserve_quant
