"""The forced-ISA kernel builds of `tests/cpu_ops/test_isa.py`, run beside the suite.

Each build (a fresh process under VSERVE_CPU_ISA that compiles the kernels and computes what
the test compares) takes a minute and a half of both cores. Most of the suite waits on
processes and sockets, so `tests/conftest.py` starts the builds its selected tests need as
soon as collection ends, at the lowest CPU priority (`nice 19`: they take the cores only when
the tests leave them idle), and runs those tests last, when their results are ready or
nearly. A test run alone starts its build when it asks. `stop()` ends what is still running
at the session's end: no build outlives the suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST = "tests/cpu_ops/test_isa.py::test_forced_isa_builds_and_multiplies"


@dataclass
class Build:
    proc: subprocess.Popen
    saved: Path  # where the child saves its tensors (and prints its JSON to saved.out)


_builds: dict[str, Build] = {}
_root: Path | None = None


def start(choice: str, code: str) -> Build:
    """The build for `choice` (VSERVE_CPU_ISA), started now unless it already was."""
    global _root
    if choice in _builds:
        return _builds[choice]
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix="vserve-isa-builds-"))
    env = {**os.environ, "VSERVE_CPU_ISA": choice}
    for key in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(key, None)
    saved = _root / f"{choice}.pt"
    with open(f"{saved}.out", "w") as out, open(f"{saved}.err", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(saved)],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=err,
            preexec_fn=lambda: os.nice(19),
        )
    _builds[choice] = Build(proc, saved)
    return _builds[choice]


def wait(choice: str, code: str, timeout: float) -> tuple[int, str, str, Path]:
    """(exit status, stdout, stderr, saved path) of `choice`'s build, once it ended."""
    build = start(choice, code)
    try:
        status = build.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        build.proc.kill()
        build.proc.wait()
        raise
    saved = build.saved
    return status, Path(f"{saved}.out").read_text(), Path(f"{saved}.err").read_text(), saved


def stop() -> None:
    """Ends every build still running and removes their files."""
    global _root
    for build in _builds.values():
        if build.proc.poll() is None:
            build.proc.kill()
            build.proc.wait()
    _builds.clear()
    if _root is not None:
        shutil.rmtree(_root, ignore_errors=True)
        _root = None


def choices_of(items) -> list[str]:
    """The forced-ISA builds the selected tests will ask for (those not skipped here)."""
    chosen = [item.callspec.params["choice"] for item in items if item.nodeid.startswith(TEST)]
    if not chosen:
        return []
    from tests.cpu_ops.test_isa import will_run

    return [choice for choice in chosen if will_run(choice)]
