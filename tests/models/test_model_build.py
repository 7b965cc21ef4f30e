"""Building a model costs its layers, not torch's compiler: models are built on the meta
device, where a random init (`normal_`) runs torch's reference ops and, on first use, imports
`torch._dynamo` (2.4 s of every worker's start). A fresh process that builds, loads and runs a
tiny model of each kind (dense, bf16 with a tied head, a mixture of experts) never imports it.

A worker (its config resolved and cached by the front end) imports neither transformers
(1.5 s: the front end's tokenizer and config need it, a model with plain rotary embeddings
does not) nor sympy (0.6 s: `to_empty`'s reference `empty_like` on meta tensors imports it)."""

import json
import subprocess
import sys

import pytest

# one fresh process for both checks (each start imports torch): first the worker's part, which
# must import neither transformers nor sympy, then whole engines, which import transformers
# (the tokenizer) but never torch._dynamo, the worker's part included
SCRIPT = """
import json, sys
from vserve.engine.arg_utils import EngineArgs
from vserve.executor.uniproc import UniProcExecutor
found = {"worker": {}, "engine": {}}
for path, dtype in json.loads(sys.argv[1]):
    config = EngineArgs(model=path, dtype=dtype).create_engine_config()
    UniProcExecutor(config).shutdown()
    found["worker"][path] = [n for n in ("transformers", "sympy") if n in sys.modules]
from vserve import LLM, SamplingParams
for path, dtype in json.loads(sys.argv[2]):
    llm = LLM(path, dtype=dtype, multiprocess=False, distributed_executor_backend="uni")
    llm.generate(["hi there"], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()
    found["engine"][path] = [n for n in ("torch._dynamo",) if n in sys.modules]
print(json.dumps(found))
"""
KINDS = {"llama": "float32", "gemma3": "bfloat16", "qwen3_moe": "float32"}


@pytest.fixture(scope="module")
def imported(tiny_model_dir, tiny_gguf_dir):
    """What the fresh process had imported after each model: {"worker": .., "engine": ..}.
    The front end's part, the resolved config in vserve's cache, the fixtures did
    (tests/conftest.py: `resolved`)."""
    workers = [[tiny_model_dir("llama"), "float32"], [tiny_gguf_dir("gemma3"), "bfloat16"]]
    engines = [[tiny_model_dir(kind), dtype] for kind, dtype in KINDS.items()]
    cmd = [sys.executable, "-c", SCRIPT, json.dumps(workers), json.dumps(engines)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_models_build_without_importing_the_compiler(imported):
    assert len(imported["engine"]) == len(KINDS)
    assert all(names == [] for names in imported["engine"].values()), imported["engine"]


def test_a_worker_loads_plain_rope_models_without_transformers(imported):
    assert len(imported["worker"]) == 2
    assert all(names == [] for names in imported["worker"].values()), imported["worker"]
