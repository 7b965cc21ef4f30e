"""The frozen configs every layer reads: an `EngineConfig` made of small frozen parts.

They are resolved from what users pass by `vserve.engine.arg_utils.EngineArgs`. Values found at
start-up (the number of KV blocks) are returned by the engine, never written back into a
config. This module sits in the core layer: it imports no torch and nothing above the core.
"""

from __future__ import annotations

from dataclasses import dataclass

from vserve.core.scheduler import SchedulerConfig
from vserve.core.sliding_window import local_block_cap
from vserve.core.spec_decode import SpeculativeConfig
from vserve.host import isa


@dataclass(frozen=True)
class ModelConfig:
    model: str  # local folder with config.json and safetensors
    tokenizer: str
    architecture: str
    dtype: str  # float32 | bfloat16 | float16
    seed: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    served_model_name: str
    max_logprobs: int = 20
    # how linear weights are stored: "gguf" (a GGUF's own blocks), "int8" (Q8_0 blocks made at
    # load), "none" (dense in `dtype`); `dtype` is then the activations'
    quantization: str = "none"
    hidden_size: int = 0  # the size of an embedding (SamplingParams.pooling); 0: unknown


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    # None: what max_num_seqs x max_model_len use, at most 4 GiB, on CPU (committed as blocks
    # fill); gpu_memory_utilization on CUDA
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # window of the sliding-window layers' own KV group, whose blocks are returned once out of
    # the window; None: one group for every layer
    sliding_window: int | None = None


@dataclass(frozen=True)
class ParallelConfig:
    pipeline_parallel_size: int = 1
    # ranks per stage that split every layer (grid rank = pp_rank * tp + tp_rank)
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"  # uni | mp
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port
    nnodes: int = 1
    node_rank: int = 0
    layer_partition: tuple[int, ...] = ()  # decoder layers per stage; () = even split

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size


@dataclass(frozen=True)
class DataParallelConfig:
    """Data parallel: `size` independent engine cores behind one front end (or, with `rank`
    set, one plain server per rank behind an external load balancer)."""

    size: int = 1  # engine cores in all, over every host
    size_local: int = 1  # engine cores on this host
    start_rank: int = 0  # the first rank on this host
    rank: int | None = None  # external load balancing: this server runs only this rank
    address: str = "127.0.0.1"  # the head's address: remote engines connect to it
    rpc_port: int = 0  # the head's handshake port for remote (headless) engines
    keep_serving: bool = False  # one engine's death fails only its requests
    engine_index: int = 0  # the rank of the engine core this config was made for

    @property
    def local_ranks(self) -> range:
        return range(self.start_rank, self.start_rank + self.size_local)

    @property
    def remote_ranks(self) -> list[int]:
        """Ranks the head's front end reaches over TCP (started by `--headless` hosts)."""
        if self.rank is not None:  # external load balancing: this server's rank alone
            return []
        local = set(self.local_ranks)
        return [r for r in range(self.size) if r not in local]


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"  # cpu | cuda
    attention_backend: str = "torch"
    enforce_eager: bool = False


@dataclass(frozen=True)
class StructuredOutputConfig:
    """What one structured-output constraint may cost. A constraint's source (a JSON schema's
    text, a regex, a grammar, the choices) longer than `max_constraint_chars` is refused
    before it reaches the engine; a grammar is first compiled by a worker process that is
    killed past `compile_timeout` seconds or `compile_memory_mb` MiB, which fails only the
    requests that wait for it."""

    max_constraint_chars: int = 256 * 1024
    compile_timeout: float = 10.0
    compile_memory_mb: int = 2048

    def __post_init__(self) -> None:
        if not (isinstance(self.max_constraint_chars, int) and self.max_constraint_chars >= 1):
            raise ValueError(
                f"max_constraint_chars must be >= 1, got {self.max_constraint_chars!r}"
            )
        if not (isinstance(self.compile_timeout, (int, float)) and self.compile_timeout > 0):
            raise ValueError(f"grammar_compile_timeout must be > 0, got {self.compile_timeout!r}")
        if not (isinstance(self.compile_memory_mb, int) and self.compile_memory_mb >= 64):
            raise ValueError(
                f"grammar_compile_memory_mb must be >= 64, got {self.compile_memory_mb!r}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    async_scheduling: bool
    async_off_reason: str | None = None
    speculative: SpeculativeConfig | None = None
    # seconds a step may stay in flight, or the engine core go without answering, before the
    # engine is declared dead (0: no watchdog)
    watchdog_timeout: float = 300.0
    data_parallel: DataParallelConfig = DataParallelConfig()
    structured: StructuredOutputConfig = StructuredOutputConfig()

    @property
    def max_concurrent_batches(self) -> int:
        """Steps in flight. PP: one per stage, plus (async) the step being scheduled, which
        carries the requests of the step `pp` back, whose ids stage 0 has by then."""
        pp = self.parallel.pipeline_parallel_size
        if pp > 1:
            return pp + 1 if self.async_scheduling else pp
        return 2 if self.async_scheduling else 1

    @property
    def local_block_cap(self) -> int:
        """Most blocks the sliding-window KV group can use at once (0: no such group)."""
        window = self.cache.sliding_window
        if window is None:
            return 0
        s = self.scheduler
        return local_block_cap(
            window,
            self.cache.block_size,
            s.max_num_seqs,
            s.max_num_batched_tokens,
            self.max_concurrent_batches,
        )


def cpu_flags() -> set[str]:
    """The instruction sets vserve's CPU kernels may use: this CPU's, less what
    `VSERVE_CPU_ISA` turns off (vserve/host/isa.py)."""
    return isa.cpu_flags()


def cpu_has_bf16() -> bool:
    """Native bf16 matmul instructions (AVX512-BF16 or AMX) on this CPU."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_has_int8_gemv() -> bool:
    """An int8 gemv for quantized weights (vserve/cpu_ops: AVX512-VNNI, or AVX2 with FMA and
    F16C), which takes bf16 activations as they are on any such CPU."""
    flags = cpu_flags()
    return "avx512_vnni" in flags or {"avx2", "fma", "f16c"} <= flags


__all__ = [
    "EngineConfig",
    "ModelConfig",
    "CacheConfig",
    "ParallelConfig",
    "DeviceConfig",
    "DataParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "cpu_flags",
    "cpu_has_bf16",
    "cpu_has_int8_gemv",
]
