"""N-gram speculative decoding in the scheduler, with a fake model: outputs equal the plain
run, drafts get accepted on repetitive text, rejected drafts roll back C and PH, and the
invariants hold under preemption and aborts with drafts in flight."""

import random

import pytest

from tests.support.fakes import (
    Driver,
    FakeRunner,
    expected_tokens,
    make_request,
    make_scheduler,
    random_prompt,
)
from vserve.core.request import RequestStatus
from vserve.core.spec_decode import SpeculativeConfig, propose_ngram

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=1)
PERIOD = 6


def test_propose_ngram():
    assert propose_ngram([1, 2, 3, 4, 1, 2], 1, 3, 2) == [3, 4]
    assert propose_ngram([1, 2, 3, 9, 2, 3, 5, 2, 3], 2, 2, 3) == [5, 2, 3]  # most recent
    assert propose_ngram([5, 6, 7], 1, 3, 3) == []
    assert propose_ngram([7, 7], 1, 3, 0) == []


def _reference_ngram(tokens, min_n, max_n, k):
    """The proposer's rule, written as the plain loop over start positions."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        best = []
        for start in range(length - n - 1, -1, -1):
            if k > 0 and tokens[start : start + n] == tokens[length - n :]:
                follow = tokens[start + n : start + n + k]
                if len(follow) == k:
                    return follow
                best = follow if len(follow) > len(best) else best
        if best:
            return best
    return []


def test_propose_ngram_equals_the_plain_loop():
    rng = random.Random(0)
    for _ in range(5000):
        vocab = rng.choice([2, 3, 20, 300, 2**31 - 1])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        if rng.random() < 0.3:
            tokens = tokens[: len(tokens) // 2] * 2 + tokens[: rng.randint(0, 3)]
        lo = rng.randint(1, 4)
        hi, k = rng.randint(lo, 5), rng.randint(0, 5)
        assert propose_ngram(tokens, lo, hi, k) == _reference_ngram(tokens, lo, hi, k), tokens


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_outputs_equal_plain_run_and_drafts_are_accepted(depth):
    rng = random.Random(depth)
    prompts = {f"r{i}": random_prompt(rng, PERIOD) * 2 for i in range(4)}
    sched = make_scheduler(async_scheduling=depth > 1, spec=SPEC, max_model_len=80)
    driver = Driver(sched, FakeRunner(period=PERIOD), depth=depth)
    for k, p in prompts.items():
        driver.add(make_request(k, p, max_tokens=30))
    driver.run()
    for k, p in prompts.items():
        assert driver.outputs[k] == expected_tokens(p, 30, period=PERIOD), k
    stats = sched.spec_stats
    drafts, draft_tokens, accepted = (
        stats.num_drafts,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
    )
    assert drafts > 0 and accepted > 0 and accepted <= draft_tokens
    steps_with_drafts = [so for so in driver.runner.steps if so.spec_token_ids]
    assert steps_with_drafts
    # a request with drafts in flight is never scheduled again before they are verified
    inflight: dict[str, int] = {}
    for so in driver.runner.steps:
        for req_id in so.num_scheduled_tokens:
            assert (
                inflight.get(req_id, -10) < so.step_id - (depth - 1)
                or req_id not in driver.runner.steps[inflight[req_id] - 1].spec_token_ids
            )
        for req_id in so.spec_token_ids:
            inflight[req_id] = so.step_id


def test_max_tokens_is_exact_with_drafts():
    prompt = [3, 4, 5] * 4
    sched = make_scheduler(spec=SPEC)
    driver = Driver(sched, FakeRunner(period=3), depth=2)
    for n in (1, 2, 5, 9):
        driver.add(make_request(f"n{n}", prompt, max_tokens=n))
    driver.run()
    for n in (1, 2, 5, 9):
        assert driver.outputs[f"n{n}"] == expected_tokens(prompt, n, period=3)
    for so in driver.runner.steps:
        for req_id, drafts in so.spec_token_ids.items():
            assert len(drafts) <= SPEC.num_speculative_tokens


def test_rejected_drafts_roll_back_computed_and_placeholders():
    prompt = [1, 2, 3, 4, 5, 6] * 2
    sched = make_scheduler(spec=SPEC)
    runner = FakeRunner(period=PERIOD)  # repeats, but departs now and then: rejections
    driver = Driver(sched, runner, depth=2)
    driver.add(make_request("a", prompt, max_tokens=40))
    seen = False
    while sched.has_requests() or driver.queue:
        driver.step()
        req = sched.requests.get("a")
        if req is not None and not req.inflight_step_ids:
            assert req.num_output_placeholders == 0
            assert req.num_computed_tokens == req.num_tokens - 1  # D == 1 after rollback
            seen = True
    assert seen and driver.outputs["a"] == expected_tokens(prompt, 40, period=PERIOD)
    stats = sched.spec_stats
    drafts, draft_tokens, accepted = (
        stats.num_drafts,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
    )
    assert drafts > 0 and draft_tokens > accepted


@pytest.mark.parametrize("seed", range(6))
def test_invariants_under_preemption_and_abort_with_drafts(seed):
    rng = random.Random(seed)
    sched = make_scheduler(
        num_blocks=14,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=rng.choice([8, 32]),
        max_model_len=48,
        spec=SPEC,
    )
    driver = Driver(sched, FakeRunner(period=PERIOD), depth=rng.choice([1, 2, 3]))
    prompts = {f"r{i}": random_prompt(rng, PERIOD) * rng.randint(1, 3) for i in range(8)}
    max_tokens = {}
    for k, p in prompts.items():
        max_tokens[k] = rng.randint(4, 20)
        driver.add(make_request(k, p, max_tokens=max_tokens[k]))
    aborted = set()

    def on_step(i, drv):
        if rng.random() < 0.04 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
            sched.check_invariants()

    driver.run(on_step=on_step)
    assert sched.num_preemptions > 0  # 14 blocks: every seed preempts
    for k, p in prompts.items():
        expected = expected_tokens(p, max_tokens[k], period=PERIOD, max_model_len=48)
        tokens = driver.outputs[k]
        assert tokens == (expected[: len(tokens)] if k in aborted else expected), k
    assert not driver.emitted_after_finish
    assert sched.kv.pool.num_used_blocks == 0


class _RejectingGrammar:
    """A grammar that accepts `limit` tokens, then rejects (as a buggy mask would let pass)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def accept(self, token_id: int) -> bool:
        self.limit -= 1
        return self.limit >= 0

    def is_terminated(self) -> bool:
        return False


class _Structured:
    def new_state(self, compiled, starts_after=None):
        return _RejectingGrammar(compiled)

    def allocate_bitmask(self, num_rows):
        return [[-1] for _ in range(num_rows)]

    def fill(self, state, bitmask, row):
        pass

    def release(self, compiling):
        pass


def test_grammar_rejection_fails_only_that_request():
    from concurrent.futures import Future

    from vserve.sampling_params import StructuredOutputsParams

    sched = make_scheduler(async_scheduling=True)
    sched.structured = _Structured()
    driver = Driver(sched, depth=2)
    req = make_request(
        "g", [1, 2, 3], max_tokens=10, structured_outputs=StructuredOutputsParams(regex="a+")
    )
    compiled = Future()
    compiled.set_result(3)  # the fake grammar accepts three tokens
    req.grammar_future = compiled
    driver.add(req)
    driver.add(make_request("free", [4, 5, 6], max_tokens=6))
    driver.run()
    assert driver.finish["g"] == "error" and len(driver.outputs["g"]) == 3
    assert driver.outputs["free"] == expected_tokens([4, 5, 6], 6)
    assert sched.kv.pool.num_used_blocks == 0


# -- overlap: only requests whose next step may carry drafts wait for their previous step --------
NO_MATCH = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=2)


def _no_draft_workload(kind: str, rng: random.Random):
    """Requests that get no drafts: random ids with no repeated 2-gram (no match for NO_MATCH),
    or repetitive ones (drafts would be accepted) with penalties or min_tokens still active."""
    if kind == "no-match":
        prompts = {f"r{i}": random_prompt(rng, 8) for i in range(5)}
        for p in prompts.values():
            seq = p + expected_tokens(p, 12)
            bigrams = list(zip(seq, seq[1:]))
            assert len(set(bigrams)) == len(bigrams)  # the premise: no n-gram match at all
        return [make_request(k, p, max_tokens=12) for k, p in prompts.items()]
    reqs = []
    for i in range(4):
        prompt = random_prompt(rng, 3) * 3
        extra = {"repetition_penalty": 1.2} if i % 2 else {"min_tokens": 12}
        reqs.append(make_request(f"{kind}{i}", prompt, max_tokens=12, **extra))
    return reqs


def _steps(spec, kind, depth, period=None):
    sched = make_scheduler(async_scheduling=depth > 1, spec=spec)
    driver = Driver(sched, FakeRunner(period=period), depth=depth)
    for req in _no_draft_workload(kind, random.Random(7)):
        driver.add(req)
    driver.run()
    return driver, [dict(so.num_scheduled_tokens) for so in driver.runner.steps]


@pytest.mark.parametrize(
    "kind, spec, depth, period",
    [("no-match", NO_MATCH, 2, None), ("static", SPEC, 2, 3), ("static", SPEC, 3, 3)],
)
def test_requests_without_drafts_overlap_as_without_spec(kind, spec, depth, period):
    driver, steps = _steps(spec, kind, depth, period)
    plain_driver, plain_steps = _steps(None, kind, depth, period)
    sync_driver, _ = _steps(spec, kind, 1, period)
    assert driver.sched.spec_stats.num_drafts == 0
    assert steps == plain_steps  # the same steps, each request in the same
    assert driver.outputs == plain_driver.outputs == sync_driver.outputs
    assert driver.sched.num_draft_waits == 0


@pytest.mark.parametrize("depth", [2, 3])
def test_a_request_with_drafts_waits_only_for_its_own_previous_step(depth):
    rng = random.Random(3)
    sched = make_scheduler(async_scheduling=True, spec=SPEC, max_model_len=96)
    driver = Driver(sched, FakeRunner(periods={"rep": PERIOD}), depth=depth)
    prompts = {"rep": random_prompt(rng, PERIOD) * 2}
    driver.add(make_request("rep", prompts["rep"], max_tokens=40))
    for i in range(3):  # never draft (penalties): they must be in every step, as without spec
        prompts[f"pen{i}"] = random_prompt(rng, PERIOD) * 2
        driver.add(
            make_request(f"pen{i}", prompts[f"pen{i}"], max_tokens=30, repetition_penalty=1.1)
        )
    driver.run()
    for k, p in prompts.items():
        assert driver.outputs[k] == expected_tokens(
            p, 40 if k == "rep" else 30, period=PERIOD if k == "rep" else None
        )
    assert sched.spec_stats.num_drafts > 0 and sched.spec_stats.num_accepted_tokens > 0
    steps = driver.runner.steps
    for req_id in prompts:
        ids = [so.step_id for so in steps if req_id in so.num_scheduled_tokens]
        gaps = {b - a for a, b in zip(ids, ids[1:])}
        if req_id.startswith("pen"):
            assert gaps == {1}, (req_id, ids)
        else:  # after a step with drafts it skips only the steps scheduled while in flight
            assert max(gaps) <= depth, (req_id, ids)
