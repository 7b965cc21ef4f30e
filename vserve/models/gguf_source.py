"""A GGUF file as a model's weights: its tensors by Hugging Face name, in their stored blocks.

`vserve.models.resolve` turns a `.gguf` into a small folder (config.json, tokenizer and
`gguf_weights.json`, no weights): the manifest names the file and maps each GGUF tensor name
(`blk.3.attn_q.weight`) to the checkpoint name the model classes load
(`model.layers.3.self_attn.q_proj.weight`), computed once by transformers' own mapping.

`iter_gguf_weights` yields the tensors under those names: float tensors (F32/F16/BF16, the
norms) as torch tensors in the model's dtype, block-quantized ones either as `QuantBlocks` (the
raw bytes, one row of blocks per output feature, for the CPU kernels: `quantization="gguf"`) or
dequantized by `gguf`'s own code (`quantization="none"`). Two fixes llama.cpp's converter made
are undone here, as transformers does: Gemma norms were stored as 1 + w, and Llama/Mistral
q/k rows were permuted for llama.cpp's rotary layout (a permutation of whole rows, so it applies
to quantized rows unchanged).
"""

from __future__ import annotations

import json
import re
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the front end reads manifests without importing torch or numpy
    import numpy as np
    import torch

MANIFEST = "gguf_weights.json"
# GGML type ids of the block formats the CPU kernels run (vserve/cpu_ops/quant_formats.h)
BLOCK_FORMATS = {2: "Q4_0", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
BLOCK_SIZES = {2: 32, 6: 32, 8: 32, 12: 256, 13: 256, 14: 256}  # inputs per block
# not a GGML type: Q5_0 repacked at load for the CPU kernels (quant_formats.h's Q5_0R, four blocks
# of 32 in 88 bytes; `quant_linear.install`)
Q5_0, Q8_0, Q5_0R = 6, 8, 1006
_NAMES, _SIZES = {**BLOCK_FORMATS, Q5_0R: "Q5_0R"}, {**BLOCK_SIZES, Q5_0R: 128}
_PERMUTE_QK = ("llama", "mistral", "granite", "smollm3")  # llama.cpp's rotary row order
HEAD_BYTES = 16 * 2**20  # first read of a header; those with large vocabularies run to MiBs


@dataclass(frozen=True)
class QuantBlocks:
    """One weight in a GGUF block format: `data` [N, row_bytes] uint8, `shape` (N, K)."""

    qtype: int
    data: torch.Tensor
    shape: tuple[int, int]

    @property
    def name(self) -> str:
        return _NAMES[self.qtype]

    @property
    def block_size(self) -> int:
        return _SIZES[self.qtype]

    def rows(self, start: int, count: int) -> QuantBlocks:
        """Output features [start, start + count): whole rows of blocks (a view)."""
        if not 0 <= start <= start + count <= self.shape[0]:
            raise ValueError(f"rows [{start}, {start + count}) of a weight with {self.shape[0]}")
        return QuantBlocks(self.qtype, self.data[start : start + count], (count, self.shape[1]))

    def cols(self, start: int, count: int) -> QuantBlocks:
        """Inputs [start, start + count), in whole blocks (a copy: each row's slice of its
        bytes); ValueError when the range cuts a block."""
        block, (n, k) = self.block_size, self.shape
        if start % block or count % block or not 0 <= start < start + count <= k:
            raise ValueError(
                f"inputs [{start}, {start + count}) of a {self.name} weight with {k} inputs are "
                f"not whole blocks of {block}"
            )
        per_block = self.data.shape[1] // (k // block)
        data = self.data[:, start // block * per_block : (start + count) // block * per_block]
        return QuantBlocks(self.qtype, data.contiguous(), (n, count))


def manifest_path(model_path: str | Path) -> Path:
    return Path(model_path) / MANIFEST


def gguf_file(model_path: str | Path) -> Path | None:
    """The GGUF a model folder reads its weights from, or None (a safetensors folder)."""
    path = manifest_path(model_path)
    if not path.is_file():
        return None
    return Path(json.loads(path.read_text())["file"])


def write_manifest(folder: Path, gguf: Path, hf_config) -> str:
    """Map the file's tensor names to checkpoint names with transformers (the front end's
    process, once per conversion); returns the model's class name (`architectures`)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    table = read_tensor_table(gguf)
    # by the file's architecture: a Mixtral file is llama.cpp's `llama` with experts
    names = get_gguf_hf_weights_map(model, TensorProcessor(), model_type=table.architecture)
    manifest = {
        "file": str(gguf.resolve()),
        "architecture": table.architecture,
        "names": {t.name: _hf_name(t.name, names) for t in table.tensors},
        "num_heads": hf_config.num_attention_heads,
        "num_kv_heads": getattr(hf_config, "num_key_value_heads", hf_config.num_attention_heads),
    }
    manifest_path(folder).write_text(json.dumps(manifest, indent=1))
    return type(model).__name__


def _hf_name(gguf_name: str, names: dict[str, str]) -> str | None:
    """transformers' name for a tensor; a stacked experts tensor (which transformers' mapping
    leaves out) under its projection's name, split per expert as it is read (`_pieces`)."""
    stacked = _EXPERTS.match(gguf_name)
    if stacked is not None:
        return f"model.layers.{stacked[1]}.mlp.experts.{stacked[2]}_proj.weight"
    return names.get(gguf_name)


def check_tp_blocks(model_path: str | Path, tp_size: int, row_parallel: tuple[str, ...]) -> None:
    """ValueError unless every block-format weight named `row_parallel` (checkpoint name
    endings: the layers tensor parallel splits by inputs) splits its inputs over `tp_size`
    ranks in whole blocks (32 inputs for Q4_0 / Q5_0 / Q8_0 and the types rewritten as Q8_0,
    256 for the K-quants)."""
    manifest = json.loads(manifest_path(model_path).read_text())
    for info in read_tensor_table(Path(manifest["file"])).tensors:
        name = manifest["names"].get(info.name) or ""  # tensors no weight takes: None
        block = _kernel_block(info.qtype)
        if block is None or not name.endswith(row_parallel):
            continue
        k = info.dims[0]
        if k % tp_size or (k // tp_size) % block:
            raise ValueError(
                f"tensor_parallel_size {tp_size} cannot split {name} ({info.name}, "
                f"{_type_name(info.qtype)}, {k} inputs) by whole blocks of {block} inputs "
                f"({k / tp_size:g} per rank); use another tensor_parallel_size or "
                "quantization='none' (dense weights)"
            )


def _kernel_block(qtype: int) -> int | None:
    """Inputs per block of a weight of this GGML type as the kernels run it (the types
    rewritten as Q8_0 at load: 32), or None (dense)."""
    from vserve.models.gguf_repack import REPACKED

    return BLOCK_SIZES.get(qtype) or (BLOCK_SIZES[Q8_0] if qtype in REPACKED else None)


def _type_name(qtype: int) -> str:
    from vserve.models.gguf_repack import REPACKED

    return BLOCK_FORMATS.get(qtype) or f"{REPACKED[qtype][0]} as Q8_0"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: the innermost (K) first
    qtype: int
    offset: int  # from the start of the file


@dataclass(frozen=True)
class TensorTable:
    architecture: str
    tensors: list[TensorInfo]


# byte sizes of the fixed-size GGUF metadata value types (8: string, 9: array)
_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def read_tensor_table(path: Path) -> TensorTable:
    """The tensor table of a GGUF file (v2/v3), skipping its metadata values but the
    architecture and alignment: `gguf.GGUFReader` builds every vocabulary string as an array
    (8 s for the embedded model's 262k tokens), this walks past them (0.2 s)."""
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
        try:
            try:
                return _parse_table(memoryview(head), path)
            except struct.error:  # a longer header: read the whole file
                return _parse_table(memoryview(head + f.read()), path)
        except (struct.error, KeyError) as e:  # truncated, or a value type GGUF lacks
            raise ValueError(f"{path}: not a readable GGUF header ({e!r})") from e


def _parse_table(buf: memoryview, path: Path) -> TensorTable:
    pos = 0

    def take(fmt: str):
        nonlocal pos
        value = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return value[0] if len(value) == 1 else value

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        if pos > len(buf):
            raise struct.error("past the end")
        return bytes(buf[pos - n : pos]).decode("utf-8", "replace")

    def skip(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            string()
        elif vtype == 9:
            etype, count = take("I"), take("Q")
            if etype in _SCALARS:
                pos += _SCALARS[etype] * count
            elif etype == 8:  # a vocabulary: walk the lengths, decode nothing
                length = struct.Struct("<Q").unpack_from
                for _ in range(count):
                    pos += 8 + length(buf, pos)[0]
                if pos > len(buf):
                    raise struct.error("past the end")
            else:
                for _ in range(count):
                    skip(etype)
        else:
            pos += _SCALARS[vtype]

    magic, version, n_tensors, n_kv = take("4sIQQ")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path} is not a GGUF v2/v3 file")
    arch, alignment = "", 32
    for _ in range(n_kv):
        key, vtype = string(), take("I")
        if key == "general.architecture" and vtype == 8:
            arch = string()
        elif key == "general.alignment" and vtype == 4:
            alignment = take("I")
        else:
            skip(vtype)
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = tuple(take("Q") for _ in range(take("I")))
        qtype, offset = take("I"), take("Q")
        infos.append((name, dims, qtype, offset))
    data_start = -(-pos // alignment) * alignment
    return TensorTable(arch, [TensorInfo(n, d, q, data_start + o) for n, d, q, o in infos])


def iter_gguf_weights(
    model_path: str | Path, dtype: torch.dtype, quantized: bool, kernels=None
) -> Iterator[tuple[str, torch.Tensor | QuantBlocks]]:
    """(checkpoint name, tensor or QuantBlocks) for every tensor of the folder's GGUF.
    `kernels`: the CPU kernels' `quant` module (`cpu_ops.load_quant()`), whose `dequantize`
    gives `gguf`'s values bit for bit in a fraction of its time for the block formats."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from vserve.models.gguf_repack import REPACKED, to_q8_0

    manifest = json.loads(manifest_path(model_path).read_text())
    path = Path(manifest["file"])
    table = read_tensor_table(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    for info in table.tensors:
        name = manifest["names"].get(info.name)
        if name is None:
            continue
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.qtype)]
        k, rows = info.dims[0], int(np.prod(info.dims[1:], dtype=np.int64))
        row_bytes = k // block * block_bytes
        data = raw[info.offset : info.offset + rows * row_bytes].reshape(rows, row_bytes)
        data = _rows_fixed(data, info.name, manifest)
        blocks = quantized and not name.endswith(_DENSE)
        for part_name, part, shape in _pieces(info, name, data):
            n = part.shape[0]
            if blocks and info.qtype in BLOCK_FORMATS:
                yield part_name, QuantBlocks(info.qtype, _mapped(part), (n, k))
            elif blocks and info.qtype in REPACKED:
                q8 = torch.from_numpy(to_q8_0(part, info.qtype, k))
                yield part_name, QuantBlocks(Q8_0, q8, (n, k))
            else:
                if info.qtype in _FLOAT_DTYPES:
                    values = part.view(_FLOAT_DTYPES[info.qtype]).reshape(n, k)
                else:
                    values = _dequantized(part, info, kernels)
                yield part_name, _float_tensor(values.reshape(shape), part_name, manifest, dtype)


# checkpoint names read dense whatever their GGUF type: a mixture's routers (their rounding
# would move tokens between experts; llama.cpp stores them F32)
_DENSE = (".mlp.gate.weight", ".shared_expert_gate.weight")
# a mixture's experts, stacked in one 3-D tensor per projection: [E][N rows][K]
_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


def _pieces(info: TensorInfo, name: str, data: np.ndarray):
    """(checkpoint name, rows, dense shape) of a tensor: itself, or each expert of a stacked
    experts tensor under its own checkpoint name (`...mlp.experts.3.up_proj.weight`, whole rows
    of blocks: a view); Qwen2-MoE's shared-expert gate as its [1, H]."""
    stacked = _EXPERTS.match(info.name)
    if stacked is None:
        shape = tuple(reversed(info.dims))
        if name.endswith(".shared_expert_gate.weight"):  # [H] or [1, H] in the file
            shape = (1, info.dims[0])
        yield name, data, shape
        return
    layer, proj = stacked.groups()
    k, n, experts = info.dims
    for e in range(experts):
        part = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"
        yield part, data[e * n : (e + 1) * n], (n, k)


_FLOAT_DTYPES = {0: "float32", 1: "float16"}  # GGML F32, F16


def _dequantized(data: np.ndarray, info: TensorInfo, kernels=None) -> np.ndarray:
    """`gguf`'s dequantization of a tensor (the kernels' for a block format, the same values);
    ValueError for a type it has none for (Q8_1, Q8_K, the integer and F64 types: none of
    them a model weight llama.cpp writes)."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if kernels is not None and info.qtype in BLOCK_FORMATS:
        k = info.dims[0]
        return kernels.dequantize(_mapped(data), info.qtype, k, torch.float32).numpy()

    qtype = GGMLQuantizationType(info.qtype)
    try:
        return dequantize(data, qtype)
    except NotImplementedError:
        raise ValueError(
            f"GGUF tensor {info.name} has GGML type {qtype.name}, which vserve cannot read "
            "(the types it reads: docs/cpu_kernels.md, GGUF types)"
        ) from None


def _mapped(data: np.ndarray) -> torch.Tensor:
    """The file's bytes as a tensor without a copy: pages come from the page cache, shared by
    every process that maps the file. Read-only (the kernels only read them): torch warns
    about that once per tensor, which says nothing here."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


def _rows_fixed(data: np.ndarray, gguf_name: str, manifest: dict) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for Llama-family files (whole rows: any format)."""
    if manifest["architecture"] not in _PERMUTE_QK:
        return data
    if ".attn_q." in gguf_name:
        heads = manifest["num_heads"]
    elif ".attn_k." in gguf_name:
        heads = manifest["num_kv_heads"]
    else:
        return data
    rows = data.shape[0]
    w = data.reshape(heads, rows // heads // 2, 2, *data.shape[1:])
    return w.swapaxes(2, 1).reshape(data.shape)


def _float_tensor(values: np.ndarray, name: str, manifest: dict, dtype: torch.dtype):
    import numpy as np
    import torch

    t = torch.from_numpy(np.array(values, dtype=np.float32))
    if manifest["architecture"].startswith("gemma") and name.endswith("norm.weight"):
        t = t - 1.0  # stored as the scale 1 + w
    return t.to(dtype)
