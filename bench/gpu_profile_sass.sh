#!/usr/bin/env bash
# ncu on one kernel path, one large shape: speed-of-light, stalls, and per-instruction (SASS)
# stall samples as CSV for offline reading.
#   (device) bash bench/gpu_profile_sass.sh [B,H,n,L]                    # the Hopper kernel
#   (device) PATH_KERNEL=portable bash bench/gpu_profile_sass.sh [B,H,n,L] # the portable kernel
#   (device) NAME_RE=<kernel-name regex> KDTREE_LIB=/tmp/lib_x.so bash bench/gpu_profile_sass.sh  # an A/B build
set -uo pipefail
source bench/gpu_env.sh
shape=${1:-32,16,64,8192}
export KDTREE_KERNEL=${PATH_KERNEL:-hopper}
if [ "$KDTREE_KERNEL" = hopper ]; then name_re=hopper_kernel; else name_re=verify_attention_kernel; fi
name_re=${NAME_RE:-$name_re}  # an A/B build whose kernel has another name (loaded through KDTREE_LIB)
timeout 200 ncu --clock-control none --kernel-name "regex:$name_re" --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section LaunchStats --section Occupancy \
  --section SourceCounters --import-source no -o /tmp/prof python3 bench/smoke.py --profile-shape "$shape" \
  > "$OUT/ncu_run.log" 2>&1
echo "ncu rc=$?"
ncu -i /tmp/prof.ncu-rep --print-units base > "$OUT/ncu.log" 2>&1
grep -vE "^\s*$|----" "$OUT/ncu.log" | grep -E "Duration|Throughput|Stall|Warp Cycles|Issue|Pipe|Bank|Eligible|Active Warps|Registers|L1/TEX Hit|L2 Hit|Executed Ipc|SM Busy|Memory \[%\]|Compute \(SM\)|One or More|No Eligible|DRAM|Tensor" | head -50
ncu -i /tmp/prof.ncu-rep --page source --csv --print-source sass > "$OUT/sass_stalls.csv" 2>/dev/null
echo "sass csv $(wc -l < "$OUT/sass_stalls.csv") lines"
