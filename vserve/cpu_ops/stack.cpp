// The decode stack: every decoder layer of a decode step (1 to 8 rows, one token each) on
// GGUF-block weights in one call, for FusedDecode (vserve/models/fused_decode.py).
//
// `decoder_layer_q` runs a layer as ~40 ATen ops around its gemvs, and each gemv forks and
// joins the thread pool: at batch 1 that costs more than streaming the layer's small weights
// (0.1-1 MB each). Here the threads enter one parallel region for the whole step. The first
// (the master) runs the layers' row kernels (norms, rotary, KV write, attention, residuals:
// decode.cpp's, through layer_rows.h) on buffers allocated once, and publishes each gemv as a
// job; every thread then streams its share of the job's rows (vserve_rows::RowShares, as
// `gemv` splits them, with stealing) and the master waits for the job's last chunk before it
// goes on. A thread that the OS preempts holds up only a chunk it has claimed, never a phase
// it has not reached. The kernels, their inputs and their order are those of
// `decoder_layer_q`, and each gemv row is computed alone in `gemv`'s order, so the result is
// bitwise that of the per-layer call (tests/workers/test_cpu_ops.py). The gated activation is
// ATen's, as `act_mul`'s.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/silu.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "layer_rows.h"
#include "quant.h"
#include "row_shares.h"

namespace {

using bf16 = c10::BFloat16;
using vserve_rows::cpu_relax;
using vserve_rows::RowShares;

inline float f(bf16 x) { return static_cast<float>(x); }
inline bf16 b(float x) { return static_cast<bf16>(x); }

// spins (then yields the core) until pred() holds
template <class Pred>
void wait_until(Pred&& pred) {
  for (int i = 0; !pred(); ++i) {
    if (i < 4096)
      cpu_relax();
    else
      std::this_thread::yield();
  }
}

struct Part {  // a run of output rows in one GGUF block format
  at::Tensor data;
  int64_t qtype, rows, row_bytes, offset;  // offset: its first output column
};

struct Linear {
  std::vector<Part> parts;
  std::optional<at::Tensor> bias;  // bf16 [out]
  int64_t in = 0, out = 0;  // features
};

struct Layer {
  Linear linear[4];  // qkv, o, gate_up, down
  std::vector<at::Tensor> norms;
  int64_t heads, kv_heads, head_dim, window, style, act, rope;
  float scale, softcap, eps;
};

// what the threads share in a step: one linear's gemv (each part's prepared activations and
// row shares), or a loop of the master's (fn over [0, n) in chunks)
struct Job {
  const Linear* linear = nullptr;
  bf16* y = nullptr;  // [rows, linear->out]
  std::vector<vserve_quant::GemvInput> inputs;
  std::vector<RowShares> shares;
  const std::function<void(int64_t, int64_t)>* fn = nullptr;  // a loop
  int64_t n = 0, chunk = 1;
  alignas(64) std::atomic<int64_t> next{0};  // (each on its own cache line)
  int64_t total = 0;  // chunks (over all parts)
  alignas(64) std::atomic<int64_t> done{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // the first failed chunk's, set by the thread that set `failed`

  void reset_error() {
    failed.store(false, std::memory_order_relaxed);
    error = nullptr;
  }
  // runs a chunk; an exception is kept (the first) rather than lost in a helper's thread or
  // thrown past the wait for chunks that helpers still run; the chunk counts as done anyway
  template <class Fn>
  void run_chunk(Fn&& fn) noexcept {
    try {
      if (fail_chunks.load(std::memory_order_relaxed))
        throw std::runtime_error("DecodeStack: a chunk failed (injected by _fail_chunks)");
      fn();
    } catch (...) {
      if (!failed.exchange(true, std::memory_order_acq_rel)) error = std::current_exception();
    }
    done.fetch_add(1, std::memory_order_release);
  }
  // after every chunk is done: the first chunk's exception, if one failed
  void rethrow_error() {
    if (failed.load(std::memory_order_acquire)) std::rethrow_exception(error);
  }

  static std::atomic<bool> fail_chunks;  // a test hook: every chunk throws
};

std::atomic<bool> Job::fail_chunks{false};

// row r of buffer p of width n
inline bf16* row(std::vector<bf16>& p, int64_t r, int64_t n) { return p.data() + r * n; }

class DecodeStack final : public vserve_layer::DecodeStackApi {
 public:
  DecodeStack() = default;

  void add_layer(const std::vector<std::vector<at::Tensor>>& parts,
                 const std::vector<std::vector<int64_t>>& qtypes,
                 const std::vector<std::optional<at::Tensor>>& biases,
                 const std::vector<at::Tensor>& norms, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_dim, int64_t window, double scale, double softcap, double eps,
                 int64_t style, int64_t act, int64_t rope) override {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(parts.size() == 4 && qtypes.size() == 4 && biases.size() == 4,
                "DecodeStack: 4 linears");
    size_t plain_norms = style == 1 ? 4 : 2;
    TORCH_CHECK(norms.size() == plain_norms || norms.size() == plain_norms + 2,
                "DecodeStack: wrong number of norms");
    for (size_t i = 0; i < norms.size(); ++i)
      TORCH_CHECK(norms[i].is_contiguous() &&
                      norms[i].scalar_type() == (style == 1 ? at::kFloat : at::kBFloat16) &&
                      norms[i].numel() == (i < plain_norms ? norms[0].numel() : head_dim),
                  "DecodeStack: a norm has the wrong size or dtype for its style");
    Layer l;
    l.norms = norms;
    l.heads = num_heads;
    l.kv_heads = num_kv_heads;
    l.head_dim = head_dim;
    l.window = window;
    l.style = style;
    l.act = act;
    l.rope = rope;
    l.scale = static_cast<float>(scale);
    l.softcap = static_cast<float>(softcap);
    l.eps = static_cast<float>(eps);
    for (int i = 0; i < 4; ++i) {
      Linear& lin = l.linear[i];
      TORCH_CHECK(parts[i].size() == qtypes[i].size() && !parts[i].empty(), "DecodeStack: parts");
      for (size_t p = 0; p < parts[i].size(); ++p) {
        const at::Tensor& d = parts[i][p];
        TORCH_CHECK(vserve_quant::supported_qtype(qtypes[i][p]) && d.scalar_type() == at::kByte &&
                        d.dim() == 2 && d.is_contiguous(),
                    "DecodeStack: every part must be GGUF blocks");
        lin.parts.push_back({d, qtypes[i][p], d.size(0), d.size(1), lin.out});
        lin.out += d.size(0);
      }
      if (biases[i].has_value() && biases[i]->defined()) {
        TORCH_CHECK(biases[i]->scalar_type() == at::kBFloat16 && biases[i]->is_contiguous() &&
                        biases[i]->numel() == lin.out, "DecodeStack: a bias must be bf16 [out]");
        lin.bias = *biases[i];
      }
    }
    const int64_t qd = num_heads * head_dim, kd = num_kv_heads * head_dim;
    const int64_t hidden = norms[0].numel();
    TORCH_CHECK(hidden_ == 0 || hidden_ == hidden, "DecodeStack: layers of one hidden size");
    TORCH_CHECK(l.linear[0].out == qd + 2 * kd && l.linear[1].out == hidden &&
                    l.linear[2].out % 2 == 0 && l.linear[3].out == hidden,
                "DecodeStack: linear sizes do not match the layer");
    const int64_t ins[4] = {hidden, qd, hidden, l.linear[2].out / 2};
    for (int i = 0; i < 4; ++i) {
      l.linear[i].in = ins[i];
      for (const Part& p : l.linear[i].parts)
        TORCH_CHECK(vserve_quant::row_bytes_of(p.qtype, ins[i]) == p.row_bytes,
                    "DecodeStack: a part's row bytes do not match its inputs");
    }
    hidden_ = hidden;  // (a rejected layer leaves the stack as it was)
    layers_.push_back(std::move(l));
    jobs_.clear();  // planned again on the next run
  }

  at::Tensor run(const at::Tensor& h, const std::vector<at::Tensor>& cos,
                 const std::vector<at::Tensor>& sin, const std::vector<at::Tensor>& kv_caches,
                 const at::Tensor& slots_full, const at::Tensor& tables_full,
                 const at::Tensor& slots_local, const at::Tensor& tables_local,
                 const at::Tensor& seq_lens) override;

 private:
  std::vector<Layer> layers_;
  std::vector<std::unique_ptr<Job>> jobs_;   // 4 per layer
  std::vector<std::unique_ptr<Job>> loops_;  // the attention's loops, taken in turn
  size_t loops_used_ = 0;
  int64_t planned_threads_ = 0;
  int64_t hidden_ = 0;
  std::vector<bf16> x_, qkv_, qn_, kn_, qr_, kr_, attn_, o_, tmp_, mlp_in_, gate_up_, gelu_, act_,
      down_;
  std::atomic<int64_t> phase_{0};  // jobs published in this step
  std::atomic<Job*> current_{nullptr};  // the latest
  std::atomic<bool> stop_{false};
  vserve_layer::ParallelFor par_;
  // one step (or add_layer) at a time: `run` releases the GIL, and its plan, buffers and
  // jobs are the stack's own
  std::mutex mu_;

  void plan(int64_t threads);
  void run_job(Job& job, const bf16* x, int64_t m);
  void publish(Job& job);
  void team_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);
  void work(Job& job, int64_t tid, int64_t m) const;
  void helper(int64_t tid, int64_t m);
  void master(at::Tensor& out, int64_t m, const std::vector<at::Tensor>& cos,
              const std::vector<at::Tensor>& sin, const std::vector<at::Tensor>& kv_caches,
              const at::Tensor* slots[2], const at::Tensor* tables[2], const int64_t* lens);
  void layer(const Layer& l, size_t li, bf16* h, int64_t m, const bf16* cos, const bf16* sin,
             int64_t rot, const at::Tensor& kv, const int64_t* slots, const int64_t* tables,
             int64_t bt_cols, const int64_t* lens);
};

}  // namespace

namespace {

constexpr int64_t kMaxRows = 8;  // the gemv's activation rows
constexpr int64_t kActUnit = 64;  // the gated activation's columns split at multiples of this

// the jobs and buffers of a step: shares for `threads` threads, buffers for kMaxRows rows
void DecodeStack::plan(int64_t threads) {
  jobs_.clear();
  int64_t qkv_w = 0, q_w = 0, k_w = 0, gu_w = 0;
  for (const Layer& l : layers_) {
    qkv_w = std::max(qkv_w, l.linear[0].out);
    q_w = std::max(q_w, l.heads * l.head_dim);
    k_w = std::max(k_w, l.kv_heads * l.head_dim);
    gu_w = std::max(gu_w, l.linear[2].out);
  }
  auto alloc = [](std::vector<bf16>& v, int64_t width) { v.assign(kMaxRows * width, bf16(0)); };
  alloc(x_, hidden_);
  alloc(qkv_, qkv_w);
  alloc(qn_, q_w);
  alloc(qr_, q_w);
  alloc(attn_, q_w);
  alloc(kn_, k_w);
  alloc(kr_, k_w);
  alloc(o_, hidden_);
  alloc(tmp_, hidden_);
  alloc(mlp_in_, hidden_);
  alloc(gate_up_, gu_w);
  alloc(gelu_, gu_w / 2);
  alloc(act_, gu_w / 2);
  alloc(down_, hidden_);
  bf16* outs[4] = {qkv_.data(), o_.data(), gate_up_.data(), down_.data()};
  for (const Layer& l : layers_)
    for (int i = 0; i < 4; ++i) {
      auto job = std::make_unique<Job>();
      job->linear = &l.linear[i];
      job->y = outs[i];
      job->inputs.resize(l.linear[i].parts.size());
      for (const Part& p : l.linear[i].parts) {
        job->shares.push_back(RowShares::of(p.rows, p.row_bytes, threads));
        job->total += job->shares.back().total_chunks();
      }
      jobs_.push_back(std::move(job));
    }
  // the attention of a layer runs at most 2 loops per item it splits (fewer items than
  // threads), or one over its items; the gated activation one
  loops_.clear();
  for (size_t i = 0; i < layers_.size() * (2 * threads + 2); ++i)
    loops_.push_back(std::make_unique<Job>());
  par_.threads = threads;
  par_.run = [this](int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    team_for(n, grain, fn);
  };
  planned_threads_ = threads;
}

// the rows of `job` this thread can claim: its own share of each part from the front, then
// the others' from their back
void DecodeStack::work(Job& job, int64_t tid, int64_t m) const {
  if (job.fn != nullptr) {
    for (int64_t lo; (lo = job.next.fetch_add(job.chunk, std::memory_order_relaxed)) < job.n;) {
      job.run_chunk([&] { (*job.fn)(lo, std::min(job.n, lo + job.chunk)); });
    }
    return;
  }
  const Linear& lin = *job.linear;
  auto chunk_of = [&](size_t p) {
    const Part& part = lin.parts[p];
    const vserve_quant::GemvInput& in = job.inputs[p];
    const uint8_t* w = part.data.data_ptr<uint8_t>();
    bf16* y = job.y + part.offset;
    return [&in, w, y, &part, &lin, &job](int64_t lo, int64_t hi) {
      job.run_chunk([&] { vserve_quant::gemv_rows(in, w, part.row_bytes, y, lin.out, lo, hi); });
    };
  };
  (void)m;
  int64_t c;
  for (size_t p = 0; p < lin.parts.size(); ++p) {
    RowShares& sh = job.shares[p];
    if (tid >= sh.threads()) continue;
    auto fn = chunk_of(p);
    while (sh.claim(tid, true, c)) sh.run(tid, c, fn);
  }
  for (size_t p = 0; p < lin.parts.size(); ++p) {
    RowShares& sh = job.shares[p];
    auto fn = chunk_of(p);
    for (int64_t o = 0; o < sh.threads(); ++o) {
      int64_t u = (tid + o) % sh.threads();
      while (sh.claim(u, false, c)) sh.run(u, c, fn);
    }
  }
}

// the master's gemv: prepares each part's activations, publishes the job, streams its own
// share and waits for every chunk; then the bias
void DecodeStack::run_job(Job& job, const bf16* x, int64_t m) {
  const Linear& lin = *job.linear;
  for (size_t p = 0; p < lin.parts.size(); ++p)
    vserve_quant::gemv_prepare(job.inputs[p], x, m, lin.in, lin.parts[p].qtype);
  publish(job);
  work(job, 0, m);
  wait_until([&] { return job.done.load(std::memory_order_acquire) == job.total; });
  job.rethrow_error();
  if (lin.bias.has_value()) {
    const bf16* bias = lin.bias->data_ptr<bf16>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < lin.out; ++i)
        job.y[r * lin.out + i] = b(f(job.y[r * lin.out + i]) + f(bias[i]));
  }
}

// a job for the helpers: they take the latest one published (a late helper may skip one,
// whose chunks the master has taken)
void DecodeStack::publish(Job& job) {
  current_.store(&job, std::memory_order_release);
  phase_.fetch_add(1, std::memory_order_release);
}

// fn over [0, n) on the team, in chunks of at least `grain` (one per thread); on the master
// alone when the step has used up its loops
void DecodeStack::team_for(int64_t n, int64_t grain,
                           const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  const int64_t chunk = std::max<int64_t>(grain, (n + planned_threads_ - 1) / planned_threads_);
  if (loops_used_ >= loops_.size() || chunk >= n) {
    fn(0, n);
    return;
  }
  Job& job = *loops_[loops_used_++];
  job.fn = &fn;
  job.n = n;
  job.chunk = chunk;
  job.total = (n + chunk - 1) / chunk;
  job.next.store(0, std::memory_order_relaxed);
  job.done.store(0, std::memory_order_relaxed);
  job.reset_error();
  publish(job);
  work(job, 0, 0);
  wait_until([&] { return job.done.load(std::memory_order_acquire) == job.total; });
  job.rethrow_error();
}

void DecodeStack::helper(int64_t tid, int64_t m) {
  int64_t seen = 0;
  for (;;) {
    int64_t now = 0;
    wait_until([&] {
      now = phase_.load(std::memory_order_acquire);
      return now != seen || stop_.load(std::memory_order_acquire);
    });
    if (now == seen) return;  // stopped
    seen = now;
    work(*current_.load(std::memory_order_acquire), tid, m);
  }
}

// h[i] = h[i] + a[i] in bf16 (ATen's bf16 add: one rounding of the fp32 sum)
inline void add_into(bf16* h, const bf16* a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = b(f(h[i]) + f(a[i]));
}

void DecodeStack::layer(const Layer& l, size_t li, bf16* h, int64_t m, const bf16* cos,
                        const bf16* sin, int64_t rot, const at::Tensor& kv,
                        const int64_t* slots, const int64_t* tables, int64_t bt_cols,
                        const int64_t* lens) {
  using vserve_layer::rms_row;
  const int64_t hd = hidden_, d = l.head_dim, qd = l.heads * d, kd = l.kv_heads * d;
  const int64_t qkv_w = l.linear[0].out, inter = l.linear[2].out / 2;
  const size_t plain = l.style == 1 ? 4 : 2;
  const bool qk_norm = l.norms.size() == plain + 2;
  auto norm = [&](size_t i) { return l.norms[i].data_ptr(); };
  for (int64_t r = 0; r < m; ++r) rms_row(h + r * hd, row(x_, r, hd), hd, norm(0), l.style, l.eps);
  run_job(*jobs_[4 * li], x_.data(), m);
  for (int64_t r = 0; r < m; ++r) {
    const bf16* qkv = row(qkv_, r, qkv_w);
    const bf16 *q = qkv, *k = qkv + qd;
    if (qk_norm) {
      for (int64_t i = 0; i < l.heads; ++i)
        rms_row(qkv + i * d, row(qn_, r, qd) + i * d, d, norm(plain), l.style, l.eps);
      for (int64_t i = 0; i < l.kv_heads; ++i)
        rms_row(qkv + qd + i * d, row(kn_, r, kd) + i * d, d, norm(plain + 1), l.style, l.eps);
      q = row(qn_, r, qd);
      k = row(kn_, r, kd);
    }
    for (int64_t i = 0; i < l.heads; ++i)
      vserve_layer::rotary_row(q + i * d, row(qr_, r, qd) + i * d, d, cos + r * rot,
                               sin + r * rot, rot);
    for (int64_t i = 0; i < l.kv_heads; ++i)
      vserve_layer::rotary_row(k + i * d, row(kr_, r, kd) + i * d, d, cos + r * rot,
                               sin + r * rot, rot);
    bf16* kc = static_cast<bf16*>(kv.data_ptr());
    bf16* vc = kc + kv.stride(0);
    std::memcpy(kc + slots[r] * kd, row(kr_, r, kd), kd * sizeof(bf16));
    std::memcpy(vc + slots[r] * kd, qkv + qd + kd, kd * sizeof(bf16));
  }
  const bf16* kc = static_cast<const bf16*>(kv.data_ptr());
  vserve_layer::attention_rows(qr_.data(), kc, kc + kv.stride(0), attn_.data(), tables, lens, m,
                               l.heads, d, l.kv_heads, kv.size(2), bt_cols, l.window, l.scale,
                               l.softcap, &par_);
  // attn_ rows are [heads * d] = qd wide: the o projection's input
  TORCH_CHECK(l.linear[1].in == qd, "DecodeStack: o input");
  run_job(*jobs_[4 * li + 1], attn_.data(), m);
  for (int64_t r = 0; r < m; ++r) {
    bf16* hr = h + r * hd;
    if (l.style == 1) {
      rms_row(row(o_, r, hd), row(tmp_, r, hd), hd, norm(1), l.style, l.eps);
      add_into(hr, row(tmp_, r, hd), hd);
      rms_row(hr, row(mlp_in_, r, hd), hd, norm(2), l.style, l.eps);
    } else {
      add_into(hr, row(o_, r, hd), hd);
      rms_row(hr, row(mlp_in_, r, hd), hd, norm(1), l.style, l.eps);
    }
  }
  run_job(*jobs_[4 * li + 2], mlp_in_.data(), m);
  {  // act_mul: ATen's activation of the gate (rounded to bf16), times up; on the team, in
     // column ranges that start at multiples of 64: ATen's vectorized loop takes 64 bf16 (or
     // 32) at a time and the rest of a row alone, so each range gets one call's values
    const std::function<void(int64_t, int64_t)> act = [&](int64_t lo, int64_t hi) {
      const int64_t c0 = lo * kActUnit, c1 = std::min(inter, hi * kActUnit), w = c1 - c0;
      c10::InferenceMode mode;  // (a helper's thread)
      auto gate = at::from_blob(gate_up_.data() + c0, {m, w}, {2 * inter, 1}, at::kBFloat16);
      auto a = at::from_blob(gelu_.data() + c0, {m, w}, {inter, 1}, at::kBFloat16);
      if (l.act == 1)
        at::gelu_out(a, gate, "tanh");
      else
        at::silu_out(a, gate);
      for (int64_t r = 0; r < m; ++r) {
        const bf16* ap = row(gelu_, r, inter) + c0;
        const bf16* up = row(gate_up_, r, 2 * inter) + inter + c0;
        bf16* out = row(act_, r, inter) + c0;
        for (int64_t i = 0; i < w; ++i) out[i] = b(f(ap[i]) * f(up[i]));
      }
    };
    team_for((inter + kActUnit - 1) / kActUnit, 4, act);
  }
  run_job(*jobs_[4 * li + 3], act_.data(), m);
  for (int64_t r = 0; r < m; ++r) {
    bf16* hr = h + r * hd;
    if (l.style == 1) {
      rms_row(row(down_, r, hd), row(tmp_, r, hd), hd, norm(3), l.style, l.eps);
      add_into(hr, row(tmp_, r, hd), hd);
    } else {
      add_into(hr, row(down_, r, hd), hd);
    }
  }
}

void DecodeStack::master(at::Tensor& out, int64_t m, const std::vector<at::Tensor>& cos,
                         const std::vector<at::Tensor>& sin,
                         const std::vector<at::Tensor>& kv_caches, const at::Tensor* slots[2],
                         const at::Tensor* tables[2], const int64_t* lens) {
  bf16* h = out.data_ptr<bf16>();
  for (size_t li = 0; li < layers_.size(); ++li) {
    const Layer& l = layers_[li];
    const int g = l.window > 0 ? 1 : 0;  // the sliding-window group's slots and tables
    const at::Tensor& c = cos[l.rope];
    layer(l, li, h, m, c.data_ptr<bf16>(), sin[l.rope].data_ptr<bf16>(), c.size(-1),
          kv_caches[li], slots[g]->data_ptr<int64_t>(), tables[g]->data_ptr<int64_t>(),
          tables[g]->size(1), lens);
  }
}

at::Tensor DecodeStack::run(const at::Tensor& h, const std::vector<at::Tensor>& cos,
                            const std::vector<at::Tensor>& sin,
                            const std::vector<at::Tensor>& kv_caches,
                            const at::Tensor& slots_full, const at::Tensor& tables_full,
                            const at::Tensor& slots_local, const at::Tensor& tables_local,
                            const at::Tensor& seq_lens) {
  std::lock_guard<std::mutex> lock(mu_);  // (no Python object here: it runs without the GIL)
  TORCH_CHECK(h.scalar_type() == at::kBFloat16 && h.dim() == 2 && h.size(1) == hidden_,
              "DecodeStack.run: h must be bf16 [T, hidden]");
  const int64_t m = h.size(0);
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "DecodeStack.run: 1 to 8 rows");
  TORCH_CHECK(kv_caches.size() == layers_.size(), "DecodeStack.run: one cache per layer");
  TORCH_CHECK(cos.size() == sin.size(), "DecodeStack.run: cos and sin tables");
  auto lens = seq_lens.to(at::kLong).contiguous();
  at::Tensor sl[2] = {slots_full.to(at::kLong).contiguous(), slots_local.to(at::kLong).contiguous()};
  at::Tensor bt[2] = {tables_full.to(at::kLong).contiguous(),
                      tables_local.to(at::kLong).contiguous()};
  TORCH_CHECK(lens.numel() == m && sl[0].numel() == m && sl[1].numel() == m &&
                  bt[0].size(0) == m && bt[1].size(0) == m,
              "DecodeStack.run: one slot, table row and length per row");
  std::vector<at::Tensor> cs, sn;
  for (size_t i = 0; i < cos.size(); ++i) {
    cs.push_back(cos[i].contiguous());
    sn.push_back(sin[i].contiguous());
    TORCH_CHECK(cs[i].scalar_type() == at::kBFloat16 && sn[i].scalar_type() == at::kBFloat16 &&
                    cs[i].numel() == m * cs[i].size(-1) && sn[i].sizes() == cs[i].sizes(),
                "DecodeStack.run: cos and sin must be bf16 [T, (1,) rot]");
  }
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (size_t li = 0; li < layers_.size(); ++li) {
    const Layer& l = layers_[li];
    const at::Tensor& kv = kv_caches[li];
    TORCH_CHECK(kv.scalar_type() == at::kBFloat16 && kv.dim() == 5 && kv.size(0) == 2 &&
                    kv.size(3) == l.kv_heads && kv.size(4) == l.head_dim && kv.is_contiguous(),
                "DecodeStack.run: caches must be dense bf16 [2, blocks, block, kv heads, d]");
    TORCH_CHECK(l.rope < static_cast<int64_t>(cs.size()) &&
                    cs[l.rope].size(-1) % 2 == 0 && cs[l.rope].size(-1) <= l.head_dim,
                "DecodeStack.run: rotary table");
    const int g = l.window > 0 ? 1 : 0;
    const int64_t slots_total = kv.size(1) * kv.size(2);
    const int64_t* sp = sl[g].data_ptr<int64_t>();
    for (int64_t r = 0; r < m; ++r) {
      TORCH_CHECK(sp[r] >= 0 && sp[r] < slots_total, "DecodeStack.run: slot out of range");
      TORCH_CHECK(lp[r] >= 1 && lp[r] <= bt[g].size(1) * kv.size(2),
                  "DecodeStack.run: a sequence is longer than its block table");
    }
  }
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  if (jobs_.empty() || planned_threads_ != threads) plan(threads);
  for (auto& job : jobs_) {
    for (auto& sh : job->shares) sh.reset();
    job->done.store(0, std::memory_order_relaxed);
    job->reset_error();
  }
  loops_used_ = 0;
  phase_.store(0, std::memory_order_relaxed);
  current_.store(nullptr, std::memory_order_relaxed);
  stop_.store(false, std::memory_order_relaxed);
  auto out = h.contiguous().clone();
  const at::Tensor* slots[2] = {&sl[0], &sl[1]};
  const at::Tensor* tables[2] = {&bt[0], &bt[1]};
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t) {
    if (lo != 0) {
      helper(lo, m);
      return;
    }
    c10::InferenceMode mode(inference);  // (the gelu's output, when not the caller's thread)
    try {
      master(out, m, cs, sn, kv_caches, slots, tables, lp);
    } catch (...) {
      stop_.store(true, std::memory_order_release);
      throw;
    }
    stop_.store(true, std::memory_order_release);
  });
  return out;
}

}  // namespace

std::unique_ptr<vserve_layer::DecodeStackApi> vserve_layer::make_decode_stack() {
  return std::make_unique<DecodeStack>();
}

void vserve_layer::set_stack_fail_chunks(bool on) { Job::fail_chunks.store(on); }
