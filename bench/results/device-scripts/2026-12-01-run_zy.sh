# Device script of 2026-12-01 (session 14): ncu of h43 (-DKDTREE_PV1_UNDER_SOFTMAX) and of the release
# kernel on one large shape, per-instruction stall samples of both, to see where h43's 10% went
# (waits on the later refill group, or a softmax slowed by the PV beside it).
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1 KDTREE_KERNEL=hopper
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "from kdtree_backend.build import build; build('/tmp/lib_h43.so', extra_flags=('-DKDTREE_PV1_UNDER_SOFTMAX',))" > $OUT/build_h43.log 2>&1 &
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; exit 1; }
wait
echo "build done at $(( $(date +%s) - t0 ))s"
prof() {  # name, library (empty: the default build)
  KDTREE_LIB=$2 timeout 200 ncu --clock-control none --kernel-name "regex:hopper_kernel" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --section SourceCounters --import-source no -o /tmp/prof_$1 python3 bench/smoke.py --profile-shape 32,16,64,8192 > $OUT/ncu_run_$1.log 2>&1
  echo "ncu $1 rc=$? at $(( $(date +%s) - t0 ))s"
  ncu -i /tmp/prof_$1.ncu-rep --print-units base > $OUT/ncu_$1.log 2>&1
  grep -E "Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" $OUT/ncu_$1.log | head -6
  ncu -i /tmp/prof_$1.ncu-rep --page source --csv --print-source sass > $OUT/sass_stalls_$1.csv 2>/dev/null
  gzip -f $OUT/sass_stalls_$1.csv
  tar czf $REAL/all.tgz -C $OUT .
}
prof h43 /tmp/lib_h43.so
prof release ""
echo "total $(( $(date +%s) - t0 ))s"
