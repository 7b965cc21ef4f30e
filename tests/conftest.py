import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not __import__("torch").cuda.is_available():
    # Triton decides at import whether to interpret: set before anything imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import build_model  # noqa: E402

MODEL_KINDS = ["llama", "qwen2", "qwen3", "gemma3", "mistral"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    built = {}

    def get(kind: str, **overrides) -> str:
        key = (kind, tuple(sorted(overrides.items())))
        if key not in built:
            name = kind + "".join(f"-{k}{v}" for k, v in sorted(overrides.items()))
            built[key] = str(build_model(kind, root / name, **overrides))
        return built[key]

    return get


def make_llm(model_dir, **kwargs):
    """An in-process engine with the model runner in this process: fast to start, and its
    scheduler can be inspected (`llm.engine.client.core`)."""
    from vserve import LLM

    kwargs.setdefault("multiprocess", False)
    kwargs.setdefault("distributed_executor_backend", "uni")
    kwargs.setdefault("dtype", "float32")
    return LLM(model_dir, **kwargs)
