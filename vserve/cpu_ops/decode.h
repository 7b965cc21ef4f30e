// decode.cpp's ops on tensors (semantics documented there), for bindings.cpp, which binds
// them and runs `layer`, a decode step's decoder layer, with the model's all-reduce.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace vserve_decode {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, int64_t style, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor act_mul(const at::Tensor& gate_up, int64_t act);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, int64_t window, double scale,
                            double softcap);
at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias);
at::Tensor shared_linear(const at::Tensor& x, const at::Tensor& w);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& plain,
                  const std::optional<at::Tensor>& bias);
at::Tensor quant_linear(const at::Tensor& x, const std::vector<at::Tensor>& parts,
                        const std::vector<int64_t>& qtypes,
                        const std::optional<at::Tensor>& bias);

// One decoder layer for decode rows (one token each), the same ops in the same order as the
// eager model with these kernels; linear(i, x) runs the layer's i-th linear (qkv, o, gate_up,
// down). style 1 = Gemma (fp32 norm scales: input, post-attention, pre-feedforward,
// post-feedforward[, q, k]); style 0 = Llama/Qwen (bf16 norm weights: input,
// post-attention[, q, k]).
template <class Linear>
at::Tensor layer(const at::Tensor& h, const Linear& linear_i, const std::vector<at::Tensor>& norms,
                 const at::Tensor& kv_cache, const at::Tensor& slots,
                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                 const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, int64_t window, double scale,
                 double softcap, double eps, int64_t style, int64_t act) {
  int64_t t = h.size(0), qd = num_heads * head_dim, kd = num_kv_heads * head_dim;
  size_t plain_norms = style == 1 ? 4 : 2;
  TORCH_CHECK(norms.size() == plain_norms || norms.size() == plain_norms + 2,
              "decoder_layer: wrong number of norms");
  auto x = rms_norm(h, norms[0], style, eps);
  auto qkv = linear_i(0, x);
  auto q = qkv.narrow(1, 0, qd).view({t, num_heads, head_dim});
  auto k = qkv.narrow(1, qd, kd).view({t, num_kv_heads, head_dim});
  auto v = qkv.narrow(1, qd + kd, kd).view({t, num_kv_heads, head_dim});
  if (norms.size() == plain_norms + 2) {
    q = rms_norm(q, norms[plain_norms], style, eps);
    k = rms_norm(k, norms[plain_norms + 1], style, eps);
  }
  q = rotary(q, cos, sin);
  k = rotary(k, cos, sin);
  kv_cache[0].view({-1, num_kv_heads, head_dim}).index_copy_(0, slots, k);
  kv_cache[1].view({-1, num_kv_heads, head_dim}).index_copy_(0, slots, v);
  auto attn = decode_attention(q, kv_cache[0], kv_cache[1], block_tables, seq_lens, window,
                               scale, softcap).view({t, qd});
  auto o = linear_i(1, attn);
  at::Tensor mlp_in, out;
  if (style == 1) {
    out = h + rms_norm(o, norms[1], style, eps);
    mlp_in = rms_norm(out, norms[2], style, eps);
  } else {
    out = h + o;
    mlp_in = rms_norm(out, norms[1], style, eps);
  }
  auto gate_up = linear_i(2, mlp_in);
  auto down = linear_i(3, act_mul(gate_up, act));
  return style == 1 ? out + rms_norm(down, norms[3], style, eps) : out + down;
}

}  // namespace vserve_decode
