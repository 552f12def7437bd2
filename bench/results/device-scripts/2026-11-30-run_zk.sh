# Device script of 2026-11-30 (session 12), h40c: L sweeps of B32 H8 n16 (HBM-bound, 2 splits) and
# B8 H16 n64 (L2-resident, unsplit), ours and FlashMLA, short timing budgets (inside the ~40 ms
# before the power cap steps the clocks down), to fit time = F + tiles x T for each.
set -uo pipefail
t0=$(date +%s)
REAL=$OUT; export OUT=/tmp/o; mkdir -p $OUT
COMMIT=${COMMIT:-unknown}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.whl/placeholder:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader | tee $OUT/gpu.txt
python3 -m kdtree_backend.build --check > $OUT/build.log 2>&1 || { tail -20 $OUT/build.log; cp $OUT/build.log $REAL/; exit 1; }
echo "build done at $(( $(date +%s) - t0 ))s"
SH=""
for L in 2048 4096 8192 16384 32768; do SH="$SH;32,8,16,$L;8,16,64,$L"; done
SH=${SH#;}
for rnd in 1 2; do
  timeout 200 python3 bench/bench_verify.py --only ours,flashmla --no-plot --no-check --budget-ms 30 --shapes "$SH" --commit $COMMIT --out $OUT/sweep_$rnd.json > $OUT/sweep_$rnd.log 2>&1 || echo "sweep $rnd failed"
  tar czf $REAL/all.tgz -C $OUT .
done
python3 - $OUT <<'PY'
import json, sys
out = sys.argv[1]
rows = {}
for rnd in (1, 2):
    try:
        d = json.load(open(f"{out}/sweep_{rnd}.json"))
    except OSError:
        continue
    for r in d["rows"]:
        s = r["shape"]
        for impl, v in r["timing"].items():
            rows.setdefault((s["B"], s["H"], s["n"], impl), {}).setdefault(s["L"], []).append(v["p10_us"])
for (B, H, n, impl), byL in sorted(rows.items()):
    Ls = sorted(byL)
    ts = [min(byL[L]) for L in Ls]
    tiles = [L / (64 * (2 if (B, H, n) == (32, 8, 16) else 1)) for L in Ls]
    k = len(Ls); mx = sum(tiles) / k; my = sum(ts) / k
    T = sum((x - mx) * (y - my) for x, y in zip(tiles, ts)) / sum((x - mx) ** 2 for x in tiles)
    F = my - T * mx
    print(f"B{B} H{H} n{n} {impl:8s} T {T:.4f} us/tile  F {F:.1f} us   " + " ".join(f"L{L}:{t:.1f}" for L, t in zip(Ls, ts)))
PY
echo "total $(( $(date +%s) - t0 ))s"
