// The GGUF block-format kernels' entry points (quant_api.cpp documents their semantics,
// quant_formats.h the formats), for bindings.cpp (the extension's `quant` submodule),
// decode.cpp (its linears on quantized weights) and stack.cpp (the decode stack).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

namespace vserve_quant {

// data [N, row_bytes] uint8, qtype: the GGML type id, k: inputs per row
at::Tensor dequantize(const at::Tensor& data, int64_t qtype, int64_t k, at::ScalarType dtype);
at::Tensor gemv(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k);
at::Tensor matmul(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k);
at::Tensor embedding(const at::Tensor& data, int64_t qtype, int64_t k, const at::Tensor& ids,
                     at::ScalarType dtype);

// The gemv of `gemv` in two halves, for callers that run its rows on their own threads (the
// decode stack, stack.cpp): `prepare` quantizes (or widens) M <= 8 bf16 activation rows once
// as `gemv` does, `rows` computes output rows [r0, r1) of that product into y (bf16, row
// stride ldy) from any thread. Each output row is computed alone, in gemv's order, so any
// split of the rows gives gemv's values exactly.
struct GemvInput {
  std::vector<uint8_t> buf;  // quantized activation chunks, or fp32 activations
  int64_t m = 0, k = 0, qtype = 0;
  bool int8 = false;
  const void* data() const;
};
void gemv_prepare(GemvInput& in, const c10::BFloat16* x, int64_t m, int64_t k, int64_t qtype);
void gemv_rows(const GemvInput& in, const uint8_t* w, int64_t row_bytes, c10::BFloat16* y,
               int64_t ldy, int64_t r0, int64_t r1);
bool supported_qtype(int64_t qtype);
// whether matmul may take the AMX tile GEMM here: built for a CPU with AMX and granted the tile
// state by the OS (the `amx` option off still keeps it off)
bool amx_gemm();
// the int8 gemv this build has: "vnni" (AVX512-VNNI), "avx_vnni" (AVX2 with AVX-VNNI), "avx2"
// or "" (none: gemv is the exact path alone)
const char* int8_gemv();
// whether gemv quantizes activations of this dtype (unless the `exact` option is on)
bool int8_activations(at::ScalarType dtype);
// the AVX2 int8 gemv whatever int8_gemv() says (builds with AVX2, FMA and F16C), checked
at::Tensor gemv_avx2_checked(const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                             int64_t k);
// and its GEMM, any number of rows (the panels of 8 even below 9)
at::Tensor gemm_avx2_checked(const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                             int64_t k);
int64_t row_bytes_of(int64_t qtype, int64_t k);  // -1 when k is not a whole number of blocks
// whether this build's gemv reads Q5_0R (the quad gemv: AVX512-VNNI, VBMI and BITALG)
bool q5_0r_supported();
// Q5_0 blocks [N, K / 32 * 22] as Q5_0R [N, K / 128 * 88] (K % 128 == 0), a new tensor
at::Tensor repack_q5_0(const at::Tensor& data, int64_t k);
// Q5_0 blocks [N, K / 32 * 22] as Q8_0 [N, K / 32 * 34], a new tensor: each weight d * (q - 16)
// becomes the int8 q - 16 under the same fp16 d, so the values are exactly the same
at::Tensor q5_0_as_q8_0(const at::Tensor& data, int64_t k);

// The kernels' two switches, vserve/envs.py's VSERVE_QUANT_EXACT and VSERVE_QUANT_AMX, which
// vserve/cpu_ops/__init__.py sets once when it loads the extension (tests set them to run the
// other path). `exact`: gemv and matmul take the exact path (fp32 activations times the
// dequantized weights) for bf16 activations too. `amx` off: matmul keeps bf16 rows off the
// AMX tiles (the int8 GEMM instead). Read on each call, from any thread.
struct Options {
  bool exact = false;
  bool amx = true;
};
void set_options(const Options& opts);
Options options();

}  // namespace vserve_quant
