# Device script of 2026-11-30 (session 7), kept so the results that name it can be rerun exactly.
# Run from the checkout root on the GPU machine at the commit the result names, with the wheels in .whl/.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
( python3 -c "from kdtree_backend.build import build; build('/tmp/lib_tl.so', extra_flags=('-DKDTREE_TIMELINE',))" > $OUT/build_tl.log 2>&1 || echo "build tl failed" ) &
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -5 $OUT/build.log; exit 1; }
grep "hopper_kernel" $OUT/build.log | head -2
timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/kernel_tests.log 2>&1
echo "kernel tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/kernel_tests.log | tail -3
timeout 100 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 100 --time-limit 45 --commit 1df0b77 --out $OUT/grid.json > $OUT/grid.log 2>&1
echo "grid rc=$?"; grep -E "geomean|large" $OUT/grid.log | head -3
tar czf $REAL/all.tgz -C $OUT .
KDTREE_KERNEL=hopper timeout 70 compute-sanitizer --tool racecheck --print-limit 10 python3 bench/smoke.py --small --no-triton > $OUT/racecheck-hopper.log 2>&1
echo "racecheck rc=$?"; grep -E "RACECHECK SUMMARY" $OUT/racecheck-hopper.log
KDTREE_KERNEL=hopper KDTREE_TEST_SMALL=1 timeout 100 compute-sanitizer --tool memcheck --print-limit 10 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernel_gpu.py -k hopper > $OUT/memcheck-hopper.log 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" $OUT/memcheck-hopper.log | tail -2
tar czf $REAL/all.tgz -C $OUT .
wait
for s in 8,16,64,64 8,16,64,1024; do
  KDTREE_LIB=/tmp/lib_tl.so KDTREE_KERNEL=hopper timeout 40 python3 bench/timeline.py $s --json $OUT/tl_$s.json 2>&1 | tail -9
done
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
