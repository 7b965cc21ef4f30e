"""Tokenizer loading: once per process, straight from `tokenizer.json` where that is the same.

`AutoTokenizer` builds a model-specific class, which in transformers 5 may re-parse the whole
`tokenizer.json` in Python (4x slower than the Rust load of the same file for Gemma 3's 262k
vocabulary). Transformers' generic fast tokenizer over the Rust `tokenizers` load gives the
same object whenever the model class adds nothing: the same pipeline, special and added
tokens, chat template and class settings, and no method of its own. The first load of a folder
builds both and compares them; the verdict is cached in `$XDG_CACHE_HOME/vserve/tokenizers`,
keyed by the tokenizer files' identity and the library versions (like the kernel cache), so
later loads take the fast path only where it was proven equal, and `AutoTokenizer` elsewhere.
Only the front end loads a tokenizer (and the engine core for structured output, on demand).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path

from vserve.cache_files import cache_dir, write_json_atomic

logger = logging.getLogger("vserve")

VERDICT_VERSION = 1
BPE_CACHE_ENTRIES = 1024  # see bound_caches
NUM_LOADS = [0]  # tokenizers built by this process (tests count them)
_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "added_tokens.json",
)
_DROP = ("tokenizer_class", "backend", "auto_map", "is_local", "local_files_only", "name_or_path")
_CLASS_SETTINGS = ("padding_side", "truncation_side")


@functools.lru_cache(maxsize=8)
def load_tokenizer(path: str):
    NUM_LOADS[0] += 1
    folder = Path(path)
    try:
        if (folder / "tokenizer.json").is_file():
            tokenizer = _load_checked(folder)
        else:
            tokenizer = _load_auto(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path}: {e}") from e
    bound_caches(tokenizer)
    return tokenizer


def bound_caches(tokenizer) -> None:
    """Cap the Rust BPE model's memo of encoded pre-tokens at BPE_CACHE_ENTRIES.

    Where spaces are normalized away before pre-tokenization (Gemma: ' ' -> '▁', then a
    split on ' ' that finds none), a whole prompt is one pre-token, so the memo (10000 entries
    by default) holds recent prompts: it never hits, and a server's front end grew by about
    1.1 KB per request until it was full (30-minute soak: +28 MiB). Encoding is unchanged."""
    model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    resize = getattr(model, "_resize_cache", None)
    if resize is not None:
        resize(BPE_CACHE_ENTRIES)


def _load_auto(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _load_checked(folder: Path):
    verdict_file = _verdict_path(folder)
    try:
        verdict = json.loads(verdict_file.read_text())
    except (OSError, ValueError):
        verdict = None
    if verdict is not None:
        return (
            _load_fast(folder, verdict["settings"]) if verdict["fast"] else _load_auto(str(folder))
        )
    auto = _load_auto(str(folder))
    settings = {name: getattr(auto, name) for name in _CLASS_SETTINGS}
    try:
        fast = _load_fast(folder, settings)
        same = fingerprint(fast) == fingerprint(auto)
    except Exception as e:  # the generic class cannot take these files: keep AutoTokenizer
        logger.debug("fast tokenizer load of %s failed: %s", folder, e)
        same = False
    _write_verdict(verdict_file, {"fast": same, "settings": settings})
    return auto


def _load_fast(folder: Path, settings: dict):
    from transformers import PreTrainedTokenizerFast

    kwargs = _read_json(folder / "tokenizer_config.json")
    for key, value in _read_json(folder / "special_tokens_map.json").items():
        kwargs.setdefault(key, value)
    for key in _DROP:
        kwargs.pop(key, None)
    template = folder / "chat_template.jinja"
    if template.is_file():
        kwargs["chat_template"] = template.read_text()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), name_or_path=str(folder), **kwargs
    )
    for name, value in settings.items():
        setattr(tokenizer, name, value)
    return tokenizer


def fingerprint(tokenizer) -> dict:
    """What makes two transformers fast tokenizers behave the same."""
    from transformers import PreTrainedTokenizerFast

    own = sorted(
        name
        for klass in type(tokenizer).__mro__
        if issubclass(klass, PreTrainedTokenizerFast) and klass is not PreTrainedTokenizerFast
        for name, value in vars(klass).items()
        if callable(value) and not isinstance(value, type) and name != "__init__"
    )
    return {
        "pipeline": tokenizer.backend_tokenizer.to_str(),
        "special": repr(tokenizer.special_tokens_map),
        "added": repr(sorted((i, str(t)) for i, t in tokenizer.added_tokens_decoder.items())),
        "chat_template": repr(tokenizer.chat_template),
        "clean_up": tokenizer.clean_up_tokenization_spaces,
        "max_length": tokenizer.model_max_length,
        "settings": [getattr(tokenizer, name) for name in _CLASS_SETTINGS],
        "methods": own,
    }


def _verdict_path(folder: Path) -> Path:
    import tokenizers
    import transformers

    key = [
        str(folder.resolve()),
        transformers.__version__,
        tokenizers.__version__,
        str(VERDICT_VERSION),
    ]
    for name in _FILES:
        try:
            stat = (folder / name).stat()
            key.append(f"{name}:{stat.st_size}:{stat.st_mtime_ns}")
        except OSError:
            key.append(f"{name}:-")
    digest = hashlib.sha256("\n".join(key).encode()).hexdigest()[:16]
    return cache_dir("tokenizers") / f"{digest}.json"


def _write_verdict(path: Path, verdict: dict) -> None:
    try:
        write_json_atomic(path, verdict)
    except OSError as e:  # a read-only cache: check again next time
        logger.debug("cannot record the tokenizer verdict in %s: %s", path, e)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
