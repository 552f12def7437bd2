"""Where the warp-specialised portable kernel's tile time goes, from per-tile clock64 stamps (a
diagnostics build only; csrc/common/tile_stamps.cuh).

    (device) python3 -m kdtree_backend.kernel.build --profiler --arch 90 --no-ptx --out /tmp/lib_tl.so
    (device) KDTREE_LIB=/tmp/lib_tl.so KDTREE_KERNEL=portable python3 bench/diag/ws_timeline.py 32,8,64,8192 [--json PATH]

QK warp 0 and PV warp 0 of the first 32 CTAs stamp each K tile's hand-offs (the first 64 tiles of the
CTA's first segment). This runs the op a few times back to back (as the benchmark's replays do),
copies the last call's stamps with `kdtree_tile_stamps_copy` and prints, over every (CTA, tile) of the
steady state (tiles 2 .. last - 2), the median / p10 / p90 in SM cycles of:

  period            K tile i landed -> K tile i + 1 landed, as the QK warp saw it (the tile time)
  qk.k_wait         QK warp: P(i - 1) handed over -> K tile i landed (waiting for the refill)
  qk.mma            QK warp: K tile landed -> scores complete (144 mma, 76 ldmatrix, mask, row max)
  qk.softmax        QK warp: scores -> probabilities and row sums
  qk.p_free_wait    QK warp: waiting for the PV warps to release the P buffer (their tile i - 2)
  qk.handoff        QK warp: P stores and the factors -> bar.arrive
  pv.p_wait         PV warp: its refill of tile i + 1 issued -> P(i) received
  pv.mma            PV warp: P(i) received -> its last P.V mma issued
  pv.stage_wait     PV warp: -> every PV warp done with the stage (the refill barrier)
  pv.refill         PV warp: the refill's copies and arrival issued
  refill_to_k       PV warp 0's refill of tile i + 2 issued -> the QK warp saw K tile i + 2 land
  p_to_pv           QK warp's P(i) arrive -> PV warp 0 past P full(i)

The chain model of journal m13 (two K stages): period >= (qk.mma + qk.softmax + handoff + pv.mma +
stage_wait + refill + refill_to_k) / 2 when the QK warp waits for K (qk.k_wait > 0); the numbers say
which terms are large. One shape per process (the stamp buffer is the library's).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from smoke import shape_batch, verify_attention  # noqa: E402 (smoke puts the checkout on sys.path)

# = kTileStampCtas, kTileStampTiles, kTileEvents (kdtree_backend/kernel/csrc/common/tile_stamps.cuh)
CTAS, TILES, EVENTS = 32, 64, 9
QK_KFULL, QK_SCORES, QK_SOFTMAX, QK_PFREE, QK_PFULL, PV_PFULL, PV_MMA_ISSUED, PV_STAGE, PV_REFILL = range(EVENTS)

INTERVALS = (
    ("period", lambda e, i: e[i + 1][QK_KFULL] - e[i][QK_KFULL]),
    ("qk.k_wait", lambda e, i: e[i][QK_KFULL] - e[i - 1][QK_PFULL]),
    ("qk.mma", lambda e, i: e[i][QK_SCORES] - e[i][QK_KFULL]),
    ("qk.softmax", lambda e, i: e[i][QK_SOFTMAX] - e[i][QK_SCORES]),
    ("qk.p_free_wait", lambda e, i: e[i][QK_PFREE] - e[i][QK_SOFTMAX]),
    ("qk.handoff", lambda e, i: e[i][QK_PFULL] - e[i][QK_PFREE]),
    ("pv.p_wait", lambda e, i: e[i][PV_PFULL] - e[i - 1][PV_REFILL]),
    ("pv.mma", lambda e, i: e[i][PV_MMA_ISSUED] - e[i][PV_PFULL]),
    ("pv.stage_wait", lambda e, i: e[i][PV_STAGE] - e[i][PV_MMA_ISSUED]),
    ("pv.refill", lambda e, i: e[i][PV_REFILL] - e[i][PV_STAGE]),
    ("refill_to_k", lambda e, i: e[i + 2][QK_KFULL] - e[i][PV_REFILL]),
    ("p_to_pv", lambda e, i: e[i][PV_PFULL] - e[i][QK_PFULL]),
)


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarise(buf) -> dict:
    """Per interval: median / p10 / p90 cycles over the steady-state (CTA, tile) samples."""
    samples = {name: [] for name, _ in INTERVALS}
    ctas = 0
    for c in range(CTAS):
        e = [buf[(c * TILES + t) * EVENTS:(c * TILES + t + 1) * EVENTS] for t in range(TILES)]
        # The stamped tiles: the QK warp's and the refilling PV warp's events all written.
        n = 0
        while n < TILES and all(e[n][k] != 0 for k in (QK_KFULL, QK_SCORES, QK_SOFTMAX, QK_PFREE, QK_PFULL,
                                                       PV_PFULL, PV_MMA_ISSUED)):
            n += 1
        if n < 8:
            continue
        ctas += 1
        for i in range(2, n - 2):
            if e[i][PV_REFILL] == 0 or e[i - 1][PV_REFILL] == 0 or e[i][PV_STAGE] == 0:
                continue  # the segment's last tiles have no refill
            for name, f in INTERVALS:
                samples[name].append(f(e, i))
    out = {"ctas": ctas}
    for name, xs in samples.items():
        if xs:
            out[name] = {"median": statistics.median(xs), "p10": _pct(xs, 0.1), "p90": _pct(xs, 0.9), "n": len(xs)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", help="B,H,n,L")
    ap.add_argument("--json")
    ap.add_argument("--calls", type=int, default=5, help="calls back to back; the last one's stamps are read")
    args = ap.parse_args()
    if os.environ.get("KDTREE_KERNEL") != "portable":
        print("set KDTREE_KERNEL=portable (the warp-specialised kernel is the portable path on 9.0/10.0/12.0)")
        return 2
    lib = ctypes.CDLL(os.environ["KDTREE_LIB"])
    if not hasattr(lib, "kdtree_tile_stamps_copy"):
        print(f"{os.environ['KDTREE_LIB']} has no kdtree_tile_stamps_copy: build it with --profiler")
        return 2
    (B, H, n, L), a = shape_batch(args.shape, seed=3)
    for _ in range(args.calls):
        verify_attention(**a)
    torch.cuda.synchronize()
    buf = (ctypes.c_longlong * (CTAS * TILES * EVENTS))()
    rc = lib.kdtree_tile_stamps_copy(buf, ctypes.sizeof(buf))
    if rc != 0:
        print(f"kdtree_tile_stamps_copy failed: {rc}")
        return 1
    res = {"shape": [B, H, n, L], **summarise(buf)}
    if res["ctas"] == 0:
        print(f"B={B} H={H} n={n} L={L}: no CTA stamped 8 or more tiles")
        return 1
    per = res["period"]["median"]
    print(f"B={B} H={H} n={n} L={L}: {res['ctas']} CTAs stamped; cycles a 32-key tile (median, p10-p90; % of period)")
    for name, _ in INTERVALS:
        v = res.get(name)
        if v:
            print(f"  {name:15s} {v['median']:7.0f}  ({v['p10']:6.0f} - {v['p90']:6.0f})  {100 * v['median'] / per:5.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
