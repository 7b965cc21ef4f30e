"""Every environment variable vserve reads, typed, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Env:
    log_level: str  # VSERVE_LOG_LEVEL: log level of engine and worker processes
    engine_ready_timeout: float  # VSERVE_ENGINE_READY_TIMEOUT: seconds to wait for start-up
    dist_timeout: float  # VSERVE_DIST_TIMEOUT: torch.distributed op timeout (s)
    fault_inject: str | None  # VSERVE_FAULT_INJECT="execute_model:N": raise at step N,
    # "execute_model_hang:N": never return from step N, "execute_model_delay:MS": every step
    # sleeps MS ms first, or "grammar_compile_delay:S": compiles take S s longer
    # (testing hooks for failure handling)
    api_key: str | None  # VSERVE_API_KEY: server API key when --api-key is absent
    cpu_num_reserved: str | None  # VSERVE_CPU_NUM_RESERVED: cores kept for the engine core
    # and front end beside CPU workers ("auto" / unset: chosen
    # from measured host work per step; vLLM's
    # VLLM_CPU_NUM_OF_RESERVED_CPU)
    cpu_threads_bind: str | None  # VSERVE_CPU_THREADS_BIND: "auto", "nobind" or one CPU list
    # per local worker, "0-3|4-7" (VLLM_CPU_OMP_THREADS_BIND)
    pp_layer_partition: str | None  # VSERVE_PP_LAYER_PARTITION="10,8": decoder layers per
    # pipeline stage, first to last (default: by cost)
    debug_invariants: bool  # VSERVE_DEBUG_INVARIANTS=1: the engine core checks the
    # scheduler and KV-block invariants each time it goes idle
    # (free + cached + in-use == total, none in use); on in tests
    dp_secret: str | None = None  # VSERVE_DP_SECRET: shared secret (at least 16 characters)
    # of a multi-host data-parallel setup; the CURVE keys of its TCP connections derive from
    # it (without it, a loopback head makes a random one per run: dp/transport.py)
    weight_cache: bool = True  # VSERVE_WEIGHT_CACHE=0: load CPU weights from the checkpoint
    # every time, without the memory-mapped copy on disk
    cpu_park: bool = True  # VSERVE_CPU_PARK=0: a CPU worker's other threads spin between
    # forwards instead of sleeping while the host works (workers/host_gap.py)
    quant_repack: bool = True  # VSERVE_QUANT_REPACK=0: Q5_0 weights stay in their GGUF
    # bytes instead of the quad gemv's layout (vserve/models/quant_linear.py)
    cpu_ops: bool = True  # VSERVE_CPU_OPS=0: no C++ kernels; models keep the eager torch path
    quant_exact: bool = False  # VSERVE_QUANT_EXACT=1: the quantized CPU kernels multiply bf16
    # activations on their exact path too (fp32 products of the dequantized weights), not int8
    quant_amx: bool = True  # VSERVE_QUANT_AMX=0: batched bf16 rows on quantized weights take the
    # int8 GEMM, not the AMX tiles (both set once in the kernels at load: vserve/cpu_ops)
    cpu_isa: str = "native"  # VSERVE_CPU_ISA=avx_vnni / avx2 / portable: the CPU kernels built
    # and chosen as on a CPU with AVX2 and AVX-VNNI, no AVX-512 (Intel's client cores) / with
    # AVX2 alone / with no x86 vector paths (vserve/host/isa.py)


def read_env() -> Env:
    return Env(
        log_level=os.environ.get("VSERVE_LOG_LEVEL", "WARNING"),
        engine_ready_timeout=float(os.environ.get("VSERVE_ENGINE_READY_TIMEOUT", 600)),
        dist_timeout=float(os.environ.get("VSERVE_DIST_TIMEOUT", 1800)),
        fault_inject=os.environ.get("VSERVE_FAULT_INJECT") or None,
        api_key=os.environ.get("VSERVE_API_KEY") or None,
        cpu_num_reserved=os.environ.get("VSERVE_CPU_NUM_RESERVED") or None,
        cpu_threads_bind=os.environ.get("VSERVE_CPU_THREADS_BIND") or None,
        pp_layer_partition=os.environ.get("VSERVE_PP_LAYER_PARTITION") or None,
        debug_invariants=os.environ.get("VSERVE_DEBUG_INVARIANTS", "0") not in ("", "0"),
        dp_secret=os.environ.get("VSERVE_DP_SECRET") or None,
        weight_cache=os.environ.get("VSERVE_WEIGHT_CACHE", "1") not in ("0", "false", "off"),
        cpu_park=os.environ.get("VSERVE_CPU_PARK", "1") not in ("0", "false", "off"),
        quant_repack=os.environ.get("VSERVE_QUANT_REPACK", "1") not in ("0", "false", "off"),
        cpu_ops=os.environ.get("VSERVE_CPU_OPS", "1") not in ("0", "false", "off"),
        quant_exact=os.environ.get("VSERVE_QUANT_EXACT", "") not in ("", "0", "false", "off"),
        quant_amx=os.environ.get("VSERVE_QUANT_AMX", "1") not in ("0", "false", "off"),
        cpu_isa=_cpu_isa(os.environ.get("VSERVE_CPU_ISA", "")),
    )


def _cpu_isa(value: str) -> str:
    value = value.strip().lower() or "native"
    if value not in ("native", "avx_vnni", "avx2", "portable"):
        raise ValueError(
            f"VSERVE_CPU_ISA must be native, avx_vnni, avx2 or portable, not {value!r}"
        )
    return value


ENV = read_env()
