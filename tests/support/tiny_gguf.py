"""A tiny random-weight model as a GGUF model folder: a tiny Hugging Face model's tensors
written into a .gguf in block formats, its config and tokenizer beside the manifest
(`vserve.models.gguf_source`) that names the file, as `resolve` would describe a GGUF.

The tensors keep their checkpoint names in the file (the manifest maps each to itself), and
none of llama.cpp's conversion fixes apply (Gemma norms are written as 1 + w, as llama.cpp
stores them). The formats are mixed as in a real file (a fused projection's parts in
different formats); every weight's inputs are whole blocks of 32. Biases, zero in the tiny
checkpoints, are drawn at random so that a bias added on every rank shows.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

# GGML types by the projection a weight belongs to (whole-block formats gguf can quantize)
FORMATS = {
    "q_proj": "Q5_0",
    "k_proj": "Q5_0",
    "v_proj": "Q8_0",
    "o_proj": "Q4_0",
    "gate_proj": "Q8_0",
    "up_proj": "Q5_0",
    "down_proj": "Q4_0",
    "embed_tokens": "Q8_0",
    "lm_head": "Q5_0",
}
_COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def build_gguf_model(hf_folder: str | Path, target: Path, seed: int = 0) -> Path:
    """The model of `hf_folder` (tests.support.tiny_models) as a GGUF model folder."""
    from vserve.models.gguf_source import MANIFEST

    target = Path(target)
    if (target / MANIFEST).is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    hf_folder = Path(hf_folder)
    for name in _COPIED:
        if (hf_folder / name).is_file():
            shutil.copy(hf_folder / name, target / name)
    config = json.loads((hf_folder / "config.json").read_text())
    arch = config["model_type"].removesuffix("_text")
    names = _write(hf_folder, target / "model.gguf", arch, seed)
    manifest = {
        "file": str((target / "model.gguf").resolve()),
        "architecture": arch,
        "names": {n: n for n in names},
        "num_heads": config["num_attention_heads"],
        "num_kv_heads": config["num_key_value_heads"],
    }
    (target / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return target


def _write(hf_folder: Path, path: Path, arch: str, seed: int) -> list[str]:
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    if arch in ("llama", "mistral"):
        raise ValueError("llama.cpp permutes these q/k rows: not written here")
    rng = np.random.default_rng(seed)
    tensors = {}
    for file in sorted(hf_folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    writer = GGUFWriter(str(path), arch)
    for name, values in sorted(tensors.items()):
        values = values.astype(np.float32)
        qtype = _format(name)
        if qtype is not None:
            q = quantize(values, GGMLQuantizationType[qtype])
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType[qtype])
            continue
        if name.endswith(".bias"):
            values = rng.standard_normal(values.shape).astype(np.float32) * 0.5
        elif arch.startswith("gemma") and name.endswith("norm.weight"):
            values = values + 1.0  # llama.cpp stores Gemma's norm scales so
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(tensors)


def _format(name: str) -> str | None:
    if not name.endswith(".weight"):
        return None
    module = name.removesuffix(".weight").rpartition(".")[2]
    return FORMATS.get(module)
