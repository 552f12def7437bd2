# Device script of 2026-11-30 (session 8): h25 A/B (two-tile prologue after h23), an ncu profile of
# B32 H8 n16 L8k, and two grid runs of the default build.
# Run from the checkout root on the GPU machine at the commit the result names, with the wheels in .whl/.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
bld() { python3 -c "import sys; from kdtree_backend.build import build; build(sys.argv[1], extra_flags=tuple(sys.argv[2:]))" "$@"; }
( bld /tmp/lib_old.so -DKDTREE_PROLOGUE_TWO_TILES > $OUT/build_old.log 2>&1 || echo "build variant failed" ) &
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
timeout 200 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 100 --time-limit 45 --commit $COMMIT --out $OUT/grid1.json > $OUT/grid1.log 2>&1 || echo "grid1 failed"
grep -E "geomean|large shapes" $OUT/grid1.log
tar czf $REAL/all.tgz -C $OUT .
wait
SH="1,8,16,1024;8,8,16,1024;32,8,16,1024;1,8,64,1024;8,8,64,1024;32,8,64,1024;1,16,16,1024;8,16,16,1024;32,16,16,1024;1,16,64,1024;8,16,64,1024;32,16,64,1024;1,8,8,1024;8,8,8,1024;32,8,8,1024;8,16,64,8192;32,8,16,8192"
for rnd in 1 2; do for name in new old; do
  if [ $name = old ]; then export KDTREE_LIB=/tmp/lib_old.so; fi
  timeout 40 python3 bench/bench_verify.py --only ours --no-plot --no-check --budget-ms 50 --shapes "$SH" --commit $COMMIT-$name --out $OUT/ab_${name}_$rnd.json > /dev/null 2>&1 || echo "ab $name failed"
  unset KDTREE_LIB
done; done
python3 - $OUT <<'PY'
import json, math, sys
out = sys.argv[1]
def t(n, r): return {x["label"]: x["times_us"]["ours"] for x in json.load(open(f"{out}/ab_{n}_{r}.json"))["rows"]}
for r in (1, 2):
    try:
        a, b = t("old", r), t("new", r)
    except OSError:
        continue
    q = [a[k] / b[k] for k in a]
    print("two-tile prologue / default, round", r, "geomean %.3f" % math.exp(sum(map(math.log, q)) / len(q)), " ".join(f"{k.replace(' ','')}:{a[k]/b[k]:.3f}" for k in a))
PY
tar czf $REAL/all.tgz -C $OUT .
echo "profile start $(( $(date +%s) - t0 ))s"
export KDTREE_KERNEL=hopper
timeout 200 ncu --clock-control none --kernel-name "regex:hopper_kernel" --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section LaunchStats --section Occupancy \
  --section SourceCounters --import-source no -o /tmp/prof python3 bench/smoke.py --profile-shape 32,8,16,8192 \
  > "$OUT/ncu_run.log" 2>&1
echo "ncu rc=$?"
ncu -i /tmp/prof.ncu-rep --print-units base > "$OUT/ncu.log" 2>&1
ncu -i /tmp/prof.ncu-rep --page source --csv --print-source sass > "$OUT/sass_stalls.csv" 2>/dev/null
gzip -f "$OUT/sass_stalls.csv"
unset KDTREE_KERNEL
tar czf $REAL/all.tgz -C $OUT .
echo "grid2 start $(( $(date +%s) - t0 ))s"
timeout 100 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 100 --time-limit 45 --commit $COMMIT --out $OUT/grid2.json > $OUT/grid2.log 2>&1 || echo "grid2 failed"
grep -E "geomean|large shapes" $OUT/grid2.log
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
