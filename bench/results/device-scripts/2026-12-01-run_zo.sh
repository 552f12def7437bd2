# Device script of 2026-12-01 (session 13): h41c debugging. The consecutive-slot tests hung on the
# Hopper path at db0cf17; run them alone, verbose, with timeouts, on this build and on -DKDTREE_NO_K_TMA.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
( python3 -c "from kdtree_backend.build import build; build('/tmp/lib_nok.so', extra_flags=('-DKDTREE_NO_K_TMA',))" > $OUT/build_nok.log 2>&1 ) &
KDTREE_KERNEL=hopper timeout 60 python3 -m pytest -x -v -p no:cacheprovider tests/gpu/test_kernel_gpu.py -k "consecutive_slots and hopper" > $OUT/t_new.log 2>&1
echo "new rc=$?"; grep -E "PASSED|FAILED|Error|error" $OUT/t_new.log | head -12
wait
KDTREE_LIB=/tmp/lib_nok.so KDTREE_KERNEL=hopper timeout 40 python3 -m pytest -x -v -p no:cacheprovider tests/gpu/test_kernel_gpu.py -k "consecutive_slots and hopper" > $OUT/t_nok.log 2>&1
echo "nok rc=$?"; grep -E "PASSED|FAILED|Error|error" $OUT/t_nok.log | head -12
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
