"""OLMo 2: the decoder with its norms moved. A layer has no input norm; RMS norms follow the
attention and the MLP (on the sublayer outputs, before the residual add), q and k are
normalized over the whole projection (all heads at once, before rotary), every norm scales in
float32 before casting back (`Fp32ScaleRMSNorm`), and rotary runs in float32.

Under tensor parallel a rank holds some heads but the q/k norms span all of them: each rank
gathers the whole projection, normalizes it and keeps its own heads (with fewer KV heads than
ranks, every KV head is gathered from the first rank that holds a copy). Its layers are not
Llama-shaped, so the fused CPU decode layers never run them (`supports_fused_decode`).
"""

from __future__ import annotations

import torch
from torch import nn

from vserve.attention.base import AttentionLayerSpec
from vserve.distributed.tp_comm import TPShard
from vserve.models.decoder import DecoderForCausalLM
from vserve.models.layers import Attention, Fp32ScaleRMSNorm, apply_rotary, gated_mlp
from vserve.models.parallel_layers import (
    HeadSplit,
    gate_up_linear,
    qkv_linear,
    row_linear,
    split_heads,
)


class Olmo2Attention(nn.Module):
    def __init__(
        self, hf_config, spec: AttentionLayerSpec, layer_idx: int, tp: TPShard = TPShard()
    ) -> None:
        """`spec`: this rank's heads (all of them without tensor parallel)."""
        super().__init__()
        h, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        bias = getattr(hf_config, "attention_bias", False)
        self.split: HeadSplit = split_heads(heads, kv_heads, tp)
        self.tp = tp
        self.kv_copies = max(1, tp.size // kv_heads)  # ranks holding each KV head
        self.qkv_proj = qkv_linear(hidden, self.split, d, bias, tp)
        self.o_proj = row_linear(heads * d, hidden, bias, tp)
        self.q_norm = Fp32ScaleRMSNorm(heads * d, eps)  # the whole projection's
        self.k_norm = Fp32ScaleRMSNorm(kv_heads * d, eps)
        self.attn = Attention(spec, layer_idx)

    def forward(self, x, rope, kv_caches, meta, backend):
        t, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.shard_sizes, dim=-1)
        q = self._normed(q, self.q_norm, self.split.q_first, 1)
        k = self._normed(k, self.k_norm, self.split.kv_first, self.kv_copies)
        q, k = q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d)
        q_rot, k_rot = apply_rotary(q.float(), k.float(), rope)  # rope: float32 tables
        q, k = q_rot.to(x.dtype), k_rot.to(x.dtype)
        v = v.view(t, self.num_kv_heads, d)
        return self.o_proj(self.attn(q, k, v, kv_caches, meta, backend))

    def _normed(self, x: torch.Tensor, norm: nn.Module, first_head: int, copies: int):
        """`x` [T, local heads * d] normalized over every rank's heads: [T, local * d]."""
        if self.tp.size == 1:
            return norm(x)
        full = self.tp.comm.all_gather_last(x)  # [T, ranks * local * d], rank order
        if copies > 1:  # replicated KV heads: the copy of each head's first rank
            full = full.view(x.shape[0], self.tp.size, -1)[:, ::copies].reshape(x.shape[0], -1)
        return norm(full).narrow(-1, first_head * self.head_dim, x.shape[-1])


class Olmo2DecoderLayer(nn.Module):
    def __init__(
        self, hf_config, spec: AttentionLayerSpec, layer_idx: int, tp: TPShard = TPShard()
    ) -> None:
        super().__init__()
        eps, hidden = hf_config.rms_norm_eps, hf_config.hidden_size
        self.self_attn = Olmo2Attention(hf_config, spec, layer_idx, tp)
        self.post_attention_layernorm = Fp32ScaleRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Fp32ScaleRMSNorm(hidden, eps)
        inter = hf_config.intermediate_size
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = gate_up_linear(hidden, inter, False, tp)
        self.mlp.down_proj = row_linear(inter, hidden, False, tp)
        self.act = hf_config.hidden_act
        self.kernel = None

    def forward(self, h, rope, kv_caches, meta, backend):
        attn = self.self_attn(h, rope, kv_caches, meta, backend)
        h = h + self.post_attention_layernorm(attn)
        mlp = gated_mlp(h, self.mlp.gate_up_proj, self.mlp.down_proj, self.act, self.kernel)
        return h + self.post_feedforward_layernorm(mlp)


class Olmo2ForCausalLM(DecoderForCausalLM):
    norm_cls = Fp32ScaleRMSNorm
    rope_in_fp32 = True  # transformers keeps OLMo 2's cos/sin in float32

    @property
    def supports_fused_decode(self) -> bool:
        return False  # post-norms, q/k norms over the whole projection: not Llama's shape

    def make_layer(self, hf_config, spec: AttentionLayerSpec, layer_idx: int, tp: TPShard):
        return Olmo2DecoderLayer(hf_config, spec, layer_idx, tp)
