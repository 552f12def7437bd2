# Sourced by the device scripts (gpu_ab.sh, gpu_release.sh): compute-sanitizer on one kernel path.
# racecheck runs the smoke cases (bench/smoke.py --small, scattered slots) and the sanitizer-sized
# consecutive-slot kernel tests (runs of cache slots: the layout a TMA-loaded tile needs, perf-notes
# h41), memcheck all the sanitizer-sized kernel tests (KDTREE_TEST_SMALL=1) of that path; logs go to
# $OUT/{racecheck,racecheck-slots,memcheck}-<path>.log and the summary lines to stdout. Kept in one
# place so every device script checks the same way.
#   sanitize_path hopper|portable [racecheck timeout s] [memcheck timeout s]
sanitize_path() {
  local pth=$1 race_s=${2:-60} mem_s=${3:-90}
  KDTREE_KERNEL=$pth timeout "$race_s" compute-sanitizer --tool racecheck --print-limit 20 \
    python3 bench/smoke.py --small --no-triton > "$OUT/racecheck-$pth.log" 2>&1
  echo "racecheck ($pth) rc=$?"; grep -E "RACECHECK SUMMARY" "$OUT/racecheck-$pth.log"
  KDTREE_KERNEL=$pth KDTREE_TEST_SMALL=1 timeout "$race_s" compute-sanitizer --tool racecheck --print-limit 20 \
    python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernel_gpu.py -k "consecutive_slots and $pth" \
    > "$OUT/racecheck-slots-$pth.log" 2>&1
  echo "racecheck, consecutive slots ($pth) rc=$?"; grep -E "RACECHECK SUMMARY|passed|failed" "$OUT/racecheck-slots-$pth.log" | tail -2
  KDTREE_KERNEL=$pth KDTREE_TEST_SMALL=1 timeout "$mem_s" compute-sanitizer --tool memcheck --print-limit 20 \
    python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernel_gpu.py -k "$pth" > "$OUT/memcheck-$pth.log" 2>&1
  echo "memcheck ($pth) rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$OUT/memcheck-$pth.log" | tail -2
}
