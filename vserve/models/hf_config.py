"""A model's Hugging Face config, resolved by transformers once and then read as plain JSON.

Building the config through `AutoConfig` costs about a second of CPU in every process that does
it (importing transformers scans its 1,700 model files), and the worker and engine core need
nothing from transformers but the resolved values (defaults and derived fields such as
`layer_types` and `rope_parameters` included). The first load resolves the config with
transformers and stores `to_dict()` in `$XDG_CACHE_HOME/vserve/configs`, keyed by the
`config.json` file's identity and the transformers version (like the kernel cache); later
loads, in any process, read that file into a `ModelHFConfig`, attribute for attribute the
same values.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from types import SimpleNamespace

from vserve.cache_files import cache_dir, write_json_atomic

logger = logging.getLogger("vserve")

CACHE_VERSION = 3  # 2, 3: multimodal checkpoints cached as their text model (text_tower)


class ModelHFConfig(SimpleNamespace):
    """The resolved config's attributes (`to_dict()` of the transformers config)."""

    def to_dict(self) -> dict:
        return dict(vars(self))

    def standardize_rope_params(self) -> None:
        """transformers' rope functions call this; the resolved `rope_parameters` already are."""


def load_hf_config(model_path: str):
    cache = _cache_path(Path(model_path))
    try:
        return _from_json(json.loads(cache.read_text()))
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    values = text_tower(_resolve(model_path).to_dict())
    _write(cache, values)
    return ModelHFConfig(**values)


# multimodal checkpoints whose text model vserve runs alone: its config is their `text_config`
TEXT_TOWERS = ("Gemma3ForConditionalGeneration",)


def text_tower(values: dict) -> dict:
    """A multimodal checkpoint's config as its text model's (`text_config`, under the
    checkpoint's architecture), other configs as they are."""
    text = values.get("text_config")
    if not isinstance(text, dict) or not set(values.get("architectures") or ()) & {*TEXT_TOWERS}:
        return values
    # what the checkpoint sets on the wrapper wins over the text config's defaults (Gemma 3:
    # eos_token_id [1, 106], its dtype)
    outer = {k: values[k] for k in _OUTER if values.get(k) is not None}
    return {**text, **outer, "architectures": values["architectures"]}


_OUTER = ("eos_token_id", "torch_dtype", "dtype")


def _from_json(values: dict) -> ModelHFConfig:
    if isinstance(values.get("id2label"), dict):  # JSON made its integer keys strings
        values["id2label"] = {int(k): v for k, v in values["id2label"].items()}
    return ModelHFConfig(**values)


def _resolve(model_path: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"cannot read the model config in {model_path}: {e}") from e


def _cache_path(folder: Path) -> Path:
    try:
        stat = (folder / "config.json").stat()
        identity = f"{stat.st_size}:{stat.st_mtime_ns}"
    except OSError:
        identity = "-"
    key = "\n".join([str(folder.resolve()), identity, _transformers_version(), str(CACHE_VERSION)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir("configs") / f"{digest}.json"


def _transformers_version() -> str:
    """The installed version without importing transformers (its metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "-"


def _write(path: Path, values: dict) -> None:
    try:
        write_json_atomic(path, values)
    except (OSError, TypeError, ValueError) as e:  # read-only cache or an odd value
        logger.debug("cannot cache the resolved config in %s: %s", path, e)


def layer_windows(hf_config) -> list[int | None]:
    """Sliding window of each layer, or None for global attention."""
    n = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if hf_config.model_type in ("mistral", "phi3") and window:  # every layer
        return [window] * n
    return [None] * n
