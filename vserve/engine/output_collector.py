"""`OutputCollector`: one request's pending outputs between `AsyncLLM`'s output handler and
the consumer of its stream, held as at most one item (vLLM's `RequestOutputCollector`).

A consumer that stops reading (an SSE client that does not read its socket) therefore pins
one output, however long its request runs: a new DELTA output is merged into the pending one
(texts, token ids and logprobs appended per choice; finish reasons from the newer), a
CUMULATIVE or FINAL_ONLY output replaces it, and an error replaces whatever was pending.
"""

from __future__ import annotations

import asyncio

from vserve.engine.output_processor import OutputKind
from vserve.outputs import CompletionOutput, RequestOutput

Item = RequestOutput | BaseException


class OutputCollector:
    def __init__(self, kind: OutputKind) -> None:
        self.kind = kind
        self._item: Item | None = None
        self._ready = asyncio.Event()

    def qsize(self) -> int:
        return 0 if self._item is None else 1

    def put_nowait(self, item: Item) -> None:
        pending = self._item
        if pending is None or isinstance(item, BaseException):
            self._item = item
        elif isinstance(pending, BaseException):
            pass  # the error stands; nothing after it is read
        elif self.kind == OutputKind.DELTA:
            self._item = merge_deltas(pending, item)
        else:
            self._item = item
        self._ready.set()

    async def get(self) -> Item:
        while self._item is None:
            self._ready.clear()
            await self._ready.wait()
        item, self._item = self._item, None
        return item


def merge_deltas(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """Two DELTA outputs of one request as one: what `old` carried, then what `new` adds."""
    by_index = {c.index: c for c in old.outputs}
    for c in new.outputs:
        prev = by_index.get(c.index)
        by_index[c.index] = c if prev is None else _merge_choice(prev, c)
    outputs = [by_index[i] for i in sorted(by_index)]
    return RequestOutput(
        new.request_id,
        new.prompt,
        new.prompt_token_ids,
        outputs,
        new.finished,
        new.num_cached_tokens,
        new.metrics,
        old.prompt_logprobs or new.prompt_logprobs,
    )


def _merge_choice(old: CompletionOutput, new: CompletionOutput) -> CompletionOutput:
    logprobs = None
    if old.logprobs is not None or new.logprobs is not None:
        logprobs = (old.logprobs or []) + (new.logprobs or [])
    return CompletionOutput(
        new.index,
        old.text + new.text,
        old.token_ids + new.token_ids,
        new.cumulative_logprob,
        logprobs,
        new.finish_reason,
        new.stop_reason,
    )
