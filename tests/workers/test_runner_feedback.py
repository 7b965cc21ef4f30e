"""The worker's on-device token feedback (scenarios 24 and 25): decode tokens come from the
device, not from the host copy; unchanged batches use one slice copy, changed ones a scatter."""

import pytest
import torch

from tests.support.engines import make_llm
from tests.support.hf_reference import PROMPTS
from vserve import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _runner(llm):
    return llm.engine.client.core.executor.runner


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), max_model_len=256, async_scheduling=False)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("async_on", [True, False])
def test_poisoned_host_tokens_do_not_change_outputs(tiny_model_dir, reference, async_on):
    llm = make_llm(
        tiny_model_dir("llama"),
        max_model_len=256,
        async_scheduling=async_on,
        max_num_batched_tokens=16,
    )
    runner = _runner(llm)
    runner.poison_feedback_slots = True
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == reference
    assert runner.feedback_stats["rows"] > 0


@pytest.fixture(scope="module")
def cpu_reference(tiny_model_dir, reference):
    """`reference` on the CPU; where CUDA is available the default device is cuda."""
    if not torch.cuda.is_available():
        return reference
    llm = make_llm(tiny_model_dir("llama"), max_model_len=256, async_scheduling=False, device="cpu")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_poison_is_not_vacuous(tiny_model_dir, cpu_reference, monkeypatch):
    """Without the device scatter the poisoned host tokens reach the model. On the CPU, with
    a CPU reference: `device` defaults to cuda where there is one."""
    llm = make_llm(tiny_model_dir("llama"), max_model_len=256, device="cpu")
    runner = _runner(llm)
    runner.poison_feedback_slots = True
    monkeypatch.setattr(torch.Tensor, "__setitem__", _no_scatter(torch.Tensor.__setitem__))
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got != cpu_reference


def _no_scatter(setitem):
    def patched(self, key, value):
        if (
            self.dtype == torch.int64
            and self.dim() == 1
            and isinstance(value, torch.Tensor)
            and value.dtype == torch.int64
            and _called_from_input_ids()
        ):
            return None
        return setitem(self, key, value)

    return patched


def _called_from_input_ids() -> bool:
    import sys

    frame = sys._getframe(2)
    return frame.f_code.co_name == "_input_ids"


def test_slice_path_for_unchanged_batch_and_scatter_after_condense(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), max_model_len=256)
    runner = _runner(llm)
    same_len = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 3
    llm.generate(PROMPTS[:3], same_len, use_tqdm=False)
    assert runner.feedback_stats["slice"] > 0
    before = dict(runner.feedback_stats)
    # the middle request finishes first: condense moves the last row into its hole
    mixed = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 3, 12)]
    outs = llm.generate(PROMPTS[:3], mixed, use_tqdm=False)
    assert runner.feedback_stats["scatter"] > before["scatter"]
    ref = make_llm(tiny_model_dir("llama"), max_model_len=256, async_scheduling=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in ref.generate(PROMPTS[:3], mixed, use_tqdm=False)
    ]


def test_partial_prefill_rows_are_never_fed_back(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), max_model_len=256, max_num_batched_tokens=5)
    runner = _runner(llm)
    seen = []
    push = runner.feedback.push
    steps = {}
    execute = runner.execute_model

    def spy_execute(so, defer_sampling=False, hidden_in=None):
        steps[so.step_id] = so
        return execute(so, defer_sampling, hidden_in)

    def spy(step_id, batch, rows, req_ids, token_ids, wait_fn=None):
        so = steps[step_id]
        partial = set(so.num_scheduled_tokens) - so.sampling_req_ids
        seen.append((set(req_ids), set(so.sampling_req_ids), partial))
        return push(step_id, batch, rows, req_ids, token_ids, wait_fn)

    runner.execute_model = spy_execute
    runner.feedback.push = spy
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert any(partial for _, _, partial in seen)  # chunks were in flight
    assert all(fed == sampling and not fed & partial for fed, sampling, partial in seen)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
