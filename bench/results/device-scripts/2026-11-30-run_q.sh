# Device script of 2026-11-30 (session 9): a second grid of the final kernels (d0e3648's SASS; the
# commit adds tests and docs only), and one diagnostic: B1 H8 n16 at the old plan's 33 splits
# (KDTREE_NUM_SPLITS=33) against the planned 66, to see whether the extra planned splits cost the
# L1k / L8k shapes their 3%.
# Run from the checkout root on the GPU machine at the commit the result names, with the wheels in .whl/.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
echo "build done at $(( $(date +%s) - t0 ))s"
timeout 120 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 100 --time-limit 45 --commit $COMMIT --out $OUT/grid.json > $OUT/grid.log 2>&1 || echo "grid failed"
grep -E "geomean|large shapes" $OUT/grid.log | head -5
tar czf $REAL/all.tgz -C $OUT .
SH="1,8,16,1024;1,8,16,8192;1,8,16,32768"
for rnd in 1 2; do for s in planned 33; do
  if [ $s = 33 ]; then export KDTREE_NUM_SPLITS=33; fi
  KDTREE_KERNEL=hopper timeout 40 python3 bench/bench_verify.py --only ours --no-plot --no-check --budget-ms 50 --shapes "$SH" --commit $COMMIT-$s --out $OUT/diag_${s}_$rnd.json 2>&1 | grep -E "^\[" | sed "s/^/[$s r$rnd] /"
  unset KDTREE_NUM_SPLITS
done; done
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
