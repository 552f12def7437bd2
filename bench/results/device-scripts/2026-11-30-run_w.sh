# Device script of 2026-11-30 (session 10), h34b: PV in 2 (pv2) or 4 (pv4) groups against the default
# (-DKDTREE_PV_SPLIT=2|4). Kernel tests of the variant on both paths, then an A/B of the
# default build against both on 14 shapes, two interleaved rounds.
# Run from the checkout root on the GPU machine at the commit the result names, with the wheels in .whl/.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
for v in pv2:-DKDTREE_PV_SPLIT=2 pv4:-DKDTREE_PV_SPLIT=4; do
  ( python3 -c "import sys; from kdtree_backend.build import build; build('/tmp/lib_${v%%:*}.so', extra_flags=tuple(sys.argv[1].split(',')))" ${v#*:} > $OUT/build_${v%%:*}.log 2>&1 || echo "build ${v%%:*} failed" ) &
done
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
wait
echo "builds done at $(( $(date +%s) - t0 ))s"
for v in pv4; do
  KDTREE_LIB=/tmp/lib_$v.so timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/kernel_tests_$v.log 2>&1
  echo "kernel tests ($v, both paths) rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/kernel_tests_$v.log | tail -4
done
tar czf $REAL/all.tgz -C $OUT .
SH="8,16,64,8192;8,8,64,32768;1,8,16,1024;32,8,16,8192;8,8,16,32768;32,8,16,32768;8,8,8,8192;8,8,8,32768;32,8,8,8192;32,16,16,8192;8,16,16,8192;8,8,16,8192;32,16,64,8192;8,16,64,1024;1,8,16,8192;1,8,8,32768;32,8,64,1024;32,16,16,32768"
export KDTREE_KERNEL=hopper
for rnd in 1 2; do for name in default pv2 pv4; do
  if [ $name != default ]; then export KDTREE_LIB=/tmp/lib_$name.so; fi
  timeout 60 python3 bench/bench_verify.py --only ours --no-plot --no-check --budget-ms 50 --shapes "$SH" --commit $COMMIT-$name --out $OUT/ab_${name}_$rnd.json > $OUT/ab_${name}_$rnd.log 2>&1 || echo "ab $name $rnd failed"
  unset KDTREE_LIB
done; echo "round $rnd done at $(( $(date +%s) - t0 ))s"; done
unset KDTREE_KERNEL
python3 - $OUT <<'PY'
import json, math, sys
out = sys.argv[1]
def t(n, r):
    try:
        return {x["label"]: x["times_us"]["ours"] for x in json.load(open(f"{out}/ab_{n}_{r}.json"))["rows"]}
    except OSError:
        return {}
for v in ("pv2", "pv4"):
    for r in (1, 2):
        a, b = t(v, r), t("default", r)
        q = {k: a[k] / b[k] for k in a if k in b}
        if q:
            print(f"{v}/default round {r} geomean {math.exp(sum(map(math.log, q.values())) / len(q)):.3f} " + " ".join(f"{k.replace(' ','')}:{x:.3f}" for k, x in q.items()))
PY
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
