"""Engine arguments (vLLM's names) and their resolution into the frozen `EngineConfig`.

`EngineArgs` is what users pass (`LLM(**kwargs)`, CLI flags). `EngineArgs.create_engine_config()`
resolves the model (the embedded default, a folder, a GGUF), reads its config, checks every
value and returns an `EngineConfig` (`vserve.config`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from vserve.config import (
    CacheConfig,
    DataParallelConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    StructuredOutputConfig,
    cpu_has_bf16,
    cpu_has_int8_gemv,
)
from vserve.models.hf_config import layer_windows, load_hf_config

_DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}
# CPU defaults that suit a small machine (2 cores): a batch of 64 already saturates the
# matmuls, and an 8k-token prompt takes seconds to prefill. The KV budget follows from them.
CPU_DEFAULT_MAX_NUM_SEQS = 64
CPU_DEFAULT_MAX_MODEL_LEN = 8192
QUANTIZATIONS = ("gguf", "int8", "none")
DEFAULT_MAX_NUM_SEQS = 256
MAX_DATA_PARALLEL = 1024  # engine cores behind one front end: a sanity bound, not a tuning


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    quantization: str | None = None  # None: "gguf" for a GGUF model, else "none"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # None: 64 on CPU, 256 on CUDA
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    served_model_name: str | list[str] | None = None
    async_scheduling: bool | None = None
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    nnodes: int = 1
    node_rank: int = 0
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None  # None: every rank on this host
    data_parallel_start_rank: int = 0
    data_parallel_rank: int | None = None  # external load balancing: this rank only
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 0
    data_parallel_keep_serving: bool = False
    device: str = "auto"
    attention_backend: str | None = None
    max_logprobs: int = 20
    disable_log_stats: bool = True
    speculative_config: dict | str | None = None
    watchdog_timeout: float = 300.0
    max_constraint_chars: int = StructuredOutputConfig.max_constraint_chars
    grammar_compile_timeout: float = StructuredOutputConfig.compile_timeout
    grammar_compile_memory_mb: int = StructuredOutputConfig.compile_memory_mb

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def create_engine_config(self) -> EngineConfig:
        from vserve.models.resolve import resolve_model_path

        model_path = resolve_model_path(self.model)
        hf_config = load_hf_config(model_path)
        device = _resolve_device(self.device)
        model_cfg = self._model_config(model_path, hf_config, device)
        backend = self.attention_backend or ("triton" if device == "cuda" else "torch")
        from vserve.attention import available_backends

        _require(
            backend in available_backends(),
            f"attention_backend must be one of {available_backends()}, got {backend!r}",
        )
        async_on, reason = self._async_decision()
        parallel = self._parallel_config(device, async_on, hf_config, model_cfg)
        max_num_seqs = self.max_num_seqs
        if max_num_seqs is None:
            max_num_seqs = CPU_DEFAULT_MAX_NUM_SEQS if device == "cpu" else DEFAULT_MAX_NUM_SEQS
        _require(max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {max_num_seqs}")
        batched = self.max_num_batched_tokens or 2048
        _require(batched >= 1, f"max_num_batched_tokens must be >= 1, got {batched}")
        _require(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            f"block_size must be a power of two up to 128, got {self.block_size}",
        )
        scheduler = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=batched,
            max_model_len=model_cfg.max_model_len,
            async_scheduling=async_on,
            pipeline_parallel_size=parallel.pipeline_parallel_size,
        )
        cache = CacheConfig(
            self.block_size,
            self.enable_prefix_caching,
            self.num_gpu_blocks_override,
            self.kv_cache_memory_bytes,
            self.gpu_memory_utilization,
            kv_sliding_window(hf_config, backend, model_cfg.max_model_len),
        )
        return EngineConfig(
            model_cfg,
            cache,
            scheduler,
            parallel,
            DeviceConfig(device, backend, self.enforce_eager),
            async_on,
            reason,
            self._speculative(),
            _watchdog_timeout(self.watchdog_timeout),
            self._data_parallel(),
            StructuredOutputConfig(
                self.max_constraint_chars,
                self.grammar_compile_timeout,
                self.grammar_compile_memory_mb,
            ),
        )

    def _data_parallel(self) -> DataParallelConfig:
        size, rank = self.data_parallel_size, self.data_parallel_rank
        _require(
            isinstance(size, int) and 1 <= size <= MAX_DATA_PARALLEL,
            f"data_parallel_size must be in [1, {MAX_DATA_PARALLEL}], got {size!r}",
        )
        _require_port("data_parallel_rpc_port", self.data_parallel_rpc_port)
        for name in ("data_parallel_size_local", "data_parallel_start_rank", "data_parallel_rank"):
            value = getattr(self, name)
            _require(
                value is None or isinstance(value, int),
                f"{name} must be an integer, got {value!r}",
            )
        if rank is not None:  # external LB: one plain engine, numbered `rank`
            _require(
                0 <= rank < size,
                f"data_parallel_rank must be in [0, data_parallel_size), got {rank} of {size}",
            )
            return DataParallelConfig(size, 1, rank, rank, engine_index=rank)
        local = size if self.data_parallel_size_local is None else self.data_parallel_size_local
        start = self.data_parallel_start_rank
        _require(
            0 <= local and 0 <= start and start + local <= size and (start == 0 or local >= 1),
            f"data_parallel_start_rank {start} + data_parallel_size_local {local} must lie in "
            f"data_parallel_size {size}",
        )
        _require(
            size == 1 or self.nnodes == 1,
            "data parallel with a multi-host TP/PP engine (nnodes > 1) is not supported",
        )
        dp = DataParallelConfig(
            size,
            local,
            start,
            None,
            self.data_parallel_address,
            self.data_parallel_rpc_port,
            bool(self.data_parallel_keep_serving),
            engine_index=start,
        )
        if dp.remote_ranks or start > 0:
            from vserve.engine.dp.transport import check_remote_setup

            check_remote_setup(dp.address, dp.rpc_port)
        return dp

    def _speculative(self) -> SpeculativeConfig | None:
        value = self.speculative_config
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config must be JSON: {e}") from e
        spec = SpeculativeConfig.from_dict(value)
        _require(
            spec is None or self.pipeline_parallel_size == 1,
            "speculative decoding with pipeline parallel is not supported",
        )
        _require(
            spec is None or self.tensor_parallel_size == 1,
            "speculative decoding with tensor parallel is not supported",
        )
        return spec

    def _model_config(self, model_path: str, hf_config, device: str) -> ModelConfig:
        from vserve.models.gguf_source import gguf_file
        from vserve.models.registry import check_gguf_architecture, resolve_architecture

        arch = resolve_architecture(getattr(hf_config, "architectures", None))
        if gguf_file(model_path) is not None:
            check_gguf_architecture(arch)
        _require(
            self.dtype in _DTYPES,
            f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}",
        )
        dtype = _DTYPES[self.dtype]
        quantization = self._quantization(model_path)
        if dtype == "auto":
            dtype = str(getattr(hf_config, "dtype", None) or "float32").replace("torch.", "")
            dtype = _DTYPES.get(dtype, "float32")
            # quantized weights on a CPU without bf16 instructions: the int8 gemv takes bf16
            # activations as they are, and only in bf16 does decode run the fused layer
            # kernels (the embedded GGUF's batch-1 step on an AVX2 EPYC: 22 -> 13 ms); the
            # larger matmuls multiply in fp32 there
            quantized_cpu = device == "cpu" and quantization != "none" and cpu_has_int8_gemv()
            if dtype == "float32" and (device == "cuda" or cpu_has_bf16() or quantized_cpu):
                # fp32 weights, bf16 compute: 2-3x faster matmuls where the hardware has
                # bf16 instructions; pass dtype="float32" for exact fp32 numerics
                dtype = "bfloat16"
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        default_len = min(limit, CPU_DEFAULT_MAX_MODEL_LEN) if device == "cpu" else limit
        max_len = self.max_model_len or default_len
        _require(
            isinstance(max_len, int) and 1 < max_len <= limit,
            f"max_model_len must be in [2, {limit}] (the model's "
            f"max_position_embeddings), got {self.max_model_len!r}",
        )
        names = self.served_model_name or [self.model or "gemma-3-270m"]
        if isinstance(names, str):
            names = [names]
        return ModelConfig(
            model=model_path,
            tokenizer=self.tokenizer or model_path,
            architecture=arch,
            dtype=dtype,
            seed=int(self.seed),
            max_model_len=max_len,
            vocab_size=hf_config.vocab_size,
            eos_token_ids=eos_ids(model_path, hf_config),
            served_model_name=names[0],
            max_logprobs=self.max_logprobs,
            quantization=quantization,
            hidden_size=int(getattr(hf_config, "hidden_size", 0) or 0),
        )

    def _quantization(self, model_path: str) -> str:
        from vserve.models.gguf_source import gguf_file

        is_gguf = gguf_file(model_path) is not None
        value = self.quantization
        if value is None:
            value = "gguf" if is_gguf else "none"
        _require(
            value in QUANTIZATIONS,
            f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {value!r}",
        )
        _require(
            value != "gguf" or is_gguf,
            "quantization='gguf' needs a GGUF model (a .gguf file or the embedded model); "
            "use 'int8' to quantize a safetensors model at load",
        )
        return value

    def _parallel_config(
        self, device: str, async_on: bool, hf_config, model_cfg: ModelConfig
    ) -> ParallelConfig:
        max_model_len = model_cfg.max_model_len
        pp = self.pipeline_parallel_size
        layers = hf_config.num_hidden_layers
        _require(
            isinstance(pp, int) and 1 <= pp <= layers + 1,
            f"pipeline_parallel_size must be in [1, {layers + 1}] (the model's {layers} layers, "
            f"and a stage for the lm_head alone), got {pp!r}",
        )
        tp = self.tensor_parallel_size
        _require(isinstance(tp, int) and tp >= 1, f"tensor_parallel_size must be >= 1, got {tp!r}")
        if tp > 1:
            _check_tensor_parallel(hf_config, tp, model_cfg, device)
        backend = self.distributed_executor_backend or default_executor(pp * tp, device, async_on)
        _require(
            backend in ("uni", "mp"),
            f"distributed_executor_backend must be 'uni' or 'mp', got {backend!r}",
        )
        _require(
            not (pp * tp > 1 and backend == "uni"),
            "pipeline_parallel_size or tensor_parallel_size > 1 needs "
            "distributed_executor_backend='mp'",
        )
        _require(
            (pp * tp) % self.nnodes == 0,
            f"nnodes {self.nnodes} must divide the grid's {pp * tp} ranks (pipeline x tensor "
            "parallel sizes)",
        )
        _require_port("master_port", self.master_port)
        _require(
            self.nnodes >= 1 and 0 <= self.node_rank < self.nnodes,
            f"node_rank must be in [0, nnodes), got {self.node_rank} of {self.nnodes}",
        )
        from vserve import envs
        from vserve.models.partition import stage_layer_counts

        # stages balanced by estimated cost (the lm_head counts), or VSERVE_PP_LAYER_PARTITION
        partition = (
            stage_layer_counts(
                hf_config, pp, min(max_model_len, 2048) // 2, envs.ENV.pp_layer_partition
            )
            if pp > 1
            else ()
        )
        return ParallelConfig(
            pp,
            tp,
            backend,
            self.master_addr,
            self.master_port,
            self.nnodes,
            self.node_rank,
            partition,
        )

    def _async_decision(self) -> tuple[bool, str | None]:
        if self.async_scheduling is False:
            return False, "async_scheduling=False was requested"
        return True, None


def _check_tensor_parallel(hf_config, tp: int, model_cfg: ModelConfig, device: str) -> None:
    """The combinations tensor parallel supports: heads and MLP that split, and GGUF blocks
    whose row-parallel weights (o, down) split by whole blocks (on CPU: elsewhere they are
    dequantized at load). int8 blocks are made from each rank's slice: any shape goes."""
    from vserve.models.gguf_source import check_tp_blocks
    from vserve.models.parallel_layers import ROW_PARALLEL_WEIGHTS, check_tp

    check_tp(hf_config, tp)
    if model_cfg.quantization == "gguf" and device == "cpu":
        check_tp_blocks(model_cfg.model, tp, ROW_PARALLEL_WEIGHTS)


def kv_sliding_window(hf_config, backend: str, max_model_len: int) -> int | None:
    """The window of a separate KV group for the sliding-window layers, or None: no such
    layers, a window as long as the context, or the Triton backend (one block table)."""
    windows = [w for w in layer_windows(hf_config) if w]
    if backend != "torch" or not windows or max(windows) >= max_model_len:
        return None
    return max(windows)


def default_executor(world_size: int, device: str, async_on: bool) -> str:
    """Workers get their own processes for PP or TP (`world_size`: their product), and on CPU
    whenever async scheduling is on: there the forward can only overlap the scheduler from
    another process. On CUDA a single worker stays in the engine core's process (kernels run
    asynchronously)."""
    if world_size > 1 or (async_on and device == "cpu"):
        return "mp"
    return "uni"


def _watchdog_timeout(value) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    _require(
        ok and math.isfinite(value) and value >= 0,
        f"watchdog_timeout must be a finite number of seconds >= 0 (0: off), got {value!r}",
    )
    return float(value)


def eos_ids(model_path: str, hf_config) -> tuple[int, ...]:
    """EOS ids from config.json and generation_config.json (both may hold lists)."""
    import json
    from pathlib import Path

    ids: list[int] = []

    def add(value):
        for v in [value] if isinstance(value, int) else (value or []):
            if v not in ids:
                ids.append(v)

    add(getattr(hf_config, "eos_token_id", None))
    gen = Path(model_path) / "generation_config.json"
    if gen.is_file():
        add(json.loads(gen.read_text()).get("eos_token_id"))
    return tuple(ids)


def _resolve_device(device: str) -> str:
    if device == "auto" and _cpu_only_torch():
        return "cpu"  # known without importing torch (a second of start-up, 300 MB)
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    _require(device in ("cpu", "cuda"), f"device must be auto, cpu or cuda; got {device!r}")
    _require(device != "cuda" or torch.cuda.is_available(), "device='cuda' but no CUDA device")
    return device


def _cpu_only_torch() -> bool:
    """A torch build without any GPU support (its version says `+cpu`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch").endswith("+cpu")
    except PackageNotFoundError:
        return False


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _require_port(name: str, port: int) -> None:
    """A TCP port or 0 (unset): zmq and sockets would take 70000 as 70000 mod 65536."""
    _require(
        isinstance(port, int) and 0 <= port <= 65535,
        f"{name} must be a TCP port in [0, 65535] (0: unset), got {port!r}",
    )
