"""Build one pipeline stage of a model (one tensor-parallel shard of it) on a device and fill
it from safetensors files or a GGUF (`gguf_source`), with linear weights dense or in block
formats (`quant_linear`; under tensor parallel each rank parks its slice of the blocks,
`parallel_layers`)."""

from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path

import torch
from torch import nn

from vserve import cpu_ops
from vserve.distributed.tp_comm import TPShard
from vserve.models import weight_cache
from vserve.models.fused_decode import attach_kernel
from vserve.models.gguf_source import gguf_file, iter_gguf_weights
from vserve.models.packed_linear import can_pack, pack_linears, share_tied_head
from vserve.models.quant_linear import install, park_int8
from vserve.models.registry import model_class
from vserve.models.shared_head import share_head
from vserve.models.stage import StageInfo

logger = logging.getLogger("vserve")


def load_model(
    model_path: str,
    hf_config,
    stage: StageInfo,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantization: str = "none",
    tp: TPShard = TPShard(),
) -> nn.Module:
    cls = model_class(hf_config.architectures[0] if hf_config.architectures else "")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = cls(hf_config, stage, max_positions, tp)
    finally:
        torch.set_default_dtype(previous)
    _materialize(model, device)
    qkernel = _quant_kernel(quantization, device, dtype)
    if gguf_file(model_path) is not None:
        quantized = quantization == "gguf" and qkernel is not None
        _fill_gguf(model, model_path, dtype, device, (stage, tp), quantized)
    else:
        _fill(model, model_path, dtype, device, (stage, tp))
    if qkernel is not None:
        if quantization == "int8":
            park_int8(model)
        install(model, qkernel, dtype)
    for module in model.modules():
        if hasattr(module, "post_load"):
            module.post_load()  # tables: rotary cos/sin, and those derived from the weights
    model = model.eval().requires_grad_(False)
    packable = can_pack(device, dtype)
    # quantized bf16 models take the CPU kernels (the int8 gemv, the fused layers) on any CPU
    # that builds them; dense bf16 weights need the packed (oneDNN) linears too
    if packable or (qkernel is not None and dtype == torch.bfloat16):
        kernel = cpu_ops.load()
        if packable:  # bitwise the same outputs, without a weight reorder per call
            pack_linears(model, keep_plain=kernel is not None)
        if kernel is not None:
            share_tied_head(model)
            attach_kernel(model, kernel)
    elif device.type == "cpu" and dtype == torch.float32 and qkernel is None:
        kernel = cpu_ops.load()  # (fp32 models' attention loads it too)
        if kernel is not None:
            share_head(model, kernel)
    return model


def _materialize(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device)` without its meta-tensor `empty_like`, whose reference
    implementation imports sympy (~0.6 s of a worker's start-up)."""
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def _quant_kernel(quantization: str, device: torch.device, dtype: torch.dtype):
    """The block-format kernels, or None: dense weights (`none`, CUDA, no compiler)."""
    if quantization == "none":
        return None
    kernel = cpu_ops.load_quant() if device.type == "cpu" else None
    if kernel is None:
        why = "the CPU kernels are unavailable" if device.type == "cpu" else "CPU kernels only"
        logger.warning(
            "quantization=%r: %s; weights dequantized at load to %s on %s",
            quantization,
            why,
            dtype,
            device,
        )
    return kernel


def _fill_gguf(model, model_path, dtype, device, stage, quantized: bool) -> None:
    """A GGUF's tensors: block formats parked for `install`, or dequantized (then, dense, the
    same memory-mapped copy as a safetensors checkpoint gets)."""
    if quantized:
        model.load_weights(iter_gguf_weights(model_path, dtype, quantized=True))
        return
    files = [gguf_file(model_path)]
    kernels = cpu_ops.load_quant() if device.type == "cpu" else None
    weights = partial(iter_gguf_weights, model_path, dtype, quantized=False, kernels=kernels)
    _fill_cached(model, model_path, files, dtype, device, stage, weights)


def _fill(
    model: nn.Module,
    model_path: str,
    dtype: torch.dtype,
    device: torch.device,
    stage: tuple[StageInfo, TPShard],
) -> None:
    files = _safetensors_files(Path(model_path))
    weights = partial(iter_weights, model_path, dtype)
    _fill_cached(model, model_path, files, dtype, device, stage, weights)


def _fill_cached(model, model_path, files, dtype, device, stage, weights) -> None:
    """The checkpoint's weights (`weights()`), or their memory-mapped copy from an earlier
    load."""
    if not files or not weight_cache.enabled(device, files):
        model.load_weights(weights())
        return
    stage_info, tp = stage
    path = weight_cache.cache_file(model_path, files, dtype, stage_info, tp.key())
    if weight_cache.load_into(model, path):
        logger.info("weights memory-mapped from %s", path)
        return
    model.load_weights(weights())
    weight_cache.save(model, path)


def iter_weights(model_path: str, dtype: torch.dtype):
    from safetensors import safe_open

    folder = Path(model_path)
    files = _safetensors_files(folder)
    if not files:
        raise ValueError(f"no .safetensors weights in {model_path}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))
