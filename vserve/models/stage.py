"""Which slice of a model one pipeline stage owns, and fused linear layers with weight loaders."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from vserve.models.gguf_source import QuantBlocks


@dataclass(frozen=True)
class StageInfo:
    start_layer: int
    end_layer: int
    is_first: bool
    is_last: bool

    @staticmethod
    def split(num_layers: int, num_stages: int, rank: int) -> StageInfo:
        """Contiguous layer ranges; earlier stages take the remainder (they also embed)."""
        if num_stages > num_layers:
            raise ValueError(
                f"pipeline_parallel_size {num_stages} exceeds the model's {num_layers} layers"
            )
        base, extra = divmod(num_layers, num_stages)
        start = rank * base + min(rank, extra)
        end = start + base + (1 if rank < extra else 0)
        return StageInfo(start, end, rank == 0, rank == num_stages - 1)

    @staticmethod
    def from_counts(counts: tuple[int, ...] | list[int], rank: int) -> StageInfo:
        """Stage `rank` of a split given as layers per stage (`vserve.models.partition`)."""
        start = sum(counts[:rank])
        return StageInfo(start, start + counts[rank], rank == 0, rank == len(counts) - 1)

    @staticmethod
    def whole(num_layers: int) -> StageInfo:
        return StageInfo(0, num_layers, True, True)

    def owns(self, layer_idx: int) -> bool:
        return self.start_layer <= layer_idx < self.end_layer


class FusedLinear(nn.Linear):
    """Several projections of the same input in one matmul (q/k/v, gate/up)."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: list[int],
        bias: bool,
        shard_offsets: list[int] | None = None,
    ) -> None:
        """`shard_offsets`: tensor parallel, the first row of each shard's slice of its
        checkpoint tensor (None: the whole tensor)."""
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes
        self.shard_offsets = shard_offsets
        self.quant_shards: dict[int, QuantBlocks] = {}  # for vserve.models.quant_linear

    def load_shard(self, param_name: str, tensor, shard: int) -> None:
        if self.shard_offsets is not None:  # tensor parallel: this rank's rows
            offset, size = self.shard_offsets[shard], self.shard_sizes[shard]
            narrow = tensor.rows if isinstance(tensor, QuantBlocks) else partial(tensor.narrow, 0)
            tensor = narrow(offset, size)
        if isinstance(tensor, QuantBlocks):
            expected = (self.shard_sizes[shard], self.in_features)
            check_shape(f"shard {shard}", tensor.shape, expected)
            self.quant_shards[shard] = tensor
            return
        start = sum(self.shard_sizes[:shard])
        target = self.weight if param_name == "weight" else self.bias
        with torch.no_grad():
            target[start : start + self.shard_sizes[shard]].copy_(tensor)


def load_weights(
    model: nn.Module, weights, stacked: dict[str, tuple[str, int]], rename
) -> set[str]:
    """Copy checkpoint tensors into `model`. `rename(name)` maps a checkpoint name to the
    model's parameter name (or None to skip); `stacked` maps a projection name to its fused
    module and shard index. Returns the parameter names that were filled."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None:
            continue
        module_path, _, leaf = name.rpartition(".")
        parent, _, proj = module_path.rpartition(".")
        if proj in stacked:
            fused_name, shard = stacked[proj]
            fused_path = f"{parent}.{fused_name}"
            if fused_path in modules:
                modules[fused_path].load_shard(leaf, tensor, shard)
                loaded.add(f"{fused_path}.{leaf}#{shard}")
                continue
        loader = getattr(modules.get(module_path), "load_weight", None)
        if loader is not None:  # a layer that narrows its own slice (tensor parallel)
            loaded.add(f"{module_path}.{loader(leaf, tensor)}")
            continue
        if name in params:
            check_shape(ckpt_name, tuple(tensor.shape), tuple(params[name].shape))
            if isinstance(tensor, QuantBlocks):  # parked: quant_linear.install takes it
                modules[module_path].quant_weight = tensor
            else:
                with torch.no_grad():
                    params[name].copy_(tensor)
            loaded.add(name)
    return loaded


def check_shape(what: str, shape: tuple, expected: tuple) -> None:
    if tuple(shape) != tuple(expected):
        raise ValueError(f"weight {what}: shape {tuple(shape)} does not fit {tuple(expected)}")


def check_all_loaded(model: nn.Module, loaded: set[str]) -> None:
    missing = []
    for name, module in model.named_modules():
        for leaf, _ in module.named_parameters(recurse=False):
            full = f"{name}.{leaf}" if name else leaf
            if isinstance(module, FusedLinear):
                shards = range(len(module.shard_sizes))
                if not all(f"{full}#{i}" in loaded for i in shards):
                    missing.append(full)
            elif full not in loaded:
                missing.append(full)
    if missing:
        raise ValueError(
            f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
