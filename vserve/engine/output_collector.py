"""`OutputCollector`: one request's pending outputs between `AsyncLLM`'s output handler and
the consumer of its stream, held as at most one item (vLLM's `RequestOutputCollector`).

A consumer that stops reading (an SSE client that does not read its socket) therefore pins
one output, however long its request runs: a new DELTA output is merged into the pending one
(texts, token ids and logprobs appended per choice, in place; finish reasons from the newer), a
CUMULATIVE or FINAL_ONLY output replaces it, and an error replaces whatever was pending.
"""

from __future__ import annotations

import asyncio

from vserve.outputs import CompletionOutput, OutputKind, RequestOutput

Item = RequestOutput | BaseException


class OutputCollector:
    def __init__(self, kind: OutputKind) -> None:
        self.kind = kind
        self._item: Item | None = None
        self._merged = _Merged()
        self._ready = asyncio.Event()

    def qsize(self) -> int:
        return 0 if self._item is None else 1

    def put_nowait(self, item: Item) -> None:
        pending = self._item
        if isinstance(pending, BaseException):
            pass  # the error stands; nothing after it is read
        elif (
            pending is not None
            and self.kind == OutputKind.DELTA
            and isinstance(item, RequestOutput)
        ):
            self._merged.add(pending, item)
        else:  # the first item, an error, or a CUMULATIVE or FINAL_ONLY output: it replaces
            self._item, self._merged = item, _Merged()
        self._ready.set()

    async def get(self) -> Item:
        while self._item is None:
            self._ready.clear()
            await self._ready.wait()
        item, self._item = self._item, None
        if isinstance(item, RequestOutput):
            self._merged.finish(item)
        self._merged = _Merged()
        return item


class _Merged:
    """DELTA outputs merged into the pending one in place, in time linear in what they
    carry: token ids and logprobs extend its lists, texts wait as parts (joined every
    `MAX_PARTS`, and when read), so a reader that never reads costs no quadratic copying."""

    MAX_PARTS = 256

    def __init__(self) -> None:
        self.texts: dict[int, list[str]] = {}  # choice index -> its text's parts

    def add(self, old: RequestOutput, new: RequestOutput) -> None:
        by_index = {c.index: c for c in old.outputs}
        for c in new.outputs:
            prev = by_index.get(c.index)
            if prev is None:
                old.outputs.append(c)
                by_index[c.index] = c
                continue
            parts = self.texts.setdefault(c.index, [prev.text])
            parts.append(c.text)
            if len(parts) > self.MAX_PARTS:
                parts[:] = ["".join(parts)]
            _extend(prev, c)
        old.outputs.sort(key=lambda c: c.index)
        old.finished = new.finished
        old.metrics = new.metrics
        old.num_cached_tokens = new.num_cached_tokens
        old.prompt_logprobs = old.prompt_logprobs or new.prompt_logprobs

    def finish(self, item: RequestOutput) -> None:
        for c in item.outputs:
            parts = self.texts.get(c.index)
            if parts is not None:
                c.text = "".join(parts)


def _extend(prev: CompletionOutput, new: CompletionOutput) -> None:
    """`new`'s tokens after `prev`'s (lists the collector owns: made per output)."""
    prev.token_ids = prev.token_ids if isinstance(prev.token_ids, list) else list(prev.token_ids)
    prev.token_ids.extend(new.token_ids)
    if new.logprobs is not None:
        if prev.logprobs is None:
            prev.logprobs = []
        prev.logprobs.extend(new.logprobs)
    prev.cumulative_logprob = new.cumulative_logprob
    prev.finish_reason, prev.stop_reason = new.finish_reason, new.stop_reason
    prev.error_kind = new.error_kind
