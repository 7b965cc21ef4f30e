// GGUF block-quantized weights run natively on the CPU: the weight stays in its GGUF bytes and
// each kernel dequantizes blocks in registers while it streams them (vserve/cpu_ops/__init__.py
// builds this file into the decode.cpp extension, which exposes these functions as its `quant`
// submodule and calls them from `decoder_layer_q`; declared in quant.h;
// tests/cpu_ops/test_quant_kernels.py checks them against gguf.quants.dequantize).
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
//
//   dequantize(data, qtype, k, dtype) -> [N, K] fp32 or bf16, bitwise gguf.quants.dequantize
//             (each weight takes one rounding there and here) and its bf16 rounding
//   gemv(x [M <= 8, K], data, qtype, k) -> x W^T [M, N] in x's dtype: streams each weight row
//             once and multiplies each chunk of it with all M activation rows. With AVX512-VNNI
//             and bf16 activations (the default there) it quantizes them to int8 per block of
//             32 and sums integer products with vpdpbusd (see "the int8 gemv" below): its only
//             error beyond fp32 summation is the activations' rounding, at most d_x / 2 each
//             (d_x = the block's amax / 127), and it runs at memory bandwidth where the fp32
//             path is compute-bound. The exact path (fp32 activations, VSERVE_QUANT_EXACT=1,
//             read on every call, or a CPU without VNNI) dequantizes each 16 weights to fp32 in
//             registers and
//             multiply-adds them into fp32 accumulators; exact but for the order of the sums
//   matmul(x [M, K], data, qtype, k) -> [M, N]: gemv (either path) for M <= 8; else, with
//             AVX512-VNNI and bf16 activations, the int8 GEMM (see "the int8 GEMM" below: the
//             gemv's int8 arithmetic as an outer product over tiles of 32 output rows), and on
//             a CPU with AMX from 48 rows the tile GEMM ("the bf16 GEMM on AMX tiles": weights
//             dequantized to bf16 a tile at a time, the exact path's products); on the exact
//             path, and on AMX from 512 rows, each thread dequantizes tiles of output rows into
//             a buffer of x's dtype and multiplies with at::mm
//   embedding(data, qtype, k, ids [T], dtype) -> [T, K]: the dequantized rows ids
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#include "quant.h"
#include "quant_avx2.h"
#include "quant_blocks.h"
#include "row_shares.h"
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

int64_t block_size(int64_t qtype) {
  return with_format(qtype, [](auto fmt) -> int64_t { return decltype(fmt)::kBlock; });
}

int64_t block_bytes(int64_t qtype) {
  return with_format(qtype, [](auto fmt) -> int64_t { return decltype(fmt)::kBytes; });
}

void check_weight(const at::Tensor& data, int64_t qtype, int64_t k) {
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.dim() == 2 &&
              data.is_contiguous(), "weight data must be a contiguous CPU uint8 [N, row_bytes]");
  TORCH_CHECK(qtype != kQ5_0R || vserve_quant::q5_0r_supported(),
              "Q5_0R weights need the quad gemv (AVX512-VNNI, VBMI and BITALG)");
  int64_t block = block_size(qtype);
  TORCH_CHECK(k > 0 && k % block == 0, "k = ", k, " must be a positive multiple of ", block);
  TORCH_CHECK(data.size(1) == k / block * block_bytes(qtype), "row_bytes ", data.size(1),
              " does not match k = ", k, " for GGML type ", qtype);
}

void check_activations(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) == k && x.is_contiguous() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a contiguous CPU fp32 or bf16 [M, K] with K = ", k);
}

void check_out_dtype(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be fp32 or bf16");
}

// at least ~64 KB of weight per thread: smaller slices cost more to start than to stream
int64_t row_grain(int64_t row_bytes) { return std::max<int64_t>(1, (64 << 10) / row_bytes); }

// whether the environment sets `name` to 0, false or off
bool env_says_off(const char* name) {
  const char* e = std::getenv(name);
  return e != nullptr &&
         (std::strcmp(e, "0") == 0 || std::strcmp(e, "false") == 0 || std::strcmp(e, "off") == 0);
}

// VSERVE_QUANT_EXACT=1 (read on every call: tests flip it) makes gemv dequantize to fp32
bool exact_forced() {
  const char* e = std::getenv("VSERVE_QUANT_EXACT");
  return e != nullptr && *e != '\0' && !env_says_off("VSERVE_QUANT_EXACT");
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define QUANT_VNNI 1
#endif

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

// Q4_0 / Q5_0, four blocks a step (XLayout::kQuads: needs vpermi2b and vpshufbitqmb). The
// quad's bytes are two (overlapping) 64-byte loads, z0 from its start and z1 ending at its
// end, and three byte permutes of them give: the four blocks' 16 nibble bytes (their low
// nibbles: weights 0-15 of each block, the high ones 16-31), Q5_0's fifth-bit words (block i's
// in both quadwords 2i, 2i + 1, where vpshufbitqmb picks the bit of each weight into a mask)
// and the four fp16 scales, one per four int32 lanes.
#if defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
#define QUANT_QUADS 1

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

// Q4_K / Q5_K: the unsigned quants of chunk (h, p) of a super-block, from the 64 quant bytes
// of half h (`bytes`) and, for Q5_K, its 32 fifth-bit bytes in both 256-bit halves (`high`,
// `kquant_high`): sub-block 4h + p in the first 32 bytes, 4h + 2 + p in the last 32
QUANT_INLINE __m512i kquant_high(const uint8_t* b) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)));
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

// the quantization each format's chunks want: offset, layout, super-block sums
template <class F>
constexpr int x_offset() {
  if constexpr (std::is_same_v<F, Q4_0>) return 8;
  else if constexpr (std::is_same_v<F, Q5_0> || std::is_same_v<F, Q5_0R>) return 16;
  else if constexpr (std::is_same_v<F, Q8_0>) return 128;
  else if constexpr (std::is_same_v<F, Q6_K>) return 32;
  else return 0;
}

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

// ---- the int8 GEMM (AVX512-VNNI), more than 8 activation rows ----
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

constexpr int kTileN = 32;  // output rows (columns of y) per tile: two vectors of int32 lanes
constexpr int kTileM = 6;   // activation rows per micro-tile: 12 int32 + 12 fp32 accumulators

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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QUANT_AMX 1
// ---- the bf16 GEMM on AMX tiles, more than 8 activation rows ----
// CPUs with a tile unit (Intel Sapphire Rapids and later) multiply 16 x 32 bf16 by 32 x 16
// bf16 into 16 x 16 fp32 in one tdpbf16ps. The int8 GEMM's per-block scaling cannot run on
// the tiles (a block's int32 sums must be scaled before the next block's are added), and
// measured it bounds an AMX int8 kernel to the VNNI one's speed. So here each thread
// dequantizes a tile of 32 weight rows to bf16 (dequant_row: each weight gguf's fp32 value
// rounded once) and multiplies it, as the tiles' first operand and untransposed, with every
// activation tile of 16 rows, paired once per call as the second operand reads them
// (pair_activations); the sums stay in the tiles over all of K and come out transposed
// (untranspose). The result is the exact path's
// (bf16 weights times bf16 activations, summed in fp32) up to the order of the sums; the tile
// unit flushes denormal inputs and outputs to zero.

// Below kAmxMinRows rows a tile's dequantization costs more than the int8 GEMM's arithmetic;
// from kAmxMaxRows on, oneDNN's bf16 GEMM (on the tiles too) over dequantized tiles of ~2 MB
// (matmul's exact path) is faster, its blocking made for large sizes. Measured on a 2-core
// Xeon VM, the embedded model's shapes and formats: at 33 rows 0.89-1.05x the int8 GEMM's
// speed, at 64 1.26-1.55x, at 130 1.28-1.66x; at 512 rows even with the dequantized at::mm
// (0.85-1.03 ms), at 2048 1.4-1.75x slower than it.
constexpr int64_t kAmxMinRows = 48, kAmxMaxRows = 512;

// Linux hands a process the tile state only on request (once; oneDNN asks the same)
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// VSERVE_QUANT_AMX=0 (read on every call: tests compare both) keeps the int8 GEMM
bool amx_enabled() { return !env_says_off("VSERVE_QUANT_AMX") && amx_permitted(); }

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: fp32 sums (activation tile i, output half g: 2i + g); 4, 5: activations
// [16 rows][32]; 6, 7: weights [16 input pairs][16 rows][2]. A thread's configuration is its
// own and oneDNN sets another between our calls: set at the start of each share.
void amx_configure() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// the next tile's row `row`, into L2 (a tile ahead, one row per row dequantized: measured, a
// burst of the whole next tile's lines per tile stalls on the CPU's fill buffers and streams
// the weight at a third of the bandwidth)
QUANT_INLINE void fetch_row(const uint8_t* w, int64_t row_bytes, int64_t row, int64_t n) {
  if (row >= n) return;
  const char* p = reinterpret_cast<const char*>(w + row * row_bytes);
  for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

// weight rows n0 .. n0 + 32 (zeros past n) dequantized to bf16 into rows [32][K]
template <class F>
void dequant_tile(const uint8_t* w, int64_t row_bytes, int64_t n, int64_t n0, int64_t k,
                  bf16* rows) {
  for (int i = 0; i < kTileN; ++i) {
    fetch_row(w, row_bytes, n0 + kTileN + i, n);
    if (n0 + i < n)
      dequant_row<F>(w + (n0 + i) * row_bytes, rows + i * k, k / F::kBlock);
    else
      std::memset(static_cast<void*>(rows + i * k), 0, k * sizeof(bf16));
  }
}

// x [M_pad][K] as the tiles' second operand: per tile of 16 activation rows, their pairs of
// inputs [K / 2][16][2] (one tile's operand is 1 KB in a row), a 16 x 16 transpose of pairs at
// a time (M_pad and K / 2 are multiples of 16)
void pair_activations(const bf16* x, int64_t m_pad, int64_t k, bf16* xt) {
  const int64_t pairs = k / 2;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(x);
  uint32_t* dst = reinterpret_cast<uint32_t*>(xt);
  for (int64_t m0 = 0; m0 < m_pad; m0 += 16)
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + (m0 + i) * pairs + p0);
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (m0 / 16 * pairs + p0 + j) * 16, r[j]);
    }
}

// out_t[32 weight rows][16 MT] = rows [32][K] times activation tiles m0 / 16 .. of xt: the
// weight is the tiles' first operand, read as dequantized (no transpose), and the product
// comes out transposed
template <int MT>
void amx_bf16_micro(const bf16* rows, const bf16* xt, int64_t m0, int64_t k, float (*out_t)[32]) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (MT == 2) {
    _tile_zero(1);
    _tile_zero(3);
  }
  const bf16* x0 = xt + m0 * k;  // activation tile m0 / 16: [K / 2][16][2]
  for (int64_t c = 0; c < k / 32; ++c) {
    _tile_loadd(4, rows + 32 * c, 2 * k);
    _tile_loadd(5, rows + 16 * k + 32 * c, 2 * k);
    _tile_loadd(6, x0 + 512 * c, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (MT == 2) {
      _tile_loadd(7, x0 + 16 * k + 512 * c, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out_t[0], sizeof(out_t[0]));
  _tile_stored(2, out_t[16], sizeof(out_t[0]));
  if constexpr (MT == 2) {
    _tile_stored(1, out_t[0] + 16, sizeof(out_t[0]));
    _tile_stored(3, out_t[16] + 16, sizeof(out_t[0]));
  }
}

// out[m][n] = out_t[n][m] for the 32 x 32 block (two 16 x 16 transposes a quarter)
void untranspose(float (*out_t)[32], float (*out)[kTileN]) {
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(out_t[16 * a + i] + 16 * b);
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(out[16 * b + j] + 16 * a, r[j]);
    }
}

// 64-byte aligned bf16 scratch of a thread (a pool thread keeps its own between calls)
bf16* aligned_scratch(std::vector<bf16>& buf, int64_t elems) {
  buf.resize(elems + 32);
  return reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) &
                                 ~uintptr_t{63});
}

at::Tensor gemm_amx(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k) {
  const int64_t m = x.size(0), n = data.size(0), row_bytes = data.size(1);
  auto out = at::empty({m, n}, x.options());
  // whole tiles of 16 activation columns: the ones past m are zeros
  const int64_t m_pad = (m + 15) / 16 * 16;
  at::Tensor xp = x.contiguous();
  if (m_pad != m) xp = at::cat({xp, at::zeros({m_pad - m, k}, x.options())});
  auto xt = at::empty({m_pad / 16, k / 2, 16, 2}, x.options());
  pair_activations(xp.data_ptr<bf16>(), m_pad, k, xt.data_ptr<bf16>());
  const bf16* xq = xt.data_ptr<bf16>();
  const uint8_t* w = data.data_ptr<uint8_t>();
  void* yp = out.data_ptr();
  const bool stream = m * n * x.element_size() > (16 << 20);
  with_format(qtype, [&](auto fmt) {
    using F = decltype(fmt);
    const int64_t tiles = (n + kTileN - 1) / kTileN;
    vserve_rows::stream_rows(tiles, kTileN * row_bytes, [&](int64_t lo, int64_t hi) {
      thread_local std::vector<bf16> rows_buf;
      bf16* rows = aligned_scratch(rows_buf, kTileN * k);
      alignas(64) float out_t[kTileN][32], tile_out[32][kTileN];
      amx_configure();
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t n0 = t * kTileN, cols = std::min<int64_t>(kTileN, n - n0);
        dequant_tile<F>(w, row_bytes, n, n0, k, rows);
        for (int64_t m0 = 0; m0 < m; m0 += 32) {
          const int64_t rows_here = std::min<int64_t>(32, m - m0);
          if (rows_here > 16)
            amx_bf16_micro<2>(rows, xq, m0, k, out_t);
          else
            amx_bf16_micro<1>(rows, xq, m0, k, out_t);
          untranspose(out_t, tile_out);
          for (int64_t i = 0; i < rows_here; ++i)
            store_cols(tile_out[i], yp, true, n, m0 + i, n0, cols, stream);
        }
      }
      _tile_release();
      if (stream) _mm_sfence();  // this thread's streamed lines before the join
    }, kTileN * row_bytes);
  });
  return out;
}
#endif  // AMX
#endif  // QUANT_VNNI


}  // namespace

namespace vserve_quant {

at::Tensor dequantize(const at::Tensor& data, int64_t qtype, int64_t k, at::ScalarType dtype) {
  check_weight(data, qtype, k);
  check_out_dtype(dtype);
  int64_t n = data.size(0), row_bytes = data.size(1);
  auto out = at::empty({n, k}, data.options().dtype(dtype));
  const uint8_t* d = data.data_ptr<uint8_t>();
  at::parallel_for(0, n, row_grain(row_bytes), [&](int64_t lo, int64_t hi) {
    if (dtype == at::kFloat)
      dequant_rows(d, qtype, k, row_bytes, nullptr, lo, hi, out.data_ptr<float>() + lo * k);
    else
      dequant_rows(d, qtype, k, row_bytes, nullptr, lo, hi, out.data_ptr<bf16>() + lo * k);
  });
  return out;
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
  int64_t m = x.size(0), n = data.size(0), row_bytes = data.size(1);
  TORCH_CHECK(m >= 1 && m <= 8, "gemv takes 1 to 8 activation rows, got ", m);
  if (!exact_forced() && int8_activations(x.scalar_type())) {
#ifdef QUANT_VNNI
    return gemv_int8(x, data, qtype, k);
#elif defined(QUANT_AVX2_INT8)
    return gemv_avx2(x, data, qtype, k);
#endif
  }
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

at::Tensor matmul(const at::Tensor& x, const at::Tensor& data, int64_t qtype, int64_t k) {
  check_weight(data, qtype, k);
  check_activations(x, k);
  int64_t m = x.size(0), n = data.size(0), row_bytes = data.size(1);
  if (m == 0) return at::empty({0, n}, x.options());  // e.g. no row wants prompt logprobs
  if (m <= 8) return gemv(x, data, qtype, k);
#ifdef QUANT_VNNI
  const bool fast = !exact_forced() && x.scalar_type() == at::kBFloat16;
#ifdef QUANT_AMX
  const bool amx = fast && m >= kAmxMinRows && amx_enabled();
  if (amx && m < kAmxMaxRows) return gemm_amx(x, data, qtype, k);
#else
  const bool amx = false;
#endif
  if (fast && !amx) return gemm_int8(x, data, qtype, k);
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

at::Tensor embedding(const at::Tensor& data, int64_t qtype, int64_t k, const at::Tensor& ids,
                     at::ScalarType dtype) {
  check_weight(data, qtype, k);
  check_out_dtype(dtype);
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1,
              "ids must be a CPU int64 [T]");
  auto idc = ids.contiguous();
  int64_t t = idc.size(0), n = data.size(0), row_bytes = data.size(1);
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n, "id ", ip[i], " out of range [0, ", n, ")");
  auto out = at::empty({t, k}, data.options().dtype(dtype));
  const uint8_t* d = data.data_ptr<uint8_t>();
  at::parallel_for(0, t, std::max<int64_t>(1, 16384 / k), [&](int64_t lo, int64_t hi) {
    if (dtype == at::kFloat)
      dequant_rows(d, qtype, k, row_bytes, ip, lo, hi, out.data_ptr<float>() + lo * k);
    else
      dequant_rows(d, qtype, k, row_bytes, ip, lo, hi, out.data_ptr<bf16>() + lo * k);
  });
  return out;
}

bool q5_0r_supported() {
#if defined(QUANT_VNNI) && defined(QUANT_QUADS)
  return true;
#else
  return false;
#endif
}

at::Tensor repack_q5_0(const at::Tensor& data, int64_t k) {
  check_weight(data, kQ5_0, k);
  TORCH_CHECK(q5_0r_supported(), "repack_q5_0: this build's gemv does not read Q5_0R");
  TORCH_CHECK(k % Q5_0R::kBlock == 0, "repack_q5_0: K = ", k, " is not a multiple of 128");
  const int64_t n = data.size(0), quads = n * (k / Q5_0R::kBlock);
  auto out = at::empty({n, k / Q5_0R::kBlock * Q5_0R::kBytes}, data.options());
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, quads, 4096, [&](int64_t lo, int64_t hi) {
    for (int64_t q = lo; q < hi; ++q) {
      const uint8_t* b = src + q * 4 * Q5_0::kBytes;  // (rows are whole quads)
      uint8_t* o = dst + q * Q5_0R::kBytes;
      for (int i = 0; i < 4; ++i, b += Q5_0::kBytes) {
        std::memcpy(o + 16 * i, b + 6, 16);                   // nibbles
        std::memcpy(o + Q5_0R::kLowBits + 2 * i, b + 2, 2);   // fifth bits of weights 0-15
        std::memcpy(o + Q5_0R::kHighBits + 2 * i, b + 4, 2);  // of weights 16-31
        std::memcpy(o + Q5_0R::kScales + 2 * i, b, 2);        // d
      }
    }
  });
  return out;
}

const char* int8_gemv() {
#ifdef QUANT_VNNI
  return "vnni";
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

const void* GemvInput::data() const {
  return reinterpret_cast<const void*>(
      (reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
}

bool amx_gemm() {
#ifdef QUANT_AMX
  return amx_permitted();
#else
  return false;
#endif
}

bool supported_qtype(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: case kQ5_0: case kQ8_0: case kQ4_K: case kQ5_K: case kQ6_K: return true;
    case kQ5_0R: return q5_0r_supported();
  }
  return false;
}

int64_t row_bytes_of(int64_t qtype, int64_t k) {
  return k % block_size(qtype) == 0 ? k / block_size(qtype) * block_bytes(qtype) : -1;
}

void gemv_prepare(GemvInput& in, const bf16* x, int64_t m, int64_t k, int64_t qtype) {
  TORCH_CHECK(m >= 1 && m <= 8 && k % block_size(qtype) == 0, "gemv_prepare: shape");
  in.m = m;
  in.k = k;
  in.qtype = qtype;
  in.int8 = !exact_forced() && int8_activations(at::kBFloat16);  // as gemv decides, each call
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
