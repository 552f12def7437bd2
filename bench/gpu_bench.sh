#!/usr/bin/env bash
# Device call 2 of a release check: the issue-3 benchmark (ceilings, grid, JSON + PNG) and one
# ncu profile of a large shape.   (device) KDTREE_COMMIT=<sha> bash bench/gpu_bench.sh
set -uo pipefail
source bench/gpu_env.sh
python3 bench/bench_verify.py --out "$OUT/bench.json" --commit "${KDTREE_COMMIT:-nogit}" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; tail -60 "$OUT/bench.log"
if [ "${KDTREE_NCU:-1}" = "1" ]; then
  timeout 120 ncu --clock-control none --kernel-name regex:verify_attention_kernel --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    python3 bench/smoke.py --profile-shape 32,16,64,8192 > "$OUT/ncu.log" 2>&1
  echo "ncu rc=$?"; grep -E "Duration|Throughput|Stall|Warp Cycles|Issued|Pipe|Bank" "$OUT/ncu.log" | head -40
fi
