"""The interface of a tool-call parser: model text in (whole, or in deltas as it streams),
content and tool-call deltas out. Non-streaming responses run the same parser over the whole
text, so a stream and a non-stream response of the same text hold the same calls."""

from __future__ import annotations

from dataclasses import dataclass, field

from vserve.entrypoints.openai.tool_parsers.json_calls import (
    CallEmitter,
    ToolCallDelta,
    ToolCallResult,
)


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallStream:
    """One choice's parser. Subclasses implement `_consume(text, final) -> content`: take
    new text, hold back what may still turn out to be markup, and return the text that is
    plain content; calls go to `self.emitter`."""

    # markup the format writes; when the tokenizer marks one of these as special, special
    # tokens are kept in the text (else the detokenizer would drop the markup)
    markers: tuple[str, ...] = ()

    def __init__(self, max_calls: int | None = None) -> None:
        self.emitter = CallEmitter(max_calls)
        self._content: list[str] = []

    def feed(self, text: str) -> StreamDelta:
        return self._delta(self._consume(text, final=False))

    def finish(self) -> StreamDelta:
        """The end of the output: whatever was held back is decided now."""
        return self._delta(self._consume("", final=True))

    def parse(self, text: str) -> tuple[str | None, list[ToolCallResult]]:
        """A whole output: (content or None, calls)."""
        self.feed(text)
        self.finish()
        return self.result()

    def result(self) -> tuple[str | None, list[ToolCallResult]]:
        return "".join(self._content) or None, self.emitter.results()

    def _delta(self, content: str) -> StreamDelta:
        self._content.append(content)
        return StreamDelta(content, self.emitter.collect())

    def _consume(self, text: str, final: bool) -> str:
        raise NotImplementedError


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker` (text a
    stream must hold back until the next delta shows whether the marker follows)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
