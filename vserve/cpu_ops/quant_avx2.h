// The int8 gemv and GEMM in 256-bit registers (quant_avx2.cpp), for quant_api.cpp's `gemv`
// and `matmul` on CPUs with AVX2 but without AVX512-VNNI.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_AVX2_INT8 1
#ifdef __AVXVNNI__
#define QUANT_AVX2_VNNI 1  // its byte dots in one vpdpbusd (AVX-VNNI, 256-bit)
#endif
#endif

namespace vserve_quant {

// x W^T [M, N] in x's dtype for M <= 8 fp32 or bf16 activation rows and a GGUF weight of
// format qtype (shapes checked by the caller): activations quantized to int8 per block of 32
// as the VNNI gemv does, integer block dots, fp32 sums. Defined only with QUANT_AVX2_INT8.
at::Tensor gemv_avx2(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k);

// the same for M > 8 rows: the rows in panels of 8, each weight tile multiplied with every
// panel while it is in cache (the GEMM of a CPU with AVX2 and no AVX512-VNNI). matmul takes it
// below kAvx2GemmMaxRows rows: it runs at ~100 G op/s whatever M, where fp32 at::mm over
// dequantized tiles gains with M. Measured with VSERVE_CPU_ISA=avx2 on a 2-core Xeon VM
// (benchmarks/quant_gemv_speed.py --gemm), the embedded model's shapes, exact path time /
// this one's: at 16 rows 1.5-1.8, at 32 1.15-1.28, at 48 0.94-1.19, at 64 0.84-1.10, at
// 256 0.72-0.92. With AVX-VNNI's one-instruction dots it runs at ~125 G op/s and the
// crossing moves up (VSERVE_CPU_ISA=avx_vnni, the same machine, exact / int8 at 48 rows
// 0.97-1.22, at 64 0.94-1.14, at 96 0.78-1.05, at 128 0.83-0.99): to 80 rows.
#ifdef QUANT_AVX2_VNNI
constexpr int64_t kAvx2GemmMaxRows = 80;
#else
constexpr int64_t kAvx2GemmMaxRows = 48;
#endif
at::Tensor gemm_avx2(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k);

// the same in two halves (GemvInput's, quant.h): the activations quantized into a buffer of
// avx2_x_bytes(m, k) bytes (32-byte aligned), then output rows [r0, r1) from it into y (row
// stride ldy), from any thread
int64_t avx2_x_bytes(int64_t m, int64_t k);
template <typename T>
void avx2_prepare(const T* x, int64_t m, int64_t k, uint8_t* buf);
void avx2_rows(const uint8_t* buf, int64_t m, int64_t k, int64_t qtype, const uint8_t* w,
               int64_t row_bytes, void* y, bool bf16_out, int64_t ldy, int64_t r0, int64_t r1);

}  // namespace vserve_quant
