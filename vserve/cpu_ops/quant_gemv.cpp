// The gemv on GGUF blocks: x W^T for up to 8 activation rows, streaming each weight row once
// and multiplying each chunk of it with all M activation rows (formats: quant_formats.h).
// Two paths, which quant_api.cpp's `gemv` picks between: the exact one (fp32 activations, each
// 16 weights dequantized to fp32 in registers) and, with AVX512-VNNI, the int8 one (below).
// Also the gemv in two halves for the decode stack (`gemv_prepare`, `gemv_rows`: quant.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "quant.h"
#include "quant_avx2.h"
#include "quant_formats.h"
#include "quant_paths.h"
#include "quant_vnni.h"
#include "row_shares.h"

namespace {

// y[m, r] = x[m] . w[r] for rows r0..r1 of the weight, all M activation rows at once (x fp32,
// packed by `pack_x` when M > 1). Each weight chunk is dequantized once and multiply-added
// into M accumulators; one activation row alone keeps 4 independent chains (the FMA latency
// would bound it otherwise), and a 32-weight format takes two blocks a step so that both its
// chunks and its pair fill them.
template <class F, int M>
void gemv_rows(const uint8_t* w, int64_t row_bytes, const float* x, int64_t k, void* y,
               bool bf16_out, int64_t n, int64_t r0, int64_t r1) {
  constexpr int A = M == 1 ? 4 : (M == 2 ? 2 : 1);
  constexpr int U = F::kBlock == 32 ? 2 : 1, kChunks = F::kBlock / 16;
  const int64_t blocks = k / F::kBlock;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    vf acc[M][A] = {};
    auto step = [&](const uint8_t* blk, const float* xb, auto u) QUANT_FLATTEN {
      F::block(blk, [&](auto c, vf wv) QUANT_FLATTEN {
        constexpr int a = (decltype(u)::value * kChunks + decltype(c)::value) % A;
        unroll<M>([&](auto m) QUANT_FLATTEN {
          constexpr int mi = decltype(m)::value;
          acc[mi][a] += wv * load16(xb + (decltype(c)::value * M + mi) * 16);
        });
      });
    };
    int64_t i = 0;
    for (; i + U <= blocks; i += U)
      unroll<U>([&](auto u) QUANT_FLATTEN {
        step(row + (i + u) * F::kBytes, x + (i + u) * F::kBlock * M, u);
      });
    for (; i < blocks; ++i) step(row + i * F::kBytes, x + i * F::kBlock * M, C<0>{});
    unroll<M>([&](auto m) QUANT_FLATTEN {
      constexpr int mi = decltype(m)::value;
      vf s = acc[mi][0];
      unroll<A - 1>([&](auto a) QUANT_FLATTEN { s += acc[mi][decltype(a)::value + 1]; });
      float v = hsum(s);
      if (bf16_out)
        static_cast<bf16*>(y)[mi * n + r] = static_cast<bf16>(v);
      else
        static_cast<float*>(y)[mi * n + r] = v;
    });
  }
}

// x [M, K] as fp32 [K / 16][M][16]: the M activation chunks a weight chunk meets lie
// together, at offsets from one pointer that are constants of the unrolled code
at::Tensor pack_x(const at::Tensor& x) {
  int64_t m = x.size(0), k = x.size(1);
  return x.to(at::kFloat).reshape({m, k / 16, 16}).transpose(0, 1).contiguous();
}

template <class F, int M = 1>
void gemv_dispatch(int64_t m, const uint8_t* w, int64_t row_bytes, const float* x, int64_t k,
                   void* y, bool bf16_out, int64_t n, int64_t r0, int64_t r1) {
  if constexpr (M < 8) {
    if (m != M) {
      gemv_dispatch<F, M + 1>(m, w, row_bytes, x, k, y, bf16_out, n, r0, r1);
      return;
    }
  }
  gemv_rows<F, M>(w, row_bytes, x, k, y, bf16_out, n, r0, r1);
}

#ifdef QUANT_VNNI
// ---- the int8 gemv (AVX512-VNNI) ----
// The activations are quantized once per call, per block of 32 of each row: d_x = amax / 127
// (fp32), q_x = round(x / d_x) in -127..127. Each weight chunk of 64 quants is unpacked to
// unsigned bytes (Q4_0 / Q5_0 / Q6_K's q without their -8 / -16 / -32, Q8_0's q + 128, Q4_K /
// Q5_K's q), and vpdpbusd (unsigned weight x signed activation) sums four products per int32
// lane, starting from -offset * (the lane's four q_x) so that the lane holds the exact dot of
// the signed quants. The lanes of one block of 32 are then scaled in fp32 by d_w * d_x (times
// the sub-block scale of the K-quants; Q4_K / Q5_K subtract dmin * min_j * d_x * sum(q_x) per
// sub-block), into fp32 accumulators. Q4_0 / Q5_0 / Q8_0 take four blocks a step where the CPU
// has VBMI and BITALG (XQuad, `quad_unpack`): both vpdpbusd of the step add into the same lanes
// (each lane 8 products of one block), so the conversion and scaling run once per 128
// weights, and byte permutes replace the pair's inserts and shuffles; Q4_K / Q5_K likewise
// add a super-block's four chunks into one accumulator where the CPU also has GFNI
// (XLayout::kKSpread, `vnni_rows_kspread`). Its only error beyond
// fp32 summation is the activations' rounding: at most d_x / 2 per activation (but for blocks
// whose amax is below ~4e-37, where 1 / d_x overflows and the block counts as zero).
// On a Zen 4 (AVX-512 at half width, ~2.1-2.6 GHz) the 4-bit formats are bound by the vector
// pipes, not the memory: each 512-bit op takes two of its four 256-bit pipes' cycles, and a
// Q5_0 quad takes 15 of them (3 permutes, 2 vpshufbitqmb for the fifth bits, 2 masked adds,
// 2 nibble extractions, 2 vpdpbusd, the scales' conversion and product, the conversion and
// the multiply-add). Measured there (benchmarks/quant_gemv_speed.py, one thread, M = 1,
// weights in L3, 2026-12-01): Q4_0 22.5 GB/s, Q5_0 20.7, Q4_K 22.1, Q5_K 21.7 (before the
// quads and the spread K-quant chunks: 15.4, 15.6, 19.2, 19.3), Q8_0 35.8, Q6_K 29.3; on two
// threads from DRAM Q4_0 / Q5_0 ~40, Q4_K / Q5_K ~43, Q8_0 / Q6_K ~52 (README, "Quantized
// weights against llama.cpp"). Q5_0 repacked at load (Q5_0R: the nibbles one load, the fifth
// bits two mask loads, no byte permutes: 11 ops a quad) measured 19.2 -> 27.8 GB/s on one
// thread from cache, 33 -> 54 on two (2026-12-04, quant_gemv_speed.py --formats Q5_0,Q5_0R).

// 64 quantized activations of a row (two blocks of 32) and what a chunk of weights needs with
// them, in the order the weights' quants unpack (`XLayout`)
struct alignas(64) XChunk {
  int8_t q[64];
  int32_t off[16];  // -offset * the sum of the lane's four q (formats whose quants have one)
  float dx[16];     // the d_x of each int32 lane's block
};

// the K-quants' per-super-block values of one row: d_x of each 16 activations (Q6_K's
// scales) and of each of the 8 blocks, and d_x * sum(q_x) of each block (Q4_K / Q5_K's mins)
struct alignas(64) XSums {
  float dx[16];
  float dx8[8];
  float sx[8];
};

enum class XLayout {
  kInOrder,      // Q8_0 / Q6_K: chunk c = activations 64c..64c + 63
  kKNibbles,     // Q4_K / Q5_K otherwise: chunks of a super-block hold blocks (0, 2),
                 // (1, 3), (4, 6), (5, 7): the low and high nibbles of its 64-byte halves
  kQuads,        // Q4_0 / Q5_0 / Q8_0 (with VBMI, BITALG): XQuads of four blocks, then the last
                 // K / 32 % 4 blocks as kInOrder chunks
  kKSpread,      // Q4_K / Q5_K (with VBMI, BITALG and GFNI): chunk t of a super-block holds
                 // activations 8t..8t + 7 of each of its 8 blocks (bytes 8j.. : block j)
};

// 128 quantized activations of a row (four blocks of 32) as the Q4_0 / Q5_0 quad step unpacks
// its weights: the low nibbles of the four blocks' 16 quant bytes are their weights 0-15, the
// high nibbles 16-31, so `lo` holds activations 0-15 of each block in turn and `hi` 16-31.
// Both vpdpbusd of a quad add into the same int32 lanes (lane l: block l / 4), which are
// scaled once per four blocks. In the space of two XChunks (the tail chunks follow them).
struct alignas(64) XQuad {
  int8_t lo[64];
  int8_t hi[64];
  int32_t off[16];  // -offset * the sum of the lane's eight q
  float dx[16];     // the d_x of each lane's block
};
static_assert(sizeof(XQuad) <= 2 * sizeof(XChunk), "a quad takes the space of two chunks");

// the quads of a row of `blocks` blocks in layout `layout`
QUANT_INLINE int64_t quads_of(int64_t blocks, XLayout layout) {
  return layout == XLayout::kQuads ? blocks / 4 : 0;
}

// x [M, K] into chunks [K / 64 rounded up][M] (kQuads: quads [K / 128][M], then the chunks
// [K / 32 % 4 / 2 rounded up][M] of the last blocks), and sums [K / 256][M] when given
template <typename T>
void quantize_x(const T* x, int64_t m_rows, int64_t k, int offset, XLayout layout,
                XChunk* ch, XSums* sums) {
  const int64_t blocks = k / 32, quads = quads_of(blocks, layout);
  const int64_t tail0 = 4 * quads, tail = blocks - tail0, nch = (tail + 1) / 2;
  XQuad* xq = reinterpret_cast<XQuad*>(ch);
  XChunk* tc = ch + 2 * quads * m_rows;  // the chunks after the quads
  for (int64_t m = 0; m < m_rows; ++m) {
    if (tail & 1) std::memset(&tc[(nch - 1) * m_rows + m], 0, sizeof(XChunk));
    for (int64_t b = 0; b < blocks; ++b) {
      const XBlock xb = quantize_block(x + m * k + b * 32);
      const __m512i q0 = xb.q0, q1 = xb.q1;
      const float d = xb.d;
      __m128i b0 = _mm512_cvtepi32_epi8(q0), b1 = _mm512_cvtepi32_epi8(q1);
      if (b < tail0) {
        XQuad& xqd = xq[b / 4 * m_rows + m];
        const int i = static_cast<int>(b % 4);
        _mm_store_si128(reinterpret_cast<__m128i*>(xqd.lo + 16 * i), b0);
        _mm_store_si128(reinterpret_cast<__m128i*>(xqd.hi + 16 * i), b1);
        for (int l = 0; l < 4; ++l) xqd.dx[4 * i + l] = d;
        continue;
      }
      int64_t c = (b - tail0) / 2;
      int h = static_cast<int>((b - tail0) & 1);
      if (layout == XLayout::kKSpread) {  // 8 activations of the block into each chunk
        alignas(16) int8_t q[32];
        _mm_store_si128(reinterpret_cast<__m128i*>(q), b0);
        _mm_store_si128(reinterpret_cast<__m128i*>(q + 16), b1);
        for (int t = 0; t < 4; ++t)
          std::memcpy(tc[(b / 8 * 4 + t) * m_rows + m].q + 8 * (b % 8), q + 8 * t, 8);
      }
      if (layout == XLayout::kKNibbles) {
        int j = static_cast<int>(b % 8);
        c = b / 8 * 4 + j / 4 * 2 + j % 2;
        h = j % 4 / 2;
      }
      if (layout != XLayout::kKSpread) {
        XChunk& xc = tc[c * m_rows + m];
        _mm_store_si128(reinterpret_cast<__m128i*>(xc.q + 32 * h), b0);
        _mm_store_si128(reinterpret_cast<__m128i*>(xc.q + 32 * h + 16), b1);
        for (int l = 0; l < 8; ++l) xc.dx[8 * h + l] = d;
      }
      if (sums != nullptr) {
        XSums& xs = sums[(b / 8) * m_rows + m];
        xs.dx[b % 8 * 2] = xs.dx[b % 8 * 2 + 1] = d;
        xs.dx8[b % 8] = d;
        xs.sx[b % 8] =
            d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
      }
    }
  }
  const __m512i off = _mm512_set1_epi8(static_cast<char>(offset));
  for (int64_t i = 0; i < quads * m_rows; ++i) {
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), off, _mm512_load_si512(xq[i].lo));
    s = _mm512_dpbusd_epi32(s, off, _mm512_load_si512(xq[i].hi));
    _mm512_store_si512(xq[i].off, _mm512_sub_epi32(_mm512_setzero_si512(), s));
  }
  for (int64_t i = 0; i < nch * m_rows; ++i) {
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), off, _mm512_load_si512(tc[i].q));
    _mm512_store_si512(tc[i].off, _mm512_sub_epi32(_mm512_setzero_si512(), s));
  }
}

QUANT_INLINE __m512i idx16(int a, int b, int c, int d) {  // lanes 4i..4i+3 take index i's
  return _mm512_set_epi32(d, d, d, d, c, c, c, c, b, b, b, b, a, a, a, a);
}

// the fp16 scales of blocks a and b: lanes 0-7 and 8-15
QUANT_INLINE __m512 pair_scales(const uint8_t* a, const uint8_t* b) {
  uint16_t ha, hb;
  std::memcpy(&ha, a, 2);
  std::memcpy(&hb, b, 2);
  return _mm512_cvtph_ps(_mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_set1_epi16(static_cast<short>(ha))),
      _mm_set1_epi16(static_cast<short>(hb)), 1));
}

// Q4_0 / Q5_0, four blocks a step (XLayout::kQuads: needs vpermi2b and vpshufbitqmb). The
// quad's bytes are two (overlapping) 64-byte loads, z0 from its start and z1 ending at its
// end, and three byte permutes of them give: the four blocks' 16 nibble bytes (their low
// nibbles: weights 0-15 of each block, the high ones 16-31), Q5_0's fifth-bit words (block i's
// in both quadwords 2i, 2i + 1, where vpshufbitqmb picks the bit of each weight into a mask)
// and the four fp16 scales, one per four int32 lanes.
#ifdef QUANT_QUADS

template <class F>
constexpr bool quad_format() {
  return std::is_same_v<F, Q4_0> || std::is_same_v<F, Q5_0> || std::is_same_v<F, Q8_0> ||
         std::is_same_v<F, Q5_0R>;
}

template <class F>
struct QuadTables {
  static constexpr int kQuant = std::is_same_v<F, Q5_0> ? 6 : 2;  // nibbles' offset in a block
  static constexpr int kSpan = 4 * F::kBytes;
  alignas(64) int8_t nib[64] = {}, high[64] = {}, scale[64] = {}, bits_lo[64] = {},
                     bits_hi[64] = {};
  // vpermi2b's index of byte o of the quad in (z0, z1)
  static constexpr int8_t at(int o) {
    return static_cast<int8_t>(o < 64 ? o : 64 + o - (kSpan - 64));
  }
  constexpr QuadTables() {
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 16; ++j) {
        nib[16 * i + j] = at(F::kBytes * i + kQuant + j);
        high[16 * i + j] = at(F::kBytes * i + 2 + j % 4);  // the uint32 in every dword
        bits_lo[16 * i + j] = static_cast<int8_t>(j);        // weight j of block i
        bits_hi[16 * i + j] = static_cast<int8_t>(16 + j);   // weight 16 + j
      }
    for (int l = 0; l < 32; ++l) scale[l] = scale[32 + l] = at(F::kBytes * (l / 8) + l % 2);
  }
};

template <class F>
inline constexpr QuadTables<F> kQuadTables{};

QUANT_INLINE __m512i load64(const int8_t* p) { return _mm512_load_si512(p); }

// the unsigned quants (lo: weights 0-15 of each block, hi: 16-31) and the scales (lane l:
// block l / 4) of the four blocks at p
template <class F>
QUANT_INLINE void quad_unpack(const uint8_t* p, __m512i& lo, __m512i& hi, __m512& dw) {
  const QuadTables<F>& t = kQuadTables<F>;
  const __m512i z0 = _mm512_loadu_si512(p), z1 = _mm512_loadu_si512(p + t.kSpan - 64);
  const __m512i m15 = _mm512_set1_epi8(15);
  const __m512i nib = _mm512_permutex2var_epi8(z0, load64(t.nib), z1);
  lo = _mm512_and_si512(nib, m15);
  hi = high_nibbles(nib);
  if constexpr (std::is_same_v<F, Q5_0>) {
    const __m512i h = _mm512_permutex2var_epi8(z0, load64(t.high), z1);
    const __m512i sixteen = _mm512_set1_epi8(16);
    lo = _mm512_mask_add_epi8(lo, _mm512_bitshuffle_epi64_mask(h, load64(t.bits_lo)), lo,
                              sixteen);
    hi = _mm512_mask_add_epi8(hi, _mm512_bitshuffle_epi64_mask(h, load64(t.bits_hi)), hi,
                              sixteen);
  }
  dw = _mm512_cvtph_ps(
      _mm512_castsi512_si256(_mm512_permutex2var_epi8(z0, load64(t.scale), z1)));
}

// Q8_0 four blocks a step as well: a quad is 136 bytes, more than two loads hold, so `lo`
// (quants 0-15 of each block) and the scales come from its bytes [0, 128) and `hi` (16-31)
// from [8, 136), each by one byte permute of two loads; the quants become unsigned (q + 128)
// with one xor. Per 128 weights: 3 permutes, 2 xors, 2 vpdpbusd into the same lanes, one
// conversion and scaling (the pairs took two of each, and two scale broadcasts and inserts).
struct Q8QuadTables {
  alignas(64) int8_t lo[64] = {}, hi[64] = {}, scale[64] = {};
  constexpr Q8QuadTables() {
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 16; ++j) {
        lo[16 * i + j] = static_cast<int8_t>(Q8_0::kBytes * i + 2 + j);       // in [0, 128)
        hi[16 * i + j] = static_cast<int8_t>(Q8_0::kBytes * i + 18 + j - 8);  // in [8, 136)
      }
    for (int l = 0; l < 32; ++l)
      scale[l] = scale[32 + l] = static_cast<int8_t>(Q8_0::kBytes * (l / 8) + l % 2);
  }
};
inline constexpr Q8QuadTables kQ8QuadTables{};

template <>
QUANT_INLINE void quad_unpack<Q8_0>(const uint8_t* p, __m512i& lo, __m512i& hi, __m512& dw) {
  const Q8QuadTables& t = kQ8QuadTables;
  const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64);
  const __m512i c = _mm512_loadu_si512(p + 8), d = _mm512_loadu_si512(p + 72);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  lo = _mm512_xor_si512(_mm512_permutex2var_epi8(a, load64(t.lo), b), flip);
  hi = _mm512_xor_si512(_mm512_permutex2var_epi8(c, load64(t.hi), d), flip);
  dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi8(a, load64(t.scale), b)));
}

// Q5_0R, repacked for this step at load: the nibbles are one load, the fifth bits two masks
// as they are, the scales one word permute. Per 128 weights 11 ops against Q5_0's 15 (no
// byte permutes of the nibbles and fifth-bit words, no vpshufbitqmb).
template <>
QUANT_INLINE void quad_unpack<Q5_0R>(const uint8_t* p, __m512i& lo, __m512i& hi, __m512& dw) {
  const __m512i nib = _mm512_loadu_si512(p), sixteen = _mm512_set1_epi8(16);
  lo = _mm512_and_si512(nib, _mm512_set1_epi8(15));
  hi = high_nibbles(nib);
  uint64_t low_bits, high_bits;
  std::memcpy(&low_bits, p + Q5_0R::kLowBits, 8);
  std::memcpy(&high_bits, p + Q5_0R::kHighBits, 8);
  lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(low_bits), lo, sixteen);
  hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(high_bits), hi, sixteen);
  const __m256i d4 = _mm256_castsi128_si256(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + Q5_0R::kScales)));
  const __m256i spread = _mm256_setr_epi16(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  dw = _mm512_cvtph_ps(_mm256_permutexvar_epi16(spread, d4));  // lane l: block l / 4
}
#else
template <class F>
constexpr bool quad_format() {
  return false;
}
#endif

template <int M>
QUANT_INLINE void store_rows(__m512 (&acc)[M], const float* minus, void* y, bool bf16_out,
                             int64_t n, int64_t r) {
  unroll<M>([&](auto m) QUANT_FLATTEN {
    constexpr int mi = decltype(m)::value;
    float v = _mm512_reduce_add_ps(acc[mi]) - (minus != nullptr ? minus[mi] : 0.0f);
    if (bf16_out)
      static_cast<bf16*>(y)[mi * n + r] = static_cast<bf16>(v);
    else
      static_cast<float*>(y)[mi * n + r] = v;
  });
}

// K-quant rows: the A accumulators of each row summed, minus its eight mins terms (macc)
template <int M, int A>
QUANT_INLINE void store_kquant_rows(__m512 (&acc)[M][A], __m256 (&macc)[M], void* y,
                                    bool bf16_out, int64_t n, int64_t r) {
  __m512 sum[M];
  float minus[M];
  unroll<M>([&](auto m) QUANT_FLATTEN {
    constexpr int mi = decltype(m)::value;
    sum[mi] = acc[mi][0];
    if constexpr (A > 1) sum[mi] = _mm512_add_ps(sum[mi], acc[mi][1]);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(macc[mi]), _mm256_extractf128_ps(macc[mi], 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    minus[mi] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  });
  store_rows<M>(sum, minus, y, bf16_out, n, r);
}

// int32 lanes of the exact quant dot, from vpdpbusd started at the chunk's -offset sums
template <bool kOffset>
QUANT_INLINE __m512i dot_lanes(__m512i wq, const XChunk& x) {
  __m512i start = kOffset ? _mm512_load_si512(x.off) : _mm512_setzero_si512();
  return _mm512_dpbusd_epi32(start, wq, _mm512_load_si512(x.q));
}

// the bytes of a quad: 128 weights (four blocks of 32, or one of Q5_0R's)
template <class F>
constexpr int64_t quad_bytes() {
  return 128 / F::kBlock * F::kBytes;
}

template <class F, int M>
void vnni_rows(const uint8_t* w, int64_t row_bytes, const XChunk* xc, const XSums*, int64_t k,
               void* y, bool bf16_out, int64_t n, int64_t r0, int64_t r1) {
  using T = Vnni32<F>;
  constexpr int A = M == 1 ? 2 : 1;  // independent accumulator chains
  const int64_t blocks = k / 32;
  const int64_t quads = quads_of(blocks, quad_format<F>() ? XLayout::kQuads : XLayout::kInOrder);
  const int64_t pairs = (blocks - 4 * quads) / 2;
  const XQuad* xq = reinterpret_cast<const XQuad*>(xc);
  const XChunk* tc = xc + 2 * quads * M;  // the chunks of the blocks after the quads
  for (int64_t r = r0; r < r1; ++r) {
    vserve_rows::fetch_ahead(w, row_bytes, r, r1);
    __m512 acc[M] = {}, acc2[M] = {};
#ifdef QUANT_QUADS
    if constexpr (quad_format<F>()) {
      const uint8_t* row = w + r * row_bytes;
      auto quad = [&](int64_t q, auto u) QUANT_FLATTEN {
        __m512i lo, hi;
        __m512 dw;
        quad_unpack<F>(row + q * quad_bytes<F>(), lo, hi, dw);
        const XQuad* x = xq + q * M;
        unroll<M>([&](auto m) QUANT_FLATTEN {
          constexpr int mi = decltype(m)::value;
          __m512i d = _mm512_dpbusd_epi32(_mm512_load_si512(x[mi].off), lo,
                                          _mm512_load_si512(x[mi].lo));
          d = _mm512_dpbusd_epi32(d, hi, _mm512_load_si512(x[mi].hi));
          __m512 s = _mm512_mul_ps(dw, _mm512_load_ps(x[mi].dx));
          if constexpr (decltype(u)::value == 0)
            acc[mi] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[mi]);
          else
            acc2[mi] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc2[mi]);
        });
      };
      int64_t q = 0;
      for (; q + A <= quads; q += A) unroll<A>([&](auto u) QUANT_FLATTEN { quad(q + u, u); });
      for (; q < quads; ++q) quad(q, C<0>{});
    }
#endif
    if constexpr (F::kBlock == 32) {  // the blocks after the quads (Q5_0R's rows: whole quads)
      const uint8_t* row = w + r * row_bytes + 4 * quads * F::kBytes;  // the blocks after them
      auto step = [&](const uint8_t* a, const uint8_t* b, const XChunk* x, auto u) QUANT_FLATTEN {
        __m512i wq = T::unpack(a, b);
        __m512 dw = pair_scales(a, b);
        unroll<M>([&](auto m) QUANT_FLATTEN {
          constexpr int mi = decltype(m)::value;
          __m512 s = _mm512_mul_ps(dw, _mm512_load_ps(x[mi].dx));
          __m512 p = _mm512_cvtepi32_ps(dot_lanes<true>(wq, x[mi]));
          if constexpr (decltype(u)::value == 0)
            acc[mi] = _mm512_fmadd_ps(p, s, acc[mi]);
          else
            acc2[mi] = _mm512_fmadd_ps(p, s, acc2[mi]);
        });
      };
      int64_t p = 0;
      for (; p + A <= pairs; p += A)
        unroll<A>([&](auto u) QUANT_FLATTEN {
          const uint8_t* a = row + 2 * (p + u) * F::kBytes;
          step(a, a + F::kBytes, tc + (p + u) * M, u);
        });
      for (; p < pairs; ++p) {
        const uint8_t* a = row + 2 * p * F::kBytes;
        step(a, a + F::kBytes, tc + p * M, C<0>{});
      }
      if (blocks & 1) {  // a lone last block: paired with itself against zero activations
        const uint8_t* a = row + 2 * pairs * F::kBytes;
        step(a, a, tc + pairs * M, C<0>{});
      }
    }
    if constexpr (A > 1)
      unroll<M>([&](auto m) QUANT_FLATTEN {
        acc[decltype(m)::value] = _mm512_add_ps(acc[decltype(m)::value], acc2[decltype(m)::value]);
      });
    store_rows<M>(acc, nullptr, y, bf16_out, n, r);
  }
}

// a super-block chunk's exact quant dots with each of the M rows' activations x[0..M),
// scaled per lane by the rows' d * sub-block scale * d_x (sdx, lanes picked by idx), into
// accumulator chain C % A (a constant: the accumulators stay in registers)
template <bool kOffset, int C, int M, int A>
QUANT_INLINE void add_chunk(__m512 (&acc)[M][A], __m512i wq, const XChunk* x, __m512i idx,
                            const __m512 (&sdx)[M]) {
  unroll<M>([&](auto m) QUANT_FLATTEN {
    constexpr int mi = decltype(m)::value;
    __m512 p = _mm512_cvtepi32_ps(dot_lanes<kOffset>(wq, x[mi]));
    acc[mi][C % A] = _mm512_fmadd_ps(p, _mm512_permutexvar_ps(idx, sdx[mi]), acc[mi][C % A]);
  });
}

// d * scale_j (lanes 0-7) and dmin * min_j (lanes 8-15) of the Q4_K / Q5_K super-block at b
// (scale_min's unpacking of its 12 bytes, by two byte shuffles: byte o of `a` holds the low
// bits of scale o (o < 8) or min o - 8, byte o of `hi` the top two bits of those of j >= 4)
QUANT_INLINE __m512 kquant_scales_mins(const uint8_t* b) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));  // d, dmin, 12 bytes
  __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12,
                                                13, 14, 15));
  __m128i hi = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8,
                                                 9, 10, 11));
  a = _mm_srlv_epi16(a, _mm_setr_epi16(0, 0, 0, 0, 0, 0, 4, 4));  // mins 4-7: high nibbles
  hi = _mm_and_si128(_mm_srli_epi16(hi, 2), _mm_set1_epi8(0x30));  // bits 6-7 to 4-5
  const __m128i keep = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15,
                                     15, 15);
  const __m128i sm = _mm_ternarylogic_epi32(keep, a, hi, 0xCA);  // keep ? a : hi, bitwise
  const __m256i dd = _mm256_shuffle_epi8(
      _mm256_broadcastsi128_si256(v),
      _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2,
                       3, 2, 3, 2, 3, 2, 3));  // d x 8, dmin x 8 (fp16)
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm)), _mm512_cvtph_ps(dd));
}

// Q4_K / Q5_K: the low and high nibbles of 64-byte half h of a super-block's quants are
// chunks 2h and 2h + 1: sub-blocks (4h, 4h + 2) and (4h + 1, 4h + 3) (XLayout::kKNibbles);
// Q5_K adds fifth bit j of its 32 bytes to sub-block j
template <bool kFifth, int M>
void vnni_rows_k(const uint8_t* w, int64_t row_bytes, const XChunk* xc, const XSums* xs,
                 int64_t k, void* y, bool bf16_out, int64_t n, int64_t r0, int64_t r1) {
  using F = KQuant<kFifth>;
  constexpr int A = M == 1 ? 2 : 1;
  const int64_t supers = k / 256;
  for (int64_t r = r0; r < r1; ++r) {
    vserve_rows::fetch_ahead(w, row_bytes, r, r1);
    const uint8_t* row = w + r * row_bytes;
    __m512 acc[M][A] = {};
    __m256 macc[M] = {};
    for (int64_t sb = 0; sb < supers; ++sb) {
      const uint8_t* b = row + sb * F::kBytes;
      const XChunk* x = xc + sb * 4 * M;
      const XSums* s = xs + sb * M;
      const __m512 sm = kquant_scales_mins(b);
      const __m256 scales = _mm512_castps512_ps256(sm), mins = _mm512_extractf32x8_ps(sm, 1);
      // d * scale_j * d_x_j of each row, in lanes 0-7
      __m512 sdx[M];
      unroll<M>([&](auto m) QUANT_FLATTEN {
        constexpr int mi = decltype(m)::value;
        macc[mi] = _mm256_fmadd_ps(mins, _mm256_load_ps(s[mi].sx), macc[mi]);
        sdx[mi] = _mm512_castps256_ps512(_mm256_mul_ps(scales, _mm256_load_ps(s[mi].dx8)));
      });
      const uint8_t* qs = b + (kFifth ? 48 : 16);
      const __m512i high = kFifth ? kquant_high(b) : _mm512_setzero_si512();
      unroll<2>([&](auto hi) QUANT_FLATTEN {
        constexpr int h = decltype(hi)::value;
        __m512i bytes = _mm512_loadu_si512(qs + 64 * h);
        unroll<2>([&](auto part) QUANT_FLATTEN {
          constexpr int pt = decltype(part)::value, c = 2 * h + pt;
          constexpr int sa = 4 * h + pt, sb2 = 4 * h + 2 + pt;  // the chunk's sub-blocks
          const __m512i wq = kquant_chunk<kFifth>(bytes, high, h, pt);
          add_chunk<false, c>(acc, wq, x + c * M, idx16(sa, sa, sb2, sb2), sdx);
        });
      });
    }
    store_kquant_rows<M, A>(acc, macc, y, bf16_out, n, r);
  }
}

// Q4_K / Q5_K with the activations spread (XLayout::kKSpread): chunk t of a super-block takes
// bytes 8t..8t + 7 of each 32-byte group g of its quants twice, the low nibbles for sub-block
// 2g and the high ones for 2g + 1 (one vpermt2b and one vgf2p8affineqb, whose bit matrix is
// per quadword), so that byte 8j + e of every chunk is weight 8t + e of sub-block j and int32
// lanes 2j, 2j + 1 belong to sub-block j in all four: the four vpdpbusd of a super-block add
// into one accumulator, converted and scaled (d * scale_j * d_x_j, XSums::dx) once. Q5_K's
// fifth bits of weights 8t.. are fifth-bit bytes 8t..8t + 7, whose bit j vpshufbitqmb picks.
template <class F>
constexpr bool kspread_format() {
#if defined(QUANT_QUADS) && defined(__GFNI__)
  return std::is_same_v<F, Q4_K> || std::is_same_v<F, Q5_K>;
#else
  return false;
#endif
}

#if defined(QUANT_QUADS) && defined(__GFNI__)
struct KSpreadTables {
  alignas(64) int8_t idx[4][64] = {}, bits[64] = {};
  constexpr KSpreadTables() {
    for (int t = 0; t < 4; ++t)
      for (int j = 0; j < 8; ++j)
        for (int e = 0; e < 8; ++e)
          idx[t][8 * j + e] = static_cast<int8_t>(32 * (j / 2) + 8 * t + e);
    for (int j = 0; j < 8; ++j)
      for (int e = 0; e < 8; ++e) bits[8 * j + e] = static_cast<int8_t>(8 * e + j);
  }
};
inline constexpr KSpreadTables kKSpread{};

template <bool kFifth, int M>
void vnni_rows_kspread(const uint8_t* w, int64_t row_bytes, const XChunk* xc, const XSums* xs,
                       int64_t k, void* y, bool bf16_out, int64_t n, int64_t r0, int64_t r1) {
  using F = KQuant<kFifth>;
  constexpr int A = M == 1 ? 2 : 1;
  const int64_t supers = k / 256;
  // the low nibbles in even quadwords (sub-blocks 2g), the high ones in odd ones
  const __m512i nibbles = _mm512_set_epi64(0x1020408000000000LL, 0x0102040800000000LL,
                                           0x1020408000000000LL, 0x0102040800000000LL,
                                           0x1020408000000000LL, 0x0102040800000000LL,
                                           0x1020408000000000LL, 0x0102040800000000LL);
  const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  for (int64_t r = r0; r < r1; ++r) {
    vserve_rows::fetch_ahead(w, row_bytes, r, r1);
    const uint8_t* row = w + r * row_bytes;
    __m512 acc[M][A] = {};
    __m256 macc[M] = {};
    auto super = [&](int64_t sb, auto u) QUANT_FLATTEN {
      const uint8_t* b = row + sb * F::kBytes;
      const XChunk* x = xc + sb * 4 * M;
      const XSums* s = xs + sb * M;
      const __m512 sm = kquant_scales_mins(b);
      const __m512 scales = _mm512_permutexvar_ps(pairs, sm);  // lanes 2j, 2j + 1: sub-block j
      const __m256 mins = _mm512_extractf32x8_ps(sm, 1);
      const uint8_t* qs = b + (kFifth ? 48 : 16);
      const __m512i z0 = _mm512_loadu_si512(qs), z1 = _mm512_loadu_si512(qs + 64);
      __m512i wq[4];
      unroll<4>([&](auto tc) QUANT_FLATTEN {
        constexpr int t = decltype(tc)::value;
        wq[t] = _mm512_gf2p8affine_epi64_epi8(
            _mm512_permutex2var_epi8(z0, _mm512_load_si512(kKSpread.idx[t]), z1), nibbles, 0);
        if constexpr (kFifth) {
          uint64_t h8;
          std::memcpy(&h8, b + 16 + 8 * t, 8);
          const __mmask64 high = _mm512_bitshuffle_epi64_mask(
              _mm512_set1_epi64(static_cast<long long>(h8)), _mm512_load_si512(kKSpread.bits));
          wq[t] = _mm512_mask_add_epi8(wq[t], high, wq[t], _mm512_set1_epi8(16));
        }
      });
      unroll<M>([&](auto m) QUANT_FLATTEN {
        constexpr int mi = decltype(m)::value;
        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[0], _mm512_load_si512(x[mi].q));
        d = _mm512_dpbusd_epi32(d, wq[1], _mm512_load_si512(x[M + mi].q));
        d = _mm512_dpbusd_epi32(d, wq[2], _mm512_load_si512(x[2 * M + mi].q));
        d = _mm512_dpbusd_epi32(d, wq[3], _mm512_load_si512(x[3 * M + mi].q));
        const __m512 sdx = _mm512_mul_ps(scales, _mm512_load_ps(s[mi].dx));
        constexpr int a = decltype(u)::value;
        acc[mi][a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sdx, acc[mi][a]);
        macc[mi] = _mm256_fmadd_ps(mins, _mm256_load_ps(s[mi].sx), macc[mi]);
      });
    };
    int64_t sb = 0;
    for (; sb + A <= supers; sb += A) unroll<A>([&](auto u) QUANT_FLATTEN { super(sb + u, u); });
    for (; sb < supers; ++sb) super(sb, C<0>{});
    store_kquant_rows<M, A>(acc, macc, y, bf16_out, n, r);
  }
}
#endif

// Q6_K: chunk v of a super-block (weights 64v..64v+63: half h = v / 2, runs 2(v % 2) and
// 2(v % 2) + 1 of it) takes the low or high nibbles of the half's 64 low bytes and the
// 2-bit pairs (2(v % 2), 2(v % 2) + 1) of its 32 high bytes; scale 4v + i for lanes 4i..4i+3
template <int M>
void vnni_rows_q6k(const uint8_t* w, int64_t row_bytes, const XChunk* xc, const XSums* xs,
                   int64_t k, void* y, bool bf16_out, int64_t n, int64_t r0, int64_t r1) {
  constexpr int A = M == 1 ? 2 : 1;
  const int64_t supers = k / 256;
  for (int64_t r = r0; r < r1; ++r) {
    vserve_rows::fetch_ahead(w, row_bytes, r, r1);
    const uint8_t* row = w + r * row_bytes;
    __m512 acc[M][A] = {};
    for (int64_t sb = 0; sb < supers; ++sb) {
      const uint8_t* b = row + sb * Q6_K::kBytes;
      const XChunk* x = xc + sb * 4 * M;
      __m512 sc = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)))),
          _mm512_set1_ps(half_at(b + 208)));
      // d * scale_i * d_x of each 16 weights of each row
      __m512 sdx[M];
      unroll<M>([&](auto m) QUANT_FLATTEN {
        constexpr int mi = decltype(m)::value;
        sdx[mi] = _mm512_mul_ps(sc, _mm512_load_ps(xs[sb * M + mi].dx));
      });
      unroll<2>([&](auto hi) QUANT_FLATTEN {
        constexpr int h = decltype(hi)::value;
        __m512i low = _mm512_loadu_si512(b + 64 * h), pairs = q6k_pairs(b, h);
        unroll<2>([&](auto qi) QUANT_FLATTEN {
          constexpr int q = decltype(qi)::value, v = 2 * h + q;
          const __m512i wq = q6k_chunk(low, pairs, q);
          add_chunk<true, v>(acc, wq, x + v * M, idx16(4 * v, 4 * v + 1, 4 * v + 2, 4 * v + 3),
                             sdx);
        });
      });
    }
    __m512 sum[M];
    unroll<M>([&](auto m) QUANT_FLATTEN {
      constexpr int mi = decltype(m)::value;
      sum[mi] = acc[mi][0];
      if constexpr (A > 1) sum[mi] = _mm512_add_ps(sum[mi], acc[mi][1]);
    });
    store_rows<M>(sum, nullptr, y, bf16_out, n, r);
  }
}

template <class F, int M>
QUANT_INLINE void vnni_rows_any(const uint8_t* w, int64_t row_bytes, const XChunk* xc,
                                const XSums* xs, int64_t k, void* y, bool bf16_out, int64_t n,
                                int64_t r0, int64_t r1) {
#if defined(QUANT_QUADS) && defined(__GFNI__)
  if constexpr (kspread_format<F>()) {
    vnni_rows_kspread<std::is_same_v<F, Q5_K>, M>(w, row_bytes, xc, xs, k, y, bf16_out, n, r0,
                                                  r1);
    return;
  }
#endif
  if constexpr (std::is_same_v<F, Q4_K>)
    vnni_rows_k<false, M>(w, row_bytes, xc, xs, k, y, bf16_out, n, r0, r1);
  else if constexpr (std::is_same_v<F, Q5_K>)
    vnni_rows_k<true, M>(w, row_bytes, xc, xs, k, y, bf16_out, n, r0, r1);
  else if constexpr (std::is_same_v<F, Q6_K>)
    vnni_rows_q6k<M>(w, row_bytes, xc, xs, k, y, bf16_out, n, r0, r1);
  else
    vnni_rows<F, M>(w, row_bytes, xc, xs, k, y, bf16_out, n, r0, r1);
}

template <class F, int M = 1>
void vnni_dispatch(int64_t m, const uint8_t* w, int64_t row_bytes, const XChunk* xc,
                   const XSums* xs, int64_t k, void* y, bool bf16_out, int64_t n, int64_t r0,
                   int64_t r1) {
  if constexpr (M < 8) {
    if (m != M) {
      vnni_dispatch<F, M + 1>(m, w, row_bytes, xc, xs, k, y, bf16_out, n, r0, r1);
      return;
    }
  }
  vnni_rows_any<F, M>(w, row_bytes, xc, xs, k, y, bf16_out, n, r0, r1);
}

// the quantization each format's chunks want: layout, super-block sums (offset: x_offset)
template <class F>
constexpr XLayout x_layout() {
  if constexpr (kspread_format<F>()) return XLayout::kKSpread;
  else if constexpr (std::is_same_v<F, Q4_K> || std::is_same_v<F, Q5_K>) return XLayout::kKNibbles;
  else if constexpr (quad_format<F>()) return XLayout::kQuads;
  else return XLayout::kInOrder;
}

template <class F>
constexpr bool x_sums() {
  return F::kBlock == 256;
}

#endif  // QUANT_VNNI

}  // namespace

namespace vserve_quant {

at::Tensor gemv_exact(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k) {
  const int64_t m = x.size(0), n = data.size(0), row_bytes = data.size(1);
  auto xf = m == 1 ? x.to(at::kFloat).contiguous() : pack_x(x);
  auto out = at::empty({m, n}, x.options());
  const uint8_t* w = data.data_ptr<uint8_t>();
  const float* xp = xf.data_ptr<float>();
  void* yp = out.data_ptr();
  bool bf16_out = x.scalar_type() == at::kBFloat16;
  with_format(qtype, [&](auto fmt) {
    using F = decltype(fmt);
    vserve_rows::stream_rows(n, row_bytes, [&](int64_t lo, int64_t hi) {
      gemv_dispatch<F>(m, w, row_bytes, xp, k, yp, bf16_out, n, lo, hi);
    });
  });
  return out;
}

#ifdef QUANT_VNNI
at::Tensor gemv_int8(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k) {
  int64_t m = x.size(0), n = data.size(0), row_bytes = data.size(1);
  auto out = at::empty({m, n}, x.options());
  const int64_t nch = (k / 32 + 1) / 2;
  // reused by the calls of this thread: a layer's gemvs quantize a few KB each
  thread_local std::vector<XChunk> chunks;
  thread_local std::vector<XSums> sums;
  chunks.resize(nch * m);
  const uint8_t* w = data.data_ptr<uint8_t>();
  void* yp = out.data_ptr();
  bool bf16_out = x.scalar_type() == at::kBFloat16;
  with_format(qtype, [&](auto fmt) {
    using F = decltype(fmt);
    if (x_sums<F>()) sums.resize(k / 256 * m);
    XSums* sp = x_sums<F>() ? sums.data() : nullptr;
    if (x.scalar_type() == at::kBFloat16)
      quantize_x(x.data_ptr<bf16>(), m, k, x_offset<F>(), x_layout<F>(), chunks.data(), sp);
    else
      quantize_x(x.data_ptr<float>(), m, k, x_offset<F>(), x_layout<F>(), chunks.data(), sp);
    const XChunk* xc = chunks.data();
    const XSums* xs = sums.data();
    vserve_rows::stream_rows(n, row_bytes, [&](int64_t lo, int64_t hi) {
      vnni_dispatch<F>(m, w, row_bytes, xc, xs, k, yp, bf16_out, n, lo, hi);
    });
  });
  return out;
}
#endif

const void* GemvInput::data() const {
  return reinterpret_cast<const void*>(
      (reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
}

void gemv_prepare(GemvInput& in, const bf16* x, int64_t m, int64_t k, int64_t qtype) {
  TORCH_CHECK(m >= 1 && m <= 8 && k % block_size(qtype) == 0, "gemv_prepare: shape");
  in.m = m;
  in.k = k;
  in.qtype = qtype;
  in.int8 = !options().exact && int8_activations(at::kBFloat16);  // as gemv decides, each call
  if (in.int8) {
#ifdef QUANT_VNNI
    with_format(qtype, [&](auto fmt) {
      using F = decltype(fmt);
      const int64_t nch = (k / 32 + 1) / 2, nsums = x_sums<F>() ? k / 256 * m : 0;
      in.buf.resize(nch * m * sizeof(XChunk) + nsums * sizeof(XSums) + 64);
      auto* ch = static_cast<XChunk*>(const_cast<void*>(in.data()));
      XSums* sums = nsums > 0 ? reinterpret_cast<XSums*>(ch + nch * m) : nullptr;
      quantize_x(x, m, k, x_offset<F>(), x_layout<F>(), ch, sums);
    });
#elif defined(QUANT_AVX2_INT8)
    in.buf.resize(avx2_x_bytes(m, k) + 64);
    avx2_prepare(x, m, k, static_cast<uint8_t*>(const_cast<void*>(in.data())));
#endif
    return;
  }
  // fp32 [K / 16][M][16] (pack_x; one row: x in order)
  in.buf.resize(m * k * sizeof(float) + 64);
  float* xf = static_cast<float*>(const_cast<void*>(in.data()));
  for (int64_t c = 0; c < k / 16; ++c)
    for (int64_t mi = 0; mi < m; ++mi)
      for (int l = 0; l < 16; ++l)
        xf[(c * m + mi) * 16 + l] = static_cast<float>(x[mi * k + c * 16 + l]);
}

void gemv_rows(const GemvInput& in, const uint8_t* w, int64_t row_bytes, bf16* y, int64_t ldy,
               int64_t r0, int64_t r1) {
  with_format(in.qtype, [&](auto fmt) {
    using F = decltype(fmt);
#if !defined(QUANT_VNNI) && defined(QUANT_AVX2_INT8)
    if (in.int8) {
      avx2_rows(static_cast<const uint8_t*>(in.data()), in.m, in.k, in.qtype, w, row_bytes, y,
                true, ldy, r0, r1);
      return;
    }
#endif
#ifdef QUANT_VNNI
    if (in.int8) {
      const auto* ch = static_cast<const XChunk*>(in.data());
      const int64_t nch = (in.k / 32 + 1) / 2;
      const auto* sums = reinterpret_cast<const XSums*>(ch + nch * in.m);
      vnni_dispatch<F>(in.m, w, row_bytes, ch, sums, in.k, y, true, ldy, r0, r1);
      return;
    }
#endif
    gemv_dispatch<F>(in.m, w, row_bytes, static_cast<const float*>(in.data()), in.k, y, true,
                     ldy, r0, r1);
  });
}

}  // namespace vserve_quant
