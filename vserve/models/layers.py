"""Building blocks shared by the model files: norms, rotary embedding, attention wrapper.

Numerics follow the Hugging Face reference implementations exactly (norms in float32, rotary
tables computed in float32 and cast), so fp32 greedy outputs are token-identical. bf16 models
on the CPU set `kernel` to the fused CPU kernels (vserve.cpu_ops), which compute the same ops
with the same bf16 rounding points in one call each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vserve.attention.base import AttentionLayerSpec, AttentionMetadata


class RMSNorm(nn.Module):
    """Llama-style: normalize in float32, cast back, then scale by `weight`."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.rms_norm(x, self.weight, 0, self.eps)
        # F.rms_norm in fp32 is bitwise the reference's pow/mean/rsqrt, in one fused op
        h = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma-style: scale by (1 + weight) in float32, then cast back. The fp32 scale is
    computed once after loading and handed to the fused op (bitwise the separate multiply)."""

    offset = 1.0  # the scale is offset + weight

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.scale: torch.Tensor | None = None
        self.kernel = None

    def post_load(self) -> None:
        self.scale = self.offset + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.rms_norm(x, self.scale, 1, self.eps)
        scale = self.scale if self.scale is not None else self.offset + self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), scale, self.eps).type_as(x)


class Fp32ScaleRMSNorm(GemmaRMSNorm):
    """OLMo 2: scale by `weight` in float32, then cast back (Llama casts first, then
    scales)."""

    offset = 0.0


def rope_inv_freq(
    hf_config, layer_type: str | None = None, max_positions: int | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling as transformers computes them. LongRoPE
    (Phi-3) takes one table for every position, as vLLM does: its long factors when the
    context (`max_positions`) may pass the original training length, else its short ones
    (transformers switches per call by the sequence's length, and recomputes its cache when
    a sequence crosses that length)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        head_dim = getattr(hf_config, "head_dim", None) or (
            hf_config.hidden_size // hf_config.num_attention_heads
        )
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        arange = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
        return 1.0 / (base ** (arange / dim)), 1.0
    # transformers only for the scaled kinds: importing it costs a worker ~1.5 s of start-up
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fn = ROPE_INIT_FUNCTIONS[rope_type]
    kwargs: dict = {"layer_type": layer_type} if layer_type is not None else {}
    if rope_type == "longrope" and max_positions is not None:
        kwargs["seq_len"] = max_positions
    inv, scaling = fn(hf_config, torch.device("cpu"), **kwargs)
    return inv.to("cpu"), scaling


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed in float32 on the CPU. Models are built on
    the meta device; `post_load()` fills the tables once the model is materialized."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int) -> None:
        super().__init__()
        self.inv_freq, self.scaling, self.max_positions = inv_freq, scaling, max_positions
        cos, sin = self._tables()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = pos[:, None] * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def post_load(self) -> None:
        cos, sin = self._tables()
        self.cos = cos.to(self.cos.device)
        self.sin = sin.to(self.sin.device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """Tables for this step's positions [T], once per step: [T, 1, rot] each."""
        return (
            self.cos[positions].to(dtype).unsqueeze(1),
            self.sin[positions].to(dtype).unsqueeze(1),
        )


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos_sin, kernel=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D] rotated by the step's (cos, sin)."""
    cos, sin = cos_sin
    if kernel is not None:
        return kernel.rotary(q, cos, sin), kernel.rotary(k, cos, sin)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot < x.shape[-1]:  # partial rotary
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        return torch.cat((_rotate(x_rot, cos, sin), x_pass), dim=-1)
    half = rot // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Calls the step's attention backend for one layer; owns no weights."""

    def __init__(self, spec: AttentionLayerSpec, layer_idx: int) -> None:
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx

    def forward(
        self, q, k, v, kv_caches: list[torch.Tensor], meta: AttentionMetadata, backend
    ) -> torch.Tensor:
        return backend.forward(self.spec, q, k, v, kv_caches[self.layer_idx], meta)


KERNEL_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}


def gated_mlp(
    x: torch.Tensor, gate_up: nn.Linear, down: nn.Linear, act: str, kernel=None
) -> torch.Tensor:
    if kernel is not None and act in KERNEL_ACTIVATIONS:
        return down(kernel.act_mul(gate_up(x), KERNEL_ACTIVATIONS[act]))
    return down(act_and_mul(gate_up(x), act))


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up of a gate/up product [.., 2 I] -> [.., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if act in ("silu", "swish"):
        h = F.silu(gate)
    elif act in ("gelu_pytorch_tanh", "gelu_tanh"):
        h = F.gelu(gate, approximate="tanh")
    elif act == "gelu":
        h = F.gelu(gate)
    else:
        raise ValueError(f"unsupported activation {act!r}")
    return h * up
