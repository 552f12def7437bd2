# Device script of 2026-11-30 (session 12): release checks of the final session-11 build (its grid
# was never run) and h40, the timeline of the bimodal HBM-bound H8 n16 shapes (SM id, SM clock,
# row-tile skew per call). Kernel tests on both paths, the h40 timelines with nvidia-smi sampling,
# the grid against FlashMLA, the sanitizers on both paths, then the other GPU tests.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "from kdtree_backend.build import build; build('/tmp/lib_tl.so', extra_flags=('-DKDTREE_TIMELINE',))" > $OUT/build_tl.log 2>&1 &
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
wait
ls /tmp/lib_tl.so || tail -5 $OUT/build_tl.log
echo "builds done at $(( $(date +%s) - t0 ))s"
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/kernel_tests.log 2>&1
echo "kernel tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/kernel_tests.log | tail -6
tar czf $REAL/all.tgz -C $OUT .
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv -lms 200 > $OUT/smi.csv 2>&1 &
SMI=$!
for s in "32,8,16,32768:40" "32,8,16,8192:40" "8,8,16,32768:30" "8,16,64,8192:20"; do
  shp=${s%%:*}; n=${s##*:}; tag=$(echo $shp | tr , _)
  echo "timeline $shp start $(date +%T.%N)" >> $OUT/marks.txt
  KDTREE_LIB=/tmp/lib_tl.so KDTREE_KERNEL=hopper timeout 90 python3 bench/timeline.py $shp --replays $n --json $OUT/tl_$tag.json > $OUT/tl_$tag.log 2>&1 || echo "timeline $shp failed"
  echo "== $shp (calls by span: fastest, every 5th)"; sort -k4 -n $OUT/tl_$tag.log | grep "^call" | awk "NR==1||NR%5==0" | cut -c1-230
done
echo "bench4 start $(date +%T.%N)" >> $OUT/marks.txt
timeout 120 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 200 --shapes "32,8,16,32768;32,8,16,8192;8,8,16,32768;8,16,64,8192" --commit $COMMIT --out $OUT/bench4.json > $OUT/bench4.log 2>&1 || echo "bench4 failed"
kill $SMI
python3 - $OUT <<'PY'
import json, sys
d = json.load(open(sys.argv[1] + "/bench4.json"))
for r in d["rows"]:
    print(r["label"], " ".join(f"{k}: p10 {v['p10_us']:.1f} med {v['us']:.1f} p90 {v['p90_us']:.1f} ({v['replays']}x{v['calls_per_replay']})" for k, v in r["timing"].items()))
PY
echo "timelines done at $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
timeout 100 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 100 --time-limit 45 --commit $COMMIT --out $OUT/grid.json > $OUT/grid.log 2>&1 || echo "grid failed"
grep -E "geomean|large shapes|under" $OUT/grid.log | head -8
tar czf $REAL/all.tgz -C $OUT .
source bench/gpu_sanitize.sh
sanitize_path hopper 50 90
sanitize_path portable 50 90
tar czf $REAL/all.tgz -C $OUT .
left=$(( 585 - ($(date +%s) - t0) ))
echo "other gpu tests with ${left}s"
[ $left -gt 20 ] && timeout $left python3 -m pytest -q -m gpu tests --deselect tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/other_gpu_tests.log 2>&1; echo "other gpu tests rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/other_gpu_tests.log | tail -4
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
