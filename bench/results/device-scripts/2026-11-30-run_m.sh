# Device script of 2026-11-30 (session 9), h28 (persistent CTAs): kernel tests on both paths, an A/B
# of the persistent kernel against the same source with one CTA per item (-DKDTREE_NO_PERSISTENT)
# and against the previous commit's library (a25e232, rebuilt with the ABI number 2: the struct
# layout is unchanged), then the Hopper sanitizers (racecheck also on 2 persistent CTAs).
# Run from the checkout root on the GPU machine at the commit the result names, with the wheels in .whl/.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
bld() { python3 -c "import sys; from kdtree_backend.build import build; build(sys.argv[1], extra_flags=tuple(sys.argv[2:]))" "$@"; }
( bld /tmp/lib_nopersist.so -DKDTREE_NO_PERSISTENT > $OUT/build_nopersist.log 2>&1 || echo "build nopersist failed" ) &
cp .whl/lib_old.so /tmp/lib_old.so
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
wait
echo "builds done at $(( $(date +%s) - t0 ))s"
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/kernel_tests.log 2>&1
echo "kernel tests (both paths) rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/kernel_tests.log | tail -6
tar czf $REAL/all.tgz -C $OUT .
SH="32,16,64,1024;32,8,64,1024;32,16,64,8192;32,8,64,8192;8,16,64,1024;32,16,16,1024;8,8,16,1024;32,8,16,1024;32,8,16,8192;8,16,64,8192;1,8,16,8192;8,8,8,8192"
for rnd in 1 2; do for name in default nopersist old; do
  if [ $name != default ]; then export KDTREE_LIB=/tmp/lib_$name.so; fi
  timeout 45 python3 bench/bench_verify.py --only ours --no-plot --no-check --budget-ms 50 --shapes "$SH" --commit $COMMIT-$name --out $OUT/ab_${name}_$rnd.json > $OUT/ab_${name}_$rnd.log 2>&1 || echo "ab $name $rnd failed"
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
for v, base in (("default", "old"), ("default", "nopersist"), ("nopersist", "old")):
    for r in (1, 2):
        a, b = t(v, r), t(base, r)
        q = {k: a[k] / b[k] for k in a if k in b}
        if q:
            g = math.exp(sum(map(math.log, q.values())) / len(q))
            print(f"{v}/{base} round {r} geomean {g:.3f} " + " ".join(f"{k.replace(' ','')}:{x:.3f}" for k, x in q.items()))
d = t("default", 1)
print("default us:", " ".join(f"{k.replace(' ','')}:{x:.1f}" for k, x in d.items()))
PY
echo "ab done at $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
source bench/gpu_sanitize.sh
sanitize_path hopper 60 100
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
