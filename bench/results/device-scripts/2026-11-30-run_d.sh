# Device script of 2026-11-30 (session 7), kept so the results that name it can be rerun exactly.
# Run from the checkout root on the GPU machine at the commit the result names, with the wheels in .whl/.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
( python3 -c "from kdtree_backend.build import build; build('/tmp/lib_old.so', extra_flags=('-DKDTREE_PROLOGUE_TWO_TILES','-DKDTREE_Q_HALF_LINES'))" > $OUT/build_old.log 2>&1 || echo "build old failed" ) &
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -5 $OUT/build.log; exit 1; }
timeout 100 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 100 --time-limit 45 --commit 1df0b77 --out $OUT/grid2.json > $OUT/grid2.log 2>&1
echo "grid2 rc=$?"; grep -E "geomean|large" $OUT/grid2.log | head -3
tar czf $REAL/all.tgz -C $OUT .
wait
SH="1,8,16,1024;8,8,16,1024;32,8,16,1024;1,8,64,1024;8,8,64,1024;32,8,64,1024;1,16,16,1024;8,16,16,1024;32,16,16,1024;1,16,64,1024;8,16,64,1024;32,16,64,1024;1,8,8,1024;8,8,8,1024;32,8,8,1024;8,16,64,8192;32,8,16,8192"
for rnd in 1 2; do for name in new old; do
  if [ $name = old ]; then export KDTREE_LIB=/tmp/lib_old.so; fi
  timeout 40 python3 bench/bench_verify.py --only ours --no-plot --no-check --budget-ms 60 --shapes "$SH" --commit 1df0b77-$name --out $OUT/ab_${name}_$rnd.json > /dev/null 2>&1 || echo "ab $name failed"
  unset KDTREE_LIB
done; done
python3 - $OUT <<'PY'
import json, math, sys
out = sys.argv[1]
def t(n, r): return {x["label"]: x["times_us"]["ours"] for x in json.load(open(f"{out}/ab_{n}_{r}.json"))["rows"]}
for r in (1, 2):
    a, b = t("new", r), t("old", r)
    q = [a[k] / b[k] for k in a]
    print("new/old round", r, "geomean %.3f" % math.exp(sum(map(math.log, q)) / len(q)), " ".join("%.3f" % x for x in q))
PY
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
