"""vserve: a vLLM-style LLM serving engine with overlap (async) scheduling."""

# first: in a source checkout, maps vserve.workers / vserve.csrc_triton to its folders
from vserve import source_layout  # noqa: F401
from vserve.engine.arg_utils import EngineArgs
from vserve.entrypoints.llm import LLM
from vserve.host import isa
from vserve.outputs import CompletionOutput, Logprob, RequestOutput
from vserve.sampling_params import SamplingParams, StructuredOutputsParams

# VSERVE_CPU_ISA holds torch's kernels too (read when first run, and inherited by the processes
# started from here: the workers)
isa.pin_torch()

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineArgs",
    "__version__",
]
