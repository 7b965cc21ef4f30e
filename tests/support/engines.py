"""Engines for tests: an in-process LLM and greedy runs with logprobs for exact comparisons."""


def make_llm(model_dir, **kwargs):
    """An in-process engine with the model runner in this process: fast to start, and its
    scheduler can be inspected (`llm.engine.client.core`)."""
    from vserve import LLM

    kwargs.setdefault("multiprocess", False)
    kwargs.setdefault("distributed_executor_backend", "uni")
    kwargs.setdefault("dtype", "float32")
    return LLM(model_dir, **kwargs)


def greedy_with_logprobs(llm, prompts, max_tokens: int, one_at_a_time: bool = False):
    """Greedy token ids and every top-3 logprob per prompt (token-id lists), for exact
    comparisons between engines; `one_at_a_time` runs each prompt alone (batch 1 decode)."""
    from vserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=3, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    outs = (
        [llm.generate([r], sp, use_tqdm=False)[0] for r in requests]
        if one_at_a_time
        else llm.generate(requests, sp, use_tqdm=False)
    )
    return [
        (
            o.outputs[0].token_ids,
            [{t: lp.logprob for t, lp in e.items()} for e in o.outputs[0].logprobs],
        )
        for o in outs
    ]


def assert_worker_drained(engine) -> None:
    """For an in-process engine whose front end has no request left: its engine core holds none
    either (every abort the front end sent was applied), and once it has run the step that tells
    the worker of the last finished requests, the worker holds no batch row."""
    core = engine.client.core
    assert not core.scheduler.requests, sorted(core.scheduler.requests)
    while core.has_work():  # finished ids ride on the next step
        engine.step()
    batch = core.executor.worker.runner.batch
    assert not batch.row_of, batch.row_of
