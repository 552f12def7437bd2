#!/usr/bin/env bash
# One device call for the Hopper (wgmma) path while it is being brought up: correctness on the
# smoke cases (and, if they fail, a diagnostic build), every kernel GPU test on both paths, and
# the smoke timings portable vs hopper.
#   (device) KDTREE_COMMIT=<sha> bash bench/gpu_hopper.sh
set -uo pipefail
t0=$(date +%s)
source bench/gpu_env.sh
grep -E "hopper" "$OUT/build.log" | head -3
KDTREE_KERNEL=hopper timeout 90 python3 bench/smoke.py --small --no-triton > "$OUT/hopper_small.log" 2>&1
echo "hopper small rc=$?"; tail -8 "$OUT/hopper_small.log"
if ! grep -q "smoke PASSED" "$OUT/hopper_small.log"; then
  python3 -m kdtree_backend.build --out /tmp/libdiag.so --quiet 2>&1 | tail -1
  nvcc -O3 -std=c++17 -Xcompiler -fPIC -DKDTREE_HOPPER_DIAG_SWAP_V -gencode=arch=compute_90a,code=sm_90a -c \
    -o /tmp/hdiag.o kdtree_backend/csrc/hopper_launch.cu && \
  nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC,-fvisibility=hidden -cudart static -DKDTREE_WITH_HOPPER \
    '-DKDTREE_BUILT_ARCHS="90"' -gencode=arch=compute_90,code=sm_90 -o /tmp/libdiag.so \
    kdtree_backend/csrc/kdtree_api.cu /tmp/hdiag.o && \
  KDTREE_LIB=/tmp/libdiag.so KDTREE_KERNEL=hopper timeout 90 python3 bench/smoke.py --small --no-triton 2>&1 | tail -8
  echo "total $(( $(date +%s) - t0 ))s"; exit 1
fi
KDTREE_KERNEL=hopper timeout 120 python3 bench/smoke.py --no-triton 2>&1 | grep -E "BAD|smoke" | tail -5
timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider -x \
  > "$OUT/gpu_kernel_tests.log" 2>&1; echo "kernel tests (both paths) rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_kernel_tests.log" | tail -6
timeout 150 python3 bench/smoke.py --no-triton --configs portable,hopper --json "$OUT/timing.json" 2>&1 \
  | grep -E "B=.*us|smoke" | tail -12
echo "total $(( $(date +%s) - t0 ))s"
