// vec16.h's 16 lanes as two 256-bit halves (lanes 0-7, 8-15), for the decode attention's
// inner loops on CPUs with AVX2 and no AVX-512. There GCC keeps a 64-byte vector of the generic
// kind (vec16::vf) on the stack between operations, and a bf16 load widens it element by
// element: the attention ran 7x slower than on AVX-512 (16 rows, 256 positions, 4 query heads of
// 256: 2.33 vs 0.34 ms a layer on one Xeon, the AVX2 build forced by VSERVE_CPU_ISA=avx2). Each
// lane here takes the same operations in the same order as in vf (fused multiply-adds, and
// hsum's tree), so the sums are the same on both builds.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define VEC16_HALVES 1

#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace vec16 {

struct vf2 {
  __m256 lo, hi;
};

inline vf2 load2(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }

inline __m256 widen8(const c10::BFloat16* p) {  // bf16 widens exactly: its bits, shifted
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline vf2 load2(const c10::BFloat16* p) { return {widen8(p), widen8(p + 8)}; }

inline vf2 mul2(vf2 a, vf2 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }

// a * b + c, rounded once (as `c += a * b` on vf contracts to)
inline vf2 fma2(vf2 a, vf2 b, vf2 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}

inline vf2 fma2(float a, vf2 b, vf2 c) {
  const __m256 s = _mm256_set1_ps(a);
  return {_mm256_fmadd_ps(s, b.lo, c.lo), _mm256_fmadd_ps(s, b.hi, c.hi)};
}

inline void store2(float* p, vf2 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}

// decode.cpp's hsum tree: lanes i + (i + 8), then + (i + 4), + (i + 2), then lane 0 + lane 1
inline float hsum2(vf2 v) {
  const __m256 s = _mm256_add_ps(v.lo, v.hi);
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(t) + _mm_cvtss_f32(_mm_shuffle_ps(t, t, 1));
}

}  // namespace vec16

#endif
