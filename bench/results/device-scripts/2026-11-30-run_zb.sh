# Device script of 2026-11-30 (session 11): what the split epilogue costs (h37's premise).
# Per-kernel GPU time (main kernel vs split combine) on the 2-split and other split shapes
# (bench/kernel_times.py, L2 flushed before each call), the cluster occupancy of the kernel's
# shape (bench/cluster_probe.cu), and the timeline of B32 H8 n16 L8k (a -DKDTREE_TIMELINE build).
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
nvcc -O2 -arch=sm_90a -o /tmp/cluster_probe bench/cluster_probe.cu && /tmp/cluster_probe | tee $OUT/cluster_probe.json
( python3 -c "from kdtree_backend.build import build; build('/tmp/lib_tl.so', extra_flags=('-DKDTREE_TIMELINE',))" > $OUT/build_tl.log 2>&1 || echo "build tl failed" ) &
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
wait
echo "builds done at $(( $(date +%s) - t0 ))s"
SH="32,8,16,8192;8,8,16,32768;32,8,16,1024;8,8,64,1024;8,8,64,8192;32,8,16,32768;8,16,16,8192;32,8,8,8192;8,8,16,8192;1,8,16,8192;8,16,64,8192"
KDTREE_KERNEL=hopper timeout 200 python3 bench/kernel_times.py "$SH" --json $OUT/kernel_times.json 2>&1 | tee $OUT/kernel_times.log
echo "kernel times done at $(( $(date +%s) - t0 ))s"
for s in 32,8,16,8192 8,8,64,1024; do
  KDTREE_LIB=/tmp/lib_tl.so KDTREE_KERNEL=hopper timeout 60 python3 bench/timeline.py $s --json $OUT/tl_${s//,/_}.json 2>&1 | tee -a $OUT/timeline.log
done
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
