"""Fused bf16 kernels for the CPU path (`decode.cpp`), compiled on first use.

At batch 1 a decode step of a small model is dominated not by its matmuls' arithmetic but by
streaming their weights and by the ~100 small torch ops per layer around them (norms that
decompose into eight ops, rotary, two tiny attention matmuls), each paying dispatch and Python
overhead. These kernels do that work in one call each, read a one-row matmul's weight at full
memory bandwidth, and `decoder_layer` runs a whole layer of a decode step in one call.

The extension is built with the system C++ compiler the first time a CPU model loads
(about 75 s on 2 cores), into `$XDG_CACHE_HOME/vserve/cpu_ops/` (default `~/.cache`), keyed by the
source, the torch and Python versions and the CPU's instruction sets; later loads reuse it.
Without a compiler, or with `VSERVE_CPU_OPS=0`, models keep the eager torch path. bf16 models
use all of these kernels; fp32 models only the paged decode attention (`attention_kernel`),
which reads the cache in place where the eager path gathers it, and whose fp32 result differs
from the eager matmuls' only in summation order.

`sample.cpp` builds into the same extension (its `sample` submodule, `load_sampler`, first
used on the first sampled step of a CPU model of any dtype): fused temperature / top-k / top-p
/ min-p sampling over the full vocabulary (workers/cpu_sampling.py). One extension is one
build: each translation unit but the bindings' (decode.cpp) includes only ATen,
not torch/extension.h, which alone takes about 30 s to compile here.

`quant.cpp` builds into the same extension as decode.cpp (its `quant` submodule, `load_quant`):
GGUF block-quantized weights (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) in their GGUF bytes:
dequantization, a small-batch gemv that dequantizes blocks in registers while streaming the
weight, a batched matmul over dequantized tiles, and the embedding lookup of quantized rows;
`decoder_layer_q` runs a whole decode layer on them (on one tensor-parallel rank's shard too,
calling the all-reduce it is given back as `decoder_layer` does).

`park.h` (bound in decode.cpp as `parked(fn)`) runs fn with the other threads of torch's
OpenMP pool asleep instead of spinning: a CPU worker's gap between two forwards
(workers/host_gap.py).

`stack.cpp` builds into it too: `DecodeStack` runs every layer of a decode step (up to 8 rows)
on GGUF blocks in one call, with one parallel region for the step instead of a fork and join
per gemv (vserve/models/fused_decode.py).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from vserve.cache_files import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode.cpp")
SAMPLE_SOURCE = Path(__file__).with_name("sample.cpp")
QUANT_SOURCE = Path(__file__).with_name("quant.cpp")
QUANT_AVX2_SOURCE = Path(__file__).with_name("quant_avx2.cpp")
STACK_SOURCE = Path(__file__).with_name("stack.cpp")
_state: dict[str, object] = {}


def enabled_by_env() -> bool:
    return os.environ.get("VSERVE_CPU_OPS", "1") not in ("0", "false", "off")


def _cpu_flags() -> bytes:
    """The instruction sets the build targets (-march=native): a cache shared by different
    CPUs must not hand one a binary built for the other."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "").encode()
    except OSError:
        return platform.processor().encode()


SOURCES = (SOURCE, QUANT_SOURCE, QUANT_AVX2_SOURCE, STACK_SOURCE, SAMPLE_SOURCE)
CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def build_dir(sources: tuple[Path, ...] = SOURCES) -> Path:
    headers = b"".join(h.read_bytes() for h in sorted(sources[0].parent.glob("*.h")))
    key = (
        b"".join(s.read_bytes() for s in sources)
        + headers  # the sources include them: a changed header is a new build
        + torch.__version__.encode()
        + sys.version.encode()
        + _cpu_flags()
        + " ".join(CFLAGS).encode()  # a flag changed is a new build
    )
    digest = hashlib.sha256(key).hexdigest()[:12]
    return cache_dir("cpu_ops") / digest


def load():
    """The compiled module, or None when it is disabled or cannot be built (logged once)."""
    return _load("module", lambda: _build())


def attention_kernel(device: torch.device, dtype: torch.dtype):
    """The module whose `decode_attention` an fp32 CPU model's attention uses, or None."""
    if device.type != "cpu" or dtype != torch.float32:
        return None
    return load()


def load_sampler():
    """The fused sampling kernels (sample.cpp: `load()`'s `sample` submodule), or None."""
    module = load()
    return None if module is None else module.sample


def load_quant():
    """The GGUF block-format kernels (quant.cpp: `load()`'s `quant` submodule), or None."""
    module = load()
    return None if module is None else module.quant


def _load(key: str, build):
    if key in _state:
        return _state[key]
    module = None
    if enabled_by_env():
        try:
            module = build()
        except Exception as exc:  # no compiler, headers or linker: the eager path still works
            log.warning("vserve CPU kernels unavailable, using eager torch ops: %s", exc)
    _state[key] = module
    return module


def _build():
    return _compile(SOURCES, "vserve_cpu_ops")


def _compile(sources: tuple[Path, ...], name: str):
    from torch.utils.cpp_extension import load as load_extension

    folder = build_dir(sources)
    folder.mkdir(parents=True, exist_ok=True)
    if not any(folder.glob("*.so")):  # shown at the default log level: a minute's pause
        log.warning("building vserve's CPU kernels into %s (once per machine, a minute)", folder)
    _ninja_on_path()
    with _build_lock(folder):
        return load_extension(
            f"{name}_{folder.name}",
            [str(s) for s in _staged(sources, folder)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )


def _staged(sources: tuple[Path, ...], folder: Path) -> list[Path]:
    """The sources and their headers copied into the build folder, and built from there.
    ninja records the paths it compiled: two checkouts with the same sources (the folder is
    keyed by their bytes) would otherwise rebuild each other's kernels on every load. A copy
    is written only when it differs, so its mtime does not trigger a rebuild."""
    src = folder / "src"
    src.mkdir(exist_ok=True)
    staged = []
    for path in [*sources, *sorted(sources[0].parent.glob("*.h"))]:
        copy = src / path.name
        data = path.read_bytes()
        if not copy.exists() or copy.read_bytes() != data:
            tmp = copy.with_suffix(copy.suffix + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(copy)
        staged.append(copy)
    return staged[: len(sources)]


BATON = "lock"  # torch's FileBaton in the build folder: it waits while this file exists


@contextmanager
def _build_lock(folder: Path):
    """One builder per folder, by a lock the kernel drops when its holder dies. torch's own
    baton is a plain file that a process killed mid-build leaves behind, and every later load
    then waits for it forever; holding this lock, a baton still there is such a leftover."""
    with open(folder / "build.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            baton = folder / BATON
            if baton.exists():
                log.warning("removing %s, left by a build that did not finish", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _ninja_on_path() -> None:
    """torch builds extensions with the `ninja` on PATH; a virtualenv that is not activated
    does not put its own (the `ninja` dependency) there."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
