# Device script of 2026-12-01 (session 14), h41f (commit 40aef25's kernel sources in the working tree):
# the slot ids of tile t+4 loaded before tile t+2's cp.async. A/B against the release kernel
# (nok = 57ceec1's sources, .whl/old_csrc) on contiguous, scattered ("random") and "runs" slots first;
# the tests and sanitizers only when scattered slots come out at <= 1.01 (else the variant is dropped).
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
mkdir -p /tmp/old && cp -r kdtree_backend /tmp/old/ && cp .whl/old_csrc/* /tmp/old/kdtree_backend/csrc/
( cd /tmp/old && PYTHONPATH=/tmp/site:/tmp/old python3 -c "from kdtree_backend.build import build; build('/tmp/lib_nok.so')" ) > $OUT/build_nok.log 2>&1 &
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
echo "build done at $(( $(date +%s) - t0 ))s"
KDTREE_KERNEL=hopper timeout 40 python3 -m pytest -x -q -p no:cacheprovider tests/gpu/test_kernel_gpu.py -k "consecutive_slots and hopper" > $OUT/t_slots.log 2>&1
rc=$?; echo "consecutive-slot tests (hopper) rc=$rc"; tail -2 $OUT/t_slots.log
tar czf $REAL/all.tgz -C $OUT .
[ $rc -eq 0 ] || exit 1
wait
SH="32,8,16,8192;8,8,16,32768;32,8,16,32768;32,16,16,8192;8,16,64,8192;32,16,64,8192;32,8,64,8192;8,8,64,32768;8,16,64,1024;32,8,16,1024"
ab_round() {
  for lay in random contiguous runs; do
    for v in default nok; do
      if [ $v = nok ]; then export KDTREE_LIB=/tmp/lib_nok.so; fi
      KDTREE_KERNEL=hopper timeout 100 python3 bench/bench_verify.py --only ours --no-plot --no-check --budget-ms 30 --slots $lay \
        --shapes "$SH" --commit $COMMIT --out $OUT/ab_${lay}_${v}_$1.json > $OUT/ab_${lay}_${v}_$1.log 2>&1 || echo "ab $lay $v $1 failed"
      unset KDTREE_LIB
    done
  done
  echo "ab round $1 done at $(( $(date +%s) - t0 ))s"
  tar czf $REAL/all.tgz -C $OUT .
}
summary() {
python3 - $OUT <<'PY'
import json, sys, math
out = sys.argv[1]
def load(n):
    try: return {tuple(r["shape"][k] for k in "BHnL"): r["times_us"]["ours"] for r in json.load(open(f"{out}/{n}.json"))["rows"]}
    except Exception as e: return {}
worst = 0.0
for lay in ("random", "contiguous", "runs"):
    for rnd in (1, 2):
        a, b = load(f"ab_{lay}_default_{rnd}"), load(f"ab_{lay}_nok_{rnd}")
        ks = [k for k in a if k in b]
        if not ks: continue
        g = math.exp(sum(math.log(a[k] / b[k]) for k in ks) / len(ks))
        if lay == "random": worst = max(worst, g)
        print(f"{lay} round {rnd}: h41f / release geomean {g:.4f}  " + "  ".join(f"B{k[0]}H{k[1]}n{k[2]}L{k[3]}:{a[k]:.1f}/{b[k]:.1f}" for k in ks))
open(f"{out}/gate", "w").write("pass" if 0 < worst <= 1.01 else "fail")
PY
}
ab_round 1
summary
if [ "$(cat $OUT/gate)" != pass ]; then echo "scattered slots > 1.01: h41f dropped, no tests run"; tar czf $REAL/all.tgz -C $OUT .; exit 0; fi
timeout 130 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/kernel_tests.log 2>&1
rc=$?; echo "kernel tests rc=$rc at $(( $(date +%s) - t0 ))s"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/kernel_tests.log | tail -8
tar czf $REAL/all.tgz -C $OUT .
source bench/gpu_sanitize.sh
sanitize_path hopper 70 90
echo "sanitizers done at $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
if [ $(( $(date +%s) - t0 )) -lt 420 ]; then ab_round 2; summary; fi
echo "total $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
