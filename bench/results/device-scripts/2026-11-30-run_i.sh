# Device script of 2026-11-30 (session 8), h26 (refill as the atoms die): checks, A/B, grid if it wins.
# Run from the checkout root on the GPU machine at the commit the result names, with the wheels in .whl/.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
bld() { python3 -c "import sys; from kdtree_backend.build import build; build(sys.argv[1], extra_flags=tuple(sys.argv[2:]))" "$@"; }
( bld /tmp/lib_old.so -DKDTREE_REFILL_AT_EMPTY > $OUT/build_old.log 2>&1 || echo "build old failed" ) &
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/tests.log 2>&1
echo "kernel tests (both paths) rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests.log | tail -6
tar czf $REAL/all.tgz -C $OUT .
KDTREE_KERNEL=hopper timeout 50 compute-sanitizer --tool racecheck --print-limit 10 python3 bench/smoke.py --small --no-triton > $OUT/racecheck-hopper.log 2>&1
echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY" $OUT/racecheck-hopper.log
KDTREE_KERNEL=hopper KDTREE_TEST_SMALL=1 timeout 70 compute-sanitizer --tool memcheck --print-limit 10 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernel_gpu.py -k hopper > $OUT/memcheck-hopper.log 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck-hopper.log | tail -2
tar czf $REAL/all.tgz -C $OUT .
wait
echo "builds done at $(( $(date +%s) - t0 ))s"
SH=${SH:-"32,8,16,8192;8,8,16,32768;32,8,16,32768;8,8,8,8192;8,8,8,32768;8,8,16,8192;8,16,16,8192;32,16,16,8192;8,16,16,32768;8,16,64,8192;32,8,64,8192;1,8,16,8192;1,16,64,32768;8,8,16,1024;32,16,16,1024;8,16,64,1024;32,8,64,1024"}
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
        a, b = t("new", r), t("old", r)
    except OSError:
        continue
    q = [a[k] / b[k] for k in a]
    print("new/old round", r, "geomean %.3f" % math.exp(sum(map(math.log, q)) / len(q)), " ".join(f"{k.replace(' ','')}:{a[k]/b[k]:.3f}" for k in a))
PY
tar czf $REAL/all.tgz -C $OUT .
win=$(python3 - $OUT <<'PY'
import json, math, sys
out = sys.argv[1]
def t(n, r): return {x["label"]: x["times_us"]["ours"] for x in json.load(open(f"{out}/ab_{n}_{r}.json"))["rows"]}
g = [math.exp(sum(math.log(t("new", r)[k] / t("old", r)[k]) for k in t("new", r)) / len(t("new", r))) for r in (1, 2)]
print(1 if max(g) < 0.995 else 0)
PY
)
echo "adopt=$win"
if [ "$win" = 1 ]; then
  for g in 1 2; do
    echo "grid $g start $(( $(date +%s) - t0 ))s"
    timeout 90 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 100 --time-limit 45 --commit $COMMIT --out $OUT/grid$g.json > $OUT/grid$g.log 2>&1 || echo "grid failed"
    grep -E "geomean|large shapes" $OUT/grid$g.log
    tar czf $REAL/all.tgz -C $OUT .
  done
fi
echo "total $(( $(date +%s) - t0 ))s"
