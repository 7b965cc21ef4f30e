"""`vserve bench serve`: a load generator for any OpenAI-compatible endpoint.

Requests stream (`stream=true`, `stream_options.include_usage=true`); arrivals follow a Poisson
process at `--request-rate` (all at once for `inf`), at most `--max-concurrency` in flight.
Metrics follow the well-known serving benchmark's definitions so numbers compare:
TTFT = send -> first chunk with content; TPOT = (E2E - TTFT) / (output tokens - 1) over
requests with more than one token; ITL = gaps between content chunks, pooled over requests;
E2EL = send -> last content chunk; output tokens from the final usage chunk.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
from tqdm.auto import tqdm

from vserve.bench.datasets import add_dataset_args, load_samples
from vserve.bench.sse import sse_lines
from vserve.bench.stats import percentile


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    error: str = ""


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="benchmark a running OpenAI-compatible server")
    p.add_argument("--backend", default="openai", choices=["openai", "openai-chat"])
    p.add_argument("--base-url", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None)
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--tokenizer", default=None, help="default: that model's root folder")
    p.add_argument("--api-key", default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--goodput", nargs="+", default=None, help="e.g. ttft:500 tpot:50")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    add_dataset_args(p)
    p.set_defaults(func=run, num_prompts=100)


def run(args) -> int:
    return asyncio.run(_main(args))


async def _main(args) -> int:
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    endpoint = args.endpoint or (
        "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    )
    limits = httpx.Limits(max_connections=args.max_concurrency or 1000)
    async with httpx.AsyncClient(
        base_url=base, headers=headers, timeout=None, limits=limits
    ) as client:
        model, root = await _model(client, args.model)
        tokenizer = _tokenizer(args.tokenizer or root)
        samples = load_samples(args, tokenizer, len(tokenizer))
        prompts = [
            (
                s.prompt_text or tokenizer.decode(s.prompt_ids, skip_special_tokens=True),
                len(s.prompt_ids),
                s.output_len,
            )
            for s in samples
        ]
        print("Starting initial single prompt test run...")
        first = await _one(client, endpoint, args, model, prompts[0], None)
        if not first.success:
            raise SystemExit(f"Initial test run failed: {first.error}")
        print("Starting main benchmark run...")
        start = time.perf_counter()
        results = await _drive(client, endpoint, args, model, prompts)
        duration = time.perf_counter() - start
    metrics = compute_metrics(results, duration, args)
    print_result(metrics, args)
    if args.save_result or args.result_filename:
        name = args.result_filename or f"vserve-bench-serve-{int(time.time())}.json"
        with open(name, "w") as f:
            json.dump(
                {
                    **metrics,
                    "model": model,
                    "backend": args.backend,
                    "request_rate": args.request_rate,
                    "max_concurrency": args.max_concurrency,
                },
                f,
                indent=2,
            )
    return 0


async def _model(client, model: str | None) -> tuple[str, str | None]:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    data = resp.json()["data"]
    entry = next((m for m in data if m["id"] == model), data[0]) if model else data[0]
    return model or entry["id"], entry.get("root")


def _tokenizer(path: str | None):
    from vserve.models.resolve import resolve_model_path
    from vserve.tokenizer import load_tokenizer

    if not path:
        raise SystemExit("no tokenizer: pass --tokenizer (the server's model root is unknown)")
    try:  # the server names its model (the embedded one by its alias), never its path
        return load_tokenizer(resolve_model_path(path))
    except ValueError as e:
        raise SystemExit(
            f"no tokenizer for the served model {path!r}: pass --tokenizer ({e})"
        ) from None


async def _drive(client, endpoint, args, model, prompts) -> list[RequestResult]:
    rng = random.Random(args.seed)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = None if args.disable_tqdm else tqdm(total=len(prompts))
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(_one(client, endpoint, args, model, prompt, sem, bar)))
        if args.request_rate != float("inf"):
            theta = 1.0 / (args.request_rate * args.burstiness)
            await asyncio.sleep(rng.gammavariate(args.burstiness, theta))
    results = await asyncio.gather(*tasks)
    if bar is not None:
        bar.close()
    return list(results)


async def _one(client, endpoint, args, model, prompt, sem, bar=None) -> RequestResult:
    if sem is not None:
        async with sem:
            return await _one(client, endpoint, args, model, prompt, None, bar)
    text, prompt_len, output_len = prompt
    body = {
        "model": model,
        "max_tokens": output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": text}]
        body["max_completion_tokens"] = body.pop("max_tokens")
    else:
        body["prompt"] = text
    result = RequestResult(prompt_len=prompt_len)
    result.start = time.perf_counter()
    try:
        await _stream(client, endpoint, body, result)
    except (httpx.HTTPError, ValueError, KeyError) as e:
        result.success, result.error = False, f"{type(e).__name__}: {e}"
    if bar is not None:
        bar.update(1)
    return result


async def _stream(client, endpoint, body, result: RequestResult) -> None:
    async with client.stream("POST", endpoint, json=body) as resp:
        if resp.status_code != 200:
            result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return
        last = result.start
        async for line in sse_lines(resp):  # not aiter_lines: see vserve.bench.sse
            line = line.strip()
            if not line or line.startswith(":") or not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = str(chunk["error"])
                return
            now = time.perf_counter()
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                result.prompt_len = chunk["usage"].get("prompt_tokens", result.prompt_len)
            if not chunk.get("choices") or not _has_content(chunk["choices"][0]):
                continue
            if not result.chunk_times:
                result.ttft = now - result.start
            else:
                result.itl.append(now - last)
            result.chunk_times.append(now)
            last = now
        result.latency = last - result.start
        result.success = bool(result.chunk_times)
        if not result.success:
            result.error = "no content chunk in the stream"


def _has_content(choice: dict) -> bool:
    if "text" in choice:
        return bool(choice["text"])
    return bool((choice.get("delta") or {}).get("content"))


# -- metrics ---------------------------------------------------------------------------------------
def compute_metrics(results: list[RequestResult], duration: float, args) -> dict:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft * 1e3 for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) * 1e3 for r in ok if r.output_tokens > 1]
    itls = [x * 1e3 for r in ok for x in r.itl]
    e2els = [r.latency * 1e3 for r in ok]
    m = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(failed),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "input_lens": [r.prompt_len for r in ok],
        "output_lens": [r.output_tokens for r in ok],
        "ttfts": ttfts,
        "itls": itls,
        "errors": [r.error for r in failed],
    }
    m.update(_peaks(ok, results))
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        m[f"mean_{name}_ms"] = statistics.fmean(values) if values else 0.0
        m[f"median_{name}_ms"] = statistics.median(values) if values else 0.0
        m[f"std_{name}_ms"] = statistics.pstdev(values) if values else 0.0
        for p in _percentiles(args):
            m[f"p{_pname(p)}_{name}_ms"] = percentile(values, p) or 0.0
    if args.goodput:
        m["request_goodput"] = _goodput(ok, args.goodput) / duration
    return m


def _peaks(ok: list[RequestResult], results: list[RequestResult]) -> dict:
    buckets: dict[int, int] = {}
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.start for r in results)
    for r in ok:
        per_chunk = r.output_tokens / max(1, len(r.chunk_times))
        for t in r.chunk_times:
            key = int(t - t0)
            buckets[key] = buckets.get(key, 0) + per_chunk
    events = sorted(
        [(r.start, 1) for r in results] + [(r.start + max(r.latency, 0), -1) for r in results]
    )
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return {"max_output_tokens_per_s": max(buckets.values()), "max_concurrent_requests": peak}


def _goodput(ok: list[RequestResult], specs: list[str]) -> int:
    slo = {k: float(v) for k, v in (s.split(":") for s in specs)}
    good = 0
    for r in ok:
        tpot = (r.latency - r.ttft) / (r.output_tokens - 1) * 1e3 if r.output_tokens > 1 else 0
        if (
            r.ttft * 1e3 <= slo.get("ttft", float("inf"))
            and tpot <= slo.get("tpot", float("inf"))
            and r.latency * 1e3 <= slo.get("e2el", float("inf"))
        ):
            good += 1
    return good


def _percentiles(args) -> list[float]:
    return [float(p) for p in args.metric_percentiles.split(",")]


def _pname(p: float) -> str:
    return str(int(p)) if p == int(p) else str(p)


def print_result(m: dict, args) -> None:
    if m["failed"]:
        print("Failed requests during benchmark run detected (capping to 10):")
        for e in m["errors"][:10]:
            print(f"  {e}")
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    rows = [("Successful requests:", m["completed"]), ("Failed requests:", m["failed"])]
    if args.max_concurrency:
        rows.append(("Maximum request concurrency:", args.max_concurrency))
    if args.request_rate != float("inf"):
        rows.append(("Request rate configured (RPS):", f"{args.request_rate:.2f}"))
    rows += [
        ("Benchmark duration (s):", f"{m['duration']:.2f}"),
        ("Total input tokens:", m["total_input_tokens"]),
        ("Total generated tokens:", m["total_output_tokens"]),
        ("Request throughput (req/s):", f"{m['request_throughput']:.2f}"),
    ]
    if "request_goodput" in m:
        rows.append(("Request goodput (req/s):", f"{m['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{m['output_throughput']:.2f}"),
        ("Peak output token throughput (tok/s):", f"{m['max_output_tokens_per_s']:.2f}"),
        ("Peak concurrent requests:", f"{m['max_concurrent_requests']:.2f}"),
        ("Total token throughput (tok/s):", f"{m['total_token_throughput']:.2f}"),
    ]
    for label, value in rows:
        print(f"{label:<40}{value:<10}")
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for name in args.percentile_metrics.split(","):
        name = name.strip()
        print("{s:{c}^50}".format(s=titles[name], c="-"))
        upper = name.upper()
        print(f"{f'Mean {upper} (ms):':<40}{m[f'mean_{name}_ms']:<10.2f}")
        print(f"{f'Median {upper} (ms):':<40}{m[f'median_{name}_ms']:<10.2f}")
        for p in _percentiles(args):
            print(f"{f'P{_pname(p)} {upper} (ms):':<40}{m[f'p{_pname(p)}_{name}_ms']:<10.2f}")
    print("=" * 50)


__all__ = ["add_parser", "compute_metrics", "RequestResult"]
