#!/usr/bin/env bash
# One device call: install the carried wheels, build for this GPU, smoke-test, sanitize, time.
# Usage (device): bash bench/gpu_smoke.sh [--no-sanitizer]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -m kdtree_backend.build --check 2>&1 | tee "$OUT/build.log" | tail -6 || exit 1
python3 -m kdtree_backend.build --experimental --out /tmp/libexp.so --quiet || exit 1
for cfg in 0 1; do KDTREE_LIB=/tmp/libexp.so KDTREE_KERNEL_CONFIG=$cfg python3 bench/smoke.py --small --no-triton 2>&1 | tail -1; done
KDTREE_LIB=/tmp/libexp.so python3 bench/smoke.py --configs 0,1 --json "$OUT/smoke.json" 2>&1 | tee "$OUT/smoke.log"
if [ "${1:-}" != "--no-sanitizer" ]; then
  timeout 240 compute-sanitizer --tool memcheck --print-limit 20 python3 bench/smoke.py --small --no-triton 2>&1 | tail -4 | tee "$OUT/memcheck.log"
  timeout 240 compute-sanitizer --tool racecheck --print-limit 20 python3 bench/smoke.py --small --no-triton 2>&1 | tail -4 | tee "$OUT/racecheck.log"
fi
