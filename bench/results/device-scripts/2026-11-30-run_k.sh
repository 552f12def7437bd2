# Device script of 2026-11-30 (session 8): the shared output-row helper (out_row) and the shared
# sanitizer function, checked with bench/gpu_ab.sh itself: kernel tests on both paths, racecheck and
# memcheck on both paths (through bench/gpu_sanitize.sh), and smoke timing against the library
# built from the sources before the change (carried in .whl/old_csrc/).
# Run from the checkout root on the GPU machine, with the wheels in .whl/.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
mkdir -p /tmp/old && cp -r kdtree_backend /tmp/old/ && cp .whl/old_csrc/*.cuh /tmp/old/kdtree_backend/csrc/
( cd /tmp/old && python3 -c "from kdtree_backend.build import build; build('/tmp/lib_before.so')" ) > $OUT/build_before.log 2>&1 || { echo "before build failed"; tail -5 $OUT/build_before.log; }
echo "before built at $(( $(date +%s) - t0 ))s"
VARIANTS="before:@/tmp/lib_before.so" PATHS=hopper,portable SANITIZE="hopper portable" bash bench/gpu_ab.sh 2>&1 | tee $OUT/gpu_ab.log
tar czf $REAL/all.tgz -C $OUT .
echo "total $(( $(date +%s) - t0 ))s"
