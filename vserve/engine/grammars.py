"""What xgrammar builds for a structured-output constraint: its kind and source text
(`grammar_source`), a digest that keys every cache (`constraint_digest`), the up-front check
that it parses (`check_grammar`, in the front end, without the tokenizer), the JSON-schema
grammar with JSON's string rules mended (`json_schema_grammar`), and the compile itself
(`compile_source`), shared by the engine core and its compile worker.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from vserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger("vserve.engine")

MAX_SCHEMA_DEPTH = 128  # nesting of a JSON schema; compile time grows ~ depth**3


class BytesLRU:
    """Least recently used values, at most `max_bytes` of them by their given sizes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str):
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def size(self, key: str) -> int:
        with self._lock:
            item = self._items.get(key)
            return item[1] if item is not None else 0

    def put(self, key: str, value, size: int) -> None:
        if size > self.max_bytes:
            return  # bigger than the whole cache: used once, never kept
        with self._lock:
            old = self._items.pop(key, None)
            self.num_bytes += size - (old[1] if old else 0)
            self._items[key] = (value, size)
            while self.num_bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.num_bytes -= dropped

    def __len__(self) -> int:
        return len(self._items)


def compile_source(compiler, kind: str, source: str):
    """xgrammar's compiled grammar for a constraint (`grammar_source`'s kind and text)."""
    if kind == "json":
        return compiler.compile_grammar(json_schema_grammar(source))
    if kind == "regex":
        return compiler.compile_regex(source)
    return compiler.compile_grammar(source)


def constraint_digest(kind: str, source: str) -> str:
    """The key of a constraint in every cache (never its text, which may be long)."""
    data = source.encode("utf-8", "surrogatepass")
    return hashlib.sha256(kind.encode() + b"\0" + data).hexdigest()


def grammar_source(params: StructuredOutputsParams) -> tuple[str, str]:
    """What xgrammar builds for a constraint: ("json" | "regex" | "ebnf", its text)."""
    kind, value = params.key
    if kind == "json_object":
        return "json", '{"type": "object"}'
    if kind == "choice":
        assert params.choice is not None  # what `key` said
        return "regex", "|".join(_regex_escape(c) for c in params.choice)
    return ("ebnf", value) if kind == "grammar" else (kind, value)


def check_grammar(params: StructuredOutputsParams) -> None:
    """Raise ValueError for a constraint that cannot compile (an invalid regex, schema or
    grammar, or a schema nested too deep), before the request is admitted. It parses the
    constraint without the tokenizer (milliseconds; the engine's compile takes longer) and
    remembers, by digest, what passed. Thread-safe: the server runs it off its event loop."""
    kind, source = grammar_source(params)
    key = constraint_digest(kind, source)
    if _passed.get(key) is None:
        _check_source(kind, source)
        _passed.put(key, True, 1)


_passed = BytesLRU(4096)  # digests of constraints that parsed


def xgrammar_reason(e: BaseException) -> str:
    """What an xgrammar error says is wrong, without its source file and time stamp."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    return text.splitlines()[-1].split("] ", 1)[-1].split(": ", 1)[-1][:300]


# xgrammar (0.2.9) writes a string with minLength / maxLength as a bounded repeat of this
# character class: it lets raw control characters in (JSON parsers refuse them) and escapes out.
_BOUNDED_CLASS = r"[^\"\\\r\n]"
_BOUNDED_STRING_CHAR = f"(({_BOUNDED_CLASS}))"
# what a JSON string character is: anything but a control character, quote or backslash, or
# an escape (one character of the string, as minLength / maxLength count it)
_JSON_STRING_CHAR = r'(([^\0-\x1f\"\\]) | ("\\" vserve_json_escape))'
_JSON_ESCAPE_RULE = (
    r"vserve_json_escape ::= (([\"\\/bfnrt]) | "
    r'("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'
)


def json_schema_grammar(source: str):
    """The grammar of a JSON schema's compact JSON (a weak model cannot wander off into
    endless whitespace), with the length-bounded strings mended to JSON's string rules."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(source, any_whitespace=False)
    lines = str(grammar).splitlines()
    bad = " ::= " + _BOUNDED_STRING_CHAR
    mended = [
        line[: -len(_BOUNDED_STRING_CHAR)] + _JSON_STRING_CHAR if line.endswith(bad) else line
        for line in lines
    ]
    if any(_BOUNDED_CLASS in line for line in mended):  # the class in another form
        _warn_unmended()
    if mended == lines:
        return grammar
    return xgr.Grammar.from_ebnf("\n".join([*mended, _JSON_ESCAPE_RULE]))


@functools.lru_cache(maxsize=1)
def _warn_unmended() -> None:
    from importlib.metadata import version

    logger.warning(
        "xgrammar %s wrote the length-bounded string class in a form vserve does not mend: "
        "such strings may admit raw control characters (invalid JSON)",
        version("xgrammar"),
    )


def _check_source(kind: str, source: str) -> None:
    import xgrammar as xgr

    if kind == "json" and _depth(_json_value(source)) > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"structured outputs: the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} levels"
        )
    builds: dict[str, Callable[[str], Any]] = {
        "json": json_schema_grammar,
        "regex": xgr.Grammar.from_regex,
        "ebnf": xgr.Grammar.from_ebnf,
    }
    build = builds[kind]
    try:
        build(source)
    except UnicodeError:
        raise ValueError("structured outputs: the constraint is not valid Unicode") from None
    except RuntimeError as e:  # xgrammar's parse errors; the last line says what is wrong
        reason = xgrammar_reason(e)
        name = {"json": "JSON schema", "regex": "regex", "ebnf": "grammar"}[kind]
        raise ValueError(f"structured outputs: invalid {name}: {reason}") from None


def _json_value(source: str):
    try:
        return json.loads(source)
    except RecursionError:
        raise ValueError(
            f"structured outputs: the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} levels"
        ) from None
    except ValueError as e:
        raise ValueError(f"structured outputs: the JSON schema is not valid JSON: {e}") from None


def _depth(value, limit: int = MAX_SCHEMA_DEPTH + 1) -> int:
    """Nesting depth of a JSON value, counted up to `limit` (no deeper recursion)."""
    if limit <= 0 or not isinstance(value, (dict, list)):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(c, limit - 1) for c in children), default=0)


_REGEX_SPECIAL = str.maketrans({c: "\\" + c for c in "\\.^$|?*+()[]{}"})


def _regex_escape(text: str) -> str:
    return text.translate(_REGEX_SPECIAL)
