// The GGUF block formats as the vector kernels read them (quant_gemv.cpp, quant_gemm.cpp,
// quant_amx.cpp; the AVX2 gemv, quant_avx2.cpp, has its own decoders): each format's decoder,
// which yields 16 fp32 weights at a time exactly as gguf.quants computes them, the rows it
// dequantizes, and the checks of a weight's and its activations' shapes (quant_formats.cpp).
//
// A weight is a uint8 tensor [N, row_bytes]: one row per output feature, K inputs per row, the
// bytes a GGUFReader tensor holds. Formats by GGML type id, block = consecutive weights of a row:
//   Q4_0 (2)  32 per 18 bytes: fp16 d, 16 bytes of nibbles (low: weights 0-15, high: 16-31);
//             w = d * (q - 8)
//   Q5_0 (6)  32 per 22 bytes: fp16 d, uint32 of fifth bits (bit j: weight j), nibbles as
//             Q4_0; w = d * (q - 16)
//   Q5_0R (1006, vserve's own) Q5_0 repacked at load (`repack_q5_0`, rows of K % 128 == 0, on a
//             CPU with the quad gemv): four blocks per 88 bytes, their 64 nibble bytes in
//             order, 8 bytes of the fifth bits of weights 0-15 (bit 16i + j: weight j of block
//             i), 8 of weights 16-31, the four fp16 d; the same weights as the Q5_0 bytes
//   Q8_0 (8)  32 per 34 bytes: fp16 d, int8 q[32]; w = d * q
//   Q4_K (12) 256 per 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min)
//             pairs, 128 bytes of nibbles (32-byte group g: sub-block 2g low, 2g+1 high);
//             w = (d * scale_j) * q - dmin * min_j for sub-block j of 32
//   Q5_K (13) 256 per 176 bytes: as Q4_K with 32 bytes of fifth bits before the nibbles
//             (bit j of byte l: weight l of sub-block j)
//   Q6_K (14) 256 per 210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, int8
//             scales[16] (one per 16 weights), fp16 d; w = (d * scale) * (q - 32)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "quant_blocks.h"
#include "vec16.h"

namespace {

using bf16 = c10::BFloat16;
using namespace vec16;  // vf, vi, vh, load16
using namespace vserve_qblock;  // C, unroll, half_at, scale_min, with_format_of, kQ4_0..

typedef uint8_t vb __attribute__((vector_size(16)));
typedef int8_t vsb __attribute__((vector_size(16)));
typedef uint32_t vu __attribute__((vector_size(64)));

#if defined(__AVX2__) && !defined(__AVX512F__)
// two 8-lane halves as one 16-lane vector (AVX2: the halves are its two registers)
QUANT_INLINE vi join8(__m256i lo, __m256i hi) {
  vi v;
  std::memcpy(&v, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
  return v;
}
#endif

// 16 unsigned / signed bytes as int32 lanes. GCC 12 lowers __builtin_convertvector from a
// byte vector to sixteen scalar extensions, so AVX-512 builds say vpmovzxbd / vpmovsxbd and
// AVX2 builds two 8-lane vpmovzxbd / vpmovsxbd (scalar: 0.4-1.4 GB/s a thread on a Zen 3).
QUANT_INLINE vi bytes16(const uint8_t* p) {
#ifdef __AVX512F__
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return join8(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
               _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
#else
  vb b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, vi);
#endif
}

QUANT_INLINE vi sbytes16(const uint8_t* p) {
#ifdef __AVX512F__
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  return join8(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
               _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
#else
  vsb b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, vi);
#endif
}

QUANT_INLINE vf fl(vi v) { return __builtin_convertvector(v, vf); }

// x in every lane; unlike vec16::splat (0 + x) it keeps the sign of a zero, which a -0 scale
// passes on to its weights
QUANT_INLINE vf bcast(float x) { return vf{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

QUANT_INLINE vi lane_index() { return vi{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }

QUANT_INLINE vf iota() { return fl(lane_index()); }

#ifdef __AVX512F__
// table[q & 15] in each lane: one vpermps, which reads only the low four bits of each index,
// replaces masking, offsetting, converting and scaling the quants when a block (or
// sub-block) has 16 possible weights
QUANT_INLINE vf lookup(vf table, vi q) {
  return (vf)_mm512_permutexvar_ps((__m512i)q, (__m512)table);
}

// the same from table `hi` in the lanes whose bit of `high` is set (a fifth quant bit)
QUANT_INLINE vf lookup(vf lo, vf hi, vi q, __mmask16 high) {
  __m512 r = _mm512_permutexvar_ps((__m512i)q, (__m512)lo);
  return (vf)_mm512_mask_permutexvar_ps(r, high, (__m512i)q, (__m512)hi);
}
#endif

// Each format's `block(p, emit)` calls emit(C<c>, w) for the 16-weight chunks c of the block
// at p, in order, w exactly as gguf.quants computes it in fp32. The products of a scale and a
// quant are exact in fp32 (at most 11 + 8 or 17 + 5 significant bits) except Q6_K's single
// product, so a fused multiply-add rounds the K-quants' d * q - m where numpy rounds it, and
// a lookup table of the 16 (or 32) weights a scale gives holds the very values numpy computes.
// AVX-512 builds look weights up in such tables; others do the arithmetic per weight.

struct Q4_0 {
  static constexpr int kBlock = 32, kBytes = 18;
  template <class Emit>
  static QUANT_INLINE void block(const uint8_t* b, Emit&& emit) {
    vf d = bcast(half_at(b));
    vi q = bytes16(b + 2);
#ifdef __AVX512F__
    vf table = (iota() - 8) * d;
    emit(C<0>{}, lookup(table, q));
    emit(C<1>{}, lookup(table, q >> 4));
#else
    emit(C<0>{}, fl((q & 15) - 8) * d);
    emit(C<1>{}, fl((q >> 4) - 8) * d);
#endif
  }
};

struct Q5_0 {
  static constexpr int kBlock = 32, kBytes = 22;
  // chunks c0, c0 + 1: the block of scale d, fifth bits `high` and nibble bytes qs
  template <int c0, class Emit>
  static QUANT_INLINE void chunks(float scale, uint32_t high, const uint8_t* qs, Emit&& emit) {
    vf d = bcast(scale);
    vi q = bytes16(qs);
#ifdef __AVX512F__
    vf lo = (iota() - 16) * d, hi = iota() * d;  // fifth bit clear / set
    emit(C<c0>{}, lookup(lo, hi, q, static_cast<__mmask16>(high)));
    emit(C<c0 + 1>{}, lookup(lo, hi, q >> 4, static_cast<__mmask16>(high >> 16)));
#else
    vi h_lo = ((vi{} + static_cast<int32_t>(high & 0xFFFF)) >> lane_index()) & 1;
    vi h_hi = ((vi{} + static_cast<int32_t>(high >> 16)) >> lane_index()) & 1;
    emit(C<c0>{}, fl(((q & 15) | (h_lo << 4)) - 16) * d);
    emit(C<c0 + 1>{}, fl(((q >> 4) | (h_hi << 4)) - 16) * d);
#endif
  }
  template <class Emit>
  static QUANT_INLINE void block(const uint8_t* b, Emit&& emit) {
    uint32_t high;
    std::memcpy(&high, b + 2, sizeof(high));
    chunks<0>(half_at(b), high, b + 6, emit);
  }
};

// Q5_0R: four Q5_0 blocks as the quad gemv reads them (the header's table)
struct Q5_0R {
  static constexpr int kBlock = 128, kBytes = 88;
  static constexpr int kLowBits = 64, kHighBits = 72, kScales = 80;  // byte offsets
  // block i's fifth bits as Q5_0 stores them (bit j: weight j)
  static QUANT_INLINE uint32_t fifth_bits(const uint8_t* b, int i) {
    uint16_t lo, hi;
    std::memcpy(&lo, b + kLowBits + 2 * i, sizeof(lo));
    std::memcpy(&hi, b + kHighBits + 2 * i, sizeof(hi));
    return lo | static_cast<uint32_t>(hi) << 16;
  }
  template <class Emit>
  static QUANT_INLINE void block(const uint8_t* b, Emit&& emit) {
    unroll<4>([&](auto blk) QUANT_FLATTEN {
      constexpr int i = decltype(blk)::value;
      Q5_0::chunks<2 * i>(half_at(b + kScales + 2 * i), fifth_bits(b, i), b + 16 * i, emit);
    });
  }
};

struct Q8_0 {
  static constexpr int kBlock = 32, kBytes = 34;
  template <class Emit>
  static QUANT_INLINE void block(const uint8_t* b, Emit&& emit) {
    vf d = bcast(half_at(b));
    emit(C<0>{}, fl(sbytes16(b + 2)) * d);
    emit(C<1>{}, fl(sbytes16(b + 18)) * d);
  }
};

// Q4_K and Q5_K: 32-byte group g of nibbles holds sub-block 2g (low) and 2g + 1 (high);
// Q5_K adds bit j of fifth-bit byte l to weight l of sub-block j
template <bool kFifth>
struct KQuant {
  static constexpr int kBlock = 256, kBytes = kFifth ? 176 : 144;
  template <class Emit>
  static QUANT_INLINE void block(const uint8_t* b, Emit&& emit) {
    float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* s = b + 4;
    const uint8_t* qs = b + (kFifth ? 48 : 16);
    vi h0{}, h1{};
    if constexpr (kFifth) {
      h0 = bytes16(b + 16);
      h1 = bytes16(b + 32);
    }
    unroll<4>([&](auto g) QUANT_FLATTEN {
      constexpr int i = decltype(g)::value;
      vi q0 = bytes16(qs + 32 * i), q1 = bytes16(qs + 32 * i + 16);
      unroll<2>([&](auto half) QUANT_FLATTEN {
        constexpr int j = 2 * i + decltype(half)::value, shift = 4 * decltype(half)::value;
        int scale, min;
        scale_min(s, j, scale, min);
        vf dl = bcast(d * static_cast<float>(scale)), ml = bcast(dmin * static_cast<float>(min));
#ifdef __AVX512F__
        vi a = q0 >> shift, c = q1 >> shift;  // lookup reads the low nibble alone
        vf lo = iota() * dl - ml;
        if constexpr (kFifth) {
          vf hi = (iota() + 16) * dl - ml;
          __m512i bit = _mm512_set1_epi32(1 << j);
          emit(C<2 * j>{}, lookup(lo, hi, a, _mm512_test_epi32_mask((__m512i)h0, bit)));
          emit(C<2 * j + 1>{}, lookup(lo, hi, c, _mm512_test_epi32_mask((__m512i)h1, bit)));
        } else {
          emit(C<2 * j>{}, lookup(lo, a));
          emit(C<2 * j + 1>{}, lookup(lo, c));
        }
#else
        vi a = (q0 >> shift) & 15, c = (q1 >> shift) & 15;
        if constexpr (kFifth) {
          a |= ((h0 >> j) & 1) << 4;
          c |= ((h1 >> j) & 1) << 4;
        }
        emit(C<2 * j>{}, fl(a) * dl - ml);
        emit(C<2 * j + 1>{}, fl(c) * dl - ml);
#endif
      });
    });
  }
};

using Q4_K = KQuant<false>;
using Q5_K = KQuant<true>;

// Q6_K: weight i of half h (128 weights) takes the nibble i / 64 of low byte h * 64 + i % 64
// and the 2-bit pair i / 32 of high byte h * 32 + i % 32; one int8 scale per 16 weights
struct Q6_K {
  static constexpr int kBlock = 256, kBytes = 210;
  template <class Emit>
  static QUANT_INLINE void block(const uint8_t* b, Emit&& emit) {
    float d = half_at(b + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    unroll<16>([&](auto chunk) QUANT_FLATTEN {
      constexpr int c = decltype(chunk)::value, h = c / 8, i = 16 * (c % 8);
      vi lo = (bytes16(b + h * 64 + i % 64) >> (4 * (i / 64))) & 15;
      vi hi = (bytes16(b + 128 + h * 32 + i % 32) >> (2 * (i / 32))) & 3;
      vf dl = bcast(d * static_cast<float>(scales[c]));
      emit(C<c>{}, fl((lo | (hi << 4)) - 32) * dl);
    });
  }
};

// calls fn(Format{}) for the format of GGML type id qtype
template <class Fn>
decltype(auto) with_format(int64_t qtype, Fn&& fn) {
  if (qtype == kQ5_0R) return fn(Q5_0R{});
  return with_format_of<Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K>(qtype, fn);
}

QUANT_INLINE void store16(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// round to nearest even: what float -> bfloat16 does in torch (a NaN stays a NaN: vcvtneps2bf16
// keeps its sign and payload, the arithmetic gives torch's 0x7FC0)
QUANT_INLINE void store16(bf16* p, vf v) {
#ifdef __AVX512BF16__
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh((__m512)v));
#else
  vu u = (vu)v;
  vu r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
  r = v != v ? vu{} + 0x7FC0 : r;
#ifdef __AVX512F__
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)r));
#else
  vh h = __builtin_convertvector(r, vh);
  std::memcpy(p, &h, sizeof(h));
#endif
#endif
}

QUANT_INLINE float hsum(vf v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return v[0] + v[1];
}

template <class F, typename T>
void dequant_row(const uint8_t* row, T* out, int64_t blocks) {
  for (int64_t i = 0; i < blocks; ++i)
    F::block(row + i * F::kBytes, [&](auto c, vf w) QUANT_FLATTEN {
      store16(out + i * F::kBlock + 16 * decltype(c)::value, w);
    });
}

// rows ids[0..count) (or lo..hi when ids is null) of the weight, dequantized into out
template <typename T>
void dequant_rows(const uint8_t* data, int64_t qtype, int64_t k, int64_t row_bytes,
                  const int64_t* ids, int64_t lo, int64_t hi, T* out) {
  with_format(qtype, [&](auto fmt) {
    using F = decltype(fmt);
    for (int64_t r = lo; r < hi; ++r) {
      int64_t src = ids != nullptr ? ids[r] : r;
      dequant_row<F>(data + src * row_bytes, out + (r - lo) * k, k / F::kBlock);
    }
  });
}

}  // namespace

namespace vserve_quant {

// each format's weights per block and bytes per block (quant_formats.cpp)
int64_t block_size(int64_t qtype);
int64_t block_bytes(int64_t qtype);
// data: a contiguous CPU uint8 [N, row_bytes] of whole blocks of format qtype, K inputs a row
void check_weight(const at::Tensor& data, int64_t qtype, int64_t k);
// x: a contiguous CPU fp32 or bf16 [M, K]
void check_activations(const at::Tensor& x, int64_t k);
void check_out_dtype(at::ScalarType dtype);
// the rows a thread takes at least of a weight of row_bytes a row
int64_t row_grain(int64_t row_bytes);

}  // namespace vserve_quant
