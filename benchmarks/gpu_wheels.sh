#!/usr/bin/env bash
# Run HERE (a machine with PyPI), before a GPU check: downloads into .whl/ (ignored by git) the
# wheels of every runtime dependency of vserve that the GPU machine's image lacks, one version
# each, checks that their own dependencies are in the image or among them, that what travels
# (working tree + .whl) stays under the 64 MiB limit, and prints the device call to make.
#
#   bash benchmarks/gpu_wheels.sh
#
# The GPU image (benchmarks/gpu_image_packages.txt) has Python 3.12, torch, triton,
# transformers, tokenizers, safetensors, httpx, prometheus-client, cloudpickle, numpy, jinja2,
# pytest, ... but not the pins below. Environment: GPU_WHEELS_PYTHON (default 3.12, the image's;
# 3.11 for the CPU dry run on a machine without a 3.12 torch), GPU_WHEELS_DIR (default .whl),
# PYTHON (the pip to download with; default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
PYVER="${GPU_WHEELS_PYTHON:-3.12}"
DEST="${GPU_WHEELS_DIR:-.whl}"
ABI="cp${PYVER/./}"
# the versions this tree is tested with (pydantic pins pydantic-core exactly; fastapi needs
# opentelemetry-api, xgrammar apache-tvm-ffi)
PINS=(msgspec==0.23.0 pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
      pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 gguf==0.19.0 opentelemetry-api==1.45.2)
PLATFORMS=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done

rm -rf "$DEST"
mkdir -p "$DEST"
for pin in "${PINS[@]}"; do
  # --no-deps: one wheel per pin; the check below proves the dependencies are covered
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp --abi "$ABI" --abi abi3 --abi none "${PLATFORMS[@]}" -d "$DEST" "$pin"
done

"$PY" - "$DEST" "$PYVER" benchmarks/gpu_image_packages.txt <<'EOF'
"""Every wheel's requirements (for Linux x86-64 and this Python, extras off) are met by the
image or by another wheel; exactly one wheel per project."""
import re
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


dest, pyver, image_list = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
image = {norm(line.strip()) for line in image_list.read_text().splitlines()
         if line.strip() and not line.startswith("#")}
wheels = sorted(dest.glob("*.whl"))
names = [norm(w.name.split("-")[0]) for w in wheels]
dupes = {n for n in names if names.count(n) > 1}
assert not dupes, f"more than one version of {sorted(dupes)}"
env = {"python_version": pyver, "python_full_version": pyver + ".0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "extra": ""}
missing = []
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = norm(req.name)
        if name not in image and name not in names:
            missing.append(f"{wheel.name} needs {req}")
assert not missing, "requirements neither in the image nor downloaded:\n" + "\n".join(missing)
shadowed = sorted(set(names) & image)
assert not shadowed, f"already in the image (a second version would shadow it): {shadowed}"
total = sum(w.stat().st_size for w in wheels)
print(f"{len(wheels)} wheels for Python {pyver}, {total / 2**20:.1f} MiB, dependencies covered")
EOF

# what travels: tracked and untracked-not-ignored files, plus the carried .whl
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null \
       | tail -1 | cut -f1)
whl=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
total=$((tree + whl))
printf 'working tree %.1f MiB + %s %.1f MiB = %.1f MiB (limit 64 MiB)\n' \
  "$(echo "$tree / 1048576" | bc -l)" "$DEST" "$(echo "$whl / 1048576" | bc -l)" \
  "$(echo "$total / 1048576" | bc -l)"
[ "$total" -lt $((64 * 1048576)) ] || { echo "over the 64 MiB that can travel"; exit 1; }
echo
echo 'device call (the run tool): command "bash benchmarks/gpu_check.sh", carry [".whl"],'
echo 'timeout_s 540 (the script stops starting steps at 8 minutes; see README, GPU check)'
