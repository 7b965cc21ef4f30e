"""Slow readers pin at most one output per request: the engine's
per-request collector merges DELTA outputs while nobody reads, and the server's merge of a
batch's streams is bounded, so a client that stops reading holds a constant number of items
however many tokens its requests generate."""

from __future__ import annotations

import asyncio

from vserve.engine.output_collector import OutputCollector
from vserve.engine.output_processor import RequestState
from vserve.entrypoints.openai.serving_base import ServerContext, iterate
from vserve.outputs import CompletionOutput, Logprob, OutputKind, RequestOutput
from vserve.sampling_params import SamplingParams


def _out(
    index: int, text: str, ids: list[int], finish: str | None = None, logprobs: bool = False
) -> RequestOutput:
    lps = [{t: Logprob(-1.0)} for t in ids] if logprobs else None
    choice = CompletionOutput(index, text, ids, -float(len(ids)), lps, finish)
    return RequestOutput("r", "p", [1], [choice], finish is not None)


def test_deltas_merge_per_choice():
    async def run():
        c = OutputCollector(OutputKind.DELTA)
        c.put_nowait(_out(0, "a", [1], logprobs=True))
        c.put_nowait(_out(1, "x", [7], logprobs=True))
        c.put_nowait(_out(0, "b", [2], logprobs=True))
        c.put_nowait(_out(0, "c", [3], "length", logprobs=True))
        assert c.qsize() == 1
        merged = await c.get()
        assert c.qsize() == 0
        return merged

    merged = asyncio.run(run())
    first, second = merged.outputs
    assert (first.index, first.text, first.token_ids, first.finish_reason) == (
        0,
        "abc",
        [1, 2, 3],
        "length",
    )
    assert [list(e) for e in first.logprobs] == [[1], [2], [3]]
    assert (second.index, second.text, second.token_ids) == (1, "x", [7])
    assert merged.finished


def test_cumulative_replaces_and_error_wins():
    async def run():
        c = OutputCollector(OutputKind.CUMULATIVE)
        c.put_nowait(_out(0, "a", [1]))
        c.put_nowait(_out(0, "ab", [1, 2]))
        latest = await c.get()
        d = OutputCollector(OutputKind.DELTA)
        d.put_nowait(_out(0, "a", [1]))
        d.put_nowait(RuntimeError("dead"))
        d.put_nowait(_out(0, "b", [2]))
        return latest, await d.get()

    latest, error = asyncio.run(run())
    assert latest.outputs[0].text == "ab"
    assert isinstance(error, RuntimeError)


def test_get_waits_for_put():
    async def run():
        c = OutputCollector(OutputKind.DELTA)
        getter = asyncio.ensure_future(c.get())
        await asyncio.sleep(0)
        assert not getter.done()
        c.put_nowait(_out(0, "a", [1]))
        return await asyncio.wait_for(getter, 5)

    assert asyncio.run(run()).outputs[0].text == "a"


class _FakeEngine:
    """The two AsyncLLM methods the server's `iterate` uses."""

    async def stream(self, state: RequestState):
        while True:
            item = await state.queue.get()
            yield item
            if item.finished:
                return

    def abort_nowait(self, request_id: str) -> None:
        pass


def test_batch_merge_is_bounded():
    """Two prompts' streams merged for one client who reads one item and then stops: while
    500 outputs per prompt arrive, what is pending stays a handful of (merged) items; before,
    the server's merge queue took every output (about 1000 items). Nothing is lost."""
    num_steps = 500

    async def run() -> tuple[int, list[str]]:
        ctx = ServerContext(_FakeEngine(), ["m"])
        states = [
            RequestState(
                f"r{i}",
                None,
                [1],
                SamplingParams(),
                OutputKind.DELTA,
                {},
                0.0,
                queue=OutputCollector(OutputKind.DELTA),
            )
            for i in range(2)
        ]
        for s in states:
            s.queue.put_nowait(_out(0, "", []))
        merged = iterate(ctx, states)
        texts = ["", ""]
        index, out = await merged.__anext__()
        texts[index] += out.outputs[0].text
        for step in range(num_steps):
            for s in states:
                finish = "length" if step == num_steps - 1 else None
                s.queue.put_nowait(_out(0, "t", [step], finish))
            await asyncio.sleep(0)  # the merge's pumps run here
        num_items = 0
        async for index, out in merged:
            num_items += 1
            texts[index] += out.outputs[0].text
        return num_items, texts

    num_items, texts = asyncio.run(run())
    assert texts == ["t" * num_steps] * 2
    assert num_items <= 8, f"{num_items} outputs were pending for a reader that stopped"


def test_engine_request_pins_one_output(tiny_model_dir):
    """A real engine: a 200-token request that nobody reads until it finished holds one merged
    output (before: one queued output per step, about 200), with every token in it."""
    from vserve.engine.arg_utils import EngineArgs
    from vserve.engine.async_llm import AsyncLLM

    async def run():
        engine = AsyncLLM.from_engine_args(
            EngineArgs(
                model=tiny_model_dir("llama"),
                dtype="float32",
                max_model_len=512,
                num_gpu_blocks_override=256,
            )
        )
        try:
            params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
            state = await engine.add_request({"prompt_token_ids": [2, 5, 6]}, params, "slow")
            pending = []
            for _ in range(1200):  # up to 60 s
                pending.append(state.queue.qsize())
                if state.finished:
                    break
                await asyncio.sleep(0.05)
            out = await asyncio.wait_for(state.queue.get(), 10)
            return state.finished, max(pending), out
        finally:
            engine.shutdown()

    finished, most_pending, out = asyncio.run(run())
    assert finished, "the request did not finish within 60 s"
    assert most_pending <= 1
    assert len(out.outputs[0].token_ids) == 200 and out.finished


def test_merging_for_a_reader_that_never_reads_is_linear():
    """Thousands of deltas merged while nobody reads: ids and logprobs extend in place,
    texts wait as parts joined every MAX_PARTS (never the whole text copied per step), and
    what the reader finally gets is exact."""
    from vserve.engine.output_collector import _Merged

    async def run():
        c = OutputCollector(OutputKind.DELTA)
        for i in range(5000):
            c.put_nowait(_out(0, "ab", [i], logprobs=True))
            assert len(c._merged.texts.get(0, [])) <= _Merged.MAX_PARTS + 1
        return await c.get()

    merged = asyncio.run(run())
    (choice,) = merged.outputs
    assert choice.text == "ab" * 5000 and choice.token_ids == list(range(5000))
    assert [next(iter(e)) for e in choice.logprobs] == list(range(5000))
