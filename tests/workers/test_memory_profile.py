"""The memory profile that sizes the KV cache on CUDA, without a GPU: the dummy batches, the
budget's arithmetic, the runner's dummy steps (a forward of the step's most tokens, sampling
at temperature 1 for `max_num_seqs` rows, over a scratch cache it frees), and the Triton
variants those steps compile: a warmed runner meets new batch sizes and lengths with none."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (see tests/models/test_triton_kernels.py)

from vserve.models.hf_config import load_hf_config
from vserve.workers.kv_cache import allocate_kv_caches
from vserve.workers.memory_profile import (
    DummyBatch,
    dummy_host_inputs,
    dummy_sampling,
    kv_budget,
    profile_batches,
    scratch_blocks,
)
from vserve.workers.model_runner import ModelRunner
from vserve.workers.runner_config import RunnerConfig


def test_the_largest_step_spends_the_token_budget_in_the_fewest_rows():
    largest, *warm = profile_batches(2048, 256, 1024)
    assert largest.q_lens == largest.ctx_lens == (1024, 1024)
    assert profile_batches(100, 4, 64)[0].q_lens == (50, 50)
    assert profile_batches(4096, 2, 512)[0].q_lens == (512, 512)  # rows x length caps it
    assert profile_batches(8, 256, 32768)[0].q_lens == (8,)
    # the warm-up batches: mixed and decode, small and full, at a context long enough to
    # split and at a short one
    assert [b.q_lens for b in warm] == [(8, 1), (8, 1), (1,), (1,) * 256, (1,) * 256]
    assert [max(b.ctx_lens) for b in warm] == [1024, 8, 1024, 1024, 1]
    assert max(c for b in profile_batches(8, 4, 32768) for c in b.ctx_lens) == 4096


def test_kv_budget_leaves_the_step_its_peak():
    gib = 1024**3
    assert kv_budget(80 * gib, 0.9, 10 * gib, 2 * gib) == 60 * gib
    assert kv_budget(80 * gib, 0.5, 39 * gib, 2 * gib) == 0  # never negative


def test_dummy_inputs_point_every_row_at_the_same_scratch_blocks():
    batch = DummyBatch("b", (3, 1), (10, 7))
    host = dummy_host_inputs(batch, 4)
    assert host.query_start_loc.tolist() == [0, 3, 4]
    assert host.num_computed.tolist() == [7, 6] and host.seq_lens.tolist() == [10, 7]
    assert host.positions.tolist() == [7, 8, 9, 6]
    assert host.block_tables.tolist() == [[0, 1, 2], [0, 1, 2]]  # slot = position
    assert host.host_tokens.tolist() == [0, 0, 0, 0]
    assert scratch_blocks([batch], 4) == 4  # every slot a table names exists


def test_the_costliest_sampling_copies_what_real_requests_copy():
    plain, costly = dummy_sampling(3), dummy_sampling(3, costliest=True)
    assert set(plain.temperature) == set(costly.temperature) == {1.0}
    assert not any(plain.logit_bias) and plain.prompt_ids is None
    for meta in (plain, costly):  # filtered rows and plain ones: both sampling kernels run
        assert meta.top_k == [50, 0, 50] and meta.top_p == [0.9, 1.0, 0.9]
    assert set(costly.num_logprobs) == {20} and costly.needs_penalties
    assert len(costly.prompt_ids) == len(costly.output_ids) == 3


def _runner(path, backend="torch", max_model_len=64, tokens=40):
    config = RunnerConfig(
        model_path=path,
        dtype="float32",
        max_model_len=max_model_len,
        max_num_seqs=3,
        block_size=4,
        max_num_batched_tokens=tokens,
        attention_backend=backend,
    )
    runner = ModelRunner(config, load_hf_config(path))
    runner.load_model()
    return runner


@pytest.mark.parametrize("kind", ["llama", "gemma3"])  # gemma3: sliding-window layers
def test_profile_run_steps_the_largest_batch_and_samples_every_row(tiny_model_dir, kind):
    runner = _runner(tiny_model_dir(kind))
    forwards, sampled = [], []
    model_forward, sampler = runner.model.forward, runner.step_sampler.sampler

    def forward(first, positions, kv_caches, meta, backend):
        forwards.append(meta.num_tokens)
        assert all(c is None or c.shape[1] == 17 for c in kv_caches)  # scratch: 64 / 4 + 1
        return model_forward(first, positions, kv_caches, meta, backend)

    class SpySampler:
        def __call__(self, logits, meta):
            sampled.append((logits.shape[0], set(meta.temperature), bool(any(meta.logit_bias))))
            return sampler(logits, meta)

    runner.model.forward = forward  # nn.Module's call runs the instance's forward
    runner.step_sampler.sampler = SpySampler()
    assert runner.profile_run() == 0  # the CPU keeps no allocator peak
    assert forwards == [40, 9, 9, 1, 3, 3]  # the largest step, then the warm-ups
    # every row sampled at temperature 1: the largest step the costliest way, then plain
    assert sampled == [(3, {1.0}, True)] + [(3, {1.0}, False)] * 5
    assert runner.kv_caches == []  # the scratch is gone; the cache is sized after


@pytest.mark.slow  # the Triton interpreter over a tiny model's layer
def test_a_warmed_runner_meets_new_batches_with_no_new_variant(tiny_model_dir, monkeypatch):
    pytest.importorskip("triton")
    from vserve.csrc_triton import paged_attention as pa
    from vserve.csrc_triton.kv_write import _kv_write_kernel
    from vserve.csrc_triton.variants import VariantCounter

    # a device of 8 multiprocessors, and segments of 64 keys at least: small batches split
    # their keys, as on a GPU, at contexts the interpreter runs quickly; the largest step
    # splits too, so only a short warm-up batch compiles the unsplit mixed tile
    monkeypatch.setattr(pa, "_multiprocessors", lambda device: 8)
    monkeypatch.setattr(pa, "MIN_KEYS_PER_SPLIT", 64)
    # one layer: every layer launches the same variants, and each costs the interpreter seconds
    model = tiny_model_dir("llama", num_hidden_layers=1)
    runner = _runner(model, "triton", max_model_len=140, tokens=140)
    counter = VariantCounter(
        {
            "paged_attention": pa._paged_attention_kernel,
            "merge_splits": pa._merge_splits_kernel,
            "kv_write": _kv_write_kernel,
        }
    )
    runner.profile_run()
    warmed = counter.counts()
    assert warmed["merge_splits"] == 1 and warmed["paged_attention"] == 4, warmed
    batches = [
        DummyBatch("decode x2", (1, 1), (60, 37)),
        DummyBatch("mixed x3", (5, 1, 1), (110, 30, 140)),
        DummyBatch("decode x3, long", (1, 1, 1), (140, 129, 139)),
        DummyBatch("prefill", (29,), (29,)),
    ]
    n = scratch_blocks(batches, 4)
    layers, local = runner._kv_layers()
    scratch = allocate_kv_caches(
        runner.model.layer_specs, layers, local, n, n, 4, torch.float32, torch.device("cpu")
    )
    for batch in batches:
        runner._dummy_step(batch, scratch, dummy_sampling(3))
    assert counter.counts() == warmed


def test_the_profile_samplings_meet_every_sampling_variant():
    pytest.importorskip("triton")
    from vserve.csrc_triton.sample import _sample_kernel
    from vserve.csrc_triton.sample_filtered import _sample_filtered_kernel
    from vserve.csrc_triton.variants import VariantCounter
    from vserve.workers.sampler import Sampler

    counter = VariantCounter({"plain": _sample_kernel, "filtered": _sample_filtered_kernel})
    sampler = Sampler(triton=True)  # the CUDA path, interpreted
    logits = torch.randn(8, 96).to(torch.bfloat16)
    for costliest in (True, False):  # what the profile run samples
        sampler(logits[:3], dummy_sampling(3, costliest))
    warmed = counter.counts()
    assert warmed == {"plain": 2, "filtered": 2}, warmed  # over raw bf16 and an fp32 copy each
    # requests as they come: other batch sizes, a greedy row, a filter or a bias alone
    greedy, top_p_only, bias_only, min_p_biased = (dummy_sampling(n) for n in (2, 5, 4, 1))
    greedy.temperature[1] = 0.0
    top_p_only.top_k = [0] * 5
    bias_only.top_k, bias_only.top_p = [0] * 4, [1.0] * 4
    bias_only.logit_bias = [{7: -3.0}] * 4
    min_p_biased.top_k, min_p_biased.top_p, min_p_biased.min_p = [0], [1.0], [0.1]
    min_p_biased.logit_bias = [{1: 2.0}]
    for meta in (greedy, top_p_only, bias_only, min_p_biased):
        sampler(logits[: len(meta.temperature)], meta)
    assert counter.counts() == warmed
