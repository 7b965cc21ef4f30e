"""Engine arguments as command-line flags, named as vLLM names them (`--max-model-len`,
`--enable-prefix-caching` / `--no-enable-prefix-caching`, ...), derived from `EngineArgs`."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from vserve.engine.arg_utils import EngineArgs

_HELP = {
    "model": "model folder, .gguf file, or 'gemma-3-270m' (the embedded default)",
    "dtype": "auto, float32, bfloat16 or float16 (with quantized weights: the activations')",
    "quantization": "gguf (a GGUF's own blocks, the default for GGUF models), int8 (weights "
    "quantized at load) or none (dense weights in --dtype)",
    "max_model_len": "context length (prompt + output) per request (CPU default: the "
    "model's, at most 8192)",
    "max_num_seqs": "most requests in one batch (default: 64 on CPU, 256 on CUDA)",
    "max_num_batched_tokens": "token budget per step (prefills are chunked to fit)",
    "num_gpu_blocks_override": "number of KV blocks, whatever the device",
    "kv_cache_memory_bytes": (
        "KV cache budget in bytes (CPU default: what max_num_seqs x "
        "max_model_len use, at most 4 GiB)"
    ),
    "async_scheduling": "schedule the next step while the current one runs (default: on)",
    "pipeline_parallel_size": "split the layers over this many worker processes",
    "tensor_parallel_size": "split every layer (heads, MLP, vocabulary) over this many worker "
    "processes per pipeline stage (dense, GGUF or int8 weights)",
    "distributed_executor_backend": "uni (model in the engine process) or mp (workers)",
    "master_addr": "torch.distributed rendezvous address for multi-host pipeline parallel",
    "master_port": "torch.distributed rendezvous port (0: pick a free one, single host)",
    "nnodes": "number of hosts the pipeline stages span",
    "node_rank": "this host's index (0 runs the engine)",
    "data_parallel_size": "independent engines (each with its own TP x PP workers) behind one "
    "front end; requests go to the least loaded",
    "data_parallel_size_local": "engines on this host (default: all of them)",
    "data_parallel_start_rank": "the first engine rank on this host (a --headless host)",
    "data_parallel_rank": "external load balancing: this server runs engine rank K alone",
    "data_parallel_address": "the head host's address, where remote engines connect",
    "data_parallel_rpc_port": "the head's handshake port for remote engines (needs "
    "VSERVE_DP_SECRET unless the address is a loopback one)",
    "data_parallel_keep_serving": "when one engine dies, fail its requests and keep serving on "
    "the others (default: the server exits 1)",
    "attention_backend": "torch (CPU default) or triton (CUDA default)",
    "watchdog_timeout": "seconds a step may hang (or the engine core stay silent) before the "
    "engine is declared dead and the server exits (0: off)",
    "max_constraint_chars": "characters of one structured-output constraint (a JSON schema's "
    "text, a regex, a grammar, the choices, the tools of tool_choice 'required'); longer is "
    "refused (400)",
    "grammar_compile_timeout": "seconds a grammar may take to compile (in a worker process "
    "that is then killed); longer fails the requests that wait for it (400)",
    "grammar_compile_memory_mb": "MiB of memory a grammar's compile may use (the compile "
    "worker's limit); more fails the requests that wait for it (400)",
    "enforce_eager": "no CUDA graphs: decode steps run eagerly too (graphs need CUDA + triton)",
}


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine arguments")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        kwargs = {"default": f.default, "help": _HELP.get(f.name)}
        if hint in (bool, bool | None):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name == "served_model_name":
            kwargs["nargs"] = "+"
        else:
            kwargs["type"] = _base_type(hint)
        group.add_argument(flag, **kwargs)


def _base_type(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    for t in (int, float, str):
        if t in args:
            return t
    return str


def engine_args_from(ns: argparse.Namespace, **overrides) -> EngineArgs:
    values = {
        f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(ns, f.name)
    }
    values.update(overrides)
    return EngineArgs(**values)
