// What every quantized kernel file decodes GGUF blocks with (quant_formats.h's decoders and
// quant_avx2.cpp's): the GGML type ids and the dispatch on them, compile-time unrolling, the
// fp16 scale of a block, and the K-quants' packed scales and mins.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#define QUANT_INLINE inline __attribute__((always_inline))
// on a lambda: GCC leaves a large one (the gemv's step) out of line otherwise, and its
// accumulators in memory
#define QUANT_FLATTEN __attribute__((always_inline))

namespace vserve_qblock {

constexpr int64_t kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
// not a GGML type: Q5_0 repacked at load into quads (quant_formats.h's Q5_0R, `repack_q5_0`)
constexpr int64_t kQ5_0R = 1006;

// calls fn(F{}) with F the decoder, among a kernel file's six, of GGML type id qtype
template <class Q4_0, class Q5_0, class Q8_0, class Q4_K, class Q5_K, class Q6_K, class Fn>
decltype(auto) with_format_of(int64_t qtype, Fn&& fn) {
  switch (qtype) {
    case kQ4_0: return fn(Q4_0{});
    case kQ5_0: return fn(Q5_0{});
    case kQ8_0: return fn(Q8_0{});
    case kQ4_K: return fn(Q4_K{});
    case kQ5_K: return fn(Q5_K{});
    case kQ6_K: return fn(Q6_K{});
  }
  TORCH_CHECK(false, "unsupported GGML quantization type ", qtype,
              " (supported: Q4_0=2, Q5_0=6, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14)");
}

// compile-time indices: the decoders hand each 16-weight chunk to their consumer with its
// index as a type, so a consumer's accumulator arrays are indexed by constants and stay in
// registers
template <int I>
using C = std::integral_constant<int, I>;

template <class Fn, int... I>
QUANT_INLINE void unroll_seq(Fn&& fn, std::integer_sequence<int, I...>) {
  (fn(C<I>{}), ...);
}

template <int N, class Fn>
QUANT_INLINE void unroll(Fn&& fn) {
  unroll_seq(fn, std::make_integer_sequence<int, N>{});
}

QUANT_INLINE float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// the 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block from its 12 packed
// bytes s: j < 4 in the low six bits of s[j] and s[j + 4]; j >= 4 in the nibbles of s[j + 4],
// with the top two bits of s[j - 4] (scale) and s[j] (min) above them
QUANT_INLINE void scale_min(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

}  // namespace vserve_qblock
