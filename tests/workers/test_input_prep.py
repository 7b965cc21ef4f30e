"""The fused input preparation (one Triton launch, CUDA's path) builds exactly what the
numpy/torch path builds, here on CPU under the Triton interpreter: strategy against strategy
on random steps, then a whole engine run with the fused path swapped into the runner."""

import pytest

from tests.support.engines import make_llm
from tests.support.hf_reference import PROMPTS
from tests.support.prep_cases import assert_same_inputs, build_both, random_case
from vserve import SamplingParams
from vserve.workers.input_prep import FusedInputPrep

pytest.importorskip("triton")


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize("local", [False, True], ids=["one-group", "sliding-group"])
def test_fused_prep_equals_torch_prep(seed, decode_only, local):
    host, plan, prev = random_case(seed, decode_only, local=local)
    (torch_out, torch_stats), (fused_out, fused_stats) = build_both(host, plan, prev, "cpu")
    assert_same_inputs(torch_out, fused_out, host, plan, prev)
    path = "slice" if decode_only else "scatter"
    assert torch_stats[path] == 1 and fused_stats["fused"] == 1
    assert torch_stats["rows"] == fused_stats["rows"] == len(plan.rows)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_engine_with_fused_prep_equals_sync(tiny_model_dir, kind):
    """Async, chunked prefill, poisoned host copies: every fed-back id must come through the
    fused kernel's feedback merge, and the tokens equal a sync run's. Gemma 3 adds a
    sliding-window KV group (its own tables and slots), which the fused path once refused."""
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 3, 8)]
    ref = make_llm(tiny_model_dir(kind), max_model_len=128, async_scheduling=False)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS[:3], greedy, use_tqdm=False)]
    llm = make_llm(tiny_model_dir(kind), max_model_len=128, max_num_batched_tokens=16)
    runner = llm.engine.client.core.executor.runner
    runner.input_prep = prep = FusedInputPrep(runner.shim)
    runner.feedback_stats = prep.stats
    groups = []
    build = prep.build
    prep.build = lambda host, *rest: (
        groups.append(host.local_block_tables is not None) or build(host, *rest)
    )
    runner.poison_feedback_slots = True
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], greedy, use_tqdm=False)]
    assert got == want
    assert runner.feedback_stats["fused"] > 0 and runner.feedback_stats["rows"] > 0
    assert all(groups) if kind == "gemma3" else not any(groups)
