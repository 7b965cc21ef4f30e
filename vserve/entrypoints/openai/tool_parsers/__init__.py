"""Tool-call parsers, chosen with `--tool-call-parser`: they turn a model's text into OpenAI
tool calls, whole or as a stream."""

from __future__ import annotations

from vserve.entrypoints.openai.tool_parsers.base import StreamDelta, ToolCallStream
from vserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from vserve.entrypoints.openai.tool_parsers.json_calls import ToolCallDelta, ToolCallResult
from vserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolCallStream]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}

__all__ = [
    "TOOL_PARSERS",
    "StreamDelta",
    "ToolCallDelta",
    "ToolCallResult",
    "ToolCallStream",
    "HermesToolParser",
    "Llama3JsonToolParser",
]
