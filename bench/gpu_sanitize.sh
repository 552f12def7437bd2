# Sourced by the device scripts (gpu_ab.sh, gpu_release.sh): compute-sanitizer on one kernel path.
# racecheck runs the smoke cases (bench/smoke.py --small, scattered slots) and the sanitizer-sized
# consecutive-slot kernel tests (runs of cache slots: the layout a TMA-loaded tile needs, perf-notes
# h41), memcheck all the sanitizer-sized kernel tests (KDTREE_TEST_SMALL=1) of that path; logs go to
# $OUT/{racecheck,racecheck-slots,memcheck}-<path>.log and the summary lines to stdout. Kept in one
# place so every device script checks the same way.
#   sanitize_path hopper|portable [racecheck timeout s] [memcheck timeout s]
# One compute-sanitizer tool over the path's sanitizer-sized kernel tests selected by -k:
#   _sanitize_tests path tool timeout log-name label summary-regex -k-expression
_sanitize_tests() {
  local pth=$1 tool=$2 secs=$3 log=$4 label=$5 summary=$6 select=$7
  KDTREE_KERNEL=$pth KDTREE_TEST_SMALL=1 timeout "$secs" compute-sanitizer --tool "$tool" --print-limit 20 \
    python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernel_gpu.py -k "$select" > "$OUT/$log-$pth.log" 2>&1
  echo "$label ($pth) rc=$?"; grep -E "$summary|passed|failed" "$OUT/$log-$pth.log" | tail -2
}
sanitize_path() {
  local pth=$1 race_s=${2:-60} mem_s=${3:-90}
  KDTREE_KERNEL=$pth timeout "$race_s" compute-sanitizer --tool racecheck --print-limit 20 \
    python3 bench/smoke.py --small --no-triton > "$OUT/racecheck-$pth.log" 2>&1
  echo "racecheck ($pth) rc=$?"; grep -E "RACECHECK SUMMARY" "$OUT/racecheck-$pth.log"
  _sanitize_tests "$pth" racecheck "$race_s" racecheck-slots "racecheck, consecutive slots" "RACECHECK SUMMARY" \
    "consecutive_slots and $pth"
  _sanitize_tests "$pth" memcheck "$mem_s" memcheck memcheck "ERROR SUMMARY" "$pth"
}
