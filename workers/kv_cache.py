"""The KV cache of one pipeline stage: how many blocks it gets and the tensors that hold them.

Memory follows use on the CPU: each layer's tensor maps a fresh memfd named "vserve-kv", whose
pages the kernel commits (zero-filled) on first touch. A block costs memory from the step that
first touches it, so resident memory grows with the blocks the cache has used, not with the
budget; pages stay committed afterwards (prefix caching cycles through the pool, so a busy
engine reaches the budget). The name lets anyone read the cache's share of a worker's resident
memory from /proc (`vserve.startup.kv_resident_bytes`). Where memfds are missing or refused
(old kernels, sandboxes) the tensor is an anonymous mapping instead, committed the same way.
(`torch.zeros` would write every page at start-up; a plain `torch.empty` would come from the
heap, which the worker's malloc tuning keeps instead of unmapping, so it could hold old data.)
Unwritten slots read as zeros, which the torch backend needs: it gathers whole blocks and masks
by position, and a masked slot still enters `probs @ v` as 0 x value, so it must be finite.
Device memory is allocated and zeroed up front, as before.

With a sliding-window group (`RunnerConfig.sliding_window`), the layers that have a window
hold `min(num_blocks, local cap)` blocks plus one null block (never written, so all zeros)
that the block tables point dead entries at; the other layers hold `num_blocks`.

| budget (blocks per stage)                 | when                                          |
|-------------------------------------------|-----------------------------------------------|
| `num_gpu_blocks_override`                 | given                                         |
| min(bytes / bytes per block, in-use cap)  | bytes: `kv_cache_memory_bytes`, else the CUDA |
|                                           | memory left beside the largest step's peak    |
|                                           | (`memory_profile`), else 4 GiB on CPU (a      |
|                                           | ceiling)                                      |

The in-use cap is what the engine can use at once: `max_num_seqs` sequences of
`max_model_len` tokens. The sliding-window layers' blocks come out of the same bytes: their
group gets its cap (what the windows of a full batch use) first when the budget allows it.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

from vserve.startup import KV_MAPPING_NAME

DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose pages are committed on first touch (a fresh memfd, or an
    anonymous mapping where memfds are missing or refused)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    try:
        buf = _memfd_mapping(nbytes)
    except (AttributeError, OSError):  # no memfd_create, or a kernel / sandbox that refuses it
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps `buf` alive


def _memfd_mapping(nbytes: int) -> mmap.mmap:
    fd = os.memfd_create(KV_MAPPING_NAME, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)  # (holds its own dup of the fd)
    finally:
        os.close(fd)


def new_kv_tensor(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """[2, num_blocks, block_size, num_kv_heads, head_dim], zeros (keys, then values)."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    if device.type == "cpu":
        return lazy_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def num_blocks_for(
    bytes_per_block: int,
    budget_bytes: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
    local_bytes_per_block: int = 0,
    local_cap: int = 0,
) -> int:
    """Full-attention blocks that fit in `budget_bytes` beside min(blocks, local_cap)
    sliding-window blocks, at most what `max_num_seqs` full sequences use."""
    per_seq = -(-max_model_len // block_size)
    if local_cap and budget_bytes >= local_cap * (bytes_per_block + local_bytes_per_block):
        by_memory = (budget_bytes - local_cap * local_bytes_per_block) // max(1, bytes_per_block)
    else:
        by_memory = budget_bytes // max(1, bytes_per_block + local_bytes_per_block)
    return int(min(by_memory, per_seq * max_num_seqs))


def sliding_window_layers(specs, layers: range, sliding_window: int | None) -> set[int]:
    """The layers of `layers` whose KV lives in the sliding-window group."""
    if sliding_window is None:
        return set()
    return {i for i in layers if specs[i].sliding_window is not None}


def kv_bytes_per_block(
    specs, layers: range, local: set[int], block_size: int, dtype: torch.dtype
) -> tuple[int, int]:
    """Bytes of one block over the full-attention layers, and over the sliding-window ones."""
    sizes = [0, 0]
    for i in layers:
        sizes[i in local] += 2 * block_size * specs[i].num_kv_heads * specs[i].head_dim
    return sizes[0] * dtype.itemsize, sizes[1] * dtype.itemsize


def allocate_kv_caches(
    specs,
    layers: range,
    local: set[int],
    num_blocks: int,
    num_local_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor | None]:
    """One tensor per layer of `layers` (None elsewhere); sliding-window layers get
    `num_local_blocks` + the null block."""
    caches: list[torch.Tensor | None] = [None] * len(specs)
    for i in layers:
        n = num_local_blocks + 1 if i in local else num_blocks
        caches[i] = new_kv_tensor(
            n, block_size, specs[i].num_kv_heads, specs[i].head_dim, dtype, device
        )
    return caches
