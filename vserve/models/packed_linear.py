"""oneDNN-prepacked linear layers for bf16 models on the CPU.

`F.linear` in bf16 on a CPU with native bf16 instructions already runs oneDNN, but it
reorders the weight into oneDNN's blocked layout on every call: at batch 1 that reorder costs
nearly as much as the matmul itself (the 262k-row lm_head of Gemma-3 takes ~21 ms instead of
~13 ms). Reordering once at load time gives the same kernel the same blocked weight, so the
outputs are bitwise those of `F.linear` (tests/models/test_packed_linear.py checks it), for less.

fp32 is left alone: there `F.linear` runs MKL, whose results the packed oneDNN kernel does not
reproduce bit for bit, and fp32 is the mode whose outputs must equal transformers'. fp16
packing needs AVX512-FP16 or AVX-NE-CONVERT, and without native bf16 `F.linear` may not run
oneDNN at all, so both stay on `F.linear`.
"""

from __future__ import annotations

import torch
from torch import nn

from vserve.config import cpu_has_bf16


class PackedLinear(nn.Module):
    """A linear layer whose weight lives only in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, keep_plain: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.shard_sizes = getattr(linear, "shard_sizes", None)  # FusedLinear's split
        # one reorder for every batch size: the hint only picks the packing, not the result
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # the row-major weight, for the CPU kernels' one-row gemv (vserve.cpu_ops)
        self.plain = linear.weight.detach() if keep_plain else None
        self.kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.linear(x, self.packed, self.plain, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and cpu_has_bf16()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_linears(model: nn.Module, keep_plain: bool = False) -> int:
    """Replace every nn.Linear of `model` by a PackedLinear; returns how many were packed.
    The original weights are released unless `keep_plain` (the CPU kernels' one-row gemv
    reads them; `share_tied_head` then drops the tied lm_head's copy)."""
    targets = [
        (name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)
    ]
    for name, linear in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, PackedLinear(linear, keep_plain))
    return len(targets)


def share_tied_head(model: nn.Module) -> None:
    """A tied lm_head's row-major weight equals the embedding table (the loader copies the same
    checkpoint tensor into both): read the table instead of holding a second copy."""
    head = getattr(model, "lm_head", None)
    embed = getattr(model.model, "embed_tokens", None)
    if (
        getattr(model, "tie", False)
        and isinstance(head, PackedLinear)
        and head.plain is not None
        and embed is not None
    ):
        head.plain = embed.weight
