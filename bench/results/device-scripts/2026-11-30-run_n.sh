# Device script of 2026-11-30 (session 9): split-count sweep on the small-batch shapes (Hopper path),
# KDTREE_NUM_SPLITS forced to each count for all shapes of one run (min 64 keys a split, as planned),
# plus the planned count and FlashMLA once, to calibrate a device-side split rule.
# Run from the checkout root on the GPU machine at the commit the result names, with the wheels in .whl/.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
echo "build done at $(( $(date +%s) - t0 ))s"
SH="1,8,16,1024;1,8,16,8192;1,8,16,32768;1,8,8,1024;1,8,8,8192;1,8,8,32768;1,16,16,1024;1,16,16,8192;1,16,16,32768;1,8,64,8192;1,8,64,32768;1,16,64,32768;8,8,8,8192;8,8,8,32768"
export KDTREE_KERNEL=hopper
timeout 60 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 50 --shapes "$SH" --commit $COMMIT-planned --out $OUT/sw_planned.json > $OUT/sw_planned.log 2>&1 || echo "planned failed"
for s in 8 16 24 33 48 66 96 128; do
  KDTREE_NUM_SPLITS=$s timeout 45 python3 bench/bench_verify.py --only ours --no-plot --no-check --budget-ms 50 --shapes "$SH" --commit $COMMIT-s$s --out $OUT/sw_$s.json > $OUT/sw_$s.log 2>&1 || echo "s=$s failed"
  echo "s=$s at $(( $(date +%s) - t0 ))s"
done
python3 - $OUT <<'PY'
import json, sys
out = sys.argv[1]
def load(n):
    try:
        return {x["label"]: x["times_us"] for x in json.load(open(f"{out}/sw_{n}.json"))["rows"]}
    except OSError:
        return {}
base = load("planned")
cols = [8, 16, 24, 33, 48, 66, 96, 128]
data = {s: load(s) for s in cols}
print("shape".ljust(18), "planned  flashmla  " + "  ".join(f"s{s:<5}" for s in cols))
for k, v in base.items():
    print(k.ljust(18), f"{v['ours']:7.1f}  {v.get('flashmla', 0):7.1f}  " + "  ".join(f"{data[s].get(k, {}).get('ours', float('nan')):6.1f}" for s in cols))
PY
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
