#!/usr/bin/env bash
# One device call that compares builds of the same checkout (compile flags) on the smoke shapes:
# the default build runs the kernel GPU tests on both paths first; then each variant is timed on
# the kernel path(s) in PATHS and its geometric-mean time is printed relative to the default.
#   (device) VARIANTS="exact:-DKDTREE_EXP2_EXACT" PATHS=hopper,portable \
#            VARIANT_TESTS="exact:hopper" bash bench/gpu_ab.sh
# A variant "name:@path" times a prebuilt library (e.g. the previous commit's, carried in .whl/).
set -uo pipefail
t0=$(date +%s)
source bench/gpu_env.sh
PATHS=${PATHS:-hopper}
# Variant builds run in the background while the default build goes through the kernel tests.
for v in ${VARIANTS:-}; do
  name=${v%%:*}; flags=${v#*:}
  if [ "${flags:0:1}" = "@" ]; then cp "${flags:1}" "/tmp/lib_$name.so"; continue; fi  # a prebuilt library
  ( python3 -c "import sys; from kdtree_backend.build import build; build('/tmp/lib_$name.so', extra_flags=tuple(sys.argv[1:]))" \
    ${flags//,/ } > "$OUT/build_$name.log" 2>&1 || { echo "build $name failed"; tail -3 "$OUT/build_$name.log"; } ) &
done
timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -p no:cacheprovider > "$OUT/kernel_tests.log" 2>&1
echo "kernel tests (both paths, default build) rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kernel_tests.log" | tail -4
for vt in ${VARIANT_TESTS:-}; do  # "name:path": that variant's build through the kernel tests of one path
  vname=${vt%%:*}; vpath=${vt#*:}
  KDTREE_LIB=/tmp/lib_$vname.so timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_kernel_gpu.py -k "$vpath" \
    -p no:cacheprovider > "$OUT/kernel_tests_$vname.log" 2>&1
  echo "kernel tests ($vname, $vpath path) rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kernel_tests_$vname.log" | tail -3
done
source bench/gpu_sanitize.sh
for pth in ${SANITIZE:-}; do sanitize_path "$pth" 60 90; done  # racecheck + memcheck per path
wait  # the variant builds
for v in default ${VARIANTS:-}; do
  name=${v%%:*}
  if [ "$name" != default ]; then export KDTREE_LIB=/tmp/lib_$name.so; fi
  timeout 120 python3 bench/smoke.py --no-triton --configs "$PATHS" --json "$OUT/t_$name.json" 2>&1 \
    | grep -E "B=.*us|BAD" | sed "s/^/[$name] /"
  unset KDTREE_LIB
done
python3 - "$OUT" "$PATHS" ${VARIANTS:-} <<'PY'
import json, math, sys
out, paths, variants = sys.argv[1], sys.argv[2].split(","), [v.split(":")[0] for v in sys.argv[3:]]
base = json.load(open(f"{out}/t_default.json"))["timings"]
for v in variants:
    try:
        t = json.load(open(f"{out}/t_{v}.json"))["timings"]
    except OSError:
        continue
    for pth in paths:
        r = [a["by_config"][pth] / b["by_config"][pth] for a, b in zip(t, base)]
        print(f"{v}/{pth} time vs default: geomean {math.exp(sum(map(math.log, r)) / len(r)):.3f}", [round(x, 3) for x in r])
PY
echo "total $(( $(date +%s) - t0 ))s"
