# Device script of 2026-11-30 (session 7), kept so the results that name it can be rerun exactly.
# Run from the checkout root on the GPU machine at the commit the result names, with the wheels in .whl/.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
VARS="stg:-DKDTREE_STAGED_STG late:-DKDTREE_LATE_TILE1 qfl:-DKDTREE_Q_FULL_LINES all3:-DKDTREE_STAGED_STG,-DKDTREE_LATE_TILE1,-DKDTREE_Q_FULL_LINES"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
for v in $VARS; do name=${v%%:*}; flags=${v#*:}
  ( python3 -c "import sys; from kdtree_backend.build import build; build('/tmp/lib_$name.so', extra_flags=tuple(sys.argv[1:]))" ${flags//,/ } > $OUT/build_$name.log 2>&1 || echo "build $name failed" ) &
done
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -5 $OUT/build.log; exit 1; }
wait
for v in $VARS; do name=${v%%:*}
  KDTREE_LIB=/tmp/lib_$name.so timeout 60 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -k hopper -p no:cacheprovider > $OUT/tests_$name.log 2>&1
  echo "tests $name rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/tests_$name.log | tail -2
done
SH="1,8,16,1024;8,8,16,1024;32,8,16,1024;1,8,64,1024;8,8,64,1024;32,8,64,1024;1,16,16,1024;8,16,16,1024;32,16,16,1024;1,16,64,1024;8,16,64,1024;32,16,64,1024;1,8,8,1024;8,8,8,1024;32,8,8,1024;8,16,64,8192;32,8,16,8192"
for round in 1 2; do for name in default stg late qfl all3; do
  if [ $name != default ]; then export KDTREE_LIB=/tmp/lib_$name.so; fi
  timeout 60 python3 bench/bench_verify.py --only ours --no-plot --no-check --budget-ms 60 --shapes "$SH" --commit 95de43c-$name --out $OUT/ab_${name}_$round.json > $OUT/ab_${name}_$round.log 2>&1 || echo "ab $name $round failed"
  unset KDTREE_LIB
done; done
python3 - $OUT <<'PY'
import json, math, sys, glob
out = sys.argv[1]
def t(name, rnd): return {r["label"]: r["times_us"].get("ours") for r in json.load(open(f"{out}/ab_{name}_{rnd}.json"))["rows"]}
for name in ["default", "stg", "late", "qfl", "all3"]:
    for rnd in (1, 2):
        try:
            a, b = t(name, rnd), t("default", 1 if name != "default" else 2)
        except OSError:
            continue
        r = [a[k] / b[k] for k in a if a[k] and b.get(k)]
        print(name, rnd, "vs default: geomean %.3f" % math.exp(sum(map(math.log, r)) / len(r)), " ".join("%.3f" % x for x in r))
PY
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
