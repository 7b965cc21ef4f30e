"""`POST /v1/responses`: OpenAI's Responses API over the chat endpoint (`responses_protocol.py`
maps the request and the result). A stream is the chat stream re-told as the Responses events
(`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`, whose response's status
is `incomplete` when cut at max_output_tokens), each with its `sequence_number`.

`previous_response_id` continues a stored conversation: each response made with `store`
(the default) keeps its input and output messages (not its instructions, as OpenAI's) in a
bounded in-memory store, the least recently used evicted first past STORE_MAX_RESPONSES
responses or STORE_MAX_CHARS characters in all; an id no longer there is a 404. The store
lives as long as the server process.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from vserve.entrypoints.openai.errors import APIError
from vserve.entrypoints.openai.responses_protocol import (
    ResponsesRequest,
    call_item,
    chat_request,
    history_messages,
    input_messages,
    message_item,
    new_id,
    output_items,
    output_text,
    reasoning_item,
    response_object,
    response_usage,
)
from vserve.entrypoints.openai.serving_chat import ChatServer

STORE_MAX_RESPONSES = 1024
STORE_MAX_CHARS = 64 << 20


class ResponseStore:
    """Conversations by response id, least recently used evicted first."""

    def __init__(self, max_responses=STORE_MAX_RESPONSES, max_chars=STORE_MAX_CHARS) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._items: OrderedDict[str, tuple[list[dict], int]] = OrderedDict()
        self._lock = threading.Lock()  # put runs on worker threads (its size grows)
        self.num_chars = 0

    def get(self, response_id: str) -> list[dict] | None:
        with self._lock:
            entry = self._items.get(response_id)
            if entry is None:
                return None
            self._items.move_to_end(response_id)
            return list(entry[0])

    def put(self, response_id: str, messages: list[dict]) -> None:
        size = len(json.dumps(messages))
        if size > self.max_chars:
            return  # never kept: continuing it would be a 404, as after an eviction
        with self._lock:
            self._items[response_id] = (messages, size)
            self.num_chars += size
            while len(self._items) > self.max_responses or self.num_chars > self.max_chars:
                _, (_, old) = self._items.popitem(last=False)
                self.num_chars -= old


class ResponsesServer:
    def __init__(self, chat: ChatServer, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()

    async def create(self, req: ResponsesRequest, raw: Request):
        history: list[dict] = []
        if req.previous_response_id is not None:
            found = self.store.get(req.previous_response_id)
            if found is None:
                raise APIError(
                    404,
                    f"previous response {req.previous_response_id[:64]!r} not found (the "
                    f"server keeps the last {STORE_MAX_RESPONSES} stored responses)",
                    "previous_response_id",
                )
            history = found
        turn = await asyncio.to_thread(lambda: history + input_messages(req.input))
        chat_req = await asyncio.to_thread(chat_request, req, turn)
        response_id, created = new_id("resp"), int(time.time())
        result = await self.chat.create(chat_req, raw)
        if req.stream:
            events = _Events(req, response_id, created, self._keeper(req, response_id, turn))
            return StreamingResponse(
                events.run(result.body_iterator), media_type="text/event-stream"
            )
        body = await asyncio.to_thread(json.loads, result.body)
        choice = body["choices"][0]
        output = output_items(choice["message"])
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        usage = response_usage(body["usage"])
        await asyncio.to_thread(self._keeper(req, response_id, turn), output)
        obj = response_object(req, response_id, created, body["model"], output, status, usage)
        return JSONResponse(obj)

    def _keeper(self, req: ResponsesRequest, response_id: str, turn: list[dict]):
        def keep(output: list[dict]) -> None:
            if req.store:
                self.store.put(response_id, turn + history_messages(output))

        return keep


class _Events:
    """The chat stream's chunks as Responses events, output items in the order they begin."""

    def __init__(self, req: ResponsesRequest, response_id: str, created: int, keep) -> None:
        self.req, self.id, self.created, self.keep = req, response_id, created, keep
        self.seq = itertools.count()
        self.items: list[dict] = []  # in output order, each {"item": ..., "text": ...}
        self.open: dict[str, dict] = {}  # "reasoning", "message", "call:<index>" -> entry
        self.model = req.model or ""
        self.usage: dict | None = None
        self.finish: str | None = None

    def event(self, kind: str, **fields) -> str:
        return (
            f"data: {json.dumps({'type': kind, 'sequence_number': next(self.seq), **fields})}\n\n"
        )

    def snapshot(self, status: str, output: list[dict]) -> dict:
        usage = response_usage(self.usage)
        return response_object(self.req, self.id, self.created, self.model, output, status, usage)

    async def run(self, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.snapshot("in_progress", []))
        yield self.event("response.in_progress", response=self.snapshot("in_progress", []))
        try:
            async for raw in chunks:
                text = raw.decode() if isinstance(raw, bytes) else raw
                # events end at a newline; JSON escapes every newline inside its strings (not
                # U+2028 and the like, which str.splitlines would also split at)
                for line in text.split("\n"):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        for out in self.failed(chunk["error"].get("message", "")):
                            yield out
                        return
                    for out in self.chunk(chunk):
                        yield out
            final = self.finish_all()
        except Exception as e:  # noqa: BLE001 -- the status is sent: report in the stream
            for out in self.failed(str(e)):
                yield out
            return
        for out in final:
            yield out
        await asyncio.to_thread(self.keep, self.done_items())
        status = "incomplete" if self.finish == "length" else "completed"
        # response.completed even when cut at max_output_tokens (its status says so), as vLLM
        # sends it: the openai client's stream helper ends on that event alone
        yield self.event("response.completed", response=self.snapshot(status, self.done_items()))

    def failed(self, message: str) -> list[str]:
        response = self.snapshot("failed", [e["item"] for e in self.items])
        response["error"] = {"code": "server_error", "message": message}
        return [
            self.event("error", code="server_error", message=message),
            self.event("response.failed", response=response),
        ]

    def chunk(self, chunk: dict) -> list[str]:
        self.model = chunk.get("model", self.model)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out: list[str] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self.text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self.text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self.call(call)
            self.finish = choice.get("finish_reason") or self.finish
        return out

    def _add(self, key: str, item: dict) -> tuple[dict, list[str]]:
        """A new output item; the ones before it are done first (one item open at a time)."""
        done = self.finish_all()
        entry = {"item": item, "text": "", "index": len(self.items), "done": None}
        self.items.append(entry)
        self.open[key] = entry
        added = self.event("response.output_item.added", output_index=entry["index"], item=item)
        return entry, [*done, added]

    def text(self, key: str, piece: str) -> list[str]:
        out: list[str] = []
        entry = self.open.get(key)
        if entry is None:
            if key == "message":
                entry, out = self._add(key, message_item(new_id("msg"), "", "in_progress"))
                part = output_text("")
                out.append(self._part_event("response.content_part.added", entry, part))
            else:
                entry, out = self._add(key, reasoning_item(new_id("rs"), "", "in_progress"))
        entry["text"] += piece
        kind = "response.output_text.delta" if key == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if key == "message" else {}
        out.append(
            self.event(
                kind,
                item_id=entry["item"]["id"],
                output_index=entry["index"],
                content_index=0,
                delta=piece,
                **extra,
            )
        )
        return out

    def _part_event(self, kind: str, entry: dict, part: dict) -> str:
        return self.event(
            kind,
            item_id=entry["item"]["id"],
            output_index=entry["index"],
            content_index=0,
            part=part,
        )

    def call(self, call: dict) -> list[str]:
        key = f"call:{call['index']}"
        out: list[str] = []
        entry = self.open.get(key)
        fn = call.get("function") or {}
        if entry is None:
            item = call_item(
                new_id("fc"),
                call.get("id") or new_id("call"),
                fn.get("name", ""),
                "",
                "in_progress",
            )
            entry, out = self._add(key, item)
        if fn.get("arguments"):
            entry["text"] += fn["arguments"]
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=entry["item"]["id"],
                    output_index=entry["index"],
                    delta=fn["arguments"],
                )
            )
        return out

    def finish_all(self) -> list[str]:
        """The done events of every open item, in output order."""
        out: list[str] = []
        for entry in self.items:
            if entry["done"] is None:
                out += self._finish(entry)
        self.open.clear()
        return out

    def done_items(self) -> list[dict]:
        return [entry["done"] for entry in self.items]

    def _finish(self, entry: dict) -> list[str]:
        item, text, index = entry["item"], entry["text"], entry["index"]
        ids = {"item_id": item["id"], "output_index": index}
        out: list[str] = []
        if item["type"] == "message":
            done = message_item(item["id"], text)
            out.append(
                self.event(
                    "response.output_text.done", text=text, logprobs=[], content_index=0, **ids
                )
            )
            out.append(self._part_event("response.content_part.done", entry, output_text(text)))
        elif item["type"] == "reasoning":
            done = reasoning_item(item["id"], text)
            out.append(
                self.event("response.reasoning_text.done", text=text, content_index=0, **ids)
            )
        else:
            done = call_item(item["id"], item["call_id"], item["name"], text)
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    name=item["name"],
                    arguments=text,
                    **ids,
                )
            )
        entry["done"] = done
        out.append(self.event("response.output_item.done", output_index=index, item=done))
        return out
