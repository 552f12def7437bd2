#!/usr/bin/env bash
# One device call that checks a release on the H200 (fits the 10-minute limit):
#   every GPU test (kernel tests on both paths); the kernel tests under compute-sanitizer memcheck
#   (sanitizer-sized, both paths) and the smoke cases under racecheck (each path); the
#   off/validate/on overhead; the benchmark with the default path (hopper on an H200), then with
#   the portable path if time is left (JSON + PNG).
#   (device) KDTREE_COMMIT=<sha> bash bench/gpu_release.sh
set -uo pipefail
t0=$(date +%s)
source bench/gpu_env.sh
timeout 240 python3 -m pytest -q -s -m gpu tests -p no:cacheprovider --junitxml="$OUT/gpu-junit.xml" \
  > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -6
KDTREE_TEST_SMALL=1 timeout 90 compute-sanitizer --tool memcheck --print-limit 20 \
  python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernel_gpu.py > "$OUT/memcheck.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -2
for path in hopper portable; do  # hopper is skipped where the GPU is not compute capability 9.0
  [ "$path" = hopper ] && [ "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)" != "9.0" ] && continue
  KDTREE_KERNEL=$path timeout 60 compute-sanitizer --tool racecheck --print-limit 20 python3 bench/smoke.py --small \
    --no-triton > "$OUT/racecheck-$path.log" 2>&1; echo "racecheck ($path) rc=$?"
  grep -E "RACECHECK SUMMARY|smoke" "$OUT/racecheck-$path.log" | tail -2
done
timeout 60 python3 bench/bench_modes.py --json "$OUT/modes.json" > "$OUT/modes.log" 2>&1; echo "modes rc=$?"
tail -8 "$OUT/modes.log"
left=$(( 570 - ($(date +%s) - t0) - 40 ))
echo "bench time limit ${left}s"
python3 bench/bench_verify.py --time-limit "$left" --out "$OUT/bench.json" --commit "${KDTREE_COMMIT:-nogit}" \
  > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
tail -45 "$OUT/bench.log"
left=$(( 570 - ($(date +%s) - t0) - 20 ))
if [ "${PORTABLE_BENCH:-1}" = 1 ] && [ "$left" -gt 100 ]; then  # the portable path too, where time allows
  KDTREE_KERNEL=portable python3 bench/bench_verify.py --time-limit "$left" --out "$OUT/bench-portable.json" \
    --commit "${KDTREE_COMMIT:-nogit}" > "$OUT/bench-portable.log" 2>&1; echo "portable bench rc=$?"
  tail -12 "$OUT/bench-portable.log"
fi
echo "total $(( $(date +%s) - t0 ))s"
