"""Reasoning content (`--reasoning-parser`): a thinking model's `<think>...</think>` returned as
`reasoning_content` apart from `content`, as vLLM's parsers and llama.cpp's
`--reasoning-format` do, so that tool-call and JSON parsing downstream see the answer alone.

| parser        | models                           | output before `</think>`                  |
|---------------|----------------------------------|-------------------------------------------|
| `qwen3`       | Qwen3 (thinking on or off)       | reasoning only after a `<think>` the      |
|               |                                  | model wrote; without one, all is content  |
| `deepseek_r1` | DeepSeek-R1 and its distills     | reasoning from the start (their template  |
|               | (the template opens `<think>`)   | ends the prompt with `<think>`); a        |
|               |                                  | `<think>` the model writes is dropped     |

`split` parses a whole reply; `ReasoningStream` a streamed one, delta by delta, holding back
only the characters that could begin a tag, so a tag split inside one delta or across two is
never shown as text.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class Split:
    reasoning: str | None
    content: str | None


def split(parser: str, text: str) -> Split:
    """A whole reply's reasoning and content (None where there is none)."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text, final=True)
    return Split(reasoning or None, content or None)


class ReasoningStream:
    """Feed each delta of one choice's text; get (reasoning, content) to send for it."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}: one of {', '.join(PARSERS)}")
        # before the first visible text: qwen3 thinks only if it opens with <think>;
        # deepseek_r1 is thinking already (a <think> it writes first is dropped)
        self.state = "start" if parser == "qwen3" else "open"
        self.pending = ""  # held back: might be the start of a tag

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        text, self.pending = self.pending + delta, ""
        reasoning, content = [], []
        while text:
            if self.state in ("start", "open"):
                head = text.lstrip()
                if head.startswith(OPEN):
                    text, self.state = head[len(OPEN) :], "thinking"
                elif OPEN.startswith(head) and not final:  # may still become <think>
                    self.pending = text
                    break
                else:
                    self.state = "done" if self.state == "start" else "thinking"
                continue
            if self.state == "done":
                content.append(text)
                break
            at = text.find(CLOSE)
            if at >= 0:
                reasoning.append(text[:at])
                text, self.state = text[at + len(CLOSE) :], "done"
                continue
            keep = 0 if final else _partial_tag(text, CLOSE)
            reasoning.append(text[: len(text) - keep])
            self.pending = text[len(text) - keep :]
            break
        return "".join(reasoning), "".join(content)


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
