"""The instruction sets vserve's CPU kernels target: all this CPU has, or fewer on request.

`VSERVE_CPU_ISA` (vserve/envs.py) picks one:

| value              | vserve's kernels (vserve/cpu_ops)     | torch's own kernels               |
|--------------------|---------------------------------------|-----------------------------------|
| `native` (default) | `-march=native`: every path this CPU  | as torch chooses                  |
|                    | has (AVX-512, VNNI, AMX, AVX2)        |                                   |
| `avx_vnni`         | `-march=x86-64-v3 -mavxvnni`: as      | ATen, oneDNN and MKL held to AVX2 |
|                    | `avx2`, and AVX-VNNI's 256-bit dots   |                                   |
|                    | (Intel's client cores: Alder Lake on) |                                   |
| `avx2`             | `-march=x86-64-v3`: AVX2, FMA, F16C,  | ATen, oneDNN and MKL held to AVX2 |
|                    | no AVX-512, VNNI or AMX               |                                   |
| `portable`         | `-march=x86-64` on x86: no x86 vector | ATen's default kernels, oneDNN    |
|                    | path (the code aarch64 compiles)      | and MKL held to SSE4              |

so that the AVX2 kernels, which most laptops and many cloud VMs run, can be tested and timed on
an AVX-512 machine, and the portable ones on any; `avx_vnni` needs a CPU that has it (it is
refused on one without). Everything that asks which instructions the
CPU has asks `cpu_flags()`, which leaves out what the switch turns off: the dtype `auto`
resolves to, the kernel tests' choices, the build's cache key. Each build has its own cache
folder (the compiler flags are part of its key). `pin_torch()` sets torch's own switches in the
environment of this process and the ones it starts (`vserve/__init__.py` calls it on import,
before any kernel runs: ATen, oneDNN and MKL read them when first used).
"""

from __future__ import annotations

import os
import platform
from collections.abc import MutableMapping

from vserve.envs import read_env

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
# the flags (as /proc/cpuinfo names them) each choice turns off
_ABOVE_AVX2 = ("avx512", "amx", "avx_", "avx10")
_AVX_VNNI = "avx_vnni"
_ABOVE_SSE2 = (*_ABOVE_AVX2, "avx", "fma", "f16c", "sse3", "ssse3", "sse4", "pni")
_AVX2_TORCH = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
_TORCH_ENV = {
    "avx_vnni": _AVX2_TORCH,
    "avx2": _AVX2_TORCH,
    "portable": {
        "ATEN_CPU_CAPABILITY": "default",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    },
}


def chosen() -> str:
    return read_env().cpu_isa  # read when asked: tests change it for a while


def raw_cpu_flags() -> set[str]:
    """The instruction-set flags /proc/cpuinfo lists for this CPU (empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def cpu_flags(isa: str | None = None) -> set[str]:
    """This CPU's flags less those the chosen ISA (default: `VSERVE_CPU_ISA`) turns off."""
    isa = isa or chosen()
    flags = raw_cpu_flags()
    if isa == "native":
        return flags
    off = _ABOVE_SSE2 if isa == "portable" else _ABOVE_AVX2
    kept = {f for f in flags if not f.startswith(off)}
    return kept | ({_AVX_VNNI} & flags if isa == "avx_vnni" else set())


def compiler_flags(isa: str | None = None) -> list[str]:
    """The -march (and -mtune) a CPU kernel build uses for the chosen ISA."""
    isa = isa or chosen()
    if not _X86 or isa == "native":
        return ["-march=native"]
    if isa == "portable":
        return ["-march=x86-64", "-mtune=native"]
    if isa == "avx2":
        return ["-march=x86-64-v3", "-mtune=native"]
    check(isa)
    return ["-march=x86-64-v3", "-mavxvnni", "-mtune=native"]


def check(isa: str | None = None) -> None:
    """Refuse a choice this CPU cannot run: the kernels it builds would stop at their first
    AVX-VNNI instruction."""
    isa = isa or chosen()
    if isa == "avx_vnni" and _AVX_VNNI not in raw_cpu_flags():
        raise ValueError("VSERVE_CPU_ISA=avx_vnni: this CPU has no AVX-VNNI (avx_vnni)")


def torch_env(isa: str | None = None) -> dict[str, str]:
    """The environment that holds torch's own kernels to the chosen ISA (x86 only)."""
    isa = isa or chosen()
    return dict(_TORCH_ENV.get(isa, {})) if _X86 else {}


def pin_torch(environ: MutableMapping[str, str] | None = None) -> None:
    """Set `torch_env()` in `environ` (default: this process's, and so every process started
    from here); a value the user set stays."""
    environ = os.environ if environ is None else environ
    for key, value in torch_env().items():
        environ.setdefault(key, value)
