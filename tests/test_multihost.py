"""Pipeline parallel across two "hosts" on 127.0.0.1: node 1 runs `vserve worker`, node 0 runs
the engine; the tokens equal a single-host run."""

import subprocess
import sys

from conftest import make_llm
from hf_reference import PROMPTS
from proc_utils import wait_dead

from vserve import LLM, SamplingParams
from vserve.executor.multiproc import free_port

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_two_hosts_equal_one(tiny_model_dir):
    model = tiny_model_dir("gemma3")
    single = make_llm(model, max_model_len=256)
    expected = [o.outputs[0].token_ids for o in single.generate(PROMPTS, PARAMS, use_tqdm=False)]
    port = free_port()
    common = ["--model", model, "--dtype", "float32", "--max-model-len", "256",
              "--pipeline-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(port)]
    node1 = subprocess.Popen([sys.executable, "-m", "vserve.entrypoints.cli", "worker",
                              *common, "--node-rank", "1"])
    try:
        llm = LLM(model, dtype="float32", max_model_len=256, pipeline_parallel_size=2,
                  nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        llm.shutdown()
        assert got == expected
        assert node1.wait(timeout=30) == 0      # node 1's stages exit with the engine
    finally:
        if node1.poll() is None:
            node1.kill()
    assert wait_dead([node1.pid], timeout=5) == []
