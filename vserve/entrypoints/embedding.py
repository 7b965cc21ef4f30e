"""Embeddings, shared by `LLM.embed` and `/v1/embeddings`: how a model pools (its
sentence-transformers files, as vLLM reads them), the request that asks the engine for it,
and the vector as the caller gets it.

| model folder holds                                   | pooling            | normalized |
|------------------------------------------------------|--------------------|------------|
| `modules.json` with a Pooling module: its config's   | `mean` or `last`   | if a       |
| `pooling_mode_mean_tokens` or `_lasttoken`           | (others refused)   | Normalize  |
|                                                      |                    | module     |
| no `modules.json` (a decoder, a GGUF file)           | `last` token       | yes        |

The engine runs an embedding as a request for one token (sampled greedily, then dropped),
pooling the prompt's last-layer hidden states (after the final norm) on its way; so it
batches with generation in the same engine and is bounded by the same limits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vserve.sampling_params import SamplingParams

_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
_REFUSED = ("pooling_mode_cls_token", "pooling_mode_max_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolingConfig:
    pooling: str = "last"  # "last" or "mean"
    normalize: bool = True


def pooling_config(model: str) -> PoolingConfig:
    """The model folder's pooling (the table above); `ValueError` for one vserve lacks."""
    folder = Path(model)
    modules_file = folder / "modules.json" if folder.is_dir() else None
    if modules_file is None or not modules_file.is_file():
        return PoolingConfig()
    modules = json.loads(modules_file.read_text())
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
    pooling = "last"
    if "Pooling" in kinds:
        config = json.loads((folder / kinds["Pooling"] / "config.json").read_text())
        refused = [k for k in _REFUSED if config.get(k)]
        chosen = [mode for key, mode in _MODES.items() if config.get(key)]
        if refused or len(chosen) != 1:
            raise ValueError(
                f"{folder}: pooling {refused or chosen or 'none'} is not supported "
                "(mean or last token)"
            )
        pooling = chosen[0]
    return PoolingConfig(pooling, "Normalize" in kinds)


def embedding_params(config: PoolingConfig) -> SamplingParams:
    """What one embedding asks of the engine: its pooling and one greedy token, dropped."""
    return SamplingParams(max_tokens=1, temperature=0, pooling=config.pooling, detokenize=False)


def finish(vector: list[float], normalize: bool) -> np.ndarray:
    """The vector as returned (float64): L2-normalized when the model says so."""
    values = np.asarray(vector, dtype=np.float64)
    norm = np.linalg.norm(values) if normalize else 0.0
    return values / norm if norm > 0.0 else values
