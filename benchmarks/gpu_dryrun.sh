#!/usr/bin/env bash
# The GPU check's dry run, here, without a GPU: a clean venv holding only packages of the GPU
# image (benchmarks/gpu_image_packages.txt; anything else pip pulls in is removed), wheels
# fetched by benchmarks/gpu_wheels.sh for that venv's Python, then
# `GPU_CHECK_CPU=1 benchmarks/gpu_check.sh` with pip's index off: every CPU step must pass.
#
#   bash benchmarks/gpu_dryrun.sh
#
# The GPU image runs Python 3.12; a CPU torch for 3.12 may not be at hand, so the venv's
# Python is DRYRUN_PYTHON (default python3.11) and the wheels are fetched for it (same pins).
# DRYRUN_TORCH (default: /opt/wheels/torch-*cpu*-cp311-*.whl if present, else torch from the
# index) is the CPU torch to install; DRYRUN_DIR (default /tmp/vserve-gpu-dryrun) holds the
# venv, the wheels and the check's output (DRYRUN_DIR/check/out).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYBIN="${DRYRUN_PYTHON:-python3.11}"
DIR="${DRYRUN_DIR:-/tmp/vserve-gpu-dryrun}"
TORCH="${DRYRUN_TORCH:-$(ls /opt/wheels/torch-*cpu*-cp311-*.whl 2>/dev/null | head -1)}"
TORCH="${TORCH:-torch}"
PYVER=$("$PYBIN" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
VPY="$DIR/venv/bin/python"
# the image's versions where the device notes give them
IMAGE_PKGS=("$TORCH" transformers==5.17.0 tokenizers==0.23.2 safetensors==0.8.0 triton
            httpx prometheus-client cloudpickle numpy jinja2 pytest pytest-timeout psutil
            accelerate tqdm ninja packaging)

if [ ! -x "$VPY" ]; then
  "$PYBIN" -m venv "$DIR/venv"
  "$VPY" -m pip install -q "${IMAGE_PKGS[@]}"
fi
# remove whatever the installs pulled in that the GPU image does not have
"$VPY" - benchmarks/gpu_image_packages.txt <<'EOF'
import re
import subprocess
import sys
from importlib import metadata


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


image = {norm(line.strip()) for line in open(sys.argv[1])
         if line.strip() and not line.startswith("#")}
extra = sorted({norm(d.metadata["Name"]) for d in metadata.distributions()} - image)
if extra:
    print("not in the GPU image, removed:", " ".join(extra))
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *extra], check=True)
EOF
if "$VPY" -c "import msgspec" 2>/dev/null; then
  echo "the clean venv has msgspec: not a GPU-image environment"; exit 1
fi
echo "clean venv: $("$VPY" -m pip list 2>/dev/null | tail -n +3 | wc -l) packages, all in the image"

GPU_WHEELS_PYTHON="$PYVER" GPU_WHEELS_DIR="$DIR/whl" bash benchmarks/gpu_wheels.sh
PYTHON="$VPY" GPU_CHECK_CPU=1 GPU_CHECK_WHEELS="$DIR/whl" GPU_CHECK_DIR="$DIR/check" \
  OUT="$DIR/check/out" bash benchmarks/gpu_check.sh
