"""What one pipeline stage's model runner needs of the engine's config: a frozen, torch-free
record that the engine core builds and sends to each worker process (the engine core itself
never imports torch)."""

from __future__ import annotations

from dataclasses import dataclass

from vserve.config import EngineConfig


@dataclass(frozen=True)
class RunnerConfig:
    model_path: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    block_size: int
    max_num_batched_tokens: int | None = None  # a step's most tokens (None: max_model_len)
    quantization: str = "none"
    device: str = "cpu"
    attention_backend: str = "torch"
    pp_rank: int = 0
    pp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    nnodes: int = 1  # hosts the grid spans (a TP group on one host all-reduces in shm)
    layer_partition: tuple[int, ...] = ()  # decoder layers per stage; () = even split
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enforce_eager: bool = False
    sliding_window: int | None = None  # the sliding-window KV group's window (None: no group)
    local_block_cap: int = 0  # most blocks that group holds

    @property
    def rank(self) -> int:
        """In the TP x PP grid (vserve.distributed.grid)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def local_rank(self) -> int:
        """Among the ranks of this host (the hosts split the grid evenly, in rank order)."""
        return self.rank % (self.pp_size * self.tp_size // self.nnodes)

    @staticmethod
    def of(config: EngineConfig, pp_rank: int = 0, tp_rank: int = 0) -> RunnerConfig:
        """What TP rank `tp_rank` of pipeline stage `pp_rank` needs of the engine's config."""
        m, c, s, d = config.model, config.cache, config.scheduler, config.device
        return RunnerConfig(
            model_path=m.model,
            dtype=m.dtype,
            quantization=m.quantization,
            max_model_len=m.max_model_len,
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            block_size=c.block_size,
            device=d.device,
            attention_backend=d.attention_backend,
            pp_rank=pp_rank,
            pp_size=config.parallel.pipeline_parallel_size,
            tp_rank=tp_rank,
            tp_size=config.parallel.tensor_parallel_size,
            nnodes=config.parallel.nnodes,
            layer_partition=config.parallel.layer_partition,
            kv_cache_memory_bytes=c.kv_cache_memory_bytes,
            gpu_memory_utilization=c.gpu_memory_utilization,
            num_gpu_blocks_override=c.num_gpu_blocks_override,
            enforce_eager=d.enforce_eager,
            sliding_window=c.sliding_window,
            local_block_cap=config.local_block_cap,
        )
