"""Building a model costs its layers, not torch's compiler: models are built on the meta
device, where a random init (`normal_`) runs torch's reference ops and, on first use, imports
`torch._dynamo` (2.4 s of every worker's start). A fresh process that builds, loads and runs a
tiny model of each kind (dense, bf16 with a tied head, a mixture of experts) never imports it.

A worker (its config resolved and cached by the front end) imports neither transformers
(1.5 s: the front end's tokenizer and config need it, a model with plain rotary embeddings
does not) nor sympy (0.6 s: `to_empty`'s reference `empty_like` on meta tensors imports it)."""

import subprocess
import sys

SCRIPT = """
import sys
from vserve import LLM, SamplingParams
for path, dtype in zip(sys.argv[1::2], sys.argv[2::2]):
    llm = LLM(path, dtype=dtype, multiprocess=False, distributed_executor_backend="uni")
    llm.generate(["hi there"], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()
    assert "torch._dynamo" not in sys.modules, f"building {path} imported torch._dynamo"
"""
WORKER_SCRIPT = """
import sys
from vserve.engine.arg_utils import EngineArgs
from vserve.executor.uniproc import UniProcExecutor
for path, dtype in zip(sys.argv[1::2], sys.argv[2::2]):
    config = EngineArgs(model=path, dtype=dtype).create_engine_config()
    UniProcExecutor(config).shutdown()
    for name in ("transformers", "sympy"):
        assert name not in sys.modules, f"loading {path} imported {name}"
"""
KINDS = {"llama": "float32", "gemma3": "bfloat16", "qwen3_moe": "float32"}


def test_models_build_without_importing_the_compiler(tiny_model_dir):
    args = [a for kind, dtype in KINDS.items() for a in (tiny_model_dir(kind), dtype)]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_worker_loads_plain_rope_models_without_transformers(tiny_model_dir, tiny_gguf_dir):
    from vserve.engine.arg_utils import EngineArgs

    models = {tiny_model_dir("llama"): "float32", tiny_gguf_dir("gemma3"): "bfloat16"}
    for path in models:  # the front end's part: the resolved config is cached
        EngineArgs(model=path).create_engine_config()
    args = [a for path, dtype in models.items() for a in (path, dtype)]
    proc = subprocess.run(
        [sys.executable, "-c", WORKER_SCRIPT, *args], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
