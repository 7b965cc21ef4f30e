// The int8 gemv on AVX2 (no AVX512-VNNI): quant_gemv.cpp's int8 gemv arithmetic in 256-bit
// registers, the multiply-add of byte pairs that llama.cpp's AVX2 dot products use. Formats
// and their semantics: quant_formats.h, quant_api.cpp; declared in quant_avx2.h; checked against
// gguf.quants by tests/cpu_ops/test_quant_kernels.py (`quant.gemv_avx2`).
//
// The activations are quantized once per call, per block of 32 of each row: d_x = amax / 127
// (fp32), q_x = round(x / d_x) in -127..127 (a NaN or infinity makes d_x NaN, an amax whose
// 1 / d_x overflows counts as a zero block, as in quant_vnni.h). Each 32 weights of a row unpack
// to 32 bytes in order: Q8_0 / Q6_K as their signed quants (q, q - 32), whose dot with q_x is
// vpmaddubsw(|w|, sign(q_x, w)) then vpmaddwd with ones (no int16 pair sum exceeds
// 2 * 128 * 127); Q4_0 / Q5_0 / Q4_K / Q5_K as their unsigned quants (0..31) straight into
// vpmaddubsw, with Q4_0's and Q5_0's offsets (8, 16) and the K-quants' mins taken away as
// d * offset * d_x * sum(q_x) (K-quants: dmin * min_j per sub-block). The eight int32 lanes
// of a block's dot are scaled in fp32 by d_w * d_x (Q6_K: lanes 0-3 and 4-7 by their own
// 16-weight scales) into fp32 accumulators; Q4_0 / Q5_0 / Q8_0 convert eight blocks' scales
// at once (rows32). With AVX-VNNI one vpdpbusd takes the place of vpmaddubsw and vpmaddwd
// (`dot_lanes`). The only error beyond fp32 summation is the activations' rounding, as on the
// VNNI path (the offsets' and mins' terms are subtracted in fp32, so a block of weights at
// their offset gives a residue of fp32 rounding rather than an exact 0).
#include "quant_avx2.h"

#ifdef QUANT_AVX2_INT8

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "quant_blocks.h"
#include "row_shares.h"

namespace {

using bf16 = c10::BFloat16;
using namespace vserve_qblock;  // C, unroll, half_at, scale_min, with_format_of

QUANT_INLINE __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

QUANT_INLINE __m256i bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }

// the 16 nibble bytes at p as 32 quants: low nibbles (weights 0-15), then high (16-31)
QUANT_INLINE __m256i nibbles32(const uint8_t* p) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), bytes(15));
}

// bit j of h as byte j: 0xFF where set
QUANT_INLINE __m256i bit_bytes(uint32_t h) {
  const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                            0x0303030303030303LL);
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(h)), spread);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
}

// Each rows() format's (the K-quants, Q6_K) `block(p, emit, mins)` calls emit(C<j>, w, scale)
// for the 32-weight groups j of the block at p: w its 32 quants (signed when kSigned, else
// unsigned), scale the fp32 factor of each int32 lane of their dot. The K-quants with mins
// also call mins(v): v lane j = dmin * min_j of sub-block j.

// The 32-weight formats: an fp16 scale, then the quants. `quants(b)` gives them as bytes in
// order: Q8_0 signed; Q4_0 / Q5_0 unsigned (0..15 / 0..31), their offset kOffset (8 / 16)
// taken away per block as d_w * kOffset * d_x * sum(q_x), as the K-quants' mins are.
struct Q4_0 {
  static constexpr int kBlock = 32, kBytes = 18, kOffset = 8;
  static constexpr bool kSigned = false;
  static QUANT_INLINE __m256i quants(const uint8_t* b) { return nibbles32(b + 2); }
};

struct Q5_0 {
  static constexpr int kBlock = 32, kBytes = 22, kOffset = 16;
  static constexpr bool kSigned = false;
  static QUANT_INLINE __m256i quants(const uint8_t* b) {
    uint32_t h;
    std::memcpy(&h, b + 2, sizeof(h));
    return _mm256_or_si256(nibbles32(b + 6), _mm256_and_si256(bit_bytes(h), bytes(16)));
  }
};

struct Q8_0 {
  static constexpr int kBlock = 32, kBytes = 34, kOffset = 0;
  static constexpr bool kSigned = true;
  static QUANT_INLINE __m256i quants(const uint8_t* b) { return load32(b + 2); }
};

// Q4_K / Q5_K: 32-byte group g of nibbles holds sub-block 2g (low) and 2g + 1 (high); Q5_K
// adds bit j of fifth-bit byte l to weight l of sub-block j
template <bool kFifth>
struct KQuant {
  static constexpr int kBlock = 256, kBytes = kFifth ? 176 : 144;
  static constexpr bool kSigned = false;
  template <class Emit, class Mins>
  static QUANT_INLINE void block(const uint8_t* b, Emit&& emit, Mins&& mins) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* s = b + 4;
    const uint8_t* qs = b + (kFifth ? 48 : 16);
    const __m256i high = kFifth ? load32(b + 16) : _mm256_setzero_si256();
    alignas(32) float m[8];
    unroll<4>([&](auto g) QUANT_FLATTEN {
      constexpr int i = decltype(g)::value;
      const __m256i v = load32(qs + 32 * i);
      unroll<2>([&](auto half) QUANT_FLATTEN {
        constexpr int j = 2 * i + decltype(half)::value;
        __m256i q = _mm256_and_si256(half.value ? _mm256_srli_epi16(v, 4) : v, bytes(15));
        if constexpr (kFifth)  // bit j of each byte to bit 4
          q = _mm256_or_si256(
              q, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(high, j), 4), bytes(16)));
        int scale, min;
        scale_min(s, j, scale, min);
        m[j] = dmin * static_cast<float>(min);
        emit(C<j>{}, q, _mm256_set1_ps(d * static_cast<float>(scale)));
      });
    });
    mins(_mm256_load_ps(m));
  }
};

using Q4_K = KQuant<false>;
using Q5_K = KQuant<true>;

// Q6_K: weight i of half h (128 weights) takes the nibble i / 64 of low byte h * 64 + i % 64
// and the 2-bit pair i / 32 of high byte h * 32 + i % 32; one int8 scale per 16 weights
struct Q6_K {
  static constexpr int kBlock = 256, kBytes = 210;
  static constexpr bool kSigned = true;
  template <class Emit, class Mins>
  static QUANT_INLINE void block(const uint8_t* b, Emit&& emit, Mins&&) {
    const float d = half_at(b + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    unroll<2>([&](auto half) QUANT_FLATTEN {
      constexpr int h = decltype(half)::value;
      const __m256i l0 = load32(b + 64 * h), l1 = load32(b + 64 * h + 32);
      const __m256i hb = load32(b + 128 + 32 * h);
      unroll<4>([&](auto chunk) QUANT_FLATTEN {
        constexpr int c = decltype(chunk)::value, j = 4 * h + c;
        const __m256i low = c % 2 == 0 ? l0 : l1;
        const __m256i lo = _mm256_and_si256(c < 2 ? low : _mm256_srli_epi16(low, 4), bytes(15));
        // pair c of each high byte to bits 4-5
        __m256i hi;
        if constexpr (c == 0)
          hi = _mm256_slli_epi16(hb, 4);
        else if constexpr (c == 1)
          hi = _mm256_slli_epi16(hb, 2);
        else if constexpr (c == 2)
          hi = hb;
        else
          hi = _mm256_srli_epi16(hb, 2);
        const __m256i q = _mm256_or_si256(lo, _mm256_and_si256(hi, bytes(0x30)));
        const __m256 scale = _mm256_set_m128(
            _mm_set1_ps(d * static_cast<float>(scales[2 * j + 1])),
            _mm_set1_ps(d * static_cast<float>(scales[2 * j])));
        emit(C<j>{}, _mm256_sub_epi8(q, bytes(32)), scale);
      });
    });
  }
};

// the activations of M rows: quants [blocks][M][32], d_x [M][blocks], d_x * sum(q_x)
// [M][blocks]
struct XRows {
  const int8_t* q;
  const float* dx;
  const float* sx;
  int64_t blocks;
};

QUANT_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
QUANT_INLINE __m256 load8(const bf16* p) {  // bf16 widens exactly
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

QUANT_INLINE float hmax(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

QUANT_INLINE float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

QUANT_INLINE int32_t hsum(__m256i v) {
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  return _mm_cvtsi128_si32(h);
}

// row mi of x [.., K] into the XRows of M rows at q, dx, sx
template <typename T>
void quantize_row(const T* x, int64_t mi, int64_t m_rows, int64_t blocks, int8_t* q, float* dx,
                  float* sx) {
  const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(FLT_MAX);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps();
    int bad = 0;
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x + 32 * b + 8 * i);
      const __m256 a = _mm256_andnot_ps(sign, v[i]);
      amax = _mm256_max_ps(amax, a);
      bad |= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_NLE_UQ));
    }
    float d = hmax(amax) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    if (std::isinf(id)) id = 0.0f;
    if (bad != 0) {
      d = std::numeric_limits<float>::quiet_NaN();
      id = 0.0f;
    }
    const __m256 vid = _mm256_set1_ps(id);
    __m256i i[4];
    for (int t = 0; t < 4; ++t) i[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], vid));
    const int32_t sum = hsum(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]),
                                              _mm256_add_epi32(i[2], i[3])));
    // packs work per 128-bit lane: the permute puts the 32 bytes back in order
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_store_si256(reinterpret_cast<__m256i*>(q + (b * m_rows + mi) * 32), p);
    dx[mi * blocks + b] = d;
    sx[mi * blocks + b] = d * static_cast<float>(sum);
  }
}

// the int32 lanes of the dot of 32 unsigned quants (<= 128) with 32 signed activations: lane
// i sums the products of bytes 4i..4i+3; one vpdpbusd with AVX-VNNI (Intel's client cores
// from Alder Lake, without AVX-512), else vpmaddubsw and vpmaddwd. The same integers either
// way (no int16 pair sum saturates), so the two builds' products are equal, bit for bit.
QUANT_INLINE __m256i dot_lanes(__m256i u, __m256i s) {
#ifdef QUANT_AVX2_VNNI
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// acc[m][a] += (the int32 lanes of q . row m's 32 quants at xb) * scale(m), for the M rows;
// q signed (kSigned: through |q| and sign(x, q)) or unsigned
template <bool kSigned, int M, int A, int a, class Scale>
QUANT_INLINE void add_dots(__m256i q, const int8_t* xb, __m256 (&acc)[M][A], C<a>,
                           Scale&& scale) {
  __m256i aq = q;
  if constexpr (kSigned) aq = _mm256_sign_epi8(q, q);  // |q|
  unroll<M>([&](auto m) QUANT_FLATTEN {
    constexpr int mi = decltype(m)::value;
    __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(xb + 32 * mi));
    if constexpr (kSigned) xv = _mm256_sign_epi8(xv, q);
    acc[mi][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_lanes(aq, xv)), scale(C<mi>{}), acc[mi][a]);
  });
}

// y[mi, r] = v, in the output's dtype
QUANT_INLINE void store_y(void* y, bool bf16_out, int64_t n, int64_t mi, int64_t r, float v) {
  if (bf16_out)
    static_cast<bf16*>(y)[mi * n + r] = static_cast<bf16>(v);
  else
    static_cast<float*>(y)[mi * n + r] = v;
}

// y[m, r] = x[m] . w[r] for rows r0..r1 of a 256-weight format, all M activation rows at
// once: each weight group is unpacked once and dotted with the M rows' quants; one row alone
// keeps two accumulator chains (the 32-weight formats take rows32)
template <class F, int M>
void rows(const uint8_t* w, int64_t row_bytes, const XRows& x, void* y, bool bf16_out,
          int64_t n, int64_t r0, int64_t r1) {
  static_assert(F::kBlock == 256, "rows() takes the super-block formats");
  constexpr int A = M == 1 ? 2 : 1, G = F::kBlock / 32;
  const int64_t units = x.blocks / G;
  for (int64_t r = r0; r < r1; ++r) {
    vserve_rows::fetch_ahead(w, row_bytes, r, r1);
    const uint8_t* row = w + r * row_bytes;
    __m256 acc[M][A], macc[M];
    unroll<M>([&](auto m) QUANT_FLATTEN {
      macc[m.value] = _mm256_setzero_ps();
      unroll<A>([&](auto a) QUANT_FLATTEN { acc[m.value][a.value] = _mm256_setzero_ps(); });
    });
    for (int64_t u = 0; u < units; ++u) {
      const int64_t b0 = u * G;
      F::block(
          row + u * F::kBytes,
          [&](auto j, __m256i q, __m256 scale) QUANT_FLATTEN {
            constexpr int a = decltype(j)::value % A;
            const int64_t b = b0 + decltype(j)::value;
            add_dots<F::kSigned>(q, x.q + b * M * 32, acc, C<a>{}, [&](auto m) QUANT_FLATTEN {
              return _mm256_mul_ps(scale, _mm256_broadcast_ss(x.dx + m.value * x.blocks + b));
            });
          },
          [&](__m256 mins) QUANT_FLATTEN {
            unroll<M>([&](auto m) QUANT_FLATTEN {
              constexpr int mi = decltype(m)::value;
              macc[mi] = _mm256_fmadd_ps(mins, _mm256_loadu_ps(x.sx + mi * x.blocks + b0),
                                         macc[mi]);
            });
          });
    }
    unroll<M>([&](auto m) QUANT_FLATTEN {
      constexpr int mi = decltype(m)::value;
      __m256 s = acc[mi][0];
      if constexpr (A > 1) s = _mm256_add_ps(s, acc[mi][1]);
      store_y(y, bf16_out, n, mi, r, hsum(s) - hsum(macc[mi]));
    });
  }
}

// the fp16 scales of the N <= 8 blocks from b (kBytes apart) as fp32, 0 past the N-th:
// gathered in integer registers, converted by one vcvtph2ps
template <int kBytes, int N>
QUANT_INLINE __m256 scales8(const uint8_t* b) {
  uint64_t lo = 0, hi = 0;
  unroll<N>([&](auto i) QUANT_FLATTEN {
    uint16_t h;
    std::memcpy(&h, b + i.value * kBytes, sizeof(h));
    (i.value < 4 ? lo : hi) |= static_cast<uint64_t>(h) << (16 * (i.value % 4));
  });
  return _mm256_cvtph_ps(_mm_set_epi64x(static_cast<long long>(hi), static_cast<long long>(lo)));
}

// the first N <= 8 floats at p, 0 in the other lanes (nothing read past them)
template <int N>
QUANT_INLINE __m256 first8(const float* p) {
  if constexpr (N == 8) {
    return _mm256_loadu_ps(p);
  } else {
    const __m256i live =
        _mm256_cmpgt_epi32(_mm256_set1_epi32(N), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_ps(p, live);
  }
}

// rows() for the 32-weight formats, eight blocks a step: their scales are converted and
// multiplied by the rows' d_x as one vector each (kept in `s`, one broadcast load per block),
// and an offset format's d_w * d_x * sum(q_x) terms are one fma per row
template <class F, int M>
void rows32(const uint8_t* w, int64_t row_bytes, const XRows& x, void* y, bool bf16_out,
            int64_t n, int64_t r0, int64_t r1) {
  constexpr int A = M == 1 ? 2 : 1;
  const int64_t blocks = x.blocks;
  for (int64_t r = r0; r < r1; ++r) {
    vserve_rows::fetch_ahead(w, row_bytes, r, r1);
    const uint8_t* row = w + r * row_bytes;
    __m256 acc[M][A], macc[M];
    alignas(32) float s[M][8];
    unroll<M>([&](auto m) QUANT_FLATTEN {
      macc[m.value] = _mm256_setzero_ps();
      unroll<A>([&](auto a) QUANT_FLATTEN { acc[m.value][a.value] = _mm256_setzero_ps(); });
    });
    auto scale_group = [&](int64_t b0, auto count) QUANT_FLATTEN {
      constexpr int cnt = decltype(count)::value;
      const __m256 d = scales8<F::kBytes, cnt>(row + b0 * F::kBytes);
      unroll<M>([&](auto m) QUANT_FLATTEN {
        constexpr int mi = decltype(m)::value;
        const float* dx = x.dx + mi * blocks + b0;
        _mm256_store_ps(s[mi], _mm256_mul_ps(d, first8<cnt>(dx)));
        if constexpr (F::kOffset != 0)
          macc[mi] = _mm256_fmadd_ps(d, first8<cnt>(x.sx + mi * blocks + b0), macc[mi]);
      });
    };
    auto one_block = [&](int64_t b, auto j) QUANT_FLATTEN {
      add_dots<F::kSigned>(F::quants(row + b * F::kBytes), x.q + b * M * 32, acc,
                           C<decltype(j)::value % A>{}, [&](auto m) QUANT_FLATTEN {
                             return _mm256_broadcast_ss(&s[m.value][decltype(j)::value]);
                           });
    };
    auto group = [&](int64_t b0, auto count) QUANT_FLATTEN {
      scale_group(b0, count);
      unroll<decltype(count)::value>([&](auto j) QUANT_FLATTEN { one_block(b0 + j.value, j); });
    };
    int64_t b0 = 0;
    for (; b0 + 8 <= blocks; b0 += 8) group(b0, C<8>{});
    switch (blocks - b0) {  // the last 1-7 blocks
      case 1: group(b0, C<1>{}); break;
      case 2: group(b0, C<2>{}); break;
      case 3: group(b0, C<3>{}); break;
      case 4: group(b0, C<4>{}); break;
      case 5: group(b0, C<5>{}); break;
      case 6: group(b0, C<6>{}); break;
      case 7: group(b0, C<7>{}); break;
      default: break;
    }
    unroll<M>([&](auto m) QUANT_FLATTEN {
      constexpr int mi = decltype(m)::value;
      __m256 t = acc[mi][0];
      if constexpr (A > 1) t = _mm256_add_ps(t, acc[mi][1]);
      if constexpr (F::kOffset != 0)
        t = _mm256_fnmadd_ps(_mm256_set1_ps(static_cast<float>(F::kOffset)), macc[mi], t);
      store_y(y, bf16_out, n, mi, r, hsum(t));
    });
  }
}

template <class F, int M = 1>
void dispatch(int64_t m, const uint8_t* w, int64_t row_bytes, const XRows& x, void* y,
              bool bf16_out, int64_t n, int64_t r0, int64_t r1) {
  if constexpr (M < 8) {
    if (m != M) {
      dispatch<F, M + 1>(m, w, row_bytes, x, y, bf16_out, n, r0, r1);
      return;
    }
  }
  // the 32-weight formats (Q4_0, Q5_0, Q8_0) eight blocks a step; the 256-weight ones a block
  if constexpr (F::kBlock == 32)
    rows32<F, M>(w, row_bytes, x, y, bf16_out, n, r0, r1);
  else
    rows<F, M>(w, row_bytes, x, y, bf16_out, n, r0, r1);
}

}  // namespace

namespace vserve_quant {

int64_t avx2_x_bytes(int64_t m, int64_t k) { return k / 32 * m * (32 + 2 * 4); }

namespace {

XRows x_rows(const uint8_t* buf, int64_t m, int64_t k) {
  const int64_t blocks = k / 32;
  const auto* q = reinterpret_cast<const int8_t*>(buf);
  const auto* dx = reinterpret_cast<const float*>(q + blocks * m * 32);
  return {q, dx, dx + blocks * m, blocks};
}

}  // namespace

// buf: avx2_x_bytes(m, k) bytes, 32-byte aligned: quants [blocks][M][32], d_x [M][blocks],
// d_x * sum(q_x) [M][blocks]
template <typename T>
void avx2_prepare(const T* x, int64_t m, int64_t k, uint8_t* buf) {
  const XRows xr = x_rows(buf, m, k);
  auto* q = const_cast<int8_t*>(xr.q);
  auto* dx = const_cast<float*>(xr.dx);
  for (int64_t mi = 0; mi < m; ++mi)
    quantize_row(x + mi * k, mi, m, xr.blocks, q, dx, const_cast<float*>(xr.sx));
}
template void avx2_prepare(const float*, int64_t, int64_t, uint8_t*);
template void avx2_prepare(const c10::BFloat16*, int64_t, int64_t, uint8_t*);

void avx2_rows(const uint8_t* buf, int64_t m, int64_t k, int64_t qtype, const uint8_t* w,
               int64_t row_bytes, void* y, bool bf16_out, int64_t ldy, int64_t r0, int64_t r1) {
  const XRows xr = x_rows(buf, m, k);
  with_format_of<Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K>(qtype, [&](auto fmt) {
    dispatch<decltype(fmt)>(m, w, row_bytes, xr, y, bf16_out, ldy, r0, r1);
  });
}

// The GEMM, M > 8 rows: the rows quantized once, in panels of kPanel rows (each its own
// XRows); each thread takes tiles of output rows small enough to stay in L1 (kTileBytes of
// weights) and runs every panel over a tile before the next, so a weight row is read from
// memory once and unpacked once per panel, not once per activation row.
constexpr int64_t kPanel = 8, kTileBytes = 16 << 10;

at::Tensor gemm_avx2(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k) {
  const int64_t m = x.size(0), n = data.size(0), row_bytes = data.size(1);
  const int64_t panels = (m + kPanel - 1) / kPanel;
  const int64_t panel_bytes = (avx2_x_bytes(kPanel, k) + 63) / 64 * 64;
  auto buf = at::empty({panels * panel_bytes}, data.options());  // 64-byte aligned
  uint8_t* bp = buf.data_ptr<uint8_t>();
  const bool bf16_out = x.scalar_type() == at::kBFloat16;
  auto rows_of = [&](int64_t p) { return std::min(kPanel, m - p * kPanel); };
  for (int64_t p = 0; p < panels; ++p) {
    if (bf16_out)
      avx2_prepare(x.data_ptr<bf16>() + p * kPanel * k, rows_of(p), k, bp + p * panel_bytes);
    else
      avx2_prepare(x.data_ptr<float>() + p * kPanel * k, rows_of(p), k, bp + p * panel_bytes);
  }
  auto out = at::empty({m, n}, x.options());
  const uint8_t* w = data.data_ptr<uint8_t>();
  auto* yp = static_cast<uint8_t*>(out.data_ptr());
  const int64_t y_panel = kPanel * n * x.element_size();
  const int64_t tile = std::max<int64_t>(4, kTileBytes / row_bytes);
  vserve_rows::stream_rows(
      n, row_bytes,
      [&](int64_t lo, int64_t hi) {
        for (int64_t r0 = lo; r0 < hi; r0 += tile) {
          const int64_t r1 = std::min(hi, r0 + tile);
          for (int64_t p = 0; p < panels; ++p)
            avx2_rows(bp + p * panel_bytes, rows_of(p), k, qtype, w, row_bytes,
                      yp + p * y_panel, bf16_out, n, r0, r1);
        }
      },
      tile * row_bytes);
  return out;
}

at::Tensor gemv_avx2(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k) {
  const int64_t m = x.size(0), n = data.size(0), row_bytes = data.size(1);
  auto buf = at::empty({avx2_x_bytes(m, k)}, data.options());  // 64-byte aligned
  uint8_t* bp = buf.data_ptr<uint8_t>();
  const bool bf16_out = x.scalar_type() == at::kBFloat16;
  if (bf16_out)
    avx2_prepare(x.data_ptr<bf16>(), m, k, bp);
  else
    avx2_prepare(x.data_ptr<float>(), m, k, bp);
  auto out = at::empty({m, n}, x.options());
  const uint8_t* w = data.data_ptr<uint8_t>();
  void* yp = out.data_ptr();
  vserve_rows::stream_rows(n, row_bytes, [&](int64_t lo, int64_t hi) {
    avx2_rows(bp, m, k, qtype, w, row_bytes, yp, bf16_out, n, lo, hi);
  });
  return out;
}

}  // namespace vserve_quant

#endif  // QUANT_AVX2_INT8
