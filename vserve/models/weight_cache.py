"""The loaded weights of one pipeline stage, cached on disk and memory-mapped on later loads.

Loading from the checkpoint reads every tensor, converts it to the model's dtype and copies it
into the model's own layout (q/k/v and gate/up fused): about two thirds of a CPU load of the
embedded model. The result, the stage's parameters just after `load_weights` (before the
derived tables and the oneDNN packing, which stay in the loader), is saved once with
`torch.save` and later `torch.load(mmap=True)`-ed: no copy, pages come from the page cache on
first touch and are shared between processes. (oneDNN's packed weights are opaque tensors
without a storage torch can save, so the packing itself is redone: a small part of the load.)

The file lives next to a model that vserve converted (its cache folder), else under
`$XDG_CACHE_HOME/vserve/weights`, named by a digest of the checkpoint files' identity (path,
size, mtime), the dtype, the stage, the torch version and `LAYOUT_VERSION` (bump it when a
model's parameter layout changes); a file whose names, shapes or dtypes do not match the model
is ignored and rewritten. CPU only, checkpoints of 64 MiB and more; `VSERVE_WEIGHT_CACHE=0`
turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch
from torch import nn

from vserve.cache_files import cache_dir

logger = logging.getLogger("vserve")

LAYOUT_VERSION = 2


MIN_BYTES = 64 * 2**20  # smaller checkpoints load in moments: no copy on disk for them


def enabled(device: torch.device, files: list[Path]) -> bool:
    from vserve.envs import read_env

    return (
        device.type == "cpu"
        and read_env().weight_cache
        and sum(f.stat().st_size for f in files) >= MIN_BYTES
    )


def cache_file(
    model_path: str, files: list[Path], dtype: torch.dtype, stage, shard: str = ""
) -> Path:
    """`shard`: the tensor-parallel shard's key ("" for a single rank)."""
    key = [str(LAYOUT_VERSION), torch.__version__, str(dtype), repr(stage)]
    if shard:
        key.append(shard)
    for file in files:
        stat = file.stat()
        key.append(f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}")
    digest = hashlib.sha256("\n".join(key).encode()).hexdigest()[:16]
    return _folder(Path(model_path)) / f"vserve-weights-{digest}.pt"


def _folder(model_path: Path) -> Path:
    from vserve.models.resolve import cache_root

    root = cache_root().resolve()
    if root in model_path.resolve().parents:  # converted by vserve: keep it beside the model
        return model_path
    return cache_dir("weights")


def load_into(model: nn.Module, path: Path) -> bool:
    """Point `model`'s parameters at the memory-mapped cache; False (model untouched) on a
    miss or a file that does not fit the model."""
    if not path.is_file():
        return False
    try:
        tensors = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:  # truncated or from another torch: repack
        logger.warning("ignoring the weight cache %s: %s", path, e)
        return False
    params = dict(model.named_parameters())
    if not isinstance(tensors, dict) or not isinstance(tensors.get("aliases"), dict):
        tensors = None
    else:
        tensors = {
            **tensors["tensors"],
            **{a: tensors["tensors"].get(n) for a, n in tensors["aliases"].items()},
        }
    if tensors is None or not _fits(params, tensors):
        logger.warning("ignoring the weight cache %s: it does not fit the model", path)
        return False
    for name, tensor in tensors.items():
        module_path, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_path) if module_path else model
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    return True


def _fits(params: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> bool:
    return set(params) == set(tensors) and all(
        isinstance(tensors[n], torch.Tensor)
        and params[n].shape == tensors[n].shape
        and params[n].dtype == tensors[n].dtype
        for n in params
    )


def save(model: nn.Module, path: Path) -> None:
    """Write the parameters (atomically); a failure only costs the next load its speed."""
    tensors = {name: p.detach() for name, p in model.named_parameters()}
    aliases = _tied(model, tensors)
    for name in aliases:
        del tensors[name]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"tensors": tensors, "aliases": aliases}, tmp)
        tmp.replace(path)
    except OSError as e:
        logger.warning("cannot write the weight cache %s: %s", path, e)
        tmp.unlink(missing_ok=True)


def _tied(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """A tied head's weight is a copy of the embedding table: stored once, mapped twice."""
    head, embed = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if (
        getattr(model, "tie", False)
        and head is not None
        and embed is not None
        and head.shape == embed.shape
        and torch.equal(head, embed)
    ):
        return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}
