"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE.

A sparse layer's MLP is a router and E experts; each token runs its top k experts and sums
their outputs weighted by the router's probabilities:

| family      | attention                        | top-k weights           | shared expert       |
|-------------|----------------------------------|-------------------------|---------------------|
| `qwen3_moe` | Qwen3's (q/k norms per head)     | renormalized if         | none                |
|             |                                  | `norm_topk_prob`        |                     |
| `qwen2_moe` | Qwen2's (q/k/v bias)             | the same                | one, sigmoid-gated  |
| `mixtral`   | Mistral's                        | renormalized            | none                |
| `olmoe`     | OLMo 2's (q/k norms, all heads)  | renormalized if         | none                |
|             |                                  | `norm_topk_prob`        |                     |

The router's softmax and top k run in float32 (as transformers does), the weights then cast
to the model's dtype. Experts hold their weights stacked (`w13`: gate and up rows of every
expert, `w2`: down), and a step groups its tokens by expert: each expert the step routes to
runs one matmul pair over its tokens, so a decode step reads only the routed experts'
weights (k of E at batch 1). Tensor parallel splits every expert's intermediate rows as it
splits a dense MLP; the experts' sum is all-reduced. Qwen-MoE layers outside the sparse step
(`decoder_sparse_step`, `mlp_only_layers`) keep a dense MLP. From a GGUF file the
experts stay in their blocks: each expert's rows of the file's 3-D tensors
become two quantized linears (`install_quant`), and a step runs the routed experts' only. The
fused CPU decode layers never run these models (`supports_fused_decode`). On CUDA the dense
experts run as two Triton grouped GEMMs (`csrc_triton/fused_moe.py`) instead of the loop.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from vserve.attention.base import AttentionLayerSpec
from vserve.distributed.tp_comm import TPShard
from vserve.models.decoder import DecoderForCausalLM, SelfAttention
from vserve.models.gguf_source import QuantBlocks
from vserve.models.layers import RMSNorm, act_and_mul, gated_mlp
from vserve.models.olmo2 import Olmo2Attention
from vserve.models.parallel_layers import gate_up_linear, row_linear
from vserve.models.stage import check_shape

# checkpoint names of one expert's projections -> (part, stacked row block): gate and up
# fill w13's halves, down fills w2 (Mixtral's w1, w3, w2 are the same three)
_PARTS = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
_EXPERT = re.compile(r"\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate: int  # each expert's
    renormalize: bool  # the top k weights divided by their sum
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert (0: none)


def moe_spec(hf_config) -> MoESpec:
    model_type = hf_config.model_type
    # the config's own name, or the one transformers maps it to (`attribute_map`)
    num_experts = getattr(hf_config, "num_experts", None) or hf_config.num_local_experts
    if model_type == "mixtral":
        return MoESpec(
            num_experts,
            hf_config.num_experts_per_tok,
            hf_config.intermediate_size,
            True,
        )
    inter = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    return MoESpec(
        num_experts,
        hf_config.num_experts_per_tok,
        inter,
        bool(getattr(hf_config, "norm_topk_prob", False)),
        hf_config.shared_expert_intermediate_size if model_type == "qwen2_moe" else 0,
    )


def is_sparse(hf_config, layer_idx: int) -> bool:
    """Whether a layer's MLP is the experts (Qwen-MoE's step and dense-only layers)."""
    if hf_config.model_type in ("mixtral", "olmoe"):
        return True
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    only_dense = getattr(hf_config, "mlp_only_layers", None) or []
    return layer_idx not in only_dense and (layer_idx + 1) % step == 0


def check_moe_tp(hf_config, tp_size: int) -> None:
    inter = moe_spec(hf_config).intermediate
    if inter % tp_size:
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the experts' intermediate size {inter}"
        )


class Experts(nn.Module):
    """Every expert's gate/up rows (`w13` [E, 2 I, H]) and down (`w2` [E, H, I]), this rank's
    share of I. Loaded one checkpoint tensor at a time (`load_weight`); a weight counts as
    loaded once every expert's parts arrived."""

    def __init__(self, spec: MoESpec, hidden: int, tp: TPShard) -> None:
        super().__init__()
        self.spec, self.tp = spec, tp
        self.local = spec.intermediate // tp.size
        e, i = spec.num_experts, self.local
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, hidden))
        self.w2 = nn.Parameter(torch.empty(e, hidden, i))
        # per weight, the (expert, part) pieces loaded: w13 takes 2 E, w2 takes E
        self._filled: dict[str, set[tuple[int, int]]] = {"w13": set(), "w2": set()}
        # GGUF blocks by (expert, part), until `install_quant` makes them linears
        self.quant: dict[tuple[int, int], QuantBlocks] = {}
        self.q13: nn.ModuleList | None = None
        self.q2: nn.ModuleList | None = None
        self.kernel = None  # the CPU kernels (bf16 one-row gemv), set by attach_kernel

    def load_weight(self, leaf: str, tensor: torch.Tensor | QuantBlocks) -> str:
        expert, part = (int(x) for x in leaf.split("_"))
        i, first = self.local, self.tp.rank * self.local
        full, hidden = self.spec.intermediate, self.w13.shape[2]
        expected = (full, hidden) if part < 2 else (hidden, full)
        check_shape(f"expert {expert}", tuple(tensor.shape), expected)
        if isinstance(tensor, QuantBlocks):  # this rank's rows (gate, up) or inputs (down)
            self.quant[(expert, part)] = (
                tensor.rows(first, i) if part < 2 else tensor.cols(first, i)
            )
        else:
            with torch.no_grad():
                if part < 2:  # gate or up: rows of this rank's share
                    self.w13[expert, part * i : (part + 1) * i].copy_(tensor.narrow(0, first, i))
                else:  # down: its columns
                    self.w2[expert].copy_(tensor.narrow(1, first, i))
        name = "w13" if part < 2 else "w2"
        filled = self._filled[name]
        filled.add((expert, part))
        done = len(filled) == self.spec.num_experts * (2 if part < 2 else 1)
        return name if done else f"{name}#partial"

    def install_quant(self, make_linear) -> bool:
        """GGUF blocks arrived (`load_weight`): each expert's projections become two quantized
        linears made by `make_linear(parts, in_features)` (a part: blocks, or the dense rows
        of a weight that came dense); the stacked dense weights are dropped. False when every
        weight is dense."""
        if not self.quant:
            return False
        i, hidden = self.local, self.w13.shape[2]

        def part(expert: int, p: int):
            dense = self.w13[expert, p * i : (p + 1) * i] if p < 2 else self.w2[expert]
            return self.quant.get((expert, p), dense.detach())

        experts = range(self.spec.num_experts)
        self.q13 = nn.ModuleList(make_linear([part(e, 0), part(e, 1)], hidden) for e in experts)
        self.q2 = nn.ModuleList(make_linear([part(e, 2)], i) for e in experts)
        self.w13 = self.w2 = None
        self.quant = {}
        return True

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, act: str):
        """x [T, H]; weights, ids [T, k]: the experts' weighted sum [T, H] (this rank's
        partial sum under tensor parallel)."""
        if self.q13 is None and use_triton(x):  # two grouped GEMM launches
            from vserve.csrc_triton.fused_moe import fused_experts

            return fused_experts(x, self.w13, self.w2, weights, ids, partial(act_and_mul, act=act))
        if x.shape[0] == 1:
            return self._one_token(x, weights[0], ids[0].tolist(), act)
        out = torch.zeros_like(x)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()
        tokens, slot_weights = order // k, weights.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            y = gated_mlp(x[rows], *self._projections(expert), act)
            out.index_add_(0, rows, y * slot_weights[start : start + count, None])
            start += count
        return out

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, experts: list[int], act: str):
        """A decode step at batch 1: its k experts in turn, summed in expert order (as the
        batched path sums each token's), without sorting and scattering the pairs."""
        out = None
        for slot in sorted(range(len(experts)), key=experts.__getitem__):
            gate_up, down = self._projections(experts[slot], one_row=True)
            y = gated_mlp(x, gate_up, down, act, self.kernel) * weights[slot]
            out = y if out is None else out.add_(y)
        return out

    def _projections(self, expert: int, one_row: bool = False):
        if self.q13 is not None and self.q2 is not None:
            return self.q13[expert], self.q2[expert]
        w13, w2 = self.w13[expert], self.w2[expert]
        kernel = self.kernel
        if one_row and kernel is not None and w13.dtype == torch.bfloat16:
            # the CPU kernels' one-row gemv streams the row-major weight; bf16 F.linear
            # reorders it into oneDNN's layout on every call (packed_linear.py)
            return (lambda h: kernel.gemv(h, w13, None)), (lambda h: kernel.gemv(h, w2, None))
        return (lambda h: F.linear(h, w13)), (lambda h: F.linear(h, w2))


def use_triton(x: torch.Tensor) -> bool:
    """The Triton experts run where Triton compiles for the tensor's device."""
    return x.device.type == "cuda"


class Router(nn.Module):
    """x @ W^T in the model's dtype, kept out of the packed and quantized linears (their
    rounding would move tokens between experts), as vLLM keeps its routers."""

    def __init__(self, hidden: int, outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(outputs, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoE(nn.Module):
    def __init__(self, hf_config, tp: TPShard) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        self.spec = spec = moe_spec(hf_config)
        self.tp = tp
        self.act = getattr(hf_config, "hidden_act", "silu")
        self.gate = Router(hidden, spec.num_experts)  # replicated on every rank
        self.experts = Experts(spec, hidden, tp)
        if spec.shared_intermediate:
            self.shared_expert = nn.Module()
            self.shared_expert.gate_up_proj = gate_up_linear(
                hidden, spec.shared_intermediate, False, tp
            )
            self.shared_expert.down_proj = row_linear(spec.shared_intermediate, hidden, False, tp)
            self.shared_expert_gate = Router(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        top, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        out = self.experts(x, top.to(x.dtype), ids, self.act)
        if self.tp.size > 1:
            out = self.tp.comm.all_reduce(out)
        if self.spec.shared_intermediate:
            shared = self.shared_expert
            mlp = gated_mlp(x, shared.gate_up_proj, shared.down_proj, self.act)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * mlp
        return out


class MoEDecoderLayer(nn.Module):
    def __init__(self, model: MoEForCausalLM, spec: AttentionLayerSpec, layer_idx: int, tp):
        super().__init__()
        cfg = model.hf_config
        eps, hidden = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps)
        if cfg.model_type == "olmoe":
            self.self_attn: nn.Module = Olmo2Attention(cfg, spec, layer_idx, tp)
        else:
            self.self_attn = SelfAttention(cfg, spec, layer_idx, model.family, tp)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.act = getattr(cfg, "hidden_act", "silu")
        self.sparse = is_sparse(cfg, layer_idx)
        if self.sparse:
            self.mlp: nn.Module = SparseMoE(cfg, tp)
        else:
            self.mlp = nn.Module()
            self.mlp.gate_up_proj = gate_up_linear(hidden, cfg.intermediate_size, False, tp)
            self.mlp.down_proj = row_linear(cfg.intermediate_size, hidden, False, tp)
        self.kernel = None

    def forward(self, h, rope, kv_caches, meta, backend):
        h = h + self.self_attn(self.input_layernorm(h), rope, kv_caches, meta, backend)
        x = self.post_attention_layernorm(h)
        if self.sparse:
            return h + self.mlp(x)
        return h + gated_mlp(x, self.mlp.gate_up_proj, self.mlp.down_proj, self.act, self.kernel)


class MoEForCausalLM(DecoderForCausalLM):
    def __init__(self, hf_config, stage, max_positions: int, tp: TPShard = TPShard()) -> None:
        if getattr(hf_config, "clip_qkv", None) is not None:
            raise ValueError("OLMoE's clip_qkv is not supported")
        if tp.size > 1:
            check_moe_tp(hf_config, tp.size)
        super().__init__(hf_config, stage, max_positions, tp)
        self.rope_in_fp32 = hf_config.model_type == "olmoe"  # OLMo 2's attention rotates so

    @property
    def supports_fused_decode(self) -> bool:
        return False  # the fused CPU decode layers are dense MLPs

    def make_layer(self, hf_config, spec: AttentionLayerSpec, layer_idx: int, tp: TPShard):
        return MoEDecoderLayer(self, spec, layer_idx, tp)

    def _rename(self, name: str) -> str | None:
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's
        found = _EXPERT.search(name)
        if found is not None:  # one expert's projection: Experts.load_weight's leaf
            expert, proj = found.groups()
            if proj not in _PARTS:
                return None
            name = f"{name[: found.start()]}.mlp.experts.{expert}_{_PARTS[proj]}"
        return super()._rename(name)
