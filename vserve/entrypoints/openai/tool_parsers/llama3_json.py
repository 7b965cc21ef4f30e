"""`--tool-call-parser llama3_json`: Llama 3.1 / 3.2 JSON tool calls, an output that is
`{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`), several calls
separated by `;`. An output that starts otherwise is content; after calls, other text is
dropped (as vLLM does)."""

from __future__ import annotations

from vserve.entrypoints.openai.tool_parsers.base import ToolCallStream
from vserve.entrypoints.openai.tool_parsers.json_calls import JsonCallSequence

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolCallStream):
    markers = (PYTHON_TAG,)

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.mode: str | None = None  # None until the start is seen: "calls" or "content"
        self.head = ""
        self.sequence = JsonCallSequence(self.emitter)

    def _consume(self, text: str, final: bool) -> str:
        if self.mode is None:
            self.head += text
            text = self._decide(final)
            if self.mode is None:
                return ""
        if self.mode == "content":
            return text
        self.sequence.feed(text)
        return ""

    def _decide(self, final: bool) -> str:
        """Whether the output is calls; returns the text to go on with."""
        start = self.head.lstrip()
        if start.startswith(PYTHON_TAG) or start.startswith("{"):
            self.mode = "calls"
            return start.removeprefix(PYTHON_TAG)
        if not final and (not start or PYTHON_TAG.startswith(start)):
            return ""
        self.mode = "content"
        return self.head
