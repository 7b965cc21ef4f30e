"""vserve's CPU kernels: one C++ extension, built with the system compiler on first use.

| file                  | owns                                    | tests (in tests/)              |
|-----------------------|-----------------------------------------|--------------------------------|
| bindings.cpp          | every binding; the layer's all-reduce   | (all below)                    |
| decode.{h,cpp}        | norms, rotary, attention, gemv, a layer | workers/test_cpu_ops.py        |
| layer_rows.h          | decode.cpp's row kernels, for stack.cpp | cpu_ops/test_decode_stack.py   |
| stack.cpp             | DecodeStack: a decode step in one call  | cpu_ops/test_decode_stack.py   |
| quant.h               | the GGUF kernels' API and its switches  | cpu_ops/test_quant_kernels.py  |
| quant_api.cpp         | that API: checks, each product's path   | cpu_ops/test_quant_kernels.py  |
| quant_paths.h         | the paths a build has, their entries    | cpu_ops/test_quant_kernels.py  |
| quant_blocks.h        | type ids, format dispatch, fp16 scales  | cpu_ops/test_quant_kernels.py  |
| quant_formats.{h,cpp} | layouts, dequantize, Q5_0R, Q5_0->Q8_0  | cpu_ops/test_quant_kernels.py  |
| quant_gemv.cpp        | gemv, M <= 8 rows: exact and int8 VNNI  | cpu_ops/test_quant_kernels.py  |
| quant_vnni.h          | what the int8 gemv and the GEMMs share  | cpu_ops/test_quant_kernels.py  |
| quant_gemm.cpp        | int8 GEMM, M > 8 rows (AVX512-VNNI)     | cpu_ops/test_quant_kernels.py  |
| quant_amx.cpp         | bf16 GEMM on AMX tiles, 48 <= M < 512   | cpu_ops/test_quant_kernels.py  |
| quant_avx2.{h,cpp}    | int8 gemv on AVX2 without VNNI          | cpu_ops/test_quant_kernels.py  |
| row_shares.h          | row shares of a streamed weight         | models/test_shared_head.py     |
| sample.{h,cpp}        | fused sampling, logprobs, argmax        | workers/test_sampler_kernel.py |
| vec16.h               | 16-lane fp32 vectors and their exp      | workers/test_sampler_kernel.py |
| vec16_avx2.h          | the same lanes as two AVX2 halves       | workers/test_cpu_ops.py        |
| park.h                | a worker's idle threads asleep          | cpu_ops/test_park.py           |
| __init__.py           | the build, its cache and lock; loading  | cpu_ops/test_build_lock.py     |

bf16 models use every op; fp32 models the paged decode attention alone (`attention_kernel`);
GGUF weights the `quant` kernels (`load_quant`: vserve/models/quant_linear.py) and the decode
stack (vserve/models/fused_decode.py); every CPU model the sampler (`load_sampler`:
workers/cpu_sampling.py) and `parked` (workers/host_gap.py).

The extension is built the first time a CPU model loads (about 70 s on 2 cores), into
`$XDG_CACHE_HOME/vserve/cpu_ops/` (default `~/.cache`), in a folder keyed by the sources and
headers, the compiler flags, the torch and Python versions and the CPU's instruction sets;
later loads reuse it. Every file is compiled with the same flags (`cflags()`: -march=native
picks each kernel's instruction set; `VSERVE_CPU_ISA=avx2` or `portable` builds, in a folder
of its own, the kernels of a CPU with fewer: vserve/host/isa.py). Only bindings.cpp includes
torch's pybind11 glue; the kernels include the ATen headers they use.
Without a compiler, or with `VSERVE_CPU_OPS=0`, models keep the eager torch path. The
quantized kernels' switches (vserve/envs.py: `quant_exact`, `quant_amx`) are read once and
handed to the extension when it loads (`quant.set_options`).
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
from vserve.envs import ENV, read_env
from vserve.host import isa

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SAMPLE_SOURCE = HERE / "sample.cpp"
_state: dict[str, object] = {}


def enabled_by_env() -> bool:
    return read_env().cpu_ops  # read when asked: tests turn it off for a while


def _cpu_flags() -> bytes:
    """The instruction sets the build targets (-march=native): a cache shared by different
    CPUs must not hand one a binary built for the other."""
    flags = isa.raw_cpu_flags()
    return " ".join(sorted(flags)).encode() if flags else platform.processor().encode()


# every translation unit of the extension, the longest to compile first (ninja runs a few at
# once and takes them in this order: the build ends no later than its longest one)
SOURCES = tuple(
    HERE / name
    for name in (
        "bindings.cpp",
        "quant_gemv.cpp",
        "quant_avx2.cpp",
        "decode.cpp",
        "quant_gemm.cpp",
        "stack.cpp",
        "quant_amx.cpp",
        "quant_api.cpp",
        "quant_formats.cpp",
        "sample.cpp",
    )
)
CFLAGS = ["-O3", "-fopenmp"]  # and the ISA's -march (cflags)


def cflags() -> list[str]:
    return [*CFLAGS, *isa.compiler_flags()]


def build_dir(sources: tuple[Path, ...] = SOURCES) -> Path:
    headers = b"".join(h.read_bytes() for h in sorted(sources[0].parent.glob("*.h")))
    key = (
        b"".join(s.read_bytes() for s in sources)
        + headers  # the sources include them: a changed header is a new build
        + torch.__version__.encode()
        + sys.version.encode()
        + _cpu_flags()
        + " ".join(cflags()).encode()  # a flag changed (or the ISA) is a new build
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
    """The GGUF block-format kernels (quant_*.cpp: `load()`'s `quant` submodule), or None."""
    module = load()
    return None if module is None else module.quant


def _load(key: str, build):
    if key in _state:
        return _state[key]
    module = None
    if enabled_by_env():
        isa.check()  # a choice this CPU cannot run is the user's error, not a missing compiler
        try:
            module = build()
        except Exception as exc:  # no compiler, headers or linker: the eager path still works
            log.warning("vserve CPU kernels unavailable, using eager torch ops: %s", exc)
    _state[key] = module
    return module


def _build():
    module = _compile(SOURCES, "vserve_cpu_ops")
    _set_options(module)
    return module


def _set_options(module) -> None:
    """The switches vserve/envs.py read once, handed to the kernels (quant.h's `Options`)."""
    module.quant.set_options(exact=ENV.quant_exact, amx=ENV.quant_amx)


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
            extra_cflags=cflags(),
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
