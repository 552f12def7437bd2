#!/usr/bin/env bash
# One device call that tries an experimental configuration as the next portable one: quick
# correctness, timing against config 0, and only if it is >5% faster (geomean over the smoke
# shapes) the full release check with it (GPU tests, sanitizers, benchmark).
#   (device) CFG=rows32 KDTREE_COMMIT=<sha> bash bench/gpu_candidate.sh
set -uo pipefail
t0=$(date +%s)
source bench/gpu_env.sh
CFG=${CFG:-rows32}
python3 -m kdtree_backend.build --experimental --out /tmp/libexp.so --quiet || exit 1
export KDTREE_LIB=/tmp/libexp.so
KDTREE_KERNEL=$CFG timeout 60 python3 bench/smoke.py --small --no-triton 2>&1 | tail -1
timeout 120 python3 bench/smoke.py --no-triton --configs portable,$CFG --json "$OUT/candidate_timing.json" 2>&1 \
  | grep -E "B=|smoke" | tee "$OUT/candidate_timing.log"
ratio=$(python3 -c "
import json, math; d = json.load(open('$OUT/candidate_timing.json'))
r = [t['by_config']['$CFG'] / t['by_config']['portable'] for t in d['timings']]
print(round(math.exp(sum(map(math.log, r)) / len(r)), 3))")
echo "geomean time ratio $CFG / portable: $ratio"
if python3 -c "import sys; sys.exit(0 if $ratio < 0.95 else 1)"; then
  export KDTREE_KERNEL=$CFG
  timeout 200 python3 -m pytest -q -m gpu tests -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -4
  KDTREE_TEST_SMALL=1 timeout 60 compute-sanitizer --tool memcheck python3 -m pytest -q -x -p no:cacheprovider \
    tests/gpu/test_kernel_gpu.py > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; grep -E "ERROR SUMMARY" "$OUT/memcheck.log"
  timeout 60 compute-sanitizer --tool racecheck python3 bench/smoke.py --small --no-triton > "$OUT/racecheck.log" 2>&1
  echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY" "$OUT/racecheck.log"
  left=$(( 300 - ($(date +%s) - t0) ))
  python3 bench/bench_verify.py --time-limit "$left" --out "$OUT/bench.json" --commit "${KDTREE_COMMIT:-nogit}" \
    > "$OUT/bench.log" 2>&1; echo "bench rc=$?"; tail -9 "$OUT/bench.log"
else
  echo "not adopted"
fi
echo "total $(( $(date +%s) - t0 ))s"
