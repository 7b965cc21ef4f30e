#!/usr/bin/env bash
# One-shot check of vserve on a GPU machine (no network; see docs/benchmarks.md, GPU check):
# installs the carried wheels (.whl, from benchmarks/gpu_wheels.sh) into a target folder,
# runs the GPU tests, builds random-weight models on the device (Llama ~1.1B, Gemma-3-270M
# shaped), then throughput and latency (sync vs async, CUDA graphs vs eager, temperature 0
# and 1), the Triton kernels against their torch references on real shapes, and a batch-1
# decode against the HBM roofline. Every figure goes to $OUT/results.json, a table to
# $OUT/summary.md, the whole log to $OUT/gpu_check.log.
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine (carry [".whl"])
#   GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh # the dry run here: same steps, CPU sizes
#
# Steps run in priority order (most important first), each under its own time limit; no step
# starts unless it fits in what is left of GPU_CHECK_BUDGET (default 480 s on a GPU), so the
# run ends inside 8 minutes and reports what it skipped. A failed step is reported and the
# rest still run; the exit status is non-zero if any step failed.
#
# Environment: PYTHON (default python3), OUT (default $GPU_CHECK_DIR/out), GPU_CHECK_DIR
# (models and results; default /tmp/vserve-gpu-check), GPU_CHECK_WHEELS (default .whl),
# GPU_CHECK_BUDGET (seconds), GPU_CHECK_ONLY (space-separated step names: a targeted rerun),
# GPU_CHECK_CPU=1 (CPU mode even where CUDA exists).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WORK="${GPU_CHECK_DIR:-/tmp/vserve-gpu-check}"
OUT="${OUT:-$WORK/out}"
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.whl}"
RESULTS="$WORK/results"
START=$SECONDS
STEPS="$WORK/steps.tsv"
FAILED=0
mkdir -p "$OUT" "$RESULTS"
rm -f "$RESULTS"/*.json "$STEPS"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

# -- install: carried wheels only, never a network -----------------------------------------------
export PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
SITE="$WORK/site"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$WHEELS"/*.whl || { echo "installing $WHEELS failed"; exit 1; }
  echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE"
else
  echo "no wheels in $WHEELS: using the environment as it is"
fi
# vserve runs from this tree (vserve/source_layout.py maps workers/ and csrc_triton/ in)
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1

CUDA=0
if [ "${GPU_CHECK_CPU:-0}" != 1 ] && "$PY" -c "import torch; assert torch.cuda.is_available()" \
    2>/dev/null; then
  CUDA=1
fi
BUDGET="${GPU_CHECK_BUDGET:-$([ "$CUDA" = 1 ] && echo 480 || echo 5400)}"
RESERVE=15   # for the summary
if [ "$CUDA" = 1 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  SCALE=1   # time limits as written
else
  # CPU mode: the same steps, small sizes, limits for a loaded 2-core machine (the first
  # engine also builds the CPU kernels)
  export CUDA_VISIBLE_DEVICES=""
  SCALE=8
fi
"$PY" -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], \
'| torch', torch.__version__, '| triton', triton.__version__, '| transformers', \
transformers.__version__, '| cuda', torch.cuda.is_available())" || true

step() {  # step NAME LIMIT_S CMD...: one timed step in priority order; failures are recorded
  local name=$1 limit=$(($2 * SCALE)) left
  shift 2
  if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" $name "* ]]; then
    return
  fi
  left=$((BUDGET - RESERVE - (SECONDS - START)))
  [ "$limit" -le "$left" ] || limit=$left
  echo
  if [ "$limit" -lt 20 ]; then
    echo "=== $name: SKIPPED (${left} s left of the ${BUDGET} s budget) ==="
    printf '%s\tskipped\t0\n' "$name" >>"$STEPS"
    return
  fi
  echo "=== $name (limit ${limit} s) ==="
  echo "+ $*"
  local t0=$SECONDS rc
  timeout -k 5 "$limit" "$@"
  rc=$?
  if [ "$rc" = 0 ]; then
    echo "--- $name: ok ($((SECONDS - t0)) s)"
    printf '%s\tok\t%s\n' "$name" $((SECONDS - t0)) >>"$STEPS"
  else
    [ "$rc" = 124 ] && rc="timeout"
    echo "--- $name: FAILED ($rc, $((SECONDS - t0)) s)"
    printf '%s\tFAILED (%s)\t%s\n' "$name" "$rc" $((SECONDS - t0)) >>"$STEPS"
    FAILED=1
  fi
}

VSERVE=("$PY" -m vserve.cli --log-level WARNING)
MODELS="$WORK/models"
LLAMA="$MODELS/llama-1b"
GEMMA="$MODELS/gemma3-270m-shape"
if [ "$CUDA" = 1 ]; then
  SMALL=()
  DEV=(--device cuda --dtype bfloat16)
  TPUT=(--num-prompts 128 --input-len 256 --output-len 128 --max-num-seqs 128
        --max-model-len 512)
  LAT=(--batch-size 8 --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 3
       --max-num-seqs 16 --max-model-len 512)
else
  SMALL=(--small)
  DEV=(--device cpu --dtype bfloat16)
  TPUT=(--num-prompts 8 --input-len 32 --output-len 16 --max-num-seqs 8 --max-model-len 128)
  LAT=(--batch-size 2 --input-len 16 --output-len 16 --num-iters-warmup 0 --num-iters 1
       --max-num-seqs 4 --max-model-len 128)
fi

tput() {  # tput NAME MODEL TEMPERATURE FLAGS...
  local name=$1 model=$2 temp=$3 limit=90
  shift 3
  [[ " $* " == *" --compare-sync "* ]] && limit=140  # three engines: sync, async, sync
  step "$name" "$limit" "${VSERVE[@]}" bench throughput --model "$model" "${DEV[@]}" "${TPUT[@]}" \
    --temperature "$temp" "$@" --output-json "$RESULTS/$name.json"
}
lat() {  # lat NAME MODEL FLAGS...
  local name=$1 model=$2
  shift 2
  step "$name" 75 "${VSERVE[@]}" bench latency --model "$model" "${DEV[@]}" "${LAT[@]}" \
    --temperature 0 "$@" --output-json "$RESULTS/$name.json"
}

# -- 1. correctness first: no host sync in a mixed sampling batch, then the GPU tests ----------
step sync_check 150 "$PY" -m pytest -q -rs -p no:cacheprovider tests/workers/test_sampler_staging.py \
  tests/e2e/test_gpu.py::test_mixed_batch_decode_steps_never_sync_the_host
step imports 60 "$PY" -c "import fastapi, msgspec, pydantic, uvicorn, xgrammar, zmq; \
import vserve.entrypoints.openai.server, vserve.engine.mp_client, vserve.engine.core_proc; \
print('server, engine and structured-output imports ok')"
GPU_TESTS=(tests/e2e/test_gpu.py tests/models/test_triton_kernels.py
           tests/workers/test_cuda_graph_padding.py tests/models/test_triton_variants.py)
step gpu_tests 180 "$PY" -m pytest -q -rs -p no:cacheprovider "${GPU_TESTS[@]}" -k "not never_sync"

# -- 2. models built on the device ---------------------------------------------------------------
step models 120 "$PY" benchmarks/gpu_models.py "$MODELS" "${SMALL[@]}"
# the engine against transformers on the same models and dtype, before any figure is read
step equiv_llama 90 "$PY" benchmarks/gpu_equivalence.py "$LLAMA" "$RESULTS/equiv_llama.json" \
  "${DEV[@]}"
step equiv_gemma 90 "$PY" benchmarks/gpu_equivalence.py "$GEMMA" "$RESULTS/equiv_gemma.json" \
  "${DEV[@]}"

# -- 3. figures, most telling first --------------------------------------------------------------
tput tput_llama_async_graphs_t0_vs_sync "$LLAMA" 0 --async-scheduling --compare-sync
tput tput_llama_async_graphs_t1 "$LLAMA" 1.0 --async-scheduling
tput tput_llama_async_graphs_t1_top_p "$LLAMA" 1.0 --async-scheduling --top-p 0.9
step roofline_llama_batch1 90 "$PY" benchmarks/batch1_roofline.py --model "$LLAMA" \
  --dtype bfloat16 --input-len 128 --output-len 64 --num-iters 2 \
  --output-json "$RESULTS/roofline_llama_batch1.json"
step kernels 150 "$PY" benchmarks/gpu_kernels.py "$RESULTS/kernels.json" "${SMALL[@]}"
tput tput_llama_async_eager_t0 "$LLAMA" 0 --async-scheduling --enforce-eager
lat lat_llama_async_graphs "$LLAMA" --async-scheduling
lat lat_llama_async_eager "$LLAMA" --async-scheduling --enforce-eager
tput tput_gemma_async_graphs_t0_vs_sync "$GEMMA" 0 --async-scheduling --compare-sync
tput tput_gemma_async_graphs_t1 "$GEMMA" 1.0 --async-scheduling
tput tput_gemma_async_graphs_t1_top_p "$GEMMA" 1.0 --async-scheduling --top-p 0.9
lat lat_llama_sync_graphs "$LLAMA" --no-async-scheduling
step roofline_gemma_batch1 90 "$PY" benchmarks/batch1_roofline.py --model "$GEMMA" \
  --dtype bfloat16 --input-len 128 --output-len 64 --num-iters 2 \
  --output-json "$RESULTS/roofline_gemma_batch1.json"

# -- 4. tensor parallel: TP=2 against TP=1 (tput_llama_async_eager_t0: TP runs eagerly), only
# where more than one GPU is visible -------------------------------------------------------------
NUM_GPUS=0
if [ "$CUDA" = 1 ]; then
  NUM_GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
fi
if [ "$NUM_GPUS" -gt 1 ]; then
  tput tput_llama_tp2_async_eager_t0 "$LLAMA" 0 --async-scheduling --enforce-eager \
    --tensor-parallel-size 2
else
  echo "=== tput_llama_tp2_async_eager_t0: not run ($NUM_GPUS GPU visible, TP=2 needs 2) ==="
fi

# -- summary -------------------------------------------------------------------------------------
echo
"$PY" benchmarks/gpu_summary.py "$RESULTS" "$STEPS" "$OUT" "$CUDA" "$((SECONDS - START))"
echo "gpu_check: $((SECONDS - START)) s in all; results in $OUT"
exit "$FAILED"
