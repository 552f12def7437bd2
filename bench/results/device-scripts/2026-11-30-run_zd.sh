# Device script of 2026-11-30 (session 11), h37b: the 2-cluster merge applied inside templated
# stores (the non-merge stores' SASS is the base's), and a diagnostics build that launches 2-split
# plans as 2-CTA clusters without merging (-DKDTREE_CLUSTER_LAUNCH_ONLY: kernel SASS identical to
# the base), to separate the cluster launch's cost from the merge's and to see whether racecheck's
# reports under cluster launches come with code that is race-clean without them.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
mkdir -p /tmp/old && cp -r kdtree_backend /tmp/old/ && cp .whl/old_csrc/* /tmp/old/kdtree_backend/csrc/
( cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old python3 -c "from kdtree_backend.build import build; build('/tmp/lib_base.so')" ) > $OUT/build_base.log 2>&1 &
( python3 -c "from kdtree_backend.build import build; build('/tmp/lib_launch.so', extra_flags=('-DKDTREE_CLUSTER_LAUNCH_ONLY',))" > $OUT/build_launch.log 2>&1 || echo "build launch failed" ) &
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
wait
ls /tmp/lib_base.so /tmp/lib_launch.so
echo "builds done at $(( $(date +%s) - t0 ))s"
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/kernel_tests.log 2>&1
echo "kernel tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/kernel_tests.log | tail -6
tar czf $REAL/all.tgz -C $OUT .
for lib in new launch; do
  if [ $lib = launch ]; then export KDTREE_LIB=/tmp/lib_launch.so; fi
  KDTREE_NUM_SPLITS=2 KDTREE_MIN_KEYS_PER_SPLIT=64 KDTREE_KERNEL=hopper timeout 60 compute-sanitizer --tool racecheck --print-limit 20 \
    python3 bench/smoke.py --small --no-triton > $OUT/racecheck-hopper-2splits-$lib.log 2>&1
  echo "racecheck (hopper, 2 splits, $lib) rc=$?"; grep -E "RACECHECK SUMMARY" $OUT/racecheck-hopper-2splits-$lib.log
  unset KDTREE_LIB
done
source bench/gpu_sanitize.sh
sanitize_path hopper 60 100
KDTREE_NUM_SPLITS=2 KDTREE_MIN_KEYS_PER_SPLIT=64 KDTREE_KERNEL=hopper KDTREE_TEST_SMALL=1 timeout 60 compute-sanitizer --tool memcheck --print-limit 20 \
  python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernel_gpu.py -k "hopper and (two_split or op_matches)" > $OUT/memcheck-hopper-2splits.log 2>&1
echo "memcheck (hopper, 2 splits) rc=$?"; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck-hopper-2splits.log | tail -2
echo "sanitizers done at $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
SH="32,8,16,1024;32,8,16,8192;32,8,16,32768;8,8,64,1024;8,8,64,8192;8,8,64,32768;8,16,64,1024;32,16,64,8192;1,8,16,8192;32,8,8,8192;8,16,16,8192"
export KDTREE_KERNEL=hopper
for rnd in 1 2; do for name in base launch new; do
  if [ $name != new ]; then export KDTREE_LIB=/tmp/lib_$name.so; fi
  timeout 80 python3 bench/bench_verify.py --only ours --no-plot --no-check --budget-ms 50 --shapes "$SH" --commit $COMMIT-$name --out $OUT/ab_${name}_$rnd.json > $OUT/ab_${name}_$rnd.log 2>&1 || echo "ab $name $rnd failed"
  unset KDTREE_LIB
done; done
python3 - $OUT <<'PY'
import json, math, sys
out = sys.argv[1]
def t(n, r):
    try:
        return {x["label"]: x["times_us"]["ours"] for x in json.load(open(f"{out}/ab_{n}_{r}.json"))["rows"]}
    except OSError:
        return {}
for r in (1, 2):
    for n in ("launch", "new"):
        a, b = t(n, r), t("base", r)
        q = {k: a[k] / b[k] for k in a if k in b}
        if q:
            print(f"{n}/base round {r} geomean {math.exp(sum(map(math.log, q.values())) / len(q)):.3f} " + " ".join(f"{k.replace(' ','')}:{x:.3f}({a[k]:.1f})" for k, x in q.items()))
PY
unset KDTREE_KERNEL
echo "ab done at $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
timeout 150 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 100 --time-limit 45 --commit $COMMIT --out $OUT/grid.json > $OUT/grid.log 2>&1 || echo "grid failed"
grep -E "geomean|large shapes" $OUT/grid.log | head -5
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
