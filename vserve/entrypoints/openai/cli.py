"""`vserve serve [MODEL]`: the OpenAI-compatible server's command line.

Every engine argument is a flag named as vLLM names it (`--max-model-len`, `--max-num-seqs`,
`--served-model-name`, ...); the server adds `--host`, `--port`, `--api-key`,
`--allowed-hosts`, `--chat-template`, `--enable-auto-tool-choice`, `--tool-call-parser`,
`--reasoning-parser`,
`--shutdown-timeout`, `--log-level` and the admission
limits of `limits.py` (`--max-num-queued-reqs`, `--max-request-body-bytes`, ...).
"""

from __future__ import annotations

import argparse

from vserve.entrypoints.cli_args import add_engine_args
from vserve.entrypoints.openai.limits import AdmissionLimits, add_limit_args
from vserve.entrypoints.openai.reasoning import PARSERS
from vserve.entrypoints.openai.tool_parsers import TOOL_PARSERS


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over the OpenAI HTTP API")
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model folder or .gguf file (default: the embedded Gemma-3-270M); same as --model",
    )
    add_engine_args(p)
    server = p.add_argument_group("server arguments")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes, /tokenize "
        "and /detokenize (default: $VSERVE_API_KEY)",
    )
    server.add_argument(
        "--allowed-hosts",
        nargs="+",
        default=None,
        metavar="HOST",
        help="Host header values served (names or addresses, any port; '*' "
        "for all); others get 400, against DNS rebinding (default: "
        "localhost, 127.0.0.1 and [::1]; when --host is not a loopback address also "
        "this machine's names and any IP address)",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        help="chat template file or inline Jinja text (overrides the model's)",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model call tools on its own (tool_choice "auto", the '
        "default when a request has tools); needs --tool-call-parser",
    )
    server.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="how tool calls are read from the model's text: hermes "
        "(<tool_call> blocks: Qwen 2/2.5/3, Hermes) or llama3_json",
    )
    server.add_argument(
        "--reasoning-parser",
        default=None,
        choices=PARSERS,
        help="return a thinking model's <think>...</think> as reasoning_content apart from "
        "content: qwen3, deepseek_r1 (its template opens <think>); a structured-output "
        "constraint then applies after </think>",
    )
    server.add_argument(
        "--structured-outputs-in-reasoning",
        action="store_true",
        help="with --reasoning-parser, apply a structured-output constraint to the thoughts "
        "as well (from the first token)",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests may run after SIGTERM",
    )
    server.add_argument("--log-level", default="info", help="debug, info, warning or error")
    server.add_argument(
        "--headless",
        action="store_true",
        help="run this host's data-parallel engines (--data-parallel-start-rank, "
        "--data-parallel-size-local) for the head at --data-parallel-address, with no API server",
    )
    add_limit_args(p)
    p.set_defaults(func=_serve)
    return p


def _serve(args: argparse.Namespace) -> int:
    from vserve.entrypoints.openai.run import run_server
    from vserve.entrypoints.openai.tool_settings import ToolSettings

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit(
                f"vserve serve: MODEL {args.model_tag!r} and --model "
                f"{args.model!r} disagree; give one"
            )
        args.model = args.model_tag
    if args.headless:
        return _headless(args)
    try:
        _check_api_keys(args.api_key)
        AdmissionLimits.from_args(args)
        ToolSettings.from_args(args)
    except ValueError as e:
        raise SystemExit(f"vserve serve: {e}") from None
    return run_server(args)


def _check_api_keys(keys: list[str] | None) -> None:
    """An empty key would mean no key at all: refused, not silently open."""
    if keys is not None and any(not key.strip() for key in keys):
        raise ValueError("--api-key must not be empty (leave the flag out for no key)")


def _headless(args: argparse.Namespace) -> int:
    import logging

    from vserve.engine.dp.headless import run_headless
    from vserve.entrypoints.cli_args import engine_args_from

    logging.getLogger("vserve").setLevel(str(args.log_level).upper())
    try:
        return run_headless(engine_args_from(args).create_engine_config())
    except (ValueError, TimeoutError) as e:
        raise SystemExit(f"vserve serve --headless: {e}") from None
