"""Tool calls written as JSON objects (`{"name": ..., "arguments": {...}}`), read a character
at a time, so that a stream can send each call's name as soon as its string closes and its
arguments as they grow.

`CallObjectReader` reads one object; `JsonCallSequence` reads objects one after another (a
JSON array, or objects separated by `;`); `CallEmitter` turns readers into OpenAI tool-call
deltas (the call's id, type and name first, then argument fragments).

| invariant                                                                   |
|-----------------------------------------------------------------------------|
| a call is sent only once its name is known; calls are numbered 0, 1, ...     |
| the fragments sent for a call concatenate to its final `arguments`           |
| object arguments are the model's own text (no re-serialization)              |
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\r\n"


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCallDelta:
    """One call's news in one chunk: the first one carries id and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ToolCallResult:
    id: str
    name: str
    arguments: str


class CallObjectReader:
    """One JSON object's top-level keys: the `name` string, and the text of the `arguments`
    (or `parameters`) value. Anything before the object's `{` is skipped; malformed text is
    skipped rather than raised on, since a model writes it."""

    def __init__(self) -> None:
        self.state = "start"  # start, key, colon, value_start, value, after, done
        self.key: str | None = None
        self.token: list[str] = []  # the key, or the value of a key other than the arguments
        self.kind = ""  # of the value being read: container, string, scalar
        self.depth = 0  # nesting inside a container value
        self.in_value_string = False
        self.escape = False
        self.reading_args = False
        self.name: str | None = None
        self.args: list[str] = []  # raw characters of the argument value
        self.args_kind = ""
        self.args_done = False
        self._args_text = ""

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def in_string(self) -> bool:
        """Inside a JSON string, where markup such as `</tool_call>` is text."""
        return self.state == "key_string" or (
            self.state == "value" and (self.kind == "string" or self.in_value_string)
        )

    def feed(self, text: str) -> None:
        for ch in text:
            getattr(self, "_" + self.state)(ch)

    # -- states ----------------------------------------------------------------------------
    def _start(self, ch: str) -> None:
        if ch == "{":
            self.state = "key"

    def _key(self, ch: str) -> None:
        if ch == '"':
            self.state, self.token, self.escape = "key_string", [], False
        elif ch == "}":
            self.state = "done"

    def _key_string(self, ch: str) -> None:
        if self._string_char(ch, self.token):
            self.key = _decode_string(self.token)
            self.state = "colon"

    def _colon(self, ch: str) -> None:
        if ch == ":":
            self.state = "value_start"

    def _value_start(self, ch: str) -> None:
        if ch in _WS:
            return
        self.reading_args = self.key in ARGUMENT_KEYS and not self.args_kind
        self.token = []
        self.kind = "container" if ch in "{[" else "string" if ch == '"' else "scalar"
        self.depth, self.in_value_string, self.escape = 1, False, False
        if self.reading_args:
            self.args_kind = self.kind
        self.state = "value"
        if self.kind == "scalar":
            self._value(ch)
        else:
            self._buffer().append(ch)

    def _value(self, ch: str) -> None:
        buffer = self._buffer()
        if self.kind == "scalar":
            if ch in _WS or ch in ",}":
                self._value_done()
                self._after(ch)
            else:
                buffer.append(ch)
        elif self.kind == "string":
            if self._string_char(ch, buffer):
                buffer.append('"')
                self._value_done()
        else:
            self._container_char(ch, buffer)

    def _after(self, ch: str) -> None:
        if ch == ",":
            self.state = "key"
        elif ch == "}":
            self.state = "done"

    def _done(self, ch: str) -> None:
        pass

    # -- helpers ---------------------------------------------------------------------------
    def _buffer(self) -> list[str]:
        return self.args if self.reading_args else self.token

    def _string_char(self, ch: str, buffer: list[str]) -> bool:
        """Add a character of a string body; True at the closing quote (not added)."""
        if self.escape:
            self.escape = False
        elif ch == "\\":
            self.escape = True
        elif ch == '"':
            return True
        buffer.append(ch)
        return False

    def _container_char(self, ch: str, buffer: list[str]) -> None:
        buffer.append(ch)
        if self.in_value_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_value_string = False
        elif ch == '"':
            self.in_value_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self._value_done()

    def _value_done(self) -> None:
        if self.reading_args:
            self.args_done, self.reading_args = True, False
        elif self.key == "name" and self.kind == "string":
            self.name = _decode_string(self.token[1:-1])
        self.state = "after"

    def arguments_text(self) -> str:
        """The arguments as far as they can be sent: an object's text as it grows; a string
        (some models encode the arguments as one) or a scalar once complete; `{}` for an
        object that closed without arguments."""
        if self.args_kind == "container":
            if len(self._args_text) < len(self.args):
                self._args_text += "".join(self.args[len(self._args_text) :])
            return self._args_text
        if self.args_done:
            raw = "".join(self.args)
            if self.args_kind == "string":
                return _decode_string(self.args[1:-1])
            return "{}" if raw == "null" else raw
        return "{}" if self.done and not self.args_kind else ""


def _decode_string(body: list[str]) -> str:
    raw = "".join(body)
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw


class JsonCallSequence:
    """Call objects one after another; text between them (brackets, commas, semicolons,
    whitespace) is skipped."""

    def __init__(self, emitter: CallEmitter) -> None:
        self.emitter = emitter
        self.reader: CallObjectReader | None = None

    def feed(self, text: str) -> None:
        for ch in text:
            if self.reader is not None and not self.reader.done:
                self.reader.feed(ch)
            elif ch == "{":
                self.reader = CallObjectReader()
                self.reader.feed(ch)
                self.emitter.open(self.reader)


class FixedNameCall:
    """A call whose name is known up front and whose arguments are the text itself (a
    named tool_choice, whose output is constrained to the arguments)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.parts: list[str] = []
        self.done = False

    def feed(self, text: str) -> None:
        self.parts.append(text)

    def arguments_text(self) -> str:
        if len(self.parts) > 1:
            self.parts = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""


@dataclass
class _Call:
    reader: CallObjectReader | FixedNameCall
    index: int | None = None
    id: str | None = None
    num_sent: int = 0
    dropped: bool = False


class CallEmitter:
    """Readers -> deltas. `max_calls` (1 when parallel_tool_calls is false) drops calls
    beyond it."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.calls: list[_Call] = []
        self.num_named = 0

    def open(self, reader: CallObjectReader | FixedNameCall) -> None:
        self.calls.append(_Call(reader))

    def collect(self) -> list[ToolCallDelta]:
        out = []
        for call in self.calls:
            if call.dropped or call.reader.name is None:
                continue
            args = call.reader.arguments_text()
            if call.index is None:
                if self.max_calls is not None and self.num_named >= self.max_calls:
                    call.dropped = True
                    continue
                call.index, call.id = self.num_named, new_call_id()
                self.num_named += 1
                out.append(ToolCallDelta(call.index, args, call.id, call.reader.name))
            elif len(args) > call.num_sent:
                out.append(ToolCallDelta(call.index, args[call.num_sent :]))
            call.num_sent = len(args)
        return out

    def results(self) -> list[ToolCallResult]:
        return [
            ToolCallResult(c.id, c.reader.name, c.reader.arguments_text())
            for c in self.calls
            if c.index is not None
        ]
