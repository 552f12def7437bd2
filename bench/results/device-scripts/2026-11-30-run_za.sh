# Device script of 2026-11-30 (session 10), h36: WG0's last PV group issued before P is shared
# (-DKDTREE_PV_BEFORE_SHARE). Kernel tests on the Hopper path with the switch,
# an A/B against the default (h34) build on 10 shapes, two interleaved rounds, then the grid
# against FlashMLA with the switch.
# Run from the checkout root on the GPU machine at the commit the result names, with the wheels in .whl/.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
( python3 -c "from kdtree_backend.build import build; build('/tmp/lib_pb.so', extra_flags=('-DKDTREE_PV_BEFORE_SHARE',))" > $OUT/build_pb.log 2>&1 || echo "build pb failed" ) &
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
wait
echo "builds done at $(( $(date +%s) - t0 ))s"
export KDTREE_LIB=/tmp/lib_pb.so
timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -k hopper -p no:cacheprovider > $OUT/kernel_tests_pb.log 2>&1
echo "kernel tests (pb, hopper) rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/kernel_tests_pb.log | tail -4
unset KDTREE_LIB
echo "tests done at $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
SH="8,16,64,8192;8,8,64,32768;32,8,16,8192;32,16,16,8192;32,16,64,8192;8,16,64,1024;32,8,64,1024;1,8,16,1024;1,8,16,8192;8,8,16,32768"
export KDTREE_KERNEL=hopper
for rnd in 1 2; do for name in default pb; do
  if [ $name != default ]; then export KDTREE_LIB=/tmp/lib_$name.so; fi
  timeout 60 python3 bench/bench_verify.py --only ours --no-plot --no-check --budget-ms 50 --shapes "$SH" --commit $COMMIT-$name --out $OUT/ab_${name}_$rnd.json > $OUT/ab_${name}_$rnd.log 2>&1 || echo "ab $name $rnd failed"
  unset KDTREE_LIB
done; done
unset KDTREE_KERNEL
python3 - $OUT <<'PY'
import json, math, sys
out = sys.argv[1]
def t(n, r):
    try:
        return {x["label"]: x["times_us"]["ours"] for x in json.load(open(f"{out}/ab_{n}_{r}.json"))["rows"]}
    except OSError:
        return {}
for r in (1, 2):
    a, b = t("pb", r), t("default", r)
    q = {k: a[k] / b[k] for k in a if k in b}
    if q:
        print(f"pb/default round {r} geomean {math.exp(sum(map(math.log, q.values())) / len(q)):.3f} " + " ".join(f"{k.replace(' ','')}:{x:.3f}" for k, x in q.items()))
PY
echo "ab done at $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
KDTREE_LIB=/tmp/lib_pb.so timeout 150 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 100 --time-limit 45 --commit $COMMIT-pb --out $OUT/grid_pb.json > $OUT/grid_pb.log 2>&1 || echo "grid failed"
grep -E "geomean|large shapes" $OUT/grid_pb.log | head -5
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
