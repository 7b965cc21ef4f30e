"""Gemma 3 (text): interleaved sliding-window and global layers, q/k norms, one rope base per
layer type, embeddings scaled by sqrt(hidden), four norms per layer, tied embeddings.

Gemma 2 is the same model without the q/k norms, with one rope base and tanh soft-capping of
the attention scores and of the logits (Gemma 3 configs may set those too)."""

from __future__ import annotations

import torch
from torch import nn

from vserve.attention.base import AttentionLayerSpec, AttentionMetadata
from vserve.distributed.tp_comm import TPShard
from vserve.models.decoder import STACKED, _tie, head_dim_of, rename_layer
from vserve.models.layers import (
    Attention,
    GemmaRMSNorm,
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


class Gemma3Attention(nn.Module):
    def __init__(
        self, hf_config, spec: AttentionLayerSpec, layer_idx: int, tp: TPShard = TPShard()
    ) -> None:
        """`spec`: this rank's heads (all of them without tensor parallel)."""
        super().__init__()
        qk_norm = hf_config.model_type != "gemma2"
        h, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        bias = getattr(hf_config, "attention_bias", False)
        split = split_heads(hf_config.num_attention_heads, hf_config.num_key_value_heads, tp)
        self.qkv_proj = qkv_linear(hf_config.hidden_size, split, d, bias, tp)
        self.o_proj = row_linear(hf_config.num_attention_heads * d, hf_config.hidden_size, bias, tp)
        self.q_norm = GemmaRMSNorm(d, hf_config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(d, hf_config.rms_norm_eps) if qk_norm else None
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


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, hf_config, spec: AttentionLayerSpec, layer_idx: int, tp: TPShard = TPShard()
    ) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        self.self_attn = Gemma3Attention(hf_config, spec, layer_idx, tp)
        self.mlp = nn.Module()
        inter = hf_config.intermediate_size
        self.mlp.gate_up_proj = gate_up_linear(hidden, inter, False, tp)
        self.mlp.down_proj = row_linear(inter, hidden, False, tp)
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.act = hf_config.hidden_activation
        self.sliding = spec.sliding_window is not None
        self.kernel = None

    def forward(self, h, ropes, kv_caches, meta, backend):
        rope = ropes[1] if self.sliding else ropes[0]
        attn = self.self_attn(self.input_layernorm(h), rope, kv_caches, meta, backend)
        h = h + self.post_attention_layernorm(attn)
        mlp = gated_mlp(
            self.pre_feedforward_layernorm(h),
            self.mlp.gate_up_proj,
            self.mlp.down_proj,
            self.act,
            self.kernel,
        )
        return h + self.post_feedforward_layernorm(mlp)


class Gemma3ForCausalLM(nn.Module):
    supports_fused_decode = True  # the fused CPU decode layers take Gemma's norms

    def __init__(
        self, hf_config, stage: StageInfo, max_positions: int, tp: TPShard = TPShard()
    ) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.stage = stage
        self.tp = tp
        d = head_dim_of(hf_config)
        types = hf_config.layer_types
        self.windows = [
            hf_config.sliding_window if t == "sliding_attention" else None for t in types
        ]
        split = split_heads(hf_config.num_attention_heads, hf_config.num_key_value_heads, tp)
        self.layer_specs = [  # this rank's heads
            AttentionLayerSpec(
                split.num_heads,
                split.num_kv_heads,
                d,
                hf_config.query_pre_attn_scalar**-0.5,
                self.windows[i],
                getattr(hf_config, "attn_logit_softcapping", None),
            )
            for i in range(hf_config.num_hidden_layers)
        ]
        self.model = nn.Module()
        if stage.is_first:
            self.model.embed_tokens = embedding(hf_config.vocab_size, hf_config.hidden_size, tp)
            self.embed_scale = hf_config.hidden_size**0.5
        self.model.layers = nn.ModuleList(
            Gemma3DecoderLayer(hf_config, self.layer_specs[i], i, tp)
            for i in range(stage.start_layer, stage.end_layer)
        )
        if stage.is_last:
            self.model.norm = GemmaRMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
            self.lm_head = lm_head(hf_config.hidden_size, hf_config.vocab_size, tp)
        self.final_softcap = getattr(hf_config, "final_logit_softcapping", None)
        self.tie = True  # Gemma 2 and 3 always tie the head to the embedding
        self.rotaries = nn.ModuleList(
            RotaryEmbedding(*rope_inv_freq(hf_config, t), max_positions)
            for t in ("full_attention", "sliding_attention")
        )
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
        if self.stage.is_first:
            emb = self.model.embed_tokens(inputs)
            h = emb * torch.tensor(self.embed_scale, dtype=emb.dtype)
        else:
            h = inputs
        ropes = [r.cos_sin(positions, h.dtype) for r in self.rotaries]
        if self.fused is not None and self.fused.can_run(meta, backend):
            h = self.fused.run(h, ropes, kv_caches, meta)
        else:
            for layer in self.model.layers:
                h = layer(h, ropes, kv_caches, meta, backend)
        return self.model.norm(h) if self.stage.is_last else h

    def fused_norms(self, layer: Gemma3DecoderLayer):
        """Norm scales, norm style, rotary table and eps of `layer` for the fused kernel."""
        norms = [
            layer.input_layernorm,
            layer.post_attention_layernorm,
            layer.pre_feedforward_layernorm,
            layer.post_feedforward_layernorm,
        ]
        if layer.self_attn.q_norm is not None:
            norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        return [n.scale for n in norms], 1, int(layer.sliding), norms[0].eps

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits  # model dtype: the sampler widens only when needed

    def load_weights(self, weights) -> None:
        text = ((s, t) for n, t in weights if (s := _strip(n)) is not None)
        loaded = load_weights(
            self,
            _tie(text, self.tie, self.stage.is_last),
            STACKED,
            lambda name: rename_layer(name, self.stage),
        )
        check_all_loaded(self, loaded)


_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.")
_VISION += ("model.multi_modal_projector.",)


def _strip(name: str) -> str | None:
    """Checkpoints of the multimodal wrapper prefix the text model, and hold a vision tower
    and projector that the text model does not read (None: skipped)."""
    if name.startswith(_VISION):
        return None
    return (
        name.replace("language_model.model.", "model.")
        .replace("model.language_model.", "model.")
        .replace("language_model.lm_head.", "lm_head.")
    )
