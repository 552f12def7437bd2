#!/usr/bin/env bash
# One device call for the seesaw Hopper kernel (perf-notes h6) against the h1-h5 kernel it would
# replace: correctness on the smoke cases, the Hopper-path kernel GPU tests, racecheck + memcheck
# on the small cases, and smoke timings of both kernels (two builds of the same checkout).
#   (device) KDTREE_COMMIT=<sha> bash bench/gpu_seesaw.sh
set -uo pipefail
t0=$(date +%s)
source bench/gpu_env.sh
grep -E "seesaw|hopper_kernel" "$OUT/build.log" | head -3
KDTREE_KERNEL=hopper timeout 60 python3 bench/smoke.py --small --no-triton > "$OUT/seesaw_small.log" 2>&1
echo "seesaw small rc=$?"; grep -E "BAD|smoke|rel" "$OUT/seesaw_small.log" | tail -6
python3 -c "from kdtree_backend.build import build; build('/tmp/libv1.so', extra_flags=('-DKDTREE_HOPPER_V1',))" \
  > "$OUT/build_v1.log" 2>&1 || { echo "v1 build failed"; tail -5 "$OUT/build_v1.log"; }
if grep -q "smoke PASSED" "$OUT/seesaw_small.log"; then
  KDTREE_KERNEL=hopper timeout 200 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider \
    -k hopper > "$OUT/kernel_tests.log" 2>&1; echo "kernel tests (hopper) rc=$?"
  grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kernel_tests.log" | tail -6
  KDTREE_KERNEL=hopper timeout 60 compute-sanitizer --tool racecheck python3 bench/smoke.py --small --no-triton \
    > "$OUT/racecheck.log" 2>&1; echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY|smoke" "$OUT/racecheck.log" | tail -2
  grep -E "Race reported" -A1 "$OUT/racecheck.log" | sed 's/.*seesaw_kernel[^ ]* //' | sort | uniq -c | head -8
  if grep -q "Race reported" "$OUT/racecheck.log"; then  # per-thread detail of the first hazards
    KDTREE_KERNEL=hopper timeout 60 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 6 \
      python3 bench/smoke.py --small --no-triton > "$OUT/racecheck_detail.log" 2>&1
    grep -vE "^=========\s+(#|Saved)" "$OUT/racecheck_detail.log" | head -40
  fi
  if grep -q "Race reported" "$OUT/racecheck.log"; then  # control: the same tool on the h5 kernel
    KDTREE_LIB=/tmp/libv1.so KDTREE_KERNEL=hopper timeout 60 compute-sanitizer --tool racecheck python3 bench/smoke.py \
      --small --no-triton 2>&1 | grep -E "RACECHECK SUMMARY" | sed 's/^/[v1 control] /'
  fi
fi
for lib in default v1; do
  if [ $lib = v1 ]; then export KDTREE_LIB=/tmp/libv1.so; fi
  KDTREE_KERNEL=hopper timeout 100 python3 bench/smoke.py --no-triton --configs hopper --json "$OUT/timing_$lib.json" \
    2>&1 | grep -E "B=.*us|smoke|BAD" | tail -12 | sed "s/^/[$lib] /"
done
unset KDTREE_LIB
python3 - "$OUT" <<'PY'
import json, math, sys
d = {k: json.load(open(f"{sys.argv[1]}/timing_{k}.json")) for k in ("default", "v1")}
r = [a["by_config"]["hopper"] / b["by_config"]["hopper"] for a, b in zip(d["default"]["timings"], d["v1"]["timings"])]
print("geomean time seesaw / v1:", round(math.exp(sum(map(math.log, r)) / len(r)), 3), [round(x, 2) for x in r])
PY
echo "total $(( $(date +%s) - t0 ))s"
