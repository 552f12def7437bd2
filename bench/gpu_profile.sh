#!/usr/bin/env bash
# One ncu look at the verify kernel on a large shape (compute-bound, one wave of 132 CTAs x ~4).
#   (device) bash bench/gpu_profile.sh [B,H,n,L]
set -uo pipefail
source bench/gpu_env.sh
shape=${1:-32,16,64,8192}
timeout 240 ncu --clock-control none --kernel-name regex:verify_attention_kernel --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section LaunchStats --section Occupancy \
  python3 bench/smoke.py --profile-shape "$shape" > "$OUT/ncu.log" 2>&1
echo "ncu rc=$?"
grep -vE "^\s*$|----" "$OUT/ncu.log" | grep -E "Duration|Throughput|Stall|Warp Cycles|Issue|Pipe|Bank|Eligible|Active Warps|Registers|Shared Memory|L1/TEX Hit|L2 Hit|Executed Ipc|SM Busy|Memory \[%\]|Compute \(SM\)|One or More|No Eligible|DRAM" | head -60
