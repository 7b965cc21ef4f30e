// What the AVX512-VNNI kernels share (quant_gemv.cpp, quant_gemm.cpp, quant_amx.cpp): the
// activations' rounding to int8 per block of 32, each format's quants unpacked to the unsigned
// bytes vpdpbusd takes (and the offset they carry), and the GEMM tiles' transpose and stores.
#pragma once

#include "quant_formats.h"
#include "quant_paths.h"

#ifdef QUANT_VNNI

#include <immintrin.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace {

// 16 activations as fp32: bf16 widens exactly (the gemv takes x in its dtype, no copy)
QUANT_INLINE __m512 load_x16(const float* p) { return _mm512_loadu_ps(p); }
QUANT_INLINE __m512 load_x16(const bf16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 32 activations rounded to int8 (lanes of q0: the first 16, q1: the rest) with their d_x:
// d_x = amax / 127, q = round(x / d_x) to nearest even. A NaN or infinity makes d_x NaN (the
// rows' outputs are NaN, as on the exact path); an amax below ~4e-37, whose 1 / d_x
// overflows, counts as a zero block.
struct XBlock {
  __m512i q0, q1;
  float d;
};

template <typename T>
QUANT_INLINE XBlock quantize_block(const T* p) {
  const __m512 sign = _mm512_set1_ps(-0.0f), big = _mm512_set1_ps(FLT_MAX);
  __m512 v0 = load_x16(p), v1 = load_x16(p + 16);
  __m512 a0 = _mm512_andnot_ps(sign, v0), a1 = _mm512_andnot_ps(sign, v1);
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
  bool bad = (_mm512_cmp_ps_mask(a0, big, _CMP_NLE_UQ) |
              _mm512_cmp_ps_mask(a1, big, _CMP_NLE_UQ)) != 0;
  float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  if (std::isinf(id)) id = 0.0f;
  if (bad) {
    d = std::numeric_limits<float>::quiet_NaN();
    id = 0.0f;
  }
  __m512 vid = _mm512_set1_ps(id);
  return {_mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)), _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid)),
          d};
}

// the high nibble of each byte: one vgf2p8affineqb where the CPU has GFNI (its bit matrix
// moves bits 4-7 to 0-3 and clears the rest), else a shift and a mask
QUANT_INLINE __m512i high_nibbles(__m512i v) {
#ifdef __GFNI__
  return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000LL), 0);
#else
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
#endif
}

// the 16 nibble bytes at a and at b as [a low, a high, b low, b high]: blocks a, b in order
QUANT_INLINE __m512i nibbles_pair(const uint8_t* a, const uint8_t* b) {
  __m256i t = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 4), 1);
  u = _mm512_shuffle_i64x2(u, u, 0xD8);  // 128-bit lanes 0, 2, 1, 3
  return _mm512_and_si512(u, _mm512_set1_epi8(15));
}

// the 32-weight formats: unpack(a, b) gives the unsigned quants of blocks a and b in order;
// their offset is what vpdpbusd's start takes away
template <class F>
struct Vnni32;

template <>
struct Vnni32<Q4_0> {
  static QUANT_INLINE __m512i unpack(const uint8_t* a, const uint8_t* b) {
    return nibbles_pair(a + 2, b + 2);
  }
};

template <>
struct Vnni32<Q5_0> {
  static QUANT_INLINE __m512i unpack(const uint8_t* a, const uint8_t* b) {
    __m512i u = nibbles_pair(a + 6, b + 6);
    uint32_t ha, hb;
    std::memcpy(&ha, a + 2, 4);
    std::memcpy(&hb, b + 2, 4);
    __mmask64 high = _mm512_kunpackd(_cvtu32_mask32(hb), _cvtu32_mask32(ha));
    return _mm512_mask_add_epi8(u, high, u, _mm512_set1_epi8(16));
  }
};

template <>
struct Vnni32<Q8_0> {
  static QUANT_INLINE __m512i unpack(const uint8_t* a, const uint8_t* b) {
    __m512i u = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), 1);
    return _mm512_xor_si512(u, _mm512_set1_epi8(static_cast<char>(0x80)));
  }
};

// Q4_K / Q5_K: the unsigned quants of chunk (h, p) of a super-block, from the 64 quant bytes
// of half h (`bytes`) and, for Q5_K, its 32 fifth-bit bytes in both 256-bit halves (`high`,
// `kquant_high`): sub-block 4h + p in the first 32 bytes, 4h + 2 + p in the last 32
QUANT_INLINE __m512i kquant_high(const uint8_t* b) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
}

template <bool kFifth>
QUANT_INLINE __m512i kquant_chunk(__m512i bytes, __m512i high, int h, int p) {
  __m512i q = p == 0 ? _mm512_and_si512(bytes, _mm512_set1_epi8(15)) : high_nibbles(bytes);
  if constexpr (kFifth) {
    const int sa = 4 * h + p, sb = sa + 2;
    const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8(static_cast<char>(1 << sa)),
                                           _mm256_set1_epi8(static_cast<char>(1 << sb)), 1);
    q = _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(high, bit), q, _mm512_set1_epi8(16));
  }
  return q;
}

// Q6_K: the 2-bit pairs of half h (its 32 high bytes, then the same shifted by 2), and the
// unsigned quants of chunk q of the half from them and its 64 low bytes
QUANT_INLINE __m512i q6k_pairs(const uint8_t* b, int h) {
  __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
  return _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
}

QUANT_INLINE __m512i q6k_chunk(__m512i low, __m512i pairs, int q) {
  const __m512i lo4 = _mm512_set1_epi8(15), hi2 = _mm512_set1_epi8(0x30);
  return q == 0 ? _mm512_or_si512(_mm512_and_si512(low, lo4),
                                  _mm512_and_si512(_mm512_slli_epi16(pairs, 4), hi2))
                : _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), lo4),
                                  _mm512_and_si512(pairs, hi2));
}

// the offset of each format's unsigned quants, which the int32 sums start without
// (x_layout, x_sums: quant_gemv.cpp)
template <class F>
constexpr int x_offset() {
  if constexpr (std::is_same_v<F, Q4_0>) return 8;
  else if constexpr (std::is_same_v<F, Q5_0> || std::is_same_v<F, Q5_0R>) return 16;
  else if constexpr (std::is_same_v<F, Q8_0>) return 128;
  else if constexpr (std::is_same_v<F, Q6_K>) return 32;
  else return 0;
}

constexpr int kTileN = 32;  // output rows (columns of y) per tile: two vectors of int32 lanes

// r[j] := int32 lane j of each of r[0..15] (a 16 x 16 transpose of int32)
QUANT_INLINE void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // now r[4a + c] holds, in its 128-bit lane l, int32 lane 4l + c of rows 4a..4a+3; the two
  // shuffles below gather lane l of the four groups of rows into r[4l + c]
  for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);       // lanes 0, 2 of each
    t[4 + c] = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);   // lanes 1, 3
    t[8 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);        // 128-bit lane 0
    r[8 + c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xDD);    // lane 2
    r[4 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0x88);  // lane 1
    r[12 + c] = _mm512_shuffle_i32x4(t[4 + c], t[12 + c], 0xDD);  // lane 3
  }
}

// a row's 32 results of a tile; `stream`: past the caches (an output too large to stay in
// them, e.g. the logits: no read of the line before it is written)
QUANT_INLINE void store_cols(const float* src, void* y, bool bf16_out, int64_t ldy, int64_t m,
                             int64_t n0, int64_t cols, bool stream) {
  if (bf16_out) {
    bf16* row = static_cast<bf16*>(y) + m * ldy + n0;
    if (cols == kTileN && stream && (reinterpret_cast<uintptr_t>(row) & 63) == 0) {
      alignas(64) bf16 line[kTileN];  // store16 rounds (with or without AVX512-BF16)
      store16(line, (vf)_mm512_loadu_ps(src));
      store16(line + 16, (vf)_mm512_loadu_ps(src + 16));
      _mm512_stream_si512(reinterpret_cast<__m512i*>(row), _mm512_load_si512(line));
    } else if (cols == kTileN) {
      store16(row, (vf)_mm512_loadu_ps(src));
      store16(row + 16, (vf)_mm512_loadu_ps(src + 16));
    } else {
      for (int64_t j = 0; j < cols; ++j) row[j] = static_cast<bf16>(src[j]);
    }
  } else {
    std::memcpy(static_cast<float*>(y) + m * ldy + n0, src, cols * sizeof(float));
  }
}

}  // namespace

#endif  // QUANT_VNNI
