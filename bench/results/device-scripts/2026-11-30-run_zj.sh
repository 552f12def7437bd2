# Device script of 2026-11-30 (session 12), h40b: do HBM-bound calls run slower after an idle gap?
# bench/call_series.py (release library) back to back and with 5 ms gaps on the H8 n16 shapes and
# an L2-resident control; the timeline build's stamped call after 10 back-to-back calls; the four
# shapes against FlashMLA again; nvidia-smi sampled every 50 ms throughout.
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
echo "builds done at $(( $(date +%s) - t0 ))s"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv -lms 50 > $OUT/smi.csv 2>&1 &
SMI=$!
export KDTREE_KERNEL=hopper
for s in "32,8,16,8192:400:60" "8,8,16,32768:400:60" "32,8,16,32768:200:40" "8,16,64,8192:200:40"; do
  IFS=: read shp nb ng <<< "$s"; tag=$(echo $shp | tr , _)
  echo "series $shp b2b start $(date +%T.%N)" >> $OUT/marks.txt
  timeout 60 python3 bench/call_series.py $shp --calls $nb --json $OUT/cs_${tag}_b2b.json 2>&1 | tee $OUT/cs_${tag}_b2b.log
  echo "series $shp gap start $(date +%T.%N)" >> $OUT/marks.txt
  timeout 60 python3 bench/call_series.py $shp --calls $ng --gap-ms 5 --json $OUT/cs_${tag}_gap.json 2>&1 | tee $OUT/cs_${tag}_gap.log
done
tar czf $REAL/all.tgz -C $OUT .
for shp in 32,8,16,8192 32,8,16,32768; do
  tag=$(echo $shp | tr , _)
  echo "timeline warm $shp start $(date +%T.%N)" >> $OUT/marks.txt
  KDTREE_LIB=/tmp/lib_tl.so timeout 60 python3 bench/timeline.py $shp --replays 15 --warm 10 --json $OUT/tlw_$tag.json > $OUT/tlw_$tag.log 2>&1 || echo "timeline $shp failed"
  echo "== warm $shp"; sort -k4 -n $OUT/tlw_$tag.log | grep "^call" | awk "NR==1||NR%4==0" | cut -c1-200
done
unset KDTREE_KERNEL
echo "bench4 start $(date +%T.%N)" >> $OUT/marks.txt
timeout 150 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 400 --shapes "32,8,16,32768;32,8,16,8192;8,8,16,32768;8,16,64,8192" --commit $COMMIT --out $OUT/bench4.json > $OUT/bench4.log 2>&1 || echo "bench4 failed"
kill $SMI
python3 - $OUT <<'PY'
import json, sys
d = json.load(open(sys.argv[1] + "/bench4.json"))
for r in d["rows"]:
    print(r["label"], " ".join(f"{k}: p10 {v['p10_us']:.1f} med {v['us']:.1f} p90 {v['p90_us']:.1f} ({v['replays']}x{v['calls_per_replay']})" for k, v in r["timing"].items()))
PY
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
