# Device script of 2026-12-01 (session 14), final state: the whole kernel GPU test file on both paths
# and compute-sanitizer (racecheck on the smoke and consecutive-slot cases, memcheck on the
# sanitizer-sized tests) on both paths, for the final tree (kernel sources = 57ceec1's).
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/kernel_tests.log 2>&1
echo "kernel tests (both paths) rc=$? at $(( $(date +%s) - t0 ))s"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/kernel_tests.log | tail -4
tar czf $REAL/all.tgz -C $OUT .
source bench/gpu_sanitize.sh
sanitize_path hopper 80 100
tar czf $REAL/all.tgz -C $OUT .
sanitize_path portable 80 120
echo "total $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
