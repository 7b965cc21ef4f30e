"""One parameterized decoder for Llama, Mistral, Qwen2, Qwen3, Granite, SmolLM3 and Phi-3.

The families differ only in `Family` flags, read from the config: bias on q/k/v (Qwen2), RMS
norms on q and k per head (Qwen3), sliding windows (Mistral, Phi-3, per-layer `layer_types`),
tied embeddings, Granite's multipliers (embeddings, sublayer outputs, attention scale, logits
divided), SmolLM3's layers without rotary. Phi-3 checkpoints hold q/k/v and gate/up fused;
they are split on load (`split_fused`) and its partial rotary and LongRoPE come from the
rotary tables (`rope_inv_freq`). Model classes whose layers differ in shape subclass
`DecoderForCausalLM` and build their own layers (`olmo2.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vserve.attention.base import AttentionLayerSpec, AttentionMetadata
from vserve.distributed.tp_comm import TPShard
from vserve.models.gguf_source import QuantBlocks
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


@dataclass(frozen=True)
class Family:
    """What sets a family's decoder apart from Llama's (the defaults: Llama)."""

    qk_norm: bool = False  # Qwen3: RMS norms on q and k, per head
    qkv_bias: bool = False  # Qwen2, or `attention_bias`
    embedding_multiplier: float = 1.0  # Granite: embeddings scaled
    residual_multiplier: float = 1.0  # Granite: sublayer outputs scaled before the residual
    attention_scale: float | None = None  # Granite's attention_multiplier; None: d ** -0.5
    logits_scaling: float = 1.0  # Granite: logits divided by it
    rope_layers: tuple[bool, ...] | None = None  # SmolLM3: which layers rotate (None: all)

    def uses_rope(self, layer_idx: int) -> bool:
        return self.rope_layers is None or self.rope_layers[layer_idx]


def family_of(hf_config) -> Family:
    model_type = hf_config.model_type
    granite = model_type == "granite"
    no_rope = getattr(hf_config, "no_rope_layers", None) if model_type == "smollm3" else None
    return Family(
        qk_norm=model_type.startswith("qwen3"),
        qkv_bias=(model_type in ("qwen2", "qwen2_moe") and getattr(hf_config, "qkv_bias", True))
        or bool(getattr(hf_config, "attention_bias", False)),
        embedding_multiplier=hf_config.embedding_multiplier if granite else 1.0,
        residual_multiplier=hf_config.residual_multiplier if granite else 1.0,
        attention_scale=hf_config.attention_multiplier if granite else None,
        logits_scaling=hf_config.logits_scaling if granite else 1.0,
        rope_layers=tuple(bool(x) for x in no_rope) if no_rope else None,  # 1: rotates
    )


class SelfAttention(nn.Module):
    def __init__(
        self,
        hf_config,
        spec: AttentionLayerSpec,
        layer_idx: int,
        family: Family,
        tp: TPShard = TPShard(),
    ) -> None:
        """`spec`: this rank's heads (all of them without tensor parallel)."""
        super().__init__()
        h, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        split = split_heads(hf_config.num_attention_heads, hf_config.num_key_value_heads, tp)
        self.qkv_proj = qkv_linear(hf_config.hidden_size, split, d, family.qkv_bias, tp)
        self.o_proj = row_linear(
            hf_config.num_attention_heads * d,
            hf_config.hidden_size,
            getattr(hf_config, "attention_bias", False),
            tp,
        )
        eps = hf_config.rms_norm_eps
        self.q_norm = RMSNorm(d, eps) if family.qk_norm else None
        self.k_norm = RMSNorm(d, eps) if family.qk_norm else None
        self.rotates = family.uses_rope(layer_idx)
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
        if self.rotates:
            q, k = apply_rotary(q, k, rope, self.kernel)
        return self.o_proj(self.attn(q, k, v, kv_caches, meta, backend))


class DecoderLayer(nn.Module):
    def __init__(self, hf_config, spec, layer_idx, family: Family, tp: TPShard = TPShard()):
        super().__init__()
        eps, hidden = hf_config.rms_norm_eps, hf_config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = SelfAttention(hf_config, spec, layer_idx, family, tp)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        mlp_bias = getattr(hf_config, "mlp_bias", False)
        inter = hf_config.intermediate_size
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = gate_up_linear(hidden, inter, mlp_bias, tp)
        self.mlp.down_proj = row_linear(inter, hidden, mlp_bias, tp)
        self.act = getattr(hf_config, "hidden_act", "silu")
        self.residual_multiplier = family.residual_multiplier
        self.kernel = None

    def forward(self, h, rope, kv_caches, meta, backend):
        attn = self.self_attn(self.input_layernorm(h), rope, kv_caches, meta, backend)
        h = h + self._scaled(attn)
        mlp = gated_mlp(
            self.post_attention_layernorm(h),
            self.mlp.gate_up_proj,
            self.mlp.down_proj,
            self.act,
            self.kernel,
        )
        return h + self._scaled(mlp)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


class DecoderForCausalLM(nn.Module):
    norm_cls: type[nn.Module] = RMSNorm  # the final norm's
    rope_in_fp32 = False  # rotate in float32 (OLMo 2), not in the model's dtype

    def __init__(
        self, hf_config, stage: StageInfo, max_positions: int, tp: TPShard = TPShard()
    ) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.stage = stage
        self.tp = tp
        self.family = family_of(hf_config)
        self.tie = getattr(hf_config, "tie_word_embeddings", False)
        self.windows = layer_windows(hf_config)
        self.layer_specs = self._layer_specs(hf_config, tp)  # this rank's heads
        self.model = nn.Module()
        if stage.is_first:
            self.model.embed_tokens = embedding(hf_config.vocab_size, hf_config.hidden_size, tp)
        self.model.layers = nn.ModuleList(
            self.make_layer(hf_config, self.layer_specs[i], i, tp)
            for i in range(stage.start_layer, stage.end_layer)
        )
        if stage.is_last:
            self.model.norm = self.norm_cls(hf_config.hidden_size, hf_config.rms_norm_eps)
            self.lm_head = lm_head(hf_config.hidden_size, hf_config.vocab_size, tp)
        inv_freq, scaling = rope_inv_freq(hf_config, max_positions=max_positions)
        self.rotary = RotaryEmbedding(inv_freq, scaling, max_positions)
        self.kernel = None
        self.fused = None  # FusedDecode, set when the CPU kernels are attached

    def _layer_specs(self, hf_config, tp: TPShard) -> list[AttentionLayerSpec]:
        d = head_dim_of(hf_config)
        scale = self.family.attention_scale
        split = split_heads(hf_config.num_attention_heads, hf_config.num_key_value_heads, tp)
        return [
            AttentionLayerSpec(
                split.num_heads,
                split.num_kv_heads,
                d,
                d**-0.5 if scale is None else scale,
                self.windows[i],
            )
            for i in range(hf_config.num_hidden_layers)
        ]

    def make_layer(self, hf_config, spec: AttentionLayerSpec, layer_idx: int, tp: TPShard):
        return DecoderLayer(hf_config, spec, layer_idx, self.family, tp)

    @property
    def supports_fused_decode(self) -> bool:
        """Whether the fused CPU decode layers (`fused_decode`, Llama's layer shape) compute
        this model's layers: not with scaled residuals (Granite) or layers without rotary
        (SmolLM3). A rotary over part of the head (Phi-3) is theirs too: their rotary takes
        the table's width, as the per-op kernel does."""
        family = self.family
        all_rotate = family.rope_layers is None or all(family.rope_layers)
        return family.residual_multiplier == 1.0 and all_rotate

    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        kv_caches,
        meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:
        """inputs: token ids [T] on the first stage, hidden states [T, hidden] otherwise."""
        h = self._embed(inputs) if self.stage.is_first else inputs
        rope = self.rotary.cos_sin(positions, torch.float32 if self.rope_in_fp32 else h.dtype)
        if self.fused is not None and self.fused.can_run(meta, backend):
            h = self.fused.run(h, [rope], kv_caches, meta)
        else:
            for layer in self.model.layers:
                h = layer(h, rope, kv_caches, meta, backend)
        return self.model.norm(h) if self.stage.is_last else h

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        multiplier = self.family.embedding_multiplier
        return h if multiplier == 1.0 else h * multiplier

    def fused_norms(self, layer: DecoderLayer):
        """Norm weights, norm style, rotary table and eps of `layer` for the fused kernel."""
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if layer.self_attn.q_norm is not None:
            norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
        return [n.weight for n in norms], 0, 0, norms[0].eps

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # model dtype: the sampler widens only when needed
        scaling = self.family.logits_scaling
        return logits if scaling == 1.0 else logits / scaling

    def load_weights(self, weights) -> None:
        weights = _tie(split_fused(weights, self.hf_config), self.tie, self.stage.is_last)
        loaded = load_weights(self, weights, STACKED, self._rename)
        check_all_loaded(self, loaded)

    def _rename(self, name: str) -> str | None:
        return rename_layer(name, self.stage)


def split_fused(weights, hf_config):
    """Phi-3 checkpoints hold q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`) as one tensor
    each: their parts go under the separate projections' names, which the fused layers load
    (and shard) as they load any other checkpoint's."""
    d = head_dim_of(hf_config)
    q, kv = hf_config.num_attention_heads * d, hf_config.num_key_value_heads * d
    parts = {
        ".qkv_proj.": (("q_proj", "k_proj", "v_proj"), [q, kv, kv]),
        ".gate_up_proj.": (("gate_proj", "up_proj"), [hf_config.intermediate_size] * 2),
    }
    for name, tensor in weights:
        fused = next((key for key in parts if key in name), None)
        if fused is None:
            yield name, tensor
            continue
        names, sizes = parts[fused]
        for part, piece in zip(names, _split_rows(tensor, sizes), strict=True):
            yield name.replace(fused, f".{part}."), piece


def _split_rows(tensor, sizes: list[int]):
    """Consecutive row ranges of a dense weight or of GGUF blocks (whole rows: views)."""
    if not isinstance(tensor, QuantBlocks):
        return tensor.split(sizes)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [tensor.rows(start, size) for start, size in zip(starts, sizes, strict=True)]


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
