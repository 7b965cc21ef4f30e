// The int8 GEMM on GGUF blocks (AVX512-VNNI), more than 8 activation rows (formats:
// quant_formats.h; the int8 arithmetic: quant_gemv.cpp's).
//
// Where the gemv streams each weight once and is bound by memory, a batch of rows (prefill, a
// large decode batch) is bound by arithmetic: the dot products run as an outer product. Each
// thread takes tiles of 32 output rows, unpacks a tile's quants once into unsigned bytes laid
// out [K / 4][2][16 rows][4 inputs] (a 16 x 16 transpose of int32 lanes per 64 inputs), and
// runs every activation row against it: per 4 inputs one vpdpbusd adds 4 products into each of
// 16 int32 lanes (lanes = output columns, the activation row's 4 int8 broadcast), per block
// of 32 inputs (16 for Q6_K, whose scales are per 16) the lanes are converted and scaled by
// d_w (per column) * d_x (per row) into fp32 accumulators. The activations are quantized as in
// the gemv (per block of 32, d_x = amax / 127), and the weights' offsets (Q8_0's 128, Q4_0's
// 8, ...) are taken away by starting each block's int32 sum at -offset * sum(q_x): the sums
// are exact, so the result is the gemv's up to fp32 rounding (the order of the sums and of
// the d_w * d_x products differs). Q4_K / Q5_K add -dmin * min_j * d_x * sum(q_x) per
// sub-block into the same accumulators. 64 products a vpdpbusd against 32 a
// vdpbf16ps: ~1.3-1.45x the bf16 matmul's arithmetic rate with the scaling counted.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_formats.h"
#include "quant_paths.h"
#include "quant_vnni.h"
#include "row_shares.h"

#ifdef QUANT_VNNI

#include <immintrin.h>

namespace {

constexpr int kTileM = 6;  // activation rows per micro-tile: 12 int32 + 12 fp32 accumulators

// How each format's quants and scales land in the tile: `chunk(row, k, c)` gives 64 unsigned
// quants of a row, whose first 32 are inputs lo.. and last 32 hi.. (`range(k, c, lo, hi)`;
// hi = -1: a lone last block); `scales(row, k, s, m, stride)` writes each block's d_w (and,
// for the K-quants, -dmin * min into m) at `stride` floats apart.
template <class F>
struct GemmFormat {  // Q4_0 / Q5_0 / Q8_0: chunk c = blocks 2c and 2c + 1
  static constexpr int kKB = 32;
  static constexpr bool kMins = false;
  static int64_t chunks(int64_t k) { return (k / 32 + 1) / 2; }
  static void range(int64_t k, int64_t c, int64_t& lo, int64_t& hi) {
    lo = 64 * c;
    hi = 64 * c + 32 < k ? 64 * c + 32 : -1;  // a lone last block
  }
  static QUANT_INLINE __m512i chunk(const uint8_t* row, int64_t k, int64_t c) {
    const uint8_t* a = row + 2 * c * F::kBytes;
    return Vnni32<F>::unpack(a, 64 * c + 32 < k ? a + F::kBytes : a);
  }
  static void scales(const uint8_t* row, int64_t k, float* s, float*, int64_t stride) {
    for (int64_t b = 0; b < k / 32; ++b) s[b * stride] = half_at(row + b * F::kBytes);
  }
};

template <>
struct GemmFormat<Q5_0R> : GemmFormat<Q5_0> {  // chunk c = blocks 2c, 2c + 1: half of a quad
  static QUANT_INLINE __m512i chunk(const uint8_t* row, int64_t, int64_t c) {
    const uint8_t* q = row + c / 2 * Q5_0R::kBytes;
    const int i = 2 * static_cast<int>(c % 2);  // the first of its two blocks in the quad
    const __m512i u = nibbles_pair(q + 16 * i, q + 16 * i + 16);
    const uint64_t bits = Q5_0R::fifth_bits(q, i) | uint64_t{Q5_0R::fifth_bits(q, i + 1)} << 32;
    return _mm512_mask_add_epi8(u, _cvtu64_mask64(bits), u, _mm512_set1_epi8(16));
  }
  static void scales(const uint8_t* row, int64_t k, float* s, float*, int64_t stride) {
    for (int64_t b = 0; b < k / 32; ++b)
      s[b * stride] = half_at(row + b / 4 * Q5_0R::kBytes + Q5_0R::kScales + 2 * (b % 4));
  }
};

template <bool kFifth>
struct GemmFormat<KQuant<kFifth>> {  // chunk 4 sb + 2h + p: sub-blocks 4h + p and 4h + 2 + p
  static constexpr int kKB = 32;
  static constexpr bool kMins = true;
  static int64_t chunks(int64_t k) { return k / 64; }
  static void range(int64_t, int64_t c, int64_t& lo, int64_t& hi) {
    int64_t sb = c / 4, h = c % 4 / 2, p = c % 2;
    lo = 256 * sb + 32 * (4 * h + p);
    hi = lo + 64;
  }
  static QUANT_INLINE __m512i chunk(const uint8_t* row, int64_t, int64_t c) {
    const uint8_t* b = row + c / 4 * KQuant<kFifth>::kBytes;
    const int h = static_cast<int>(c % 4 / 2), p = static_cast<int>(c % 2);
    __m512i bytes = _mm512_loadu_si512(b + (kFifth ? 48 : 16) + 64 * h);
    return kquant_chunk<kFifth>(bytes, kFifth ? kquant_high(b) : _mm512_setzero_si512(), h, p);
  }
  static void scales(const uint8_t* row, int64_t k, float* s, float* m, int64_t stride) {
    for (int64_t sb = 0; sb < k / 256; ++sb) {
      const uint8_t* b = row + sb * KQuant<kFifth>::kBytes;
      float d = half_at(b), dmin = half_at(b + 2);
      for (int j = 0; j < 8; ++j) {
        int scale, min;
        scale_min(b + 4, j, scale, min);
        s[(8 * sb + j) * stride] = d * static_cast<float>(scale);
        m[(8 * sb + j) * stride] = -dmin * static_cast<float>(min);
      }
    }
  }
};

template <>
struct GemmFormat<Q6_K> {  // chunk 4 sb + v = inputs 64v.. of super-block sb, in order
  static constexpr int kKB = 16;
  static constexpr bool kMins = false;
  static int64_t chunks(int64_t k) { return k / 64; }
  static void range(int64_t, int64_t c, int64_t& lo, int64_t& hi) {
    lo = 64 * c;
    hi = lo + 32;
  }
  static QUANT_INLINE __m512i chunk(const uint8_t* row, int64_t, int64_t c) {
    const uint8_t* b = row + c / 4 * Q6_K::kBytes;
    const int v = static_cast<int>(c % 4), h = v / 2;
    return q6k_chunk(_mm512_loadu_si512(b + 64 * h), q6k_pairs(b, h), v % 2);
  }
  static void scales(const uint8_t* row, int64_t k, float* s, float*, int64_t stride) {
    for (int64_t sb = 0; sb < k / 256; ++sb) {
      const uint8_t* b = row + sb * Q6_K::kBytes;
      float d = half_at(b + 208);
      for (int j = 0; j < 16; ++j)
        s[(16 * sb + j) * stride] = d * static_cast<float>(static_cast<int8_t>(b[192 + j]));
    }
  }
};

// one tile of the weight: quants [K / 4][2][16][4], scales (and -dmin * min) [blocks][32]
template <class F>
void pack_tile(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t n0, int64_t k,
               uint8_t* pq, float* ps, float* pm) {
  using G = GemmFormat<F>;
  for (int g = 0; g < 2; ++g)
    for (int64_t c = 0; c < G::chunks(k); ++c) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        int64_t row = n0 + 16 * g + i;
        r[i] = row < n ? G::chunk(w + row * row_bytes, k, c) : _mm512_setzero_si512();
      }
      transpose16(r);
      int64_t lo, hi;
      G::range(k, c, lo, hi);
      for (int j = 0; j < 16; ++j) {
        int64_t kk = j < 8 ? lo + 4 * j : hi + 4 * (j - 8);
        if (j >= 8 && hi < 0) break;
        _mm512_store_si512(pq + (kk / 4 * 2 + g) * 64, r[j]);
      }
    }
  const int64_t blocks = k / G::kKB;
  for (int i = 0; i < kTileN; ++i) {
    int64_t row = n0 + i;
    if (row < n) {
      G::scales(w + row * row_bytes, k, ps + i, pm + i, kTileN);
    } else {
      for (int64_t b = 0; b < blocks; ++b) ps[b * kTileN + i] = pm[b * kTileN + i] = 0.0f;
    }
  }
}

// the activations, quantized once per call: q [M][K] int8; per block of kKB inputs of each
// row d_x, -offset * sum(q) (the int32 start) and d_x * sum(q) (for the mins)
struct GemmX {
  const int8_t* q;
  const float* dx;
  const int32_t* start;
  const float* sum;
  int64_t k, blocks;
};

template <int MR, class F>
QUANT_INLINE void gemm_micro(const uint8_t* pq, const float* ps, const float* pm, const GemmX& x,
                             int64_t m0, float (*out)[kTileN]) {
  using G = GemmFormat<F>;
  constexpr int kSteps = G::kKB / 4;
  __m512 f[MR][2];
  unroll<MR>([&](auto m) QUANT_FLATTEN {
    f[decltype(m)::value][0] = _mm512_setzero_ps();
    f[decltype(m)::value][1] = _mm512_setzero_ps();
  });
  for (int64_t b = 0; b < x.blocks; ++b) {
    __m512i a[MR][2];
    unroll<MR>([&](auto m) QUANT_FLATTEN {
      constexpr int mi = decltype(m)::value;
      a[mi][0] = a[mi][1] = _mm512_set1_epi32(x.start[(m0 + mi) * x.blocks + b]);
    });
    const uint8_t* wb = pq + b * kSteps * 128;
    const int8_t* xb = x.q + m0 * x.k + b * G::kKB;
    unroll<kSteps>([&](auto s) QUANT_FLATTEN {
      constexpr int st = decltype(s)::value;
      __m512i w0 = _mm512_load_si512(wb + st * 128), w1 = _mm512_load_si512(wb + st * 128 + 64);
      unroll<MR>([&](auto m) QUANT_FLATTEN {
        constexpr int mi = decltype(m)::value;
        int32_t v;
        std::memcpy(&v, xb + mi * x.k + 4 * st, 4);
        __m512i xv = _mm512_set1_epi32(v);
        a[mi][0] = _mm512_dpbusd_epi32(a[mi][0], w0, xv);
        a[mi][1] = _mm512_dpbusd_epi32(a[mi][1], w1, xv);
      });
    });
    __m512 s0 = _mm512_load_ps(ps + b * kTileN), s1 = _mm512_load_ps(ps + b * kTileN + 16);
    unroll<MR>([&](auto m) QUANT_FLATTEN {
      constexpr int mi = decltype(m)::value;
      __m512 dx = _mm512_set1_ps(x.dx[(m0 + mi) * x.blocks + b]);
      f[mi][0] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a[mi][0]), dx), s0, f[mi][0]);
      f[mi][1] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a[mi][1]), dx), s1, f[mi][1]);
    });
    if constexpr (G::kMins) {
      __m512 c0 = _mm512_load_ps(pm + b * kTileN), c1 = _mm512_load_ps(pm + b * kTileN + 16);
      unroll<MR>([&](auto m) QUANT_FLATTEN {
        constexpr int mi = decltype(m)::value;
        __m512 sx = _mm512_set1_ps(x.sum[(m0 + mi) * x.blocks + b]);
        f[mi][0] = _mm512_fmadd_ps(c0, sx, f[mi][0]);
        f[mi][1] = _mm512_fmadd_ps(c1, sx, f[mi][1]);
      });
    }
  }
  unroll<MR>([&](auto m) QUANT_FLATTEN {
    constexpr int mi = decltype(m)::value;
    _mm512_storeu_ps(out[mi], f[mi][0]);
    _mm512_storeu_ps(out[mi] + 16, f[mi][1]);
  });
}

template <class F, int MR = kTileM>
void gemm_rows(int64_t rows, const uint8_t* pq, const float* ps, const float* pm,
               const GemmX& x, int64_t m0, float (*out)[kTileN]) {
  if constexpr (MR > 1) {
    if (rows != MR) {
      gemm_rows<F, MR - 1>(rows, pq, ps, pm, x, m0, out);
      return;
    }
  }
  gemm_micro<MR, F>(pq, ps, pm, x, m0, out);
}

// x [M, K] (fp32 or bf16) -> GemmX for blocks of kb inputs with the format's offset
template <typename T>
void quantize_rows(const T* x, int64_t m_rows, int64_t k, int kb, int offset, int8_t* q,
                   float* dx, int32_t* start, float* sum) {
  const int64_t blocks = k / kb;
  for (int64_t m = 0; m < m_rows; ++m)
    for (int64_t b32 = 0; b32 < k / 32; ++b32) {
      const XBlock xb = quantize_block(x + m * k + b32 * 32);
      const __m512i q0 = xb.q0, q1 = xb.q1;
      const float d = xb.d;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * k + b32 * 32), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * k + b32 * 32 + 16),
                       _mm512_cvtepi32_epi8(q1));
      int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
      if (kb == 32) {
        int64_t i = m * blocks + b32;
        dx[i] = d;
        start[i] = -offset * (s0 + s1);
        sum[i] = d * static_cast<float>(s0 + s1);
      } else {  // 16
        int64_t i = m * blocks + 2 * b32;
        dx[i] = dx[i + 1] = d;
        start[i] = -offset * s0;
        start[i + 1] = -offset * s1;
        sum[i] = d * static_cast<float>(s0);
        sum[i + 1] = d * static_cast<float>(s1);
      }
    }
}

}  // namespace

namespace vserve_quant {

at::Tensor gemm_int8(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k) {
  const int64_t m = x.size(0), n = data.size(0), row_bytes = data.size(1);
  auto out = at::empty({m, n}, x.options());
  const bool bf16_out = x.scalar_type() == at::kBFloat16;
  const uint8_t* w = data.data_ptr<uint8_t>();
  void* yp = out.data_ptr();
  with_format(qtype, [&](auto fmt) {
    using F = decltype(fmt);
    using G = GemmFormat<F>;
    const int64_t blocks = k / G::kKB;
    std::vector<int8_t> q(m * k);
    std::vector<float> dx(m * blocks), sum(m * blocks);
    std::vector<int32_t> start(m * blocks);
    at::parallel_for(0, m, std::max<int64_t>(1, 16384 / k), [&](int64_t lo, int64_t hi) {
      auto run = [&](const auto* xp) {
        quantize_rows(xp + lo * k, hi - lo, k, G::kKB, x_offset<F>(), q.data() + lo * k,
                      dx.data() + lo * blocks, start.data() + lo * blocks,
                      sum.data() + lo * blocks);
      };
      if (bf16_out)
        run(x.data_ptr<bf16>());
      else
        run(x.data_ptr<float>());
    });
    const GemmX gx{q.data(), dx.data(), start.data(), sum.data(), k, blocks};
    const int64_t tiles = (n + kTileN - 1) / kTileN;
    const bool stream = m * n * x.element_size() > (16 << 20);
    // tiles in shares per thread, the rest taken by whichever thread is free (stream_rows)
    vserve_rows::stream_rows(tiles, kTileN * row_bytes, [&](int64_t lo, int64_t hi) {
      thread_local std::vector<uint8_t> pq_buf;
      thread_local std::vector<float> ps_buf;
      pq_buf.resize(k / 4 * 128 + 64);
      ps_buf.resize(2 * blocks * kTileN + 16);
      // 64-byte aligned views
      uint8_t* pq = reinterpret_cast<uint8_t*>(
          (reinterpret_cast<uintptr_t>(pq_buf.data()) + 63) & ~uintptr_t{63});
      float* ps = reinterpret_cast<float*>(
          (reinterpret_cast<uintptr_t>(ps_buf.data()) + 63) & ~uintptr_t{63});
      float* pm = ps + blocks * kTileN;
      alignas(64) float tile_out[kTileM][kTileN];
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t n0 = t * kTileN, cols = std::min<int64_t>(kTileN, n - n0);
        pack_tile<F>(w, row_bytes, n, n0, k, pq, ps, pm);
        // the next tile's bytes come in while this one computes: the hardware prefetchers
        // see too short a stream per tile
        const uint8_t* next = w + std::min(n, n0 + kTileN) * row_bytes;
        const int64_t next_bytes = (std::min(n, n0 + 2 * kTileN) - std::min(n, n0 + kTileN)) *
                                   row_bytes;
        const int64_t micro_tiles = (m + kTileM - 1) / kTileM;
        const int64_t per_micro = (next_bytes / 64 + micro_tiles) / micro_tiles;
        int64_t fetched = 0;
        for (int64_t m0 = 0; m0 < m; m0 += kTileM) {
          for (int64_t i = 0; i < per_micro && fetched < next_bytes; ++i, fetched += 64)
            _mm_prefetch(reinterpret_cast<const char*>(next + fetched), _MM_HINT_T1);
          const int64_t rows = std::min<int64_t>(kTileM, m - m0);
          gemm_rows<F>(rows, pq, ps, pm, gx, m0, tile_out);
          for (int64_t i = 0; i < rows; ++i)
            store_cols(tile_out[i], yp, bf16_out, n, m0 + i, n0, cols, stream);
        }
      }
      if (stream) _mm_sfence();  // this thread's streamed lines before the join
    }, kTileN * row_bytes);
  });
  return out;
}

}  // namespace vserve_quant

#endif  // QUANT_VNNI
