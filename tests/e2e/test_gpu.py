"""End-to-end checks that need a CUDA device: the Triton backend equals the torch backend,
CUDA-graph decode equals eager, async equals sync, and the fused input preparation equals
the torch path. Every test is marked `gpu` (run them with `pytest -m gpu`) and skipped
without CUDA.

fp32 throughout: in bf16 the two backends, or a padded graph batch and an eager one, round
differently (other kernels, other cuBLAS shapes), which can flip a near-tied greedy choice,
so bf16 token equality would test luck rather than the code. The tiny models keep top-2
logit gaps far above fp32 rounding.
"""

import pytest
import torch

from tests.support.engines import make_llm
from tests.support.hf_reference import PROMPTS
from tests.support.prep_cases import assert_same_inputs, build_both, random_case
from vserve import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ENGINE = {"device": "cuda", "dtype": "float32", "max_model_len": 256, "max_num_seqs": 16}
# staggered lengths: the decode batch shrinks 6 -> 1, so several graph sizes replay and the
# padding rows of a smaller batch were real rows of a larger one
MIXED = [
    SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 5, 17, 9, 30, 13)
]


def _runner(llm):
    return llm.engine.client.core.executor.runner


def _greedy(llm, params=MIXED, prompts=PROMPTS[:6]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen3", "gemma3"])
def test_triton_backend_equals_torch_backend(tiny_model_dir, kind):
    common = dict(ENGINE, enforce_eager=True, max_num_batched_tokens=24)  # chunked prefill
    want = _greedy(make_llm(tiny_model_dir(kind), attention_backend="torch", **common))
    got = _greedy(make_llm(tiny_model_dir(kind), attention_backend="triton", **common))
    assert got == want


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("async_on", [True, False])
def test_cuda_graphs_equal_eager(tiny_model_dir, kind, async_on):
    eager = make_llm(tiny_model_dir(kind), enforce_eager=True, async_scheduling=async_on, **ENGINE)
    assert _runner(eager).graphs is None
    want = _greedy(eager)
    graphed = make_llm(tiny_model_dir(kind), async_scheduling=async_on, **ENGINE)
    graphs = _runner(graphed).graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16]
    assert _greedy(graphed) == want
    assert graphs.num_replays > 0


def test_async_equals_sync_on_cuda(tiny_model_dir):
    want = _greedy(make_llm(tiny_model_dir("llama"), async_scheduling=False, **ENGINE))
    llm = make_llm(
        tiny_model_dir("llama"), async_scheduling=True, max_num_batched_tokens=16, **ENGINE
    )
    runner = _runner(llm)
    runner.poison_feedback_slots = True  # fed-back ids must come from the device
    llm.engine.take_step_records()
    assert _greedy(llm) == want
    assert runner.feedback_stats["fused"] > 0 and runner.feedback_stats["rows"] > 0
    # every step's forward timed on the device too (events), for the overlap report
    steps = [r for r in llm.engine.take_step_records() if r.num_tokens]
    assert steps and all(0 < r.device_forward < 1 for r in steps)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize("local", [False, True], ids=["one-group", "sliding-group"])
def test_fused_prep_equals_torch_prep_on_cuda(seed, decode_only, local):
    host, plan, prev = random_case(seed, decode_only, num_reqs=40, block_size=16, local=local)
    (torch_out, _), (fused_out, _) = build_both(host, plan, prev, "cuda")
    assert fused_out.input_ids.is_cuda
    assert_same_inputs(torch_out, fused_out, host, plan, prev)


MIXED_SAMPLING = [  # one request of each kind the sampling path treats differently
    dict(temperature=0),  # greedy
    dict(temperature=1.0),  # plain random
    dict(temperature=0.8, top_k=20, top_p=0.9),  # filtered
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2),
    dict(temperature=0.7, logit_bias={5: 3.0, 7: -2.0}),
    dict(temperature=0, min_tokens=20),
    dict(temperature=1.0, logprobs=3),
]


@pytest.mark.parametrize("async_on", [True, False])
def test_mixed_batch_decode_steps_never_sync_the_host(tiny_model_dir, async_on):
    """Every decode step of a batch mixing greedy, temperature, top-k/p, min-p, penalties,
    logit_bias, min_tokens, logprobs and a grammar request runs under
    `torch.cuda.set_sync_debug_mode("error")`: any synchronizing call (a pageable or blocking
    copy, `.item()` or `.tolist()` of a device tensor, a shape read from device data) raises
    inside the step, and the run must generate what the same run unguarded generates."""
    pytest.importorskip("xgrammar")
    from vserve import StructuredOutputsParams

    llm = make_llm(tiny_model_dir("llama"), async_scheduling=async_on, **ENGINE)
    runner = _runner(llm)
    params = [
        SamplingParams(max_tokens=24, ignore_eos=True, seed=i, **kw)
        for i, kw in enumerate(MIXED_SAMPLING)
    ]
    params.append(
        SamplingParams(
            max_tokens=24,
            temperature=0,
            structured_outputs=(StructuredOutputsParams(regex="(yes|no|maybe)( [0-9]+)+")),
        )
    )
    prompts = PROMPTS[:1] * len(params)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    checked = []

    def guarded(fn, is_decode):
        def call(*args, **kwargs):
            if not is_decode(*args) or len(checked) < 2:  # (two decode steps to warm up)
                checked.append(None)
                return fn(*args, **kwargs)
            torch.cuda.synchronize()  # earlier work is not this step's
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            checked.append(fn.__name__)
            return out

        return call

    runner.execute_model = guarded(
        runner.execute_model,
        lambda so, *rest: (
            set(so.num_scheduled_tokens.values()) == {1} and len(so.num_scheduled_tokens) > 1
        ),
    )
    runner.sample_tokens = guarded(runner.sample_tokens, lambda *args: True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert sum(name == "execute_model" for name in checked) >= 10, checked
    assert [o.outputs[0].token_ids for o in outs] == want
    assert outs[7].outputs[0].logprobs and len(outs[-1].outputs[0].token_ids) > 0
