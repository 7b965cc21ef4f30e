#!/usr/bin/env bash
# One-shot check of vserve on a GPU machine: install, GPU tests, then `vserve bench throughput`
# and `vserve bench latency` on the embedded Gemma-3-270M and on a random-weight Llama-shaped
# ~1B model (built here with transformers), sync and async, CUDA graphs and eager, printing
# the throughput summaries, the overlap reports and a table of the figures at the end.
#
#   bash benchmarks/gpu_check.sh
#
# Sized to finish in under 8 minutes on one H200. Without a CUDA device it runs its CPU
# fallback: no GPU tests, the embedded model only, tiny sizes, eager only (CUDA graphs do not
# exist on CPU). Every step runs under a time limit; a failed step is reported and the rest
# still run; the exit status is non-zero if any step failed.
#
# Environment: PYTHON (default python3), SKIP_INSTALL=1 (use the environment as it is),
# GPU_CHECK_DIR (built model and JSON results; default /tmp/vserve-gpu-check, no spaces),
# GPU_CHECK_BUDGET (seconds after which no new step starts; GPU default 390). Runs are ordered
# by priority (async before sync, graphs before eager, both models per mode) so a budget cut
# drops the least informative ones.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WORK="${GPU_CHECK_DIR:-/tmp/vserve-gpu-check}"
RESULTS="$WORK/results"
FAILED=()
SKIPPED=()
START=$SECONDS

run() {  # run NAME LIMIT_S CMD...: time one step; a failure is recorded, not fatal
  local name=$1 limit=$2
  shift 2
  echo
  if [ $((SECONDS - START)) -ge "$BUDGET" ]; then
    echo "=== $name: SKIPPED (past the ${BUDGET} s budget for starting steps) ==="
    SKIPPED+=("$name")
    return
  fi
  echo "=== $name ==="
  echo "+ $*"
  local t0=$SECONDS
  if timeout "$limit" "$@"; then
    echo "--- $name: ok ($((SECONDS - t0)) s)"
  else
    echo "--- $name: FAILED (exit $?, $((SECONDS - t0)) s)"
    FAILED+=("$name")
  fi
}

has_nvidia() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
torch_cuda() { "$PY" -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1; }

# -- (a) install -------------------------------------------------------------------------------
install() {
  if [ "${SKIP_INSTALL:-0}" = 1 ]; then
    echo "SKIP_INSTALL=1: using the environment as it is"
  elif ! "$PY" -m pip install -q --retries 1 --timeout 15 -e ".[test]"; then
    # an offline machine: the dependencies must already be there
    echo "pip install -e .[test] failed; trying without dependencies"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
      || { echo "no install: running from the source tree"; export PYTHONPATH="$ROOT"; }
  fi
  if has_nvidia && ! torch_cuda; then
    echo "a GPU is present but this torch cannot use it: installing torch"
    "$PY" -m pip install -q --retries 1 --timeout 15 torch
  fi
}
install
CUDA=0
torch_cuda && CUDA=1
# No step starts after BUDGET seconds: with each GPU step capped below, the whole run stays
# under 8 minutes on an H200 even when something is slow. The CPU fallback has no such target.
BUDGET="${GPU_CHECK_BUDGET:-390}"
[ "$CUDA" = 1 ] || BUDGET="${GPU_CHECK_BUDGET:-1800}"
VSERVE=("$PY" -m vserve.entrypoints.cli --log-level INFO)
export VSERVE_LOG_LEVEL=INFO   # engine processes log their start-up (CUDA graph capture)
mkdir -p "$RESULTS"
rm -f "$RESULTS"/*.json
if [ "$CUDA" = 1 ]; then
  "$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', \
torch.__version__)"
else
  echo "device: no CUDA device, CPU fallback"
fi

# -- (b) GPU tests -----------------------------------------------------------------------------
if [ "$CUDA" = 1 ]; then
  run "GPU tests" 240 "$PY" -m pytest -m gpu -q
else
  echo
  echo "=== GPU tests: skipped (no CUDA device) ==="
fi

# -- (c) benchmarks ----------------------------------------------------------------------------
# a random-weight Llama-shaped ~1.1B model with the embedded model's tokenizer
BUILD_1B=$(cat <<'EOF'
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from vserve.models.resolve import embedded_model_path

dest = Path(sys.argv[1])
if (dest / ".complete").is_file():
    print(f"reusing {dest}")
    sys.exit(0)
tok = embedded_model_path()
cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, intermediate_size=8192, vocab_size=32000,
                  max_position_embeddings=2048, bos_token_id=2, eos_token_id=1, pad_token_id=0,
                  tie_word_embeddings=False)
with torch.device("cuda"):   # initialising 1.1B weights on the GPU takes a second
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(str(dest))
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if (tok / name).is_file():
        shutil.copy(tok / name, dest / name)
(dest / ".complete").write_text("ok")
print(f"built {dest}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
EOF
)

bench() {  # bench LABEL SCHED GRAPHS MODEL_FLAGS...: one throughput and one latency run
  local label=$1 sched=$2 graphs=$3
  shift 3
  local flags=("$@" --no-async-scheduling)
  [ "$sched" = async ] && flags=("$@" --async-scheduling)
  [ "$graphs" = eager ] && flags+=(--enforce-eager)
  local tag="${label}_${sched}_${graphs}"
  run "throughput: $label $sched $graphs" "$BENCH_LIMIT" "${VSERVE[@]}" bench throughput \
    "${flags[@]}" "${THROUGHPUT[@]}" --output-json "$RESULTS/throughput_$tag.json"
  run "latency: $label $sched $graphs" "$BENCH_LIMIT" "${VSERVE[@]}" bench latency \
    "${flags[@]}" "${LATENCY[@]}" --output-json "$RESULTS/latency_$tag.json"
}

LLAMA_1B="$WORK/llama-1b-random"
if [ "$CUDA" = 1 ]; then
  BENCH_LIMIT=75
  THROUGHPUT=(--num-prompts 64 --input-len 256 --output-len 128 --max-num-seqs 64
              --max-model-len 512)
  LATENCY=(--batch-size 8 --input-len 32 --output-len 128 --num-iters-warmup 1 --num-iters 2
           --max-num-seqs 64 --max-model-len 512)
  run "build the 1B model" 120 "$PY" -c "$BUILD_1B" "$LLAMA_1B"
  for sched in async sync; do
    for graphs in graphs eager; do
      bench gemma-270m "$sched" "$graphs" --dtype bfloat16
      if [ -f "$LLAMA_1B/.complete" ]; then
        bench llama-1b "$sched" "$graphs" --model "$LLAMA_1B" --dtype bfloat16
      fi
    done
  done
else
  BENCH_LIMIT=600
  THROUGHPUT=(--num-prompts 4 --input-len 32 --output-len 32 --max-model-len 128
              --temperature 0)
  LATENCY=(--batch-size 4 --input-len 32 --output-len 32 --num-iters-warmup 0 --num-iters 1
           --max-model-len 128 --temperature 0)
  for sched in async sync; do
    bench gemma-270m "$sched" eager     # CUDA graphs do not exist on CPU
  done
  echo
  echo "=== 1B model: skipped (no CUDA device) ==="
fi

# -- summary -----------------------------------------------------------------------------------
echo
"$PY" - "$RESULTS" <<'EOF'
import json
import sys
from pathlib import Path


def f(value, digits=1):
    return "-" if value is None else f"{value:.{digits}f}"


rows = ["| run | output tok/s | avg latency (s) | forward (ms) | launch interval (ms) | "
        "overlap eff. | TPOT p50 (ms) |", "|---|---|---|---|---|---|---|"]
for path in sorted(Path(sys.argv[1]).glob("*.json")):
    r = json.loads(path.read_text())
    ov = r.get("overlap") or {}
    rows.append(f"| {path.stem.replace('_', ' ')} | {f(r.get('output_throughput'))} | "
                f"{f(r.get('avg_latency'), 3)} | {f(ov.get('mean_forward_ms'), 2)} | "
                f"{f(ov.get('mean_launch_interval_ms'), 2)} | "
                f"{f(ov.get('overlap_efficiency'), 3)} | {f(ov.get('tpot_p50_ms'), 2)} |")
print("\n".join(rows))
EOF
echo
echo "gpu_check: $((SECONDS - START)) s in all"
[ ${#SKIPPED[@]} -eq 0 ] || printf 'SKIPPED (time budget): %s\n' "${SKIPPED[@]}"
if [ ${#FAILED[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "all steps passed"
