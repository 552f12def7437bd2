# Device script of 2026-11-30 (session 9), h29b: kernel tests on both paths; A/B of h29b (default),
# the first form's plan (-DKDTREE_SPLIT_PLAN_ONE_WAVE) and a25e232's library (old) on small-batch and
# split shapes, 2 rounds; if h29b is no slower than old on the geomean, sanitizers on both paths and
# the grid against FlashMLA.
# Run from the checkout root on the GPU machine at the commit the result names, with the wheels in .whl/.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
bld() { python3 -c "import sys; from kdtree_backend.build import build; build(sys.argv[1], extra_flags=tuple(sys.argv[2:]))" "$@"; }
( bld /tmp/lib_oneway.so -DKDTREE_SPLIT_PLAN_ONE_WAVE > $OUT/build_oneway.log 2>&1 || echo "build oneway failed" ) &
cp .whl/lib_a25.so /tmp/lib_old.so
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
wait
echo "builds done at $(( $(date +%s) - t0 ))s"
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/kernel_tests.log 2>&1
echo "kernel tests (both paths) rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/kernel_tests.log | tail -6
tar czf $REAL/all.tgz -C $OUT .
SH="1,8,16,1024;1,8,16,8192;1,8,16,32768;1,8,8,1024;1,8,8,8192;1,8,8,32768;1,16,16,1024;1,16,16,8192;1,16,16,32768;1,8,64,1024;1,8,64,32768;1,16,64,32768;8,8,8,1024;8,8,8,8192;8,8,16,1024;8,8,16,8192;8,16,16,8192;32,8,16,1024;8,16,64,8192;32,16,16,8192"
export KDTREE_KERNEL=hopper
for rnd in 1 2; do for name in default old oneway; do
  if [ $name != default ]; then export KDTREE_LIB=/tmp/lib_$name.so; fi
  timeout 50 python3 bench/bench_verify.py --only ours --no-plot --no-check --budget-ms 50 --shapes "$SH" --commit $COMMIT-$name --out $OUT/ab_${name}_$rnd.json > $OUT/ab_${name}_$rnd.log 2>&1 || echo "ab $name $rnd failed"
  unset KDTREE_LIB
done; done
unset KDTREE_KERNEL
ok=$(python3 - $OUT <<'PY'
import json, math, sys
out = sys.argv[1]
def t(n, r):
    try:
        return {x["label"]: x["times_us"]["ours"] for x in json.load(open(f"{out}/ab_{n}_{r}.json"))["rows"]}
    except OSError:
        return {}
worst = 0
for v in ("default", "oneway"):
    for r in (1, 2):
        a, b = t(v, r), t("old", r)
        q = {k: a[k] / b[k] for k in a if k in b}
        if q:
            g = math.exp(sum(map(math.log, q.values())) / len(q))
            if v == "default":
                worst = max(worst, g)
            print(f"{v}/old round {r} geomean {g:.3f} " + " ".join(f"{k.replace(' ','')}:{x:.3f}" for k, x in q.items()), file=sys.stderr)
print("yes" if 0 < worst < 1.0 else "no")
PY
)
echo "h29b no slower than old: $ok; ab done at $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
if [ "$ok" = yes ]; then
  source bench/gpu_sanitize.sh
  sanitize_path hopper 60 90
  sanitize_path portable 60 90
  echo "sanitizers done at $(( $(date +%s) - t0 ))s"
  tar czf $REAL/all.tgz -C $OUT .
  timeout 120 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 100 --time-limit 45 --commit $COMMIT --out $OUT/grid.json > $OUT/grid.log 2>&1 || echo "grid failed"
  grep -E "geomean|large shapes" $OUT/grid.log | head -5
fi
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
