#!/usr/bin/env bash
# One device call for the Hopper (wgmma) path while it is being tuned: correctness on the smoke
# cases, every kernel GPU test on both paths, smoke timings portable vs hopper, the
# min-keys-per-split sweep for the Hopper path, and an ncu summary of the large shape.
#   (device) KDTREE_COMMIT=<sha> bash bench/gpu_hopper.sh
set -uo pipefail
t0=$(date +%s)
source bench/gpu_env.sh
grep -E "hopper" "$OUT/build.log" | head -3
KDTREE_KERNEL=hopper timeout 90 python3 bench/smoke.py --small --no-triton > "$OUT/hopper_small.log" 2>&1
echo "hopper small rc=$?"; grep -E "BAD|smoke" "$OUT/hopper_small.log" | tail -4
grep -q "smoke PASSED" "$OUT/hopper_small.log" || exit 1
timeout 300 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider -x \
  > "$OUT/gpu_kernel_tests.log" 2>&1; echo "kernel tests (both paths) rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_kernel_tests.log" | tail -6
timeout 150 python3 bench/smoke.py --no-triton --configs portable,hopper --json "$OUT/timing.json" 2>&1 \
  | grep -E "B=.*us|smoke|BAD" | tail -12
[ "${SWEEP:-1}" = 1 ] && KDTREE_KERNEL=hopper timeout 90 python3 bench/smoke.py --sweep-min-keys 2>&1 | tail -6
if [ "${PROFILE:-1}" = 1 ]; then
  KDTREE_KERNEL=hopper timeout 120 ncu --clock-control none --kernel-name regex:hopper_kernel --launch-skip 1 \
    --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SourceCounters -o /tmp/prof \
    python3 bench/smoke.py --profile-shape 32,16,64,8192 > /dev/null 2>&1
  ncu -i /tmp/prof.ncu-rep --print-units base 2>&1 | grep -E "Duration|Compute \(SM\)|Tensor|highest-utilized" | head -4
  ncu -i /tmp/prof.ncu-rep --page source --csv --print-source sass > "$OUT/sass_stalls.csv" 2>/dev/null
fi
echo "total $(( $(date +%s) - t0 ))s"
