// 16-lane fp32 vectors shared by the CPU kernels (decode.cpp, sample.cpp): GCC/Clang vector
// extensions, lowered to AVX-512, AVX2 or SSE by -march=native. The build key of each
// extension covers this file (vserve/cpu_ops/__init__.py).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace vec16 {

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

// 16 values from p as fp32
inline vf load16(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vf load16(const c10::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  vi bits = __builtin_convertvector(h, vi) << 16;
  return (vf)bits;
}

inline vf splat(float x) { return vf{} + x; }

// exp for x <= 0 (Cephes' expf: within 2 ulp of std::exp), exactly 0 below -87.3 and at -inf,
// of any vector V of fp32 lanes (VI: int32 lanes of the same count): vf, or sample.cpp's
// narrower vector where a 64-byte one has no register
template <class V, class VI>
inline V vexp_of(V x) {
  const float lo = -87.33654f;
  V xc = x < lo ? V{} + lo : x;
  V fx = xc * 1.44269504088896341f + 0.5f;
  V t;
#ifdef __AVX512F__
  // floor in one instruction, and 2^t applied by vscalefps: the same bits as the arithmetic
  // below (t integral; y * 2^t rounded once either way), in fewer instructions: the sampler
  // runs this on every logit
  if constexpr (sizeof(V) == 64) {
    t = (V)_mm512_roundscale_ps((__m512)fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  } else
#endif
  {
    t = (fx + 12582912.0f) - 12582912.0f;  // round to nearest, then floor
    t = t > fx ? t - 1.0f : t;
  }
  V r = xc - t * 0.693359375f;
  r = r - t * -2.12194440e-4f;
  V y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  V res;
#ifdef __AVX512F__
  if constexpr (sizeof(V) == 64) {
    res = (V)_mm512_scalef_ps((__m512)y, (__m512)t);
  } else
#endif
  {
    VI e = (__builtin_convertvector(t, VI) + 127) << 23;
    res = y * (V)e;
  }
  return x < lo ? V{} : res;
}

inline vf vexp(vf x) { return vexp_of<vf, vi>(x); }

}  // namespace vec16
