// decode.cpp's row kernels, for the decode stack (stack.cpp), which strings them together
// on preallocated buffers exactly as decode.cpp's ops do on tensors.
#pragma once

#include <c10/util/BFloat16.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace vserve_layer {

using bf16 = c10::BFloat16;

// rms_norm of one row of n: style 1 (Gemma) with an fp32 scale, 0 (Llama) with a bf16 weight
void rms_row(const bf16* x, bf16* out, int64_t n, const void* w, int64_t style, float eps);

// rotary of one head of d (the first rot dims; cos, sin: rot each)
void rotary_row(const bf16* x, bf16* out, int64_t d, const bf16* cos, const bf16* sin,
                int64_t rot);

// a parallel loop of the caller's threads: run(n, grain, fn) calls fn(lo, hi) over [0, n)
struct ParallelFor {
  int64_t threads;
  std::function<void(int64_t, int64_t, const std::function<void(int64_t, int64_t)>&)> run;
};

// decode_attention on bf16: q [nb, h, d] -> out [nb, h, d]; caches [blocks, block, hkv, d]
// dense; block_tables [nb, bt_cols] and seq_lens [nb] int64. Its parallel loops run on `par`
// (not ATen's threads) when given; the result does not depend on the split.
void attention_rows(const bf16* q, const bf16* k_cache, const bf16* v_cache, bf16* out,
                    const int64_t* block_tables, const int64_t* seq_lens, int64_t nb, int64_t h,
                    int64_t d, int64_t hkv, int64_t block, int64_t bt_cols, int64_t window,
                    float scale, float softcap, const ParallelFor* par);

// The decode stack (stack.cpp) as bindings.cpp binds it: every decoder layer of a decode step
// on GGUF blocks in one call (semantics documented in stack.cpp)
class DecodeStackApi {
 public:
  virtual ~DecodeStackApi() = default;
  virtual void add_layer(const std::vector<std::vector<at::Tensor>>& parts,
                         const std::vector<std::vector<int64_t>>& qtypes,
                         const std::vector<std::optional<at::Tensor>>& biases,
                         const std::vector<at::Tensor>& norms, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, int64_t window, double scale,
                         double softcap, double eps, int64_t style, int64_t act,
                         int64_t rope) = 0;
  virtual at::Tensor run(const at::Tensor& h, const std::vector<at::Tensor>& cos,
                         const std::vector<at::Tensor>& sin,
                         const std::vector<at::Tensor>& kv_caches, const at::Tensor& slots_full,
                         const at::Tensor& tables_full, const at::Tensor& slots_local,
                         const at::Tensor& tables_local, const at::Tensor& seq_lens) = 0;
};
std::unique_ptr<DecodeStackApi> make_decode_stack();
void set_stack_fail_chunks(bool on);  // tests: every job's first chunk throws

}  // namespace vserve_layer
