# Device script of 2026-12-01 (session 13): the final state (release kernel sources, 57ceec1's; h41's
# K-by-TMA reverted) with this session's new tests: kernel GPU tests on both paths (incl. the
# consecutive-slot tests) and compute-sanitizer on both paths (racecheck now also on those tests).
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
echo "build done at $(( $(date +%s) - t0 ))s"
timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/kernel_tests.log 2>&1
rc=$?; echo "kernel tests rc=$rc at $(( $(date +%s) - t0 ))s"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/kernel_tests.log | tail -4
tar czf $REAL/all.tgz -C $OUT .
source bench/gpu_sanitize.sh
sanitize_path hopper 70 90
sanitize_path portable 80 100
echo "total $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
