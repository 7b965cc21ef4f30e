"""KV memory follows use: the CPU KV cache commits a block's pages when a step first writes
it, so its resident memory grows with the blocks in use, not with the budget; and the default
budget is what `max_num_seqs` x `max_model_len` can use.

Resident pages are read from /proc/self/pagemap (bit 63: page present), exactly for the
tensor's address range: no timing, no whole-process RSS noise."""

from __future__ import annotations

import os
import struct
import sys

import pytest
import torch

from tests.support.engines import make_llm
from vserve import SamplingParams
from vserve.workers.kv_cache import new_kv_tensor, num_blocks_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes(t: torch.Tensor) -> int:
    start = t.data_ptr() // PAGE
    end = -(-(t.data_ptr() + t.untyped_storage().nbytes()) // PAGE)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start * 8)
        entries = struct.unpack(f"<{end - start}Q", f.read((end - start) * 8))
    return sum(e >> 63 for e in entries) * PAGE


def test_kv_tensor_commits_pages_on_first_write():
    # 4096 blocks x 8 KiB per block, keys and values: 64 MiB of budget
    t = new_kv_tensor(4096, 16, 2, 64, torch.float32, torch.device("cpu"))
    block_bytes = t[0, 0].nbytes
    assert resident_bytes(t) == 0
    t[:, :10] = 1.0  # a step writes 10 blocks of keys and values
    touched = resident_bytes(t)
    assert 2 * 10 * block_bytes <= touched <= 2 * 10 * block_bytes + 4 * 1024**2  # (+ THP)
    t[:, 10:20] = 2.0
    assert resident_bytes(t) >= touched + 2 * 10 * block_bytes  # grows with the blocks
    assert resident_bytes(t) < t.nbytes // 4
    assert bool((t[:, 20:30] == 0).all())  # unwritten blocks read as zeros


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="the KV mapping is named on Linux")
def test_kv_resident_bytes_reads_the_cache_from_proc():
    """The cache's mappings are named, so its resident share of a process is readable from
    outside (the soak benchmark tells KV pages from a leak this way)."""
    from vserve.startup import kv_resident_bytes

    before = kv_resident_bytes(os.getpid())
    t = new_kv_tensor(1024, 16, 2, 64, torch.float32, torch.device("cpu"))
    assert kv_resident_bytes(os.getpid()) == before  # nothing written yet
    t[:, :32] = 1.0
    assert kv_resident_bytes(os.getpid()) - before == resident_bytes(t) >= 2 * 32 * t[0, 0].nbytes
    assert kv_resident_bytes(2**22 + 7) == 0  # no such process


def test_engine_kv_resident_grows_with_blocks_in_use(tiny_model_dir):
    llm = make_llm(
        tiny_model_dir("llama"), max_model_len=1024, block_size=16, num_gpu_blocks_override=4096
    )
    runner = llm.engine.client.core.executor.worker.runner
    caches = [c for c in runner.kv_caches if c is not None]
    budget = sum(c.nbytes for c in caches)
    per_block = sum(c[:, 0].nbytes for c in caches)  # every layer's keys and values
    assert sum(resident_bytes(c) for c in caches) == 0
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(3, 43))}], sp, use_tqdm=False)
    short = sum(resident_bytes(c) for c in caches)
    # 48 tokens: 3 blocks (pages are shared by neighbouring blocks, so at most 4 per layer)
    assert 0 < short <= 4 * per_block + len(caches) * 2 * PAGE
    llm.generate([{"prompt_token_ids": [5 + i % 300 for i in range(700)]}], sp, use_tqdm=False)
    long = sum(resident_bytes(c) for c in caches)
    assert long >= short + 40 * per_block  # 44 more blocks were written
    assert long <= (3 + 45 + 2) * per_block + len(caches) * 2 * PAGE
    assert long < budget // 20


def test_default_budget_is_what_the_batch_can_use():
    # 64 sequences of 8192 tokens in blocks of 16: 32768 blocks, whatever the 4 GiB allows
    assert num_blocks_for(1024, 4 * 1024**3, 64, 8192, 16) == 64 * 512
    assert num_blocks_for(1024 * 1024, 4 * 1024**3, 64, 8192, 16) == 4096  # the ceiling
    assert num_blocks_for(1024, 10 * 1024, 64, 8192, 16) == 10  # kv_cache_memory_bytes


def test_cpu_defaults(tiny_model_dir):
    from vserve.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=tiny_model_dir("llama"), device="cpu").create_engine_config()
    assert cfg.scheduler.max_num_seqs == 64
    assert cfg.model.max_model_len == 1024  # the tiny model's limit is below 8192
    cfg = EngineArgs(
        model=tiny_model_dir("llama", max_position_embeddings=32768), device="cpu"
    ).create_engine_config()
    assert cfg.model.max_model_len == 8192
    cfg = EngineArgs(
        model=tiny_model_dir("llama", max_position_embeddings=32768),
        device="cpu",
        max_model_len=16384,
        max_num_seqs=256,
    ).create_engine_config()
    assert (cfg.model.max_model_len, cfg.scheduler.max_num_seqs) == (16384, 256)


def test_uncached_blocks_are_reused_first(tiny_model_dir):
    """Without prefix caching a freed block holds nothing worth keeping: the pool hands it out
    again before a block no step has written, so resident memory stays at the peak in use
    instead of creeping through the whole budget request after request."""
    llm = make_llm(
        tiny_model_dir("llama"),
        max_model_len=1024,
        block_size=16,
        num_gpu_blocks_override=4096,
        enable_prefix_caching=False,
    )
    runner = llm.engine.client.core.executor.worker.runner
    caches = [c for c in runner.kv_caches if c is not None]
    per_block = sum(c[:, 0].nbytes for c in caches)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(6):  # 6 requests of 308 tokens (20 blocks) one after the other
        llm.generate(
            [{"prompt_token_ids": [5 + (i + j) % 300 for j in range(300)]}], sp, use_tqdm=False
        )
    resident = sum(resident_bytes(c) for c in caches)
    assert resident <= 22 * per_block + len(caches) * 2 * PAGE, resident / per_block
