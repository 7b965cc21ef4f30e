"""`ToolSettings`: the server's tool-calling flags, checked at start-up, before the engine
starts (the command line imports this, not `tool_calls.py` and its request models)."""

from __future__ import annotations

from dataclasses import dataclass

from vserve.entrypoints.openai.tool_parsers import TOOL_PARSERS


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool-calling flags, checked at start-up."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    keep_special_tokens: bool = False  # the parser's markup is special in this tokenizer

    @classmethod
    def from_args(cls, args, tokenizer=None) -> ToolSettings:
        auto = bool(getattr(args, "enable_auto_tool_choice", False))
        name = getattr(args, "tool_call_parser", None)
        if auto and not name:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        if name is not None and name not in TOOL_PARSERS:
            raise ValueError(
                f"--tool-call-parser {name!r} is not one of {', '.join(sorted(TOOL_PARSERS))}"
            )
        keep = name is not None and bool(
            set(TOOL_PARSERS[name].markers) & special_token_texts(tokenizer)
        )
        return cls(auto, name, keep)


def special_token_texts(tokenizer) -> set[str]:
    """Added tokens the detokenizer drops when skip_special_tokens is true."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {tok.content for tok in added.values() if getattr(tok, "special", False)}
