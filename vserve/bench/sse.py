"""Lines of a server-sent-events stream, as the SSE spec ends them: "\\r\\n", "\\n" or "\\r".

httpx's `aiter_lines` uses `str.splitlines`, which also breaks at U+2028, U+2029, U+0085 and
a few other characters. JSON leaves those unescaped, and a model may emit them raw inside a
string, so a `data:` line split there no longer parses. CR and LF themselves never appear
raw in a JSON line (JSON escapes control characters), so these are the only breaks.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx

_LINE_END = re.compile(r"\r\n|\r|\n")


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """Every line of `response`'s body, without its line end, as it arrives."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        # a "\r" at the end may be the first half of a "\r\n" that the next text completes
        held = "\r" if pending.endswith("\r") else ""
        *lines, pending = _LINE_END.split(pending[:-1] if held else pending)
        pending += held
        for line in lines:
            yield line
    *lines, last = _LINE_END.split(pending)
    for line in lines:
        yield line
    if last:
        yield last
