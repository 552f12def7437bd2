# Device script of 2026-12-01 (session 14), final: the release kernel (sources = 57ceec1's) after
# make_verify_batch's "contiguous" layout became slots 1, 2, ... in request order and bench_verify's
# --slots contiguous moved onto it: the consecutive-slot GPU tests on both paths, racecheck over them
# on both paths (sanitizer-sized), and the benchmark's three slot layouts on two shapes.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
tail -3 $OUT/build.log
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernel_gpu.py -k consecutive_slots > $OUT/t_slots.log 2>&1
echo "consecutive-slot tests (both paths) rc=$?"; tail -2 $OUT/t_slots.log
for pth in hopper portable; do
  KDTREE_KERNEL=$pth KDTREE_TEST_SMALL=1 timeout 90 compute-sanitizer --tool racecheck --print-limit 20 \
    python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernel_gpu.py -k "consecutive_slots and $pth" > $OUT/racecheck-slots-$pth.log 2>&1
  echo "racecheck, consecutive slots ($pth) rc=$?"; grep -E "RACECHECK SUMMARY|passed|failed" $OUT/racecheck-slots-$pth.log | tail -2
done
tar czf $REAL/all.tgz -C $OUT .
for lay in random contiguous runs; do
  timeout 100 python3 bench/bench_verify.py --only ours --no-plot --budget-ms 30 --slots $lay \
    --shapes "32,8,16,8192;8,16,64,1024" --commit $COMMIT --out $OUT/bench_$lay.json > $OUT/bench_$lay.log 2>&1
  echo "bench --slots $lay rc=$?"; grep -E "B=|ours" $OUT/bench_$lay.log | tail -3
done
echo "total $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
