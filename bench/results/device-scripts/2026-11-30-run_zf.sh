# Device script of 2026-11-30 (session 11), h38b: the combine's request indices, lse and first
# partials in one round trip. Builds the new library, h38's (combine_kernel.cuh in .whl/h38_csrc/) and
# the one before h38 (.whl/old_csrc/); kernel tests and both sanitizers on both paths; an A/B of the
# three on split shapes (Hopper, two interleaved rounds); the combine's GPU time; the grid (twice).
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
for v in old h38; do
  mkdir -p /tmp/$v && cp -r kdtree_backend /tmp/$v/ && cp .whl/${v}_csrc/* /tmp/$v/kdtree_backend/csrc/
  ( cd /tmp/$v && PYTHONPATH=/tmp/site:/tmp/$v python3 -c "from kdtree_backend.build import build; build('/tmp/lib_$v.so')" ) > $OUT/build_$v.log 2>&1 &
done
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
wait
ls /tmp/lib_old.so /tmp/lib_h38.so
echo "builds done at $(( $(date +%s) - t0 ))s"
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/kernel_tests.log 2>&1
echo "kernel tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/kernel_tests.log | tail -6
tar czf $REAL/all.tgz -C $OUT .
source bench/gpu_sanitize.sh
sanitize_path hopper 60 100
sanitize_path portable 60 100
echo "sanitizers done at $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
SH="1,8,16,1024;1,8,16,8192;1,8,16,32768;1,8,64,1024;1,16,16,8192;1,16,64,8192;1,8,8,8192;1,8,8,32768;32,8,16,1024;8,8,64,1024;32,8,16,8192;8,16,16,1024;8,8,16,8192;32,8,8,1024;8,8,8,8192;8,16,64,8192"
export KDTREE_KERNEL=hopper
for rnd in 1 2; do for name in old h38 new; do
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
    for a_n, b_n in (("new", "h38"), ("new", "old")):
        a, b = t(a_n, r), t(b_n, r)
        q = {k: a[k] / b[k] for k in a if k in b}
        if q:
            print(f"{a_n}/{b_n} round {r} geomean {math.exp(sum(map(math.log, q.values())) / len(q)):.3f} " + " ".join(f"{k.replace(' ','')}:{x:.3f}({a[k]:.1f})" for k, x in q.items()))
PY
timeout 60 python3 bench/kernel_times.py "1,8,16,8192;1,8,64,1024;32,8,16,8192;8,16,16,8192" --json $OUT/kernel_times_new.json 2>&1 | grep -v -i warn
unset KDTREE_KERNEL
echo "ab done at $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
for run in 1 2; do
  timeout 150 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 100 --time-limit 45 --commit $COMMIT --out $OUT/grid_$run.json > $OUT/grid_$run.log 2>&1 || echo "grid $run failed"
  grep -E "geomean|large shapes" $OUT/grid_$run.log | head -5
  tar czf $REAL/all.tgz -C $OUT .
done
echo "total $(( $(date +%s) - t0 ))s"
