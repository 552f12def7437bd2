# Device script of 2026-12-01 (session 14): the benchmark grid (ours and FlashMLA, CUDA-graph replays)
# on the final tree, whose kernel sources are 57ceec1's (release SASS unchanged since session 12), to
# restate issue 6's bars with this session's numbers.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
timeout 420 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 100 --time-limit 45 \
  --commit $COMMIT --out $OUT/grid.json > $OUT/grid.log 2>&1
echo "grid rc=$? at $(( $(date +%s) - t0 ))s"
tail -25 $OUT/grid.log
tar czf $REAL/all.tgz -C $OUT .
