// Fused bf16 CPU kernels: norms, rotary, gated activation, paged decode attention, a one-row
// gemv and the linears, which decode.h's `layer` strings together into one whole decoder
// layer of a decode step (declared in decode.h, bound by bindings.cpp;
// tests/workers/test_cpu_ops.py).
//
// Every kernel computes what the eager torch code it replaces computes, rounding to bf16 at
// the same points (each elementwise op rounds its result; norms and softmax run in fp32).
// Reductions accumulate in fp32 in their own order, so results may differ from the eager ops
// in the last bf16 bit. A bf16 CPU model uses these kernels on every step, prefill and decode,
// and `decoder_layer` calls exactly the kernels the per-op path calls, so a step's outputs do
// not depend on which of the two paths ran it. An fp32 CPU model uses `decode_attention` alone:
// it reads the paged cache in place instead of gathering it, and differs from the eager fp32
// matmuls only in the order of its fp32 sums.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "decode.h"
#include "layer_rows.h"
#include "row_shares.h"
#include "quant.h"
#include "vec16.h"
#include "vec16_avx2.h"

namespace {

using bf16 = c10::BFloat16;
constexpr int kLanes = 16;

inline float f(bf16 x) { return static_cast<float>(x); }
inline bf16 b(float x) { return static_cast<bf16>(x); }

inline float f(float x) { return x; }

// fp32 dot product of a bf16 or fp32 vector with an fp32 one in L independent lanes
// (vectorizes without fast-math): attention's q . k (16 lanes) and the gemv's rows (32)
template <int L, typename T>
inline float dot(const T* a, const float* xf, int64_t n) {
  float acc[L] = {};
  int64_t i = 0;
  for (; i + L <= n; i += L)
    for (int l = 0; l < L; ++l) acc[l] += xf[i + l] * f(a[i + l]);
  float s = 0;
  for (; i < n; ++i) s += xf[i] * f(a[i]);
  for (int l = 0; l < L; ++l) s += acc[l];
  return s;
}

inline float sum_squares(const bf16* x, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) { float v = f(x[i + l]); acc[l] += v * v; }
  float s = 0;
  for (; i < n; ++i) { float v = f(x[i]); s += v * v; }
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  return s;
}

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

namespace vserve_layer {

// style 0 (Llama): bf16(weight * bf16(x * r)); style 1 (Gemma): bf16(x * r * scale_fp32)
void rms_row(const bf16* x, bf16* out, int64_t n, const void* w, int64_t style, float eps) {
  float r = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  if (style == 1) {
    const float* s = static_cast<const float*>(w);
    for (int64_t i = 0; i < n; ++i) out[i] = b(f(x[i]) * r * s[i]);
  } else {
    const bf16* s = static_cast<const bf16*>(w);
    for (int64_t i = 0; i < n; ++i) out[i] = b(f(s[i]) * f(b(f(x[i]) * r)));
  }
}

void rotary_row(const bf16* xr, bf16* o, int64_t d, const bf16* c, const bf16* s,
                int64_t rot) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < rot; ++i) {
    float other = i < half ? -f(xr[i + half]) : f(xr[i - half]);
    o[i] = b(f(b(f(xr[i]) * f(c[i]))) + f(b(other * f(s[i]))));
  }
  for (int64_t i = rot; i < d; ++i) o[i] = xr[i];
}

}  // namespace vserve_layer

using vserve_layer::rms_row;
using vserve_layer::rotary_row;

namespace vserve_decode {

// x [T, n] or [T, H, n] bf16 (rows of a token dense, any token stride) -> normalized,
// contiguous; weight: fp32 scale (style 1, Gemma) or bf16 weight (style 0, Llama)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, int64_t style, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && (x.dim() == 2 || x.dim() == 3),
              "rms_norm: x must be bf16 [T, n] or [T, H, n]");
  int64_t n = x.size(-1), heads = x.dim() == 3 ? x.size(1) : 1, t = x.size(0);
  TORCH_CHECK(x.stride(-1) == 1 && (x.dim() == 2 || x.stride(1) == n),
              "rms_norm: the rows of a token must be dense");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n &&
              weight.scalar_type() == (style == 1 ? at::kFloat : at::kBFloat16),
              "rms_norm: weight has the wrong size or dtype for its style");
  auto out = at::empty(x.sizes(), x.options());
  const bf16* xp = x.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const void* wp = weight.data_ptr();
  int64_t ts = x.stride(0);
  at::parallel_for(0, t * heads, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r)
      rms_row(xp + (r / heads) * ts + (r % heads) * n, op + r * n, n, wp, style, (float)eps);
  });
  return out;
}

// x [T, H, D] (any row stride between tokens), cos/sin [T, rot] bf16: rotate-half rotary of
// the first `rot` dims as bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)); returns [T, H, D]
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.stride(2) == 1 &&
              x.stride(1) == x.size(2), "rotary: x must be bf16 [T, H, D] with dense heads");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  int64_t t = x.size(0), h = x.size(1), d = x.size(2), rot = cos.size(-1);
  TORCH_CHECK(rot % 2 == 0 && rot <= d && cos.numel() == t * rot && sin.sizes() == cos.sizes(),
              "rotary: cos and sin must be [T, (1,) rot] with an even rot <= head dim");
  auto out = at::empty({t, h, d}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sp = sin.data_ptr<bf16>();
  int64_t xs = x.stride(0);
  at::parallel_for(0, t * h, 256, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      int64_t ti = r / h, hi_ = r % h;
      rotary_row(xp + ti * xs + hi_ * d, op + r * d, d, cp + ti * rot, sp + ti * rot, rot);
    }
  });
  return out;
}

// gate_up [T, 2I] bf16 -> act(gate) * up; act 0 = silu, 1 = gelu (tanh). The ATen ops the
// eager model runs (vectorized tanh / exp), so the result is bitwise the eager one.
at::Tensor act_mul(const at::Tensor& gate_up, int64_t act) {
  int64_t inter = gate_up.size(-1) / 2;
  auto gate = gate_up.narrow(-1, 0, inter), up = gate_up.narrow(-1, inter, inter);
  return (act == 1 ? at::gelu(gate, "tanh") : at::silu(gate)).mul_(up);
}

}  // namespace vserve_decode

namespace {

// the value the eager op of dtype T stores: bf16 rounds, fp32 keeps
template <typename T>
inline float stored(float x) { return std::is_same_v<T, bf16> ? f(b(x)) : x; }

using namespace vec16;  // vf, load16, splat, vexp

inline float hsum(vf v) {  // a tree of four shuffles
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  return v[0] + v[1];
}

// q . k for a head dim that is a multiple of 16, q already fp32
template <typename T>
inline float dot16(const T* k, const float* q, int64_t d) {
#ifdef VEC16_HALVES
  vf2 acc = mul2(load2(k), load2(q));
  for (int64_t i = 16; i < d; i += 16) acc = fma2(load2(k + i), load2(q + i), acc);
  return hsum2(acc);
#else
  vf acc = load16(k) * load16(q);
  for (int64_t i = 16; i < d; i += 16) acc += load16(k + i) * load16(q + i);
  return hsum(acc);
#endif
}

// dot16 of one key with G query heads (q: G rows of d), each sum in dot16's order: G
// independent chains instead of one (a lone chain waits on its multiply-add latency)
template <int G, typename T>
inline void dot16_heads(const T* k, const float* q, int64_t d, float* out) {
#ifdef VEC16_HALVES
  vf2 acc[G];
  const vf2 k0 = load2(k);
  for (int g = 0; g < G; ++g) acc[g] = mul2(k0, load2(q + g * d));
  for (int64_t i = 16; i < d; i += 16) {
    const vf2 ki = load2(k + i);
    for (int g = 0; g < G; ++g) acc[g] = fma2(ki, load2(q + g * d + i), acc[g]);
  }
  for (int g = 0; g < G; ++g) out[g] = hsum2(acc[g]);
#else
  vf acc[G];
  vf k0 = load16(k);
  for (int g = 0; g < G; ++g) acc[g] = k0 * load16(q + g * d);
  for (int64_t i = 16; i < d; i += 16) {
    vf ki = load16(k + i);
    for (int g = 0; g < G; ++g) acc[g] += ki * load16(q + g * d + i);
  }
  for (int g = 0; g < G; ++g) out[g] = hsum(acc[g]);
#endif
}

// the dot16 of k with each of `groups` query heads, 4 at a time
template <typename T>
inline void dots16(const T* k, const float* q, int64_t d, int64_t groups, float* out) {
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4) dot16_heads<4>(k, q + g * d, d, out + g);
  for (; g + 2 <= groups; g += 2) dot16_heads<2>(k, q + g * d, d, out + g);
  for (; g < groups; ++g) out[g] = dot16(k, q + g * d, d);
}

constexpr int64_t kAhead = 8;  // how many positions ahead the attention prefetches

// the `lines` cache lines from p into the caches (a hint: no fault, no effect on results)
inline void prefetch_lines(const void* p, int64_t lines) {
  const char* c = static_cast<const char*>(p);
  for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(c + 64 * l, 0, 3);
}

// Each (row, KV head) item: scores over its positions, a softmax per query head, then
// sum p * v. Items run in parallel; with fewer items than threads (batch-1 decode, one KV
// head) the positions of the score pass and the (query head, 16 dims) sums of the value pass
// are split across the threads instead: every value is computed as before (same order of
// sums), so the result does not depend on the split.
template <typename T>
void decode_attention_rows(const T* qp, const T* kp, const T* vp, T* op, const int64_t* btp,
                           const int64_t* slp, int64_t nb, int64_t h, int64_t d, int64_t hkv,
                           int64_t block, int64_t bstride, int64_t tstride, int64_t bt_cols,
                           int64_t window, float fscale, float cap,
                           const vserve_layer::ParallelFor* par = nullptr) {
  int64_t groups = h / hkv;
  const int64_t threads = par != nullptr ? par->threads : at::get_num_threads();
  const bool split = nb * hkv < threads && d % 16 == 0;
  // fn over [0, n) in parallel (chunks of at least `grain`): ATen's threads, or the caller's
  // (the decode stack's)
  auto parallel = [&](int64_t n, int64_t grain, auto&& fn) {
    if (par != nullptr)
      par->run(n, grain, fn);
    else
      at::parallel_for(0, n, grain, fn);
  };
  // fn over [0, n) in parallel when splitting, else on this thread
  auto over = [&](int64_t n, int64_t grain, auto&& fn) {
    if (split)
      parallel(n, grain, fn);
    else
      fn(int64_t{0}, n);
  };
  auto item_fn = [&](int64_t item, std::vector<float>& qf, std::vector<float>& acc,
                     std::vector<float>& scores) {
    int64_t r = item / hkv, g = item % hkv;
    int64_t len = slp[r], qpos = len - 1;
    int64_t first = window > 0 ? std::max<int64_t>(0, qpos - window + 1) : 0;
    int64_t n = len - first;
    scores.assign(groups * n, 0.0f);
    for (int64_t j = 0; j < groups * d; ++j) qf[j] = f(qp[(r * h + g * groups) * d + j]);
    const int64_t* row_blocks = btp + r * bt_cols;
    // positions [lo, hi) of the window block by block: one table lookup per block, no
    // division per position. fetch(row) is called with the row kAhead positions ahead (in
    // the range): the cache was written steps ago and is cold (a step streams far more than
    // the caches hold), and the blocks of a sequence need not be adjacent, so the hardware
    // prefetchers would leave each row's first lines to memory latency.
    auto each_position = [&](const T* cache, int64_t lo, int64_t hi, auto&& body,
                             auto&& fetch) {
      for (int64_t p = first + lo; p < first + hi;) {
        int64_t in_block = p % block, count = std::min(block - in_block, first + hi - p);
        const T* row = cache + row_blocks[p / block] * bstride + in_block * tstride + g * d;
        const int64_t rest = std::min(block, first + hi - p - count);  // in the next block
        const T* next = rest > 0 ? cache + row_blocks[p / block + 1] * bstride + g * d : row;
        for (int64_t i = 0; i < count; ++i) {
          const int64_t a = i + kAhead;
          if (a < count)
            fetch(row + a * tstride);
          else if (a - count < rest)
            fetch(next + (a - count) * tstride);
          body(p + i - first, row + i * tstride);
        }
        p += count;
      }
    };
    const int64_t row_lines = (d * static_cast<int64_t>(sizeof(T)) + 63) / 64;
    const std::ptrdiff_t v_off = vp - kp;  // V's row of a position: K's, in V's cache
    over(n, 64, [&](int64_t lo, int64_t hi) {
      std::vector<float> dots(groups);
      for (int64_t j = lo; j < std::min(hi, lo + kAhead); ++j) {  // the first rows
        const int64_t p = first + j;
        const T* kr = kp + row_blocks[p / block] * bstride + p % block * tstride + g * d;
        prefetch_lines(kr, row_lines);
        prefetch_lines(kr + v_off, row_lines);
      }
      // the keys and the values of this share's positions: the value pass reads them next
      auto fetch_kv = [&](const T* kr) {
        prefetch_lines(kr, row_lines);
        prefetch_lines(kr + v_off, row_lines);
      };
      each_position(kp, lo, hi, [&](int64_t j, const T* kr) {
        if (d % 16 == 0)
          dots16(kr, qf.data(), d, groups, dots.data());
        else
          for (int64_t qh = 0; qh < groups; ++qh) dots[qh] = dot<kLanes>(kr, qf.data() + qh * d, d);
        for (int64_t qh = 0; qh < groups; ++qh) {
          float s = stored<T>(dots[qh]) * fscale;
          if (cap > 0) s = std::tanh(s / cap) * cap;
          scores[qh * n + j] = s;
        }
      }, fetch_kv);
    });
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t qh = 0; qh < groups; ++qh) {
      float* sc = scores.data() + qh * n;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) m = std::max(m, sc[j]);
      float total = 0;
      int64_t j = 0;
      for (; j + 16 <= n; j += 16) {
        vf e = vexp(load16(sc + j) - m);
        std::memcpy(sc + j, &e, sizeof(e));
      }
      for (; j < n; ++j) sc[j] = vexp(splat(sc[j] - m))[0];
      for (j = 0; j < n; ++j) total += sc[j];
      for (int64_t j = 0; j < n; ++j) sc[j] = stored<T>(sc[j] / total);
    }
    if (d % 16 == 0) {  // each 16 dims of a head summed in a register, not through memory
      // units of 4 x 16 dims of one head (or 16 when d is not a multiple of 64): four
      // independent chains, each summed over the positions in order
      const int64_t w = d % 64 == 0 ? 4 : 1, units = groups * (d / (16 * w));
      over(units, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t u = lo; u < hi; ++u) {
          int64_t qh = u / (d / (16 * w)), c = u % (d / (16 * w)) * 16 * w;
          const float* pr = scores.data() + qh * n;
          float* out = acc.data() + qh * d + c;
          if (w == 4) {
#ifdef VEC16_HALVES
            vf2 a[4] = {};
            each_position(vp, 0, n, [&](int64_t j, const T* vr) {
              const T* v = vr + c;
              for (int t = 0; t < 4; ++t) a[t] = fma2(pr[j], load2(v + 16 * t), a[t]);
            }, [&](const T* vr) { prefetch_lines(vr + c, (64 * sizeof(T) + 63) / 64); });
            for (int t = 0; t < 4; ++t) store2(out + 16 * t, a[t]);
#else
            vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
            each_position(vp, 0, n, [&](int64_t j, const T* vr) {
              const T* v = vr + c;
              a0 += pr[j] * load16(v);
              a1 += pr[j] * load16(v + 16);
              a2 += pr[j] * load16(v + 32);
              a3 += pr[j] * load16(v + 48);
            }, [&](const T* vr) { prefetch_lines(vr + c, (64 * sizeof(T) + 63) / 64); });
            std::memcpy(out, &a0, sizeof(a0));
            std::memcpy(out + 16, &a1, sizeof(a1));
            std::memcpy(out + 32, &a2, sizeof(a2));
            std::memcpy(out + 48, &a3, sizeof(a3));
#endif
          } else {
            vf a = {};
            each_position(vp, 0, n, [&](int64_t j, const T* vr) { a += pr[j] * load16(vr + c); },
                          [&](const T* vr) { prefetch_lines(vr + c, (16 * sizeof(T) + 63) / 64); });
            std::memcpy(out, &a, sizeof(a));
          }
        }
      });
    } else {
      each_position(vp, 0, n, [&](int64_t j, const T* vr) {
        for (int64_t qh = 0; qh < groups; ++qh) {
          float pr = scores[qh * n + j];
          float* a = acc.data() + qh * d;
          for (int64_t e = 0; e < d; ++e) a[e] += pr * f(vr[e]);
        }
      }, [&](const T* vr) { prefetch_lines(vr, row_lines); });
    }
    for (int64_t j = 0; j < groups * d; ++j) op[(r * h + g * groups) * d + j] = T(acc[j]);
  };
  if (split) {
    std::vector<float> qf(groups * d), acc(groups * d), scores;
    for (int64_t item = 0; item < nb * hkv; ++item) item_fn(item, qf, acc, scores);
    return;
  }
  parallel(nb * hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf(groups * d), acc(groups * d), scores;
    for (int64_t item = lo; item < hi; ++item) item_fn(item, qf, acc, scores);
  });
}

}  // namespace

namespace vserve_decode {

// One query token per row. q [B, H, D] bf16 or fp32; caches [num_blocks, block_size, Hkv, D]
// of q's dtype; block_tables [B, >= blocks] int; seq_lens [B] int (the query is the last
// position). scores = (q . k) * scale (fp32; the dot rounded to bf16 for bf16), optional
// softcap, window mask, fp32 softmax, probs rounded to the dtype, out = sum p * v in it: the
// eager two-matmul attention's rounding points. fp32 models use this kernel alone of this file.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, int64_t window, double scale,
                            double softcap) {
  auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "q must be bfloat16 or float32");
  TORCH_CHECK(q.is_contiguous(), "q must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "caches must have q's dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3) &&
              k_cache.stride(1) == k_cache.size(2) * k_cache.size(3) &&
              v_cache.strides() == k_cache.strides(), "caches must have dense blocks");
  auto bt = block_tables.to(at::kLong).contiguous();
  auto sl = seq_lens.to(at::kLong).contiguous();
  TORCH_CHECK(q.dim() == 3 && q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "decode_attention: q must be [B, H, D] with H a multiple of the KV heads");
  int64_t nb = q.size(0), h = q.size(1), d = q.size(2);
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) == nb && sl.numel() == nb,
              "decode_attention: one block-table row and one length per query row");
  int64_t block = k_cache.size(1), bt_cols = bt.size(1);
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* slp = sl.data_ptr<int64_t>();
  for (int64_t r = 0; r < nb; ++r)
    TORCH_CHECK(slp[r] >= 0 && slp[r] <= bt_cols * block,
                "decode_attention: a sequence is longer than its block table");
  auto out = at::empty({nb, h, d}, q.options());
  auto run = [&](auto* qp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
    decode_attention_rows<T>(qp, static_cast<const T*>(k_cache.data_ptr()),
                             static_cast<const T*>(v_cache.data_ptr()),
                             static_cast<T*>(out.data_ptr()), btp, slp, nb, h, d,
                             k_cache.size(2), block, k_cache.stride(0), k_cache.stride(1),
                             bt_cols, window, static_cast<float>(scale),
                             static_cast<float>(softcap));
  };
  if (dtype == at::kBFloat16)
    run(static_cast<const bf16*>(q.data_ptr()));
  else
    run(static_cast<const float*>(q.data_ptr()));
  return out;
}

}  // namespace vserve_decode

void vserve_layer::attention_rows(const bf16* q, const bf16* k_cache, const bf16* v_cache,
                                  bf16* out, const int64_t* block_tables,
                                  const int64_t* seq_lens, int64_t nb, int64_t h, int64_t d,
                                  int64_t hkv, int64_t block, int64_t bt_cols, int64_t window,
                                  float scale, float softcap, const ParallelFor* par) {
  decode_attention_rows<bf16>(q, k_cache, v_cache, out, block_tables, seq_lens, nb, h, d, hkv,
                              block, block * hkv * d, hkv * d, bt_cols, window, scale, softcap,
                              par);
}

namespace {

// rows [n0, n1) of y[N] = W[N, K] x[K] (+ bias), x already widened to fp32; 2 x 16 lanes keep
// the FMAs independent
void gemv_rows(const bf16* w, const float* xf, const bf16* bias, bf16* y, int64_t n0,
               int64_t n1, int64_t k) {
  for (int64_t r = n0; r < n1; ++r) {
    float s = dot<2 * kLanes>(w + r * k, xf, k);
    if (bias != nullptr) s += f(bias[r]);
    y[r] = b(s);
  }
}

}  // namespace

namespace vserve_decode {

// x [1, K] bf16, weight [N, K] bf16 row-major -> x W^T (+ bias) [1, N] bf16, accumulated in
// fp32 and rounded once. One row's matmul only streams the weight from memory: each thread
// reads its own contiguous slice of rows in plain order, which the prefetchers follow at
// full bandwidth (oneDNN's blocked kernel reaches ~70% of it at this shape).
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias) {
  check_bf16(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.size(1) == weight.size(1) &&
              x.scalar_type() == at::kBFloat16, "gemv: x must be bf16 [1, K]");
  int64_t k = x.size(1), n = weight.size(0);
  auto xf = x.to(at::kFloat).contiguous();
  auto out = at::empty({1, n}, x.options());
  const bf16* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    check_bf16(*bias, "bias");
    TORCH_CHECK(bias->numel() == n, "gemv: bias size");
    bp = bias->data_ptr<bf16>();
  }
  const bf16* w = weight.data_ptr<bf16>();
  const float* xp = xf.data_ptr<float>();
  bf16* yp = out.data_ptr<bf16>();
  at::parallel_for(0, n, 256, [&](int64_t lo, int64_t hi) {
    gemv_rows(w, xp, bp, yp, lo, hi, k);
  });
  return out;
}

}  // namespace vserve_decode

namespace {

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  // the oneDNN kernel on a weight prepacked by mkldnn::_reorder_linear_weight, as PackedLinear
  static auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                        c10::string_view, c10::List<std::optional<at::Scalar>>,
                        std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(),
                 c10::string_view(""));
}

}  // namespace

namespace vserve_decode {

// x [M, K] times the rows of w [N, K] (no bias): F.linear's product, each tile of ~1 MB of
// weight rows multiplied on one thread by ATen's own kernel (inside a parallel region ATen
// runs it single-threaded) into its columns of the output, the tiles claimed in shares
// (row_shares.h). For an fp32 lm_head, where F.linear's one static split made a thread that
// the OS preempted (the engine's host work beside the forward) hold up the whole product:
// measured, 262k x 64 at M = 32, 28.4 -> 25.8 ms alone and 37.2 -> 26.7 ms beside a process
// busy 1 ms in 6. Each tile is one product whichever thread claims it: repeated runs give the
// same result (tests/models/test_shared_head.py); across thread counts the BLAS may plan a
// tile's sums another way, as it does F.linear's.
at::Tensor shared_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && w.is_contiguous() &&
                  x.scalar_type() == w.scalar_type(),
              "shared_linear: x [M, K] and a contiguous w [N, K] of one dtype");
  const auto xc = x.contiguous();
  const int64_t m = xc.size(0), n = w.size(0), k = w.size(1), row_bytes = k * w.element_size();
  auto out = at::empty({m, n}, xc.options());
  if (m == 0 || n == 0) return out;
  const int64_t tile = std::clamp<int64_t>((1 << 20) / row_bytes / 16 * 16, 16, 8192);
  const bool inference = c10::InferenceMode::is_enabled();
  // the pool's threads do not inherit the caller's inference mode (mm_out writes into out)
  vserve_rows::stream_rows(
      (n + tile - 1) / tile, tile * row_bytes,
      [&](int64_t lo, int64_t hi) {
        c10::InferenceMode mode(inference);
        for (int64_t t = lo; t < hi; ++t) {
          const int64_t r0 = t * tile, rows = std::min(tile, n - r0);
          auto cols = out.narrow(1, r0, rows);
          at::mm_out(cols, xc, w.narrow(0, r0, rows).t());
        }
      },
      tile * row_bytes);
  return out;
}

// PackedLinear.forward with the kernels attached: gemv for one row, oneDNN otherwise
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& plain,
                  const std::optional<at::Tensor>& bias) {
  return x.dim() == 2 && x.size(0) == 1 ? gemv(x, plain, bias)
                                         : onednn_linear(x, packed, bias);
}

// QuantLinear.forward (vserve/models/quant_linear.py): each part's rows (GGML type > 0: GGUF
// blocks; 0: a dense weight), concatenated, plus the bias
at::Tensor quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& parts,
                        const std::vector<int64_t>& qtypes,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(parts.size() == qtypes.size() && !parts.empty(), "quant_linear: parts");
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < parts.size(); ++i)
    outs.push_back(qtypes[i] == 0 ? at::linear(x, parts[i])
                                  : vserve_quant::matmul(x, parts[i], qtypes[i], x.size(1)));
  auto y = outs.size() == 1 ? outs[0] : at::cat(outs, 1);
  return bias.has_value() && bias->defined() ? y + *bias : y;
}

}  // namespace vserve_decode
