#!/usr/bin/env bash
# Device call for a kernel experiment: build the experimental configurations, check config $CFG
# for correctness (kernel GPU tests, racecheck on the smoke cases) and time it against config 0.
#   (device) CFG=1 bash bench/gpu_experiment.sh   (CFG: an experimental KDTREE_KERNEL_CONFIG id)
set -uo pipefail
source bench/gpu_env.sh
CFG=${CFG:-1}
python3 -m kdtree_backend.build --experimental --out /tmp/libexp.so --quiet || exit 1
export KDTREE_LIB=/tmp/libexp.so
KDTREE_KERNEL_CONFIG=$CFG timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernel_gpu.py \
  > "$OUT/exp_tests.log" 2>&1; echo "config $CFG kernel tests rc=$?"; tail -3 "$OUT/exp_tests.log"
KDTREE_KERNEL_CONFIG=$CFG timeout 60 compute-sanitizer --tool racecheck python3 bench/smoke.py --small --no-triton \
  > "$OUT/exp_racecheck.log" 2>&1; echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|smoke" "$OUT/exp_racecheck.log" | tail -2
KDTREE_KERNEL_CONFIG=$CFG timeout 60 compute-sanitizer --tool memcheck python3 bench/smoke.py --small --no-triton \
  > "$OUT/exp_memcheck.log" 2>&1; echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|smoke" "$OUT/exp_memcheck.log" | tail -2
timeout 120 python3 bench/smoke.py --no-triton --configs 0,$CFG 2>&1 | grep -E "B=|smoke" | tee "$OUT/exp_timing.log"
