"""The process tree under a pid, read from Linux `/proc` (no psutil): the children and
descendants of a process, whether one still runs, and its command line. The failure tests,
the soak benchmark and the placement benchmark use it to find (and check the end of) an
engine core and its workers. Elsewhere than Linux every process looks childless and gone.

A parent is read from `/proc/<pid>/stat` (field 4), which every kernel has, rather than from
`/proc/<pid>/task/<tid>/children` (an optional kernel feature, documented as reliable only
for a stopped process).
"""

from __future__ import annotations

from pathlib import Path

_PROC = Path("/proc")


def _stat_fields(pid: int | str) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first); None if gone. The
    name is in parentheses and may hold spaces or ')' itself, hence the last ')'."""
    try:
        return (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process now running."""
    parents = {}
    try:
        entries = [e.name for e in _PROC.iterdir() if e.name.isdigit()]
    except OSError:
        return parents
    for name in entries:
        fields = _stat_fields(name)
        if fields is not None:
            parents[int(name)] = int(fields[1])
    return parents


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, by pid."""
    return sorted(kid for kid, parent in _parents().items() if parent == pid)


def descendants(pid: int) -> list[int]:
    """Children, grandchildren, ... of `pid` (not `pid` itself), nearest first, from one
    snapshot of the process table."""
    kids_of: dict[int, list[int]] = {}
    for kid, parent in sorted(_parents().items()):
        kids_of.setdefault(parent, []).append(kid)
    found: list[int] = []
    todo = [pid]
    while todo:
        for kid in kids_of.get(todo.pop(0), []):
            if kid not in found and kid != pid:
                found.append(kid)
                todo.append(kid)
    return found


def is_running(pid: int) -> bool:
    """Alive and not a zombie (an exited child its parent has not reaped yet)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def cmdline(pid: int) -> bytes:
    """The command line, arguments separated by NUL bytes (b"" once the process is gone)."""
    try:
        return (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""
