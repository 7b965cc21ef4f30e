"""The KV cache of one pipeline stage: how many blocks it gets and the tensors that hold them.

Memory follows use on the CPU: each layer's tensor is an anonymous private `mmap`, whose pages
the kernel commits (zero-filled) on the first write. A block costs memory from the step that
first writes it, so resident memory grows with the tokens in the cache, not with the budget.
(`torch.zeros` would write every page at start-up; a plain `torch.empty` would come from the
heap, which the worker's malloc tuning keeps instead of unmapping, so it could hold old data.)
Unwritten slots read as zeros, which the torch backend needs: it gathers whole blocks and masks
by position, and a masked slot still enters `probs @ v` as 0 x value, so it must be finite.
Device memory is allocated and zeroed up front, as before.

| budget (blocks per stage)                 | when                                          |
|-------------------------------------------|-----------------------------------------------|
| `num_gpu_blocks_override`                 | given                                         |
| min(bytes / bytes per block, in-use cap)  | bytes: `kv_cache_memory_bytes`, else the CUDA |
|                                           | memory left, else 4 GiB on CPU (a ceiling)    |

The in-use cap is what the engine can use at once: `max_num_seqs` sequences of
`max_model_len` tokens.
"""

from __future__ import annotations

import math
import mmap

import torch

DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose pages are committed on first write (fresh anonymous mmap)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)   # the tensor keeps `buf` alive


def new_kv_tensor(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[2, num_blocks, block_size, num_kv_heads, head_dim], zeros (keys, then values)."""
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    if device.type == "cpu":
        return lazy_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def num_blocks_for(bytes_per_block: int, budget_bytes: int, max_num_seqs: int,
                   max_model_len: int, block_size: int) -> int:
    """Blocks that fit in `budget_bytes`, at most what `max_num_seqs` full sequences use."""
    per_seq = -(-max_model_len // block_size)
    by_memory = budget_bytes // max(1, bytes_per_block)
    return int(min(by_memory, per_seq * max_num_seqs))
