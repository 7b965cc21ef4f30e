import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VSERVE_DEBUG_INVARIANTS", "1")  # engine cores check KV blocks at idle
if not __import__("torch").cuda.is_available():
    # Triton decides at import whether to interpret: set before anything imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support.tiny_models import build_model  # noqa: E402


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


@pytest.fixture(scope="session")
def tiny_gguf_dir(tiny_model_dir, tmp_path_factory):
    """tiny_model_dir's model written as a GGUF model folder (tests/support/tiny_gguf.py)."""
    from tests.support.tiny_gguf import build_gguf_model

    root = tmp_path_factory.mktemp("tiny-gguf")

    def get(kind: str, **overrides) -> str:
        hf = tiny_model_dir(kind, **overrides)
        return str(build_gguf_model(hf, root / Path(hf).name))

    return get
