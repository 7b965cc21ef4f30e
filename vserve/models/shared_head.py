"""The fp32 lm_head on the CPU, its rows claimed by the threads in shares (`cpu_ops.shared_linear`).

A vocabulary-sized head is most of a small fp32 model's step (262k x 64: ~20 ms of a 22 ms
decode step at batch 32). F.linear splits it once between the threads, so a thread that the OS
preempts for the engine's host work beside the forward holds up the whole product; in shares,
the other thread takes its tiles. Each tile is one thread's ATen product, so the result does
not depend on the thread count (F.linear's does at some shapes: MKL splits a 5 x 640 product
another way on two threads); it is bitwise F.linear's on the tiny models' heads, where fp32
outputs must equal transformers', and within fp32 rounding elsewhere (a partial last tile, a
small-row product that MKL threads otherwise; tests/models/test_shared_head.py). bf16 heads
take the packed oneDNN kernel instead (vserve/models/packed_linear.py); tensor-parallel heads
keep theirs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SharedHead(nn.Module):
    def __init__(self, linear: nn.Linear, kernel) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return F.linear(x, self.weight)
        return self.kernel.shared_linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, shared rows"


def share_head(model: nn.Module, kernel) -> bool:
    """model.lm_head -> SharedHead when it is a plain fp32 CPU linear without bias."""
    head = getattr(model, "lm_head", None)
    if (
        type(head) is not nn.Linear
        or head.bias is not None
        or head.weight.dtype != torch.float32
        or head.weight.device.type != "cpu"
        or not head.weight.is_contiguous()
    ):
        return False
    model.lm_head = SharedHead(head, kernel)
    return True
