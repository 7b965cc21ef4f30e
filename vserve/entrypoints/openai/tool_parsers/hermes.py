"""`--tool-call-parser hermes`: calls as `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` blocks, the format of Hermes 2 Pro and Qwen 2 / 2.5 / 3.

Text before the first block is content; text between and after blocks is dropped (as vLLM
does). A block's end tag inside a JSON string is text, not the end.
"""

from __future__ import annotations

from vserve.entrypoints.openai.tool_parsers.base import ToolCallStream, partial_suffix
from vserve.entrypoints.openai.tool_parsers.json_calls import CallObjectReader

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolCallStream):
    markers = (START, END)

    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.buffer = ""
        self.reader: CallObjectReader | None = None  # the open block's
        self.seen_block = False

    def _consume(self, text: str, final: bool) -> str:
        self.buffer += text
        content: list[str] = []
        while self.buffer:
            more = (
                self._read_block(final)
                if self.reader is not None
                else self._read_text(content, final)
            )
            if not more:
                break
        return "".join(content)

    def _read_text(self, content: list[str], final: bool) -> bool:
        """Text up to the next block; False when the rest must wait for more text."""
        at = self.buffer.find(START)
        if at < 0:
            keep = 0 if final else partial_suffix(self.buffer, START)
            text, self.buffer = (
                self.buffer[: len(self.buffer) - keep],
                self.buffer[len(self.buffer) - keep :],
            )
            if not self.seen_block:
                content.append(text)
            return False
        if not self.seen_block:
            content.append(self.buffer[:at])
        self.buffer = self.buffer[at + len(START) :]
        self.seen_block = True
        self.reader = CallObjectReader()
        self.emitter.open(self.reader)
        return True

    def _read_block(self, final: bool) -> bool:
        """A block's JSON up to its end tag; False when the rest must wait."""
        buffer, reader = self.buffer, self.reader
        for i, ch in enumerate(buffer):
            if ch == "<" and not reader.in_string:
                rest = buffer[i:]
                if rest.startswith(END):
                    self.buffer, self.reader = rest[len(END) :], None
                    return True
                if END.startswith(rest) and not final:
                    self.buffer = rest
                    return False
            reader.feed(ch)
        self.buffer = ""
        return False
