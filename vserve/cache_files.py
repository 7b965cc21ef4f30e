"""vserve's caches: where they live (`cache_dir`, under `$XDG_CACHE_HOME/vserve`, default
`~/.cache/vserve`), and small files in them written atomically: a reader sees the old file or
the new one, never a half-written one (several processes may start at once)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def cache_dir(name: str) -> Path:
    """`$XDG_CACHE_HOME/vserve/<name>` (default `~/.cache/vserve/<name>`), read at each call
    (tests point XDG_CACHE_HOME elsewhere)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vserve" / name


def write_json_atomic(path: Path, value) -> None:
    """Raises OSError (e.g. a read-only cache) or TypeError/ValueError (not JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)
