// The quantized kernels' entry points (declared in quant.h; bound as the extension's `quant`
// submodule by bindings.cpp, called by decode.cpp's `quant_linear`): each checks its inputs
// and picks the path its product takes on this CPU (quant_paths.h). The block formats:
// quant_formats.h; dequantize and embedding: quant_formats.cpp.
//
//   dequantize(data, qtype, k, dtype) -> [N, K] fp32 or bf16, bitwise gguf.quants.dequantize
//             (each weight takes one rounding there and here) and its bf16 rounding
//   gemv(x [M <= 8, K], data, qtype, k) -> x W^T [M, N] in x's dtype: streams each weight row
//             once and multiplies each chunk of it with all M activation rows. With AVX512-VNNI
//             and bf16 activations (the default there) it quantizes them to int8 per block of
//             32 and sums integer products with vpdpbusd (quant_gemv.cpp): its only
//             error beyond fp32 summation is the activations' rounding, at most d_x / 2 each
//             (d_x = the block's amax / 127), and it runs at memory bandwidth where the fp32
//             path is compute-bound. The exact path (fp32 activations, the `exact` option, or
//             a CPU without VNNI) dequantizes each 16 weights to fp32 in registers and
//             multiply-adds them into fp32 accumulators; exact but for the order of the sums
//   matmul(x [M, K], data, qtype, k) -> [M, N]: gemv (either path) for M <= 8; else, with
//             AVX512-VNNI and bf16 activations, the int8 GEMM (quant_gemm.cpp: the
//             gemv's int8 arithmetic as an outer product over tiles of 32 output rows; with
//             AVX2 alone quant_avx2.cpp's, the gemv's over panels of 8 rows), and on
//             a CPU with AMX from 48 rows the tile GEMM (quant_amx.cpp: weights
//             dequantized to bf16 a tile at a time, the exact path's products); on the exact
//             path, and on AMX from 512 rows, each thread dequantizes tiles of output rows into
//             a buffer of x's dtype and multiplies with at::mm
//   embedding(data, qtype, k, ids [T], dtype) -> [T, K]: the dequantized rows ids
//
// The `exact` and `amx` options (quant.h) are vserve/envs.py's VSERVE_QUANT_EXACT and
// VSERVE_QUANT_AMX, read once and set here at load.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "quant.h"
#include "quant_avx2.h"
#include "quant_formats.h"
#include "quant_paths.h"

namespace vserve_quant {

namespace {

std::atomic<bool> exact_option{false}, amx_option{true};

}  // namespace

void set_options(const Options& opts) {
  exact_option.store(opts.exact, std::memory_order_relaxed);
  amx_option.store(opts.amx, std::memory_order_relaxed);
}

Options options() {
  return {exact_option.load(std::memory_order_relaxed),
          amx_option.load(std::memory_order_relaxed)};
}

// whether the CPU has bf16 instructions (the build's -march=native): AVX512-BF16 or AMX
#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
constexpr bool kBf16Compute = true;
#else
constexpr bool kBf16Compute = false;
#endif

// x W^T in x's dtype over tiles of weights dequantized to it (matmul's exact path)
at::Tensor exact_matmul(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k);

at::Tensor gemv(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k) {
  check_weight(data, qtype, k);
  check_activations(x, k);
  const int64_t m = x.size(0);
  TORCH_CHECK(m >= 1 && m <= 8, "gemv takes 1 to 8 activation rows, got ", m);
  if (!options().exact && int8_activations(x.scalar_type())) {
#ifdef QUANT_VNNI
    return gemv_int8(x, data, qtype, k);
#elif defined(QUANT_AVX2_INT8)
    return gemv_avx2(x, data, qtype, k);
#endif
  }
  return gemv_exact(x, data, qtype, k);
}

at::Tensor matmul(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k) {
  check_weight(data, qtype, k);
  check_activations(x, k);
  int64_t m = x.size(0), n = data.size(0), row_bytes = data.size(1);
  if (m == 0) return at::empty({0, n}, x.options());  // e.g. no row wants prompt logprobs
  if (m <= 8) return gemv(x, data, qtype, k);
#ifdef QUANT_VNNI
  const bool fast = !options().exact && x.scalar_type() == at::kBFloat16;
#ifdef QUANT_AMX
  const bool amx = fast && m >= kAmxMinRows && amx_enabled();
  if (amx && m < kAmxMaxRows) return gemm_amx(x, data, qtype, k);
#else
  const bool amx = false;
#endif
  if (fast && !amx) return gemm_int8(x, data, qtype, k);
#elif defined(QUANT_AVX2_INT8)
  if (!options().exact && x.scalar_type() == at::kBFloat16 && m < kAvx2GemmMaxRows)
    return gemm_avx2(x, data, qtype, k);
#endif
  // the exact path; and on a CPU with AMX, from kAmxMaxRows bf16 rows on, oneDNN's GEMM.
  // Without bf16 instructions a bf16 at::mm is emulated (7x slower than fp32 on an
  // AVX2 EPYC, 128 x 640 x 2048): there bf16 x multiplies the fp32 weights in fp32
  if (x.scalar_type() == at::kBFloat16 && !kBf16Compute) {
    auto xf = x.to(at::kFloat);
    return exact_matmul(xf, data, qtype, k).to(at::kBFloat16);
  }
  return exact_matmul(x, data, qtype, k);
}

at::Tensor exact_matmul(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k) {
  const int64_t m = x.size(0), n = data.size(0), row_bytes = data.size(1);
  auto out = at::empty({m, n}, x.options());
  // Tiles of ~2 MB of dequantized rows (L3-resident while at::mm reads them): oneDNN's kernel
  // runs ~2x slower on 128-row tiles than on 2048-row ones at M = 16, and the dequantization
  // of a tile costs less than a tenth of its product. At least one tile per thread.
  const int64_t elem = x.element_size();
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t tiles = std::max(threads, (n * k * elem + (2 << 20) - 1) / (2 << 20));
  const int64_t tile = ((n + tiles - 1) / tiles + 15) / 16 * 16;
  const uint8_t* d = data.data_ptr<uint8_t>();
  bool is_bf16 = x.scalar_type() == at::kBFloat16;
  // the pool's threads do not inherit the caller's inference mode: without it mm_out's
  // write into an inference tensor (out, made under torch.inference_mode) is refused
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, (n + tile - 1) / tile, 1, [&](int64_t lo, int64_t hi) {
    c10::InferenceMode mode(inference);
    auto buf = at::empty({tile, k}, x.options());
    for (int64_t t = lo; t < hi; ++t) {
      int64_t r0 = t * tile, rows = std::min(tile, n - r0);
      if (is_bf16)
        dequant_rows(d, qtype, k, row_bytes, nullptr, r0, r0 + rows, buf.data_ptr<bf16>());
      else
        dequant_rows(d, qtype, k, row_bytes, nullptr, r0, r0 + rows, buf.data_ptr<float>());
      // inside parallel_for ATen runs the product on this thread alone
      auto slice = out.narrow(1, r0, rows);
      at::mm_out(slice, x, buf.narrow(0, 0, rows).t());
    }
  });
  return out;
}

const char* int8_gemv() {
#ifdef QUANT_VNNI
  return "vnni";
#elif defined(QUANT_AVX2_VNNI)
  return "avx_vnni";
#elif defined(QUANT_AVX2_INT8)
  return "avx2";
#else
  return "";
#endif
}

bool int8_activations(at::ScalarType dtype) {
  if (*int8_gemv() == '\0') return false;
  // bf16 only: fp32 is the exact mode (dtype="auto" gives quantized models bf16 on every
  // CPU with an int8 gemv, so fp32 is always asked for)
  return dtype == at::kBFloat16;
}

at::Tensor gemv_avx2_checked(const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                             int64_t k) {
  check_weight(data, qtype, k);
  check_activations(x, k);
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "gemv takes 1 to 8 activation rows");
#ifdef QUANT_AVX2_INT8
  return gemv_avx2(x, data, qtype, k);
#else
  TORCH_CHECK(false, "gemv_avx2: built for a CPU without AVX2, FMA and F16C");
#endif
}

at::Tensor gemm_avx2_checked(const at::Tensor& x, const at::Tensor& data, int64_t qtype,
                             int64_t k) {
  check_weight(data, qtype, k);
  check_activations(x, k);
#ifdef QUANT_AVX2_INT8
  if (x.size(0) == 0) return at::empty({0, data.size(0)}, x.options());
  return gemm_avx2(x, data, qtype, k);
#else
  TORCH_CHECK(false, "gemm_avx2: built for a CPU without AVX2, FMA and F16C");
#endif
}

bool amx_gemm() {
#ifdef QUANT_AMX
  return amx_permitted();
#else
  return false;
#endif
}

}  // namespace vserve_quant
