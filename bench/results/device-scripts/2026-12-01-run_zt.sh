# Device script of 2026-12-01 (session 13): the final state (57ceec1's kernel sources; h41 reverted)
# with this session's tests: kernel GPU tests (both paths) and the Hopper sanitizers, racecheck now
# also over the consecutive-slot tests.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
timeout 60 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/kernel_tests.log 2>&1
echo "kernel tests rc=$? at $(( $(date +%s) - t0 ))s"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/kernel_tests.log | tail -3
tar czf $REAL/all.tgz -C $OUT .
source bench/gpu_sanitize.sh
sanitize_path hopper 50 50
echo "total $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
