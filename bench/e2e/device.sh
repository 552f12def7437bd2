#!/bin/bash
# The GPU machine's side of the real-server release check (bench/e2e/README.md). Run from the
# checkout root with the wheel set carried (`carry: [".whl-e2e"]`):
#
#   bash bench/e2e/device.sh e2e --commit SHA --suite serve ...   # e2e_server.py (args passed on)
#   bash bench/e2e/device.sh pytest -q -m gpu tests/sglang/test_backend_gpu.py
#   bash bench/e2e/device.sh setup                                 # wheels + library only
#
# 1. installs .whl-e2e/*.whl into /tmp/site once per wheel set (a stamp; a warm machine skips it),
# 2. builds the kernel library for sm_90 (+ the sm_90a Hopper path) into kdtree_backend/_lib/ when
#    its sources changed (a content stamp; the ignored _lib/ survives between calls on a warm machine),
# 3. runs the subcommand with PYTHONPATH=$PWD:/tmp/site (the checkout's kdtree_backend wins; SGLang
#    finds the plugin through the installed kdtree_backend wheel's entry point).
# The e2e deadline is E2E_BUDGET_S (default 585) seconds after THIS script started, so the install
# and the build count against the device's 600 s per command.
set -uo pipefail
T0=$(date +%s)
cd "$(dirname "$0")/../.." || exit 70
OUT=${OUT:-/tmp/e2e-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:/tmp/site" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export E2E_DEVICE_COMMAND="bash bench/e2e/device.sh $*"
sub=${1:-e2e}
case "$sub" in e2e|pytest|setup) shift ;; -*) sub=e2e ;; esac

ls .whl-e2e/*.whl >/dev/null 2>&1 || { echo "device.sh: .whl-e2e/ is missing: carry it (bench/e2e/prepare-wheels.sh builds it)" >&2; exit 70; }
key=$(cat .whl-e2e/*.whl | md5sum | cut -c1-12)  # content, not mtimes: a transfer may not keep them
if [ ! -f "/tmp/site/.e2e-wheels-$key" ]; then
  t=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-e2e/*.whl \
    > "$OUT/pip-install.log" 2>&1 || { tail -30 "$OUT/pip-install.log"; exit 70; }
  mkdir -p /tmp/site && touch "/tmp/site/.e2e-wheels-$key"
  echo "device.sh: wheels installed into /tmp/site in $(( $(date +%s) - t )) s"
else
  echo "device.sh: wheels already installed (/tmp/site/.e2e-wheels-$key)"
fi

lib=kdtree_backend/_lib/libkdtree_verify.so
src=$(find kdtree_backend/kernel -type f \( -name '*.py' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h' \) | sort | xargs cat | md5sum | cut -c1-12)
if [ -n "${KDTREE_LIB:-}" ]; then
  echo "device.sh: KDTREE_LIB=$KDTREE_LIB given: no build"
elif [ -f "$lib" ] && [ "$(cat "$lib.e2e-src" 2>/dev/null)" = "$src" ]; then
  echo "device.sh: kernel library up to date ($lib)"
else
  t=$(date +%s)
  python3 -m kdtree_backend.build --arch 90 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 70; }
  mkdir -p "$(dirname "$lib")" && echo "$src" > "$lib.e2e-src"
  echo "device.sh: kernel library built in $(( $(date +%s) - t )) s"
fi
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"

case "$sub" in
  setup) exit 0 ;;
  pytest) exec python3 -m pytest "$@" ;;
esac
deadline=$(( T0 + ${E2E_BUDGET_S:-585} ))
python3 bench/e2e/e2e_server.py --out "$OUT" --deadline-epoch "$deadline" "$@"
rc=$?
echo "device.sh: e2e_server.py exited $rc after $(( $(date +%s) - T0 )) s"
exit $rc
