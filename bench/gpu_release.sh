#!/usr/bin/env bash
# One device call that checks a release on the H200 (fits the 10-minute limit):
#   every GPU test (kernel tests on both paths); per path, the sanitizer-sized kernel tests under
#   compute-sanitizer memcheck and the smoke cases under racecheck (bench/gpu_sanitize.sh); the
#   off/validate/on overhead; the benchmark with the default path (hopper on an H200), then with
#   the portable path if time is left (JSON + PNG).
#   (device) KDTREE_COMMIT=<sha> bash bench/gpu_release.sh
set -uo pipefail
t0=$(date +%s)
source bench/gpu_env.sh
timeout 240 python3 -m pytest -q -s -m gpu tests -p no:cacheprovider --junitxml="$OUT/gpu-junit.xml" \
  > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -6
source bench/gpu_sanitize.sh
for path in hopper portable; do  # hopper is skipped where the GPU is not compute capability 9.0
  [ "$path" = hopper ] && [ "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)" != "9.0" ] && continue
  sanitize_path "$path" 60 60
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
