# Sourced by the device scripts: the carried wheels (../shared/gpu/README.md) and the library.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m kdtree_backend.build --check > "$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
tail -4 "$OUT/build.log"
