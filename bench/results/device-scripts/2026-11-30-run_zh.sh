# Device script of 2026-11-30 (session 11), h39b: the whole-rows split combine as a programmatic
# dependent launch. Builds the new library and h38b's (all changed sources carried in .whl/old_csrc/);
# kernel tests on both paths, an A/B of the two (Hopper, two interleaved rounds), the Hopper
# sanitizers, the grid against FlashMLA, then the portable sanitizers.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
mkdir -p /tmp/old && cp -r kdtree_backend /tmp/old/ && cp .whl/old_csrc/* /tmp/old/kdtree_backend/csrc/
( cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old python3 -c "from kdtree_backend.build import build; build('/tmp/lib_old.so')" ) > $OUT/build_old.log 2>&1 &
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
wait
ls /tmp/lib_old.so || tail -3 $OUT/build_old.log
echo "builds done at $(( $(date +%s) - t0 ))s"
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/kernel_tests.log 2>&1
echo "kernel tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/kernel_tests.log | tail -6
tar czf $REAL/all.tgz -C $OUT .
SH="1,8,16,8192;1,8,16,32768;1,8,8,32768;1,16,64,8192;32,8,16,1024;8,8,64,1024;32,8,16,8192;8,16,16,1024;8,8,16,8192;8,8,8,8192;32,8,8,1024;8,16,64,1024;32,16,64,1024"
export KDTREE_KERNEL=hopper
for rnd in 1 2; do for name in old new; do
  if [ $name != new ]; then export KDTREE_LIB=/tmp/lib_$name.so; fi
  timeout 60 python3 bench/bench_verify.py --only ours --no-plot --no-check --budget-ms 50 --shapes "$SH" --commit $COMMIT-$name --out $OUT/ab_${name}_$rnd.json > $OUT/ab_${name}_$rnd.log 2>&1 || echo "ab $name $rnd failed"
  unset KDTREE_LIB
done; done
unset KDTREE_KERNEL
python3 - $OUT <<'PY'
import json, math, sys
out = sys.argv[1]
def t(n, r):
    try:
        return {x["label"]: x["times_us"]["ours"] for x in json.load(open(f"{out}/ab_{n}_{r}.json"))["rows"] if "ours" in x["times_us"]}
    except OSError:
        return {}
for r in (1, 2):
    a, b = t("new", r), t("old", r)
    q = {k: a[k] / b[k] for k in a if k in b}
    if q:
        print(f"new/old round {r} geomean {math.exp(sum(map(math.log, q.values())) / len(q)):.3f} " + " ".join(f"{k.replace(' ','')}:{x:.3f}({a[k]:.1f})" for k, x in q.items()))
PY
echo "ab done at $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
source bench/gpu_sanitize.sh
sanitize_path hopper 50 90
tar czf $REAL/all.tgz -C $OUT .
timeout 100 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 100 --time-limit 45 --commit $COMMIT --out $OUT/grid.json > $OUT/grid.log 2>&1 || echo "grid failed"
grep -E "geomean|large shapes" $OUT/grid.log | head -5
tar czf $REAL/all.tgz -C $OUT .
sanitize_path portable 50 90
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
