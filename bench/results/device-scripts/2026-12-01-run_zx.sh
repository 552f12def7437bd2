# Device script of 2026-12-01 (session 14), h43: WG1's PV under WG0's softmax (P per K stage)
# (-DKDTREE_PV1_UNDER_SOFTMAX, built beside the release library in the same call). A quick Hopper test
# first (hangs cost the budget), then the Hopper kernel tests on it, the A/B against the release
# kernel (10 shapes, random slots, two interleaved rounds), and racecheck/memcheck on it.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "from kdtree_backend.build import build; build('/tmp/lib_h43.so', extra_flags=('-DKDTREE_PV1_UNDER_SOFTMAX',))" > $OUT/build_h43.log 2>&1 &
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
wait
[ -f /tmp/lib_h43.so ] || { tail -20 $OUT/build_h43.log; cp $OUT/build_h43.log $REAL/; exit 1; }
echo "build done at $(( $(date +%s) - t0 ))s"
export KDTREE_KERNEL=hopper
KDTREE_LIB=/tmp/lib_h43.so timeout 60 python3 -m pytest -x -q -p no:cacheprovider tests/gpu/test_kernel_gpu.py -k "consecutive_slots and hopper" > $OUT/t_quick.log 2>&1
rc=$?; echo "quick h43 test rc=$rc"; tail -15 $OUT/t_quick.log
tar czf $REAL/all.tgz -C $OUT .
[ $rc -eq 0 ] || exit 1
KDTREE_LIB=/tmp/lib_h43.so timeout 150 env -u KDTREE_KERNEL python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/kernel_tests_h43.log 2>&1
rc=$?; echo "h43 kernel tests (both paths) rc=$rc at $(( $(date +%s) - t0 ))s"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/kernel_tests_h43.log | tail -8
tar czf $REAL/all.tgz -C $OUT .
SH="32,8,16,8192;8,8,16,32768;32,8,16,32768;32,16,16,8192;8,16,64,8192;32,16,64,8192;32,8,64,8192;8,8,64,32768;8,16,64,1024;32,8,16,1024"
ab_round() {
  for v in h43 rel; do
    if [ $v = h43 ]; then export KDTREE_LIB=/tmp/lib_h43.so; fi
    timeout 100 python3 bench/bench_verify.py --only ours --no-plot --no-check --budget-ms 30 \
      --shapes "$SH" --commit $COMMIT --out $OUT/ab_${v}_$1.json > $OUT/ab_${v}_$1.log 2>&1 || echo "ab $v $1 failed"
    unset KDTREE_LIB
  done
  echo "ab round $1 done at $(( $(date +%s) - t0 ))s"
  tar czf $REAL/all.tgz -C $OUT .
}
ab_round 1
ab_round 2
python3 - $OUT <<'PY'
import json, sys, math
out = sys.argv[1]
def load(n):
    try: return {tuple(r["shape"][k] for k in "BHnL"): r["times_us"]["ours"] for r in json.load(open(f"{out}/{n}.json"))["rows"]}
    except Exception as e: print("missing", n, e); return {}
for rnd in (1, 2):
    a, b = load(f"ab_h43_{rnd}"), load(f"ab_rel_{rnd}")
    ks = [k for k in a if k in b]
    if not ks: continue
    g = math.exp(sum(math.log(a[k] / b[k]) for k in ks) / len(ks))
    print(f"round {rnd}: h43 / release geomean {g:.4f}  " + "  ".join(f"B{k[0]}H{k[1]}n{k[2]}L{k[3]}:{a[k]:.1f}/{b[k]:.1f}" for k in ks))
PY
if [ $rc -eq 0 ]; then
  source bench/gpu_sanitize.sh
  export KDTREE_LIB=/tmp/lib_h43.so; sanitize_path hopper 70 90; unset KDTREE_LIB
  echo "sanitizers done at $(( $(date +%s) - t0 ))s"
fi
echo "total $(( $(date +%s) - t0 ))s"
tar czf $REAL/all.tgz -C $OUT .
