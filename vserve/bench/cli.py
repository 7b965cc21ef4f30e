"""`vserve bench throughput | latency | serve`."""

from __future__ import annotations


def add_bench_parser(sub) -> None:
    from vserve.bench import latency, throughput

    p = sub.add_parser("bench", help="benchmarks: throughput, latency, serve")
    bench = p.add_subparsers(dest="bench_command", required=True)
    throughput.add_parser(bench)
    latency.add_parser(bench)
    try:
        from vserve.bench import serve
    except ImportError:
        return
    serve.add_parser(bench)
