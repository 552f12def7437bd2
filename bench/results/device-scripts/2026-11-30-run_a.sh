# Device script of 2026-11-30 (session 7), kept so the results that name it can be rerun exactly.
# Run from the checkout root on the GPU machine at the commit the result names, with the wheels in .whl/.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
source bench/gpu_env.sh
for v in tl:-DKDTREE_TIMELINE pf:-DKDTREE_L2_PREFETCH; do name=${v%%:*}; flag=${v#*:}
  ( python3 -c "import sys; from kdtree_backend.build import build; build('/tmp/lib_$name.so', extra_flags=(sys.argv[1],))" $flag > $OUT/build_$name.log 2>&1 || echo "build $name failed" ) &
done
timeout 170 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > $OUT/kernel_tests.log 2>&1
echo "kernel tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/kernel_tests.log | tail -3
timeout 100 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 100 --time-limit 45 --commit 77f927b --out $OUT/grid.json > $OUT/grid.log 2>&1
echo "grid rc=$?"; grep -E "geomean|large" $OUT/grid.log | head -4
wait
for s in 8,16,64,64 8,16,64,1024 32,16,16,1024 1,8,16,1024 32,8,16,8192 8,16,64,8192; do
  KDTREE_LIB=/tmp/lib_tl.so KDTREE_KERNEL=hopper timeout 60 python3 bench/timeline.py $s --json $OUT/tl_$s.json 2>&1 | tail -9
done
for v in default pf default pf; do
  if [ $v != default ]; then export KDTREE_LIB=/tmp/lib_$v.so; fi
  timeout 60 python3 bench/smoke.py --no-triton --configs hopper --json $OUT/t_${v}_$RANDOM.json 2>&1 | grep -E "B=.*us|BAD" | awk -v v=$v '{print "["v"]", $1,$2,$3,$4,$6,$7}'
  unset KDTREE_LIB
done
KDTREE_LIB=/tmp/lib_pf.so timeout 60 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 100 --shapes "32,8,16,8192;8,8,16,32768;32,8,16,32768;8,8,16,8192;32,16,16,32768" --commit 77f927b-pf --out $OUT/pf_h8.json > $OUT/pf_h8.log 2>&1; echo "pf grid rc=$?"
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
