# Device script of 2026-12-01 (session 13): h41c debugging with -DKDTREE_DEBUG_HANG (clock watchdog in mbar_wait, each tile's votes printed)
# mbar_wait, each tile's votes printed) on the test that hangs.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
python3 -c "from kdtree_backend.build import build; build('/tmp/lib_dbg.so', extra_flags=('-DKDTREE_DEBUG_HANG',))" > $OUT/build_dbg.log 2>&1 || { tail $OUT/build_dbg.log; exit 1; }
KDTREE_LIB=/tmp/lib_dbg.so KDTREE_KERNEL=hopper timeout 45 python3 -m pytest -x -v -s -p no:cacheprovider tests/gpu/test_kernel_gpu.py -k "consecutive_slots and hopper and pool-H16" > $OUT/t_dbg.log 2>&1
echo "dbg rc=$?"; grep -E "hang|PASSED|FAILED" $OUT/t_dbg.log | head -20; grep -c "kdtree tile" $OUT/t_dbg.log
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
