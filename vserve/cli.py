"""The `vserve` command: `generate`, `chat`, `serve`, `bench` and `worker`."""

from __future__ import annotations

import argparse
import logging
import sys

from vserve.entrypoints.cli_args import add_engine_args, engine_args_from


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    return args.func(args) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _chat_parser(sub)
    _worker_parser(sub)
    _serve_parser(sub)
    _bench_parser(sub)
    return parser


# -- generate ------------------------------------------------------------------------------------
def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline and print it")
    p.add_argument("prompts", nargs="*", default=["The capital of France is"])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--chat", action="store_true", help="apply the chat template to each prompt")
    add_engine_args(p)
    p.set_defaults(func=_generate)


def _generate(args) -> int:
    from vserve import LLM, SamplingParams
    from vserve.startup import log_memory, log_ready

    llm = LLM(**vars(engine_args_from(args)))
    log_ready("frontend")
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
    )
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outs = llm.generate(args.prompts, params)
    for prompt, out in zip(args.prompts, outs):
        print(f"\n>>> {prompt}\n{out.outputs[0].text}")
    log_memory(llm.engine.process_memory())
    llm.shutdown()
    return 0


# -- chat ----------------------------------------------------------------------------------------
def _chat_parser(sub) -> None:
    from vserve.entrypoints.chat_cli import add_chat_parser

    add_chat_parser(sub, add_engine_args)


# -- worker (other hosts of a multi-host pipeline) ----------------------------------------------
def _worker_parser(sub) -> None:
    p = sub.add_parser("worker", help="run this host's pipeline stages of a multi-host engine")
    add_engine_args(p)
    p.set_defaults(func=_worker)


def _worker(args) -> int:
    from vserve.executor.remote import run_remote_workers

    return run_remote_workers(engine_args_from(args).create_engine_config())


# -- serve / bench -------------------------------------------------------------------------------
def _serve_parser(sub) -> None:
    try:
        from vserve.entrypoints.openai.cli import add_serve_parser
    except ImportError:
        return
    add_serve_parser(sub)


def _bench_parser(sub) -> None:
    try:
        from vserve.bench.cli import add_bench_parser
    except ImportError:
        return
    add_bench_parser(sub)


if __name__ == "__main__":
    sys.exit(main())
