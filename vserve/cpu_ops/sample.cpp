// Fused sampling over the full vocabulary for the CPU path (bindings.cpp binds it as the
// extension's `sample` submodule; workers/cpu_sampling.py calls it;
// tests/workers/test_sampler_kernel.py checks it against the torch sampler in
// workers/sampler.py, the oracle and the fallback).
//
// Per row, reading the logits in the model's dtype (bf16 or fp32), with no sort of the
// vocabulary and no full-size copy:
//   greedy (T == 0)  one pass: the first index of the maximum, as argmax returns it.
//   plain (C == 0)   pass 1: the maximum m; pass 2: block sums (in double) of
//                    e_i = exp(x_i / T - m / T) in fp32, as softmax(x / T) computes them; then
//                    the inverse CDF of today's sampler: the first token whose cumulative sum
//                    exceeds u * total, found through the block sums and one block re-walked.
//   filtered (C > 0) pass 1: the C best tokens by (logit desc, id asc), collected above a
//                    threshold that starts from an estimate (1 in 64 logits) and rises as
//                    the best C so far improve (chunks below it skipped); pass 2: the total;
//                    out: their probabilities e_i / total in fp32 ordered by (probability
//                    desc, id asc), the order of a stable descending sort of the whole row.
//                    The caller applies top-k / top-p / min-p to that prefix of the order.
// Probabilities equal the torch path's up to float rounding, so the same (seed, position)
// picks the same token except when u falls within rounding of a CDF edge. `logprobs` gives the
// log-softmax facts the sampler reports (a token's logprob and rank, the top k) in three passes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "sample.h"
#include "vec16.h"

namespace {

// kW lanes a vector: 16 (one register) with AVX-512, else 8. Without AVX-512 GCC has no
// register for a 64-byte vector and keeps each one in memory between operations: the sampler
// ran ~9x slower in the AVX2 build than in the AVX-512 one at 16 rows x 262144 logits
// (benchmarks/sampler_speed.py), 8 lanes are one AVX2 register.
#ifdef __AVX512F__
constexpr int64_t kW = 16;
#else
constexpr int64_t kW = 8;
#endif
typedef float vf __attribute__((vector_size(kW * 4)));
typedef int32_t vi __attribute__((vector_size(kW * 4)));
typedef uint16_t vh __attribute__((vector_size(kW * 2)));
typedef double vd __attribute__((vector_size(kW * 8)));

inline vf loadw(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vf loadw(const c10::BFloat16* p) {  // bf16 widens exactly: its bits, shifted
  vh h;
  std::memcpy(&h, p, sizeof(h));
  return (vf)(__builtin_convertvector(h, vi) << 16);
}

inline vf splat(float x) { return vf{} + x; }
inline vf vexp(vf x) { return vec16::vexp_of<vf, vi>(x); }
constexpr int64_t kBlock = 2048;   // elements per block sum of the inverse-CDF walk
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

// one row of logits in its dtype; chunks of kW past the end read -inf
template <typename T>
struct Row {
  const T* data;
  int64_t vocab;

  vf load(int64_t i) const {
    if (i + kW <= vocab) return loadw(data + i);
    vf v;
    for (int64_t l = 0; l < kW; ++l) v[l] = i + l < vocab ? to_float(data[i + l]) : kNegInf;
    return v;
  }
};

// e_i of kW logits from i: exp(x / T - m / T), the fp32 arguments softmax(x / T) uses
template <typename T>
inline vf probs_w(const Row<T>& row, int64_t i, float temp, float scaled_max) {
  // x / 1 is x: the default temperature skips a division per logit
  return vexp((temp == 1.0f ? row.load(i) : row.load(i) / temp) - scaled_max);
}

inline vf vmax(vf a, vf b) { return b > a ? b : a; }

inline float hmax(vf v) {   // a tree of shuffles instead of a chain of kW - 1 selects
#ifdef __AVX512F__
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
#else
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
#endif
  return v[0] > v[1] ? v[0] : (v[1] > v[0] ? v[1] : v[0]);
}

// whether some lane is >= t (NaN is not): one compare where AVX-512 has mask registers
inline bool any_at_least(vf v, float t) {
#ifdef __AVX512F__
  return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(t), _CMP_GE_OQ) != 0;
#else
  return hmax(v) >= t;
#endif
}

inline double hsum(vf v) {
  vd d = __builtin_convertvector(v, vd);
  double s = 0;
  for (int l = 0; l < kW; ++l) s += d[l];
  return s;
}

// the maximum and the first index holding it (argmax), NaN ignored; each lane keeps the first
// index of its own maximum
template <typename T>
std::pair<float, int64_t> row_argmax(const Row<T>& row) {
  vf m = splat(kNegInf);
  vi idx = {}, lane = {};
  for (int l = 0; l < kW; ++l) lane[l] = l;
  for (int64_t i = 0; i < row.vocab; i += kW) {
    vf v = row.load(i);
    vi gt = v > m;
    m = gt ? v : m;
    idx = gt ? lane + static_cast<int32_t>(i) : idx;
  }
  float best = hmax(m);
  int64_t first = 0;
  bool found = false;
  for (int l = 0; l < kW; ++l)
    if (m[l] == best && (!found || idx[l] < first)) first = idx[l], found = true;
  return {best, first};
}

template <typename T>
float row_max(const Row<T>& row) {
  vf m0 = splat(kNegInf), m1 = m0, m2 = m0, m3 = m0;
  int64_t i = 0;
  for (; i + 4 * kW <= row.vocab; i += 4 * kW) {
    m0 = vmax(m0, loadw(row.data + i));
    m1 = vmax(m1, loadw(row.data + i + kW));
    m2 = vmax(m2, loadw(row.data + i + 2 * kW));
    m3 = vmax(m3, loadw(row.data + i + 3 * kW));
  }
  for (; i < row.vocab; i += kW) m0 = vmax(m0, row.load(i));
  return hmax(vmax(vmax(m0, m1), vmax(m2, m3)));
}

// block sums of e_i: each lane sums its kBlock / kW (of 2048) values in fp32, the lanes and blocks add
// up in double: a block's mass is off by at most ~4e-6 of itself (relative), which the walk
// spreads over the block's own tokens (walk_cdf)
template <typename T>
std::vector<double> block_sums(const Row<T>& row, float temp, float scaled_max) {
  std::vector<double> sums((row.vocab + kBlock - 1) / kBlock);
  for (size_t b = 0; b < sums.size(); ++b) {
    vf a0 = {}, a1 = {};   // two chains: the adds' latency
    int64_t i = static_cast<int64_t>(b) * kBlock;
    int64_t end = std::min(row.vocab, static_cast<int64_t>(b + 1) * kBlock);
    for (; i + 2 * kW <= end; i += 2 * kW) {
      a0 += probs_w(row, i, temp, scaled_max);
      a1 += probs_w(row, i + kW, temp, scaled_max);
    }
    for (; i < end; i += kW) a0 += probs_w(row, i, temp, scaled_max);
    sums[b] = hsum(a0) + hsum(a1);
  }
  return sums;
}

// the first token whose cumulative e exceeds target (searchsorted right=True). The block
// holding the target is walked in double, its remaining target rescaled from the block's
// fp32-lane sum to its double sum first, so that the block's share of the target stays in
// the block (a token in the next one gains nothing from the two sums' rounding); rounding
// that leaves no such token picks the last token with e > 0
template <typename T>
int64_t walk_cdf(const Row<T>& row, float temp, float scaled_max,
                 const std::vector<double>& sums, double target) {
  double cum = 0;
  for (size_t b = 0; b < sums.size(); ++b) {
    if (cum + sums[b] <= target) {
      cum += sums[b];
      continue;
    }
    const int64_t begin = static_cast<int64_t>(b) * kBlock;
    const int64_t end = std::min(row.vocab, begin + kBlock);
    double exact = 0;
    for (int64_t i = begin; i < end; i += kW) exact += hsum(probs_w(row, i, temp, scaled_max));
    double left = sums[b] > 0 ? (target - cum) * (exact / sums[b]) : 0.0, run = 0;
    int64_t last = -1;
    for (int64_t i = begin; i < end; i += kW) {
      vf e = probs_w(row, i, temp, scaled_max);
      double chunk = hsum(e);
      for (int l = 0; l < kW && i + l < row.vocab; ++l)
        if (e[l] > 0.0f) last = i + l;
      if (run + chunk <= left) {
        run += chunk;
        continue;
      }
      for (int l = 0; l < kW && i + l < row.vocab; ++l) {
        run += static_cast<double>(e[l]);
        if (run > left) return i + l;
      }
    }
    if (last >= 0) return last;
    cum += sums[b];
  }
  for (int64_t i = row.vocab - 1; i > 0; --i)
    if (probs_w(row, i, temp, scaled_max)[0] > 0.0f) return i;
  return 0;
}

using Candidate = std::pair<float, int64_t>;   // (logit or probability, id)

inline bool better(const Candidate& a, const Candidate& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// keeps the `count` best of buf by (logit desc, id asc); returns the worst kept logit
inline float trim(std::vector<Candidate>& buf, int64_t count) {
  std::nth_element(buf.begin(), buf.begin() + count - 1, buf.end(), better);
  buf.resize(count);
  return buf[count - 1].first;
}

// the `count` best tokens at or above `threshold` by (logit desc, id asc), unordered (fewer
// when fewer reach it). Chunks of 64 whose maximum is below the threshold are skipped after
// one vector comparison; when the buffer doubles it is trimmed to `count` and the threshold
// rises to the worst kept logit: a later token that ties it has a higher id, so is worse.
template <typename T>
void collect_best(const Row<T>& row, float threshold, int64_t count,
                  std::vector<Candidate>& buf) {
  bool strict = false;
  for (int64_t i = 0; i < row.vocab; i += 4 * kW) {
    vf v[4];
    for (int k = 0; k < 4; ++k) v[k] = row.load(i + k * kW);
    if (!any_at_least(vmax(vmax(v[0], v[1]), vmax(v[2], v[3])), threshold)) continue;
    for (int k = 0; k < 4; ++k) {
      if (!any_at_least(v[k], threshold)) continue;
      for (int l = 0; l < kW; ++l) {
        int64_t id = i + k * kW + l;
        float x = v[k][l];
        if ((x > threshold || (!strict && x == threshold)) && id < row.vocab)
          buf.emplace_back(x, id);
      }
    }
    if (static_cast<int64_t>(buf.size()) >= 2 * count + 4 * kW) {
      threshold = trim(buf, count);
      strict = true;
    }
  }
  if (static_cast<int64_t>(buf.size()) > count) trim(buf, count);
}

// a logit with about max(2 x count, 256) tokens at or above it, from 1 in 64 tokens (fewer
// than `count` reach it for under 1% of rows): the pass then collects few more than `count`
template <typename T>
float estimated_threshold(const Row<T>& row, int64_t count) {
  std::vector<float> sample;
  sample.reserve(row.vocab / 64 + kW);
  for (int64_t i = 0; i < row.vocab; i += 64 * kW) {   // kW neighbours every 64 kW tokens
    vf v = row.load(i);
    for (int l = 0; l < kW; ++l)
      if (!std::isnan(v[l]) && i + l < row.vocab) sample.push_back(v[l]);
  }
  int64_t size = static_cast<int64_t>(sample.size());
  int64_t rank = std::min<int64_t>(size, std::max<int64_t>(2 * count * size / row.vocab, 4));
  if (rank == 0) return kNegInf;
  std::nth_element(sample.begin(), sample.begin() + rank - 1, sample.end(), std::greater<float>());
  return sample[rank - 1];
}

// the `count` best tokens by (logit desc, id asc), unordered, starting from a threshold
// estimated from a sample, and from -inf in the rare case that fewer than `count` tokens
// reach it (every token not collected is below every collected one: exact either way)
template <typename T>
std::vector<Candidate> top_candidates(const Row<T>& row, int64_t count) {
  std::vector<Candidate> buf;
  buf.reserve(2 * count + 4 * kW);
  if (row.vocab > 8 * count) collect_best(row, estimated_threshold(row, count), count, buf);
  if (static_cast<int64_t>(buf.size()) < count) {
    buf.clear();
    collect_best(row, kNegInf, count, buf);
  }
  return buf;
}

template <typename T>
void sample_row(const Row<T>& row, float temp, double u, int64_t count, int64_t* token,
                int64_t* cand_ids, float* cand_p) {
  if (temp == 0.0f) {
    *token = row_argmax(row).second;
    return;
  }
  std::vector<Candidate> cands;
  float m;
  if (count > 0) {
    cands = top_candidates(row, count);
    m = kNegInf;
    for (auto& c : cands) m = std::max(m, c.first);
  } else {
    m = row_max(row);
  }
  if (!(m > kNegInf)) {   // every token masked (or NaN): nothing to sample
    *token = 0;
    return;
  }
  float scaled_max = m / temp;
  std::vector<double> sums = block_sums(row, temp, scaled_max);
  double total = 0;
  for (double s : sums) total += s;
  if (count == 0) {
    *token = walk_cdf(row, temp, scaled_max, sums, u * total);
    return;
  }
  std::vector<Candidate> probs;   // (probability, id)
  probs.reserve(cands.size());
  for (auto& c : cands) {
    float e = vexp(splat(c.first / temp - scaled_max))[0];
    probs.emplace_back(static_cast<float>(static_cast<double>(e) / total), c.second);
  }
  std::sort(probs.begin(), probs.end(), better);
  for (size_t k = 0; k < probs.size(); ++k) {
    cand_p[k] = probs[k].first;
    cand_ids[k] = probs[k].second;
  }
  *token = -1;
}

template <typename T>
void sample_rows(const at::Tensor& logits, const float* temps, const double* us,
                 const int64_t* counts, int64_t* tokens, int64_t* ids, float* probs,
                 int64_t width) {
  const T* base = static_cast<const T*>(logits.data_ptr());
  int64_t stride = logits.stride(0), vocab = logits.size(1);
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      sample_row(Row<T>{base + r * stride, vocab}, temps[r], us[r], counts[r], tokens + r,
                 ids + r * width, probs + r * width);
  });
}


}  // namespace

namespace vserve_sample {

// logits [R, V] bf16 or fp32 (rows dense); temperature [R] fp32 (0: greedy); u [R] fp64
// uniforms; num_candidates [R] int64 (0: the whole vocabulary, C: candidates for the caller's
// filters). Returns token ids [R] (-1 for rows with candidates), candidate ids [R, max C] and
// probabilities [R, max C] (zero past a row's C).
std::vector<at::Tensor> sample(const at::Tensor& logits, const at::Tensor& temperature,
                               const at::Tensor& u, const at::Tensor& num_candidates) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "sample: logits [R, V], rows dense");
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat,
              "sample: logits must be bfloat16 or float32");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && u.scalar_type() == at::kDouble &&
              num_candidates.scalar_type() == at::kLong, "sample: parameter dtypes");
  int64_t rows = logits.size(0), vocab = logits.size(1);
  auto temps = temperature.contiguous();
  auto us = u.contiguous();
  auto counts = num_candidates.clamp(0, vocab).contiguous();
  int64_t width = rows ? std::max<int64_t>(counts.max().item<int64_t>(), 0) : 0;
  auto tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  auto cand_ids = at::zeros({rows, width}, tokens.options());
  auto cand_p = at::zeros({rows, width}, logits.options().dtype(at::kFloat));
  auto run = logits.scalar_type() == at::kBFloat16 ? sample_rows<c10::BFloat16>
                                                   : sample_rows<float>;
  run(logits, temps.data_ptr<float>(), us.data_ptr<double>(), counts.data_ptr<int64_t>(),
      tokens.data_ptr<int64_t>(), cand_ids.data_ptr<int64_t>(), cand_p.data_ptr<float>(),
      width);
  return {tokens, cand_ids, cand_p};
}

}  // namespace vserve_sample

namespace {

template <typename T>
void logprobs_row(const Row<T>& row, int64_t token, int64_t k, float* token_lp, int64_t* rank,
                  int64_t* top_ids, float* top_lp) {
  float m = row_max(row);
  double total = 0;
  for (double s : block_sums(row, 1.0f, m)) total += s;
  double lse = static_cast<double>(m) + std::log(total);
  float xt = to_float(row.data[token]);
  *token_lp = static_cast<float>(static_cast<double>(xt) - lse);
  vi greater = {};
  for (int64_t i = 0; i < row.vocab; i += kW) greater -= row.load(i) > xt;   // true is -1
  int64_t count = 0;
  for (int l = 0; l < kW; ++l) count += greater[l];
  *rank = count + 1;
  if (k == 0) return;
  std::vector<Candidate> top = top_candidates(row, k);
  std::sort(top.begin(), top.end(), better);
  for (size_t j = 0; j < top.size(); ++j) {
    top_ids[j] = top[j].second;
    top_lp[j] = static_cast<float>(static_cast<double>(top[j].first) - lse);
  }
}

}  // namespace

namespace vserve_sample {

// log-softmax facts of logits [R, V] (bf16 or fp32, rows dense) for token_ids [R]: the tokens'
// logprobs [R] fp32, their ranks [R] (1 + the number of strictly larger logits), and the k best
// tokens' ids [R, k] and logprobs [R, k], by (logit desc, id asc). log-sum-exp in double.
std::vector<at::Tensor> logprobs(const at::Tensor& logits, const at::Tensor& token_ids,
                                 int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logprobs: logits [R, V], rows dense");
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat,
              "logprobs: logits must be bfloat16 or float32");
  int64_t rows = logits.size(0), vocab = logits.size(1);
  k = std::min(k, vocab);
  auto ids = token_ids.to(at::kLong).contiguous();
  TORCH_CHECK(ids.numel() == rows && (rows == 0 || (ids.min().item<int64_t>() >= 0 &&
              ids.max().item<int64_t>() < vocab)), "logprobs: token ids out of range");
  auto opts = logits.options();
  auto token_lp = at::empty({rows}, opts.dtype(at::kFloat));
  auto ranks = at::empty({rows}, opts.dtype(at::kLong));
  auto top_ids = at::zeros({rows, k}, opts.dtype(at::kLong));
  auto top_lp = at::zeros({rows, k}, opts.dtype(at::kFloat));
  const int64_t* tok = ids.data_ptr<int64_t>();
  auto run = [&](auto* base) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(base)>>;
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        logprobs_row(Row<T>{base + r * logits.stride(0), vocab}, tok[r], k,
                     token_lp.data_ptr<float>() + r, ranks.data_ptr<int64_t>() + r,
                     top_ids.data_ptr<int64_t>() + r * k, top_lp.data_ptr<float>() + r * k);
    });
  };
  if (logits.scalar_type() == at::kBFloat16)
    run(static_cast<const c10::BFloat16*>(logits.data_ptr()));
  else
    run(static_cast<const float*>(logits.data_ptr()));
  return {token_lp, ranks, top_ids, top_lp};
}

// logits [R, V] bf16 or fp32 (rows dense) -> [R] int64: each row's first index of its maximum
// (NaN ignored), in one vectorized pass; torch's argmax reads fp32 rows ~10x slower
at::Tensor argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "argmax: logits [R, V], rows dense");
  TORCH_CHECK(logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat,
              "argmax: logits must be bfloat16 or float32");
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31), "argmax: vocab size");
  int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  auto run = [&](auto* base) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(base)>>;
    // groups of ~64k logits (one long row or many short ones), claimed one at a time: a
    // thread that the host work preempts (the engine core, the front end) holds up none of
    // the others, which take the groups it has not reached
    const int64_t group = std::max<int64_t>(1, (int64_t{1} << 16) / vocab);
    const int64_t groups = (rows + group - 1) / group;
    std::atomic<int64_t> next{0};
    const int64_t workers = std::min<int64_t>(groups, at::get_num_threads());
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      for (int64_t g; (g = next.fetch_add(1, std::memory_order_relaxed)) < groups;)
        for (int64_t r = g * group; r < std::min(rows, (g + 1) * group); ++r)
          op[r] = row_argmax(Row<T>{base + r * stride, vocab}).second;
    });
  };
  if (logits.scalar_type() == at::kBFloat16)
    run(static_cast<const c10::BFloat16*>(logits.data_ptr()));
  else
    run(static_cast<const float*>(logits.data_ptr()));
  return out;
}

// the exp the kernel uses, for tests: x [N] fp32 (values <= 0)
at::Tensor exp_for_test(const at::Tensor& x) {
  auto in = x.contiguous();
  auto out = at::empty_like(in);
  const float* src = in.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < in.numel(); ++i) dst[i] = vexp(splat(src[i]))[0];
  return out;
}

}  // namespace vserve_sample
