#!/usr/bin/env bash
# Device call 1 of a release check: every GPU test, then the kernel tests under compute-sanitizer
# (memcheck, racecheck) at sanitizer size, then the off/validate/on overhead benchmark.
#   (device) bash bench/gpu_tests.sh
set -uo pipefail
source bench/gpu_env.sh
timeout 330 python3 -m pytest -q -s -m gpu tests -p no:cacheprovider --junitxml="$OUT/gpu-junit.xml" \
  > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"
grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
for tool in memcheck racecheck; do
  KDTREE_TEST_SMALL=1 timeout 150 compute-sanitizer --tool $tool --print-limit 20 \
    python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernel_gpu.py > "$OUT/$tool.log" 2>&1
  echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/$tool.log" | tail -3
done
timeout 90 python3 bench/bench_modes.py --json "$OUT/modes.json" > "$OUT/modes.log" 2>&1; echo "modes rc=$?"
tail -15 "$OUT/modes.log"
timeout 60 python3 bench/smoke.py --sweep-min-keys 2>&1 | tee "$OUT/min_keys.log" | grep sweep
