"""One parameterized decoder for Llama, Mistral, Qwen2 and Qwen3.

The family differs only in flags: bias on q/k/v (Qwen2), RMS norms on q and k per head
(Qwen3), sliding windows (Mistral, per-layer `layer_types`), tied embeddings.
"""

from __future__ import annotations

import torch
from torch import nn

from vserve.attention.base import AttentionLayerSpec, AttentionMetadata
from vserve.distributed.tp_comm import TPShard
from vserve.models.hf_config import layer_windows
from vserve.models.layers import (
    Attention,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    gated_mlp,
    rope_inv_freq,
)
from vserve.models.parallel_layers import (
    embedding,
    gate_up_linear,
    lm_head,
    qkv_linear,
    row_linear,
    split_heads,
)
from vserve.models.stage import StageInfo, check_all_loaded, load_weights

STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


class SelfAttention(nn.Module):
    def __init__(
        self,
        hf_config,
        spec: AttentionLayerSpec,
        layer_idx: int,
        qk_norm: bool,
        bias: bool,
        tp: TPShard = TPShard(),
    ) -> None:
        """`spec`: this rank's heads (all of them without tensor parallel)."""
        super().__init__()
        h, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        split = split_heads(hf_config.num_attention_heads, hf_config.num_key_value_heads, tp)
        self.qkv_proj = qkv_linear(hf_config.hidden_size, split, d, bias, tp)
        self.o_proj = row_linear(
            hf_config.num_attention_heads * d,
            hf_config.hidden_size,
            getattr(hf_config, "attention_bias", False),
            tp,
        )
        eps = hf_config.rms_norm_eps
        self.q_norm = RMSNorm(d, eps) if qk_norm else None
        self.k_norm = RMSNorm(d, eps) if qk_norm else None
        self.attn = Attention(spec, layer_idx)
        self.kernel = None

    def forward(self, x, rope, kv_caches, meta, backend):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.shard_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, rope, self.kernel)
        return self.o_proj(self.attn(q, k, v, kv_caches, meta, backend))


class DecoderLayer(nn.Module):
    def __init__(self, hf_config, spec, layer_idx, qk_norm, bias, tp: TPShard = TPShard()):
        super().__init__()
        eps, hidden = hf_config.rms_norm_eps, hf_config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = SelfAttention(hf_config, spec, layer_idx, qk_norm, bias, tp)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        mlp_bias = getattr(hf_config, "mlp_bias", False)
        inter = hf_config.intermediate_size
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = gate_up_linear(hidden, inter, mlp_bias, tp)
        self.mlp.down_proj = row_linear(inter, hidden, mlp_bias, tp)
        self.act = getattr(hf_config, "hidden_act", "silu")
        self.kernel = None

    def forward(self, h, rope, kv_caches, meta, backend):
        h = h + self.self_attn(self.input_layernorm(h), rope, kv_caches, meta, backend)
        return h + gated_mlp(
            self.post_attention_layernorm(h),
            self.mlp.gate_up_proj,
            self.mlp.down_proj,
            self.act,
            self.kernel,
        )


class DecoderForCausalLM(nn.Module):
    def __init__(
        self, hf_config, stage: StageInfo, max_positions: int, tp: TPShard = TPShard()
    ) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.stage = stage
        self.tp = tp
        model_type = hf_config.model_type
        qk_norm = model_type.startswith("qwen3")
        bias = model_type == "qwen2" or getattr(hf_config, "attention_bias", False)
        self.tie = getattr(hf_config, "tie_word_embeddings", False)
        d = head_dim_of(hf_config)
        self.windows = layer_windows(hf_config)
        split = split_heads(hf_config.num_attention_heads, hf_config.num_key_value_heads, tp)
        self.layer_specs = [  # this rank's heads
            AttentionLayerSpec(
                split.num_heads,
                split.num_kv_heads,
                d,
                d**-0.5,
                self.windows[i],
            )
            for i in range(hf_config.num_hidden_layers)
        ]
        self.model = nn.Module()
        if stage.is_first:
            self.model.embed_tokens = embedding(hf_config.vocab_size, hf_config.hidden_size, tp)
        self.model.layers = nn.ModuleList(
            DecoderLayer(hf_config, self.layer_specs[i], i, qk_norm, bias, tp)
            for i in range(stage.start_layer, stage.end_layer)
        )
        if stage.is_last:
            self.model.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
            self.lm_head = lm_head(hf_config.hidden_size, hf_config.vocab_size, tp)
        inv_freq, scaling = rope_inv_freq(hf_config)
        self.rotary = RotaryEmbedding(inv_freq, scaling, max_positions)
        self.kernel = None
        self.fused = None  # FusedDecode, set when the CPU kernels are attached

    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        kv_caches,
        meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:
        """inputs: token ids [T] on the first stage, hidden states [T, hidden] otherwise."""
        h = self.model.embed_tokens(inputs) if self.stage.is_first else inputs
        rope = self.rotary.cos_sin(positions, h.dtype)
        if self.fused is not None and self.fused.can_run(meta, backend):
            h = self.fused.run(h, [rope], kv_caches, meta)
        else:
            for layer in self.model.layers:
                h = layer(h, rope, kv_caches, meta, backend)
        return self.model.norm(h) if self.stage.is_last else h

    def fused_norms(self, layer: DecoderLayer):
        """Norm weights, norm style, rotary table and eps of `layer` for the fused kernel."""
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if layer.self_attn.q_norm is not None:
            norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        return [n.weight for n in norms], 0, 0, norms[0].eps

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # model dtype: the sampler widens only when needed

    def load_weights(self, weights) -> None:
        loaded = load_weights(
            self, _tie(weights, self.tie, self.stage.is_last), STACKED, self._rename
        )
        check_all_loaded(self, loaded)

    def _rename(self, name: str) -> str | None:
        return rename_layer(name, self.stage)


def _tie(weights, tie: bool, is_last: bool):
    for name, tensor in weights:
        yield name, tensor
        if tie and is_last and name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor


def rename_layer(name: str, stage: StageInfo) -> str | None:
    """Checkpoint name -> this stage's parameter name (layer indices become stage-local)."""
    if "rotary_emb" in name:
        return None
    if name.startswith("model.layers."):
        idx_str, _, rest = name[len("model.layers.") :].partition(".")
        idx = int(idx_str)
        if not stage.owns(idx):
            return None
        return f"model.layers.{idx - stage.start_layer}.{rest}"
    if name.startswith("model.embed_tokens.") and not stage.is_first:
        return None
    if (name.startswith("model.norm.") or name.startswith("lm_head.")) and not stage.is_last:
        return None
    return name
