"""`vserve bench`: throughput, latency and serving benchmarks, the overlap report, traces."""
