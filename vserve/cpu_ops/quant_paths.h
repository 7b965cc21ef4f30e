// The products on GGUF blocks this build has (by the CPU it was built for: -march=native)
// and the entry point of each, for quant_api.cpp's `gemv` and `matmul`, which check the shapes
// and choose among them. Each path's kernels are in their own file.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define QUANT_VNNI 1  // the int8 gemv and GEMM
// the int8 gemv takes four blocks a step (and reads Q5_0R)
#if defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
#define QUANT_QUADS 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QUANT_AMX 1  // the bf16 GEMM on AMX tiles
#endif
#endif

namespace vserve_quant {

// quant_gemv.cpp: x W^T [M <= 8, N] on the exact path (fp32 activations, each 16 weights
// dequantized to fp32 in registers)
at::Tensor gemv_exact(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k);

#ifdef QUANT_VNNI
// quant_gemv.cpp: the int8 gemv, M <= 8 rows
at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k);
// quant_gemm.cpp: the int8 GEMM, more rows
at::Tensor gemm_int8(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k);
#endif

#ifdef QUANT_AMX
// quant_amx.cpp: the bf16 GEMM on AMX tiles, for kAmxMinRows <= M < kAmxMaxRows bf16 rows.
// Below kAmxMinRows rows a tile's dequantization costs more than the int8 GEMM's arithmetic;
// from kAmxMaxRows on, oneDNN's bf16 GEMM (on the tiles too) over dequantized tiles of ~2 MB
// (matmul's exact path) is faster, its blocking made for large sizes. Measured on a 2-core
// Xeon VM, the embedded model's shapes and formats: at 33 rows 0.89-1.05x the int8 GEMM's
// speed, at 64 1.26-1.55x, at 130 1.28-1.66x; at 512 rows even with the dequantized at::mm
// (0.85-1.03 ms), at 2048 1.4-1.75x slower than it.
constexpr int64_t kAmxMinRows = 48, kAmxMaxRows = 512;

// whether the OS grants this process the tile state (asked once)
bool amx_permitted();
// whether matmul takes the tile GEMM: permitted, and the `amx` option (quant.h) on
bool amx_enabled();
at::Tensor gemm_amx(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k);
#endif

}  // namespace vserve_quant
