"""Where a kernel's tile time goes, from per-tile clock64 stamps (a diagnostics build only;
csrc/common/tile_stamps.cuh). Both kernels with two roles: the warp-specialised portable kernel
(KDTREE_KERNEL=portable) and the Hopper kernel (KDTREE_KERNEL=hopper).

    (device) python3 -m kdtree_backend.kernel.build --profiler --arch 90 --no-ptx --out /tmp/lib_tl.so
    (device) KDTREE_LIB=/tmp/lib_tl.so KDTREE_KERNEL=portable python3 bench/diag/tile_timeline.py 32,8,64,8192 [--json PATH]

One thread of each role in the first 32 CTAs stamps each K tile's hand-offs (the first 64 tiles of
the CTA's last segment). This runs the op a few times back to back (as the benchmark's replays do),
copies the last call's stamps and prints, over every (CTA, tile) of the steady state (tiles 2 ..
last - 3), the median / p10 / p90 in SM cycles of each interval below and its share of the period.

Portable (QK warp 0, PV warp 0):
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
  pv.refill.ids     PV warp: its first part: the slot ids read (their cp.async group waited); a proxy fence only after zero-filled rows (p30)
  pv.refill.copies  PV warp: its second part: the stage barrier armed, the copies issued, tile i + 3's ids requested
  refill_to_k       PV warp 0's refill of tile i + 2 issued -> the QK warp saw K tile i + 2 land
  p_to_pv           QK warp's P(i) arrive -> PV warp 0 past P full(i)

Hopper (thread 0 of WG0, math; thread 128 of WG1, helper):
  period            K tile i landed -> K tile i + 1 landed, as WG0 saw it
  wg0.k_wait        WG0: its PV of tile i - 1 done -> K tile i landed
  wg0.qk            WG0: K landed -> S = Q K^T complete
  wg0.softmax       WG0: mask, max, exp2s, P packed (its first PV group issued)
  wg0.p_free_wait   WG0: waiting for WG1 to release the previous P
  wg0.share         WG0: P and the factors to shared memory -> bar.arrive
  wg0.pv            WG0: its last PV group issued and complete
  wg1.p_wait        WG1: its previous tile's work done -> P(i) received
  wg1.pv            WG1: rescale and its PV of tile i, complete
  wg1.empty_wait    WG1: waiting for WG0's PV of tile i (the stage's empty barrier)
  wg1.refill        WG1: tile i + 2's copies issued (36 cp.async a thread) and tile i + 3's ids requested
  refill_to_k       WG1's refill of tile i + 2 issued -> WG0 saw K tile i + 2 land
  p_to_wg1          WG0's P(i) arrive -> WG1 past P full(i)

`--tail K` also prints the segment's last K tiles one by one (medians over the stamped CTAs of the
intervals that need no later tile): a segment ends with its draft tiles, so a shape whose segment fits
the 64 stamped tiles (e.g. 1,8,257,2048 with KDTREE_NUM_SPLITS=1) shows what a draft tile costs
(journal m32b).

One shape per process (the stamp record is the library's).
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

# = kTileStampCtas, kTileStampTiles, kTileEvents (kdtree_backend/kernel/csrc/common/tile_stamps.cuh);
# a CTA's record is 1 + TILES * EVENTS int64: the stamped segment's tile count, then the stamps.
CTAS, TILES, EVENTS = 32, 64, 10
RECORD = 1 + TILES * EVENTS
# TileEvent (the warp-specialised portable kernel)
QK_KFULL, QK_SCORES, QK_SOFTMAX, QK_PFREE, QK_PFULL, PV_PFULL, PV_MMA_ISSUED, PV_STAGE, PV_REFILL, PV_FENCED = \
    range(10)
# HopperTileEvent
WG0_KFULL, WG0_SCORES, WG0_SOFTMAX, WG0_PFREE, WG0_PFULL, WG0_PV_DONE, WG1_PFULL, WG1_PV_DONE, WG1_EMPTY, WG1_REFILL = \
    range(10)

KERNELS = {
    "portable": {
        "reader": "kdtree_tile_stamps_copy",
        # events every stamped tile has (the refill's only while two more tiles follow)
        "always": (QK_KFULL, QK_SCORES, QK_SOFTMAX, QK_PFREE, QK_PFULL, PV_PFULL, PV_MMA_ISSUED),
        "refill": (PV_STAGE, PV_REFILL, PV_FENCED),
        "intervals": (
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
            ("pv.refill.ids", lambda e, i: e[i][PV_FENCED] - e[i][PV_STAGE]),
            ("pv.refill.copies", lambda e, i: e[i][PV_REFILL] - e[i][PV_FENCED]),
            ("refill_to_k", lambda e, i: e[i + 2][QK_KFULL] - e[i][PV_REFILL]),
            ("p_to_pv", lambda e, i: e[i][PV_PFULL] - e[i][QK_PFULL]),
        ),
    },
    "hopper": {
        "reader": "kdtree_hopper_tile_stamps_copy",
        "always": (WG0_KFULL, WG0_SCORES, WG0_SOFTMAX, WG0_PFREE, WG0_PFULL, WG0_PV_DONE, WG1_PFULL, WG1_PV_DONE),
        "refill": (WG1_EMPTY, WG1_REFILL),
        "intervals": (
            ("period", lambda e, i: e[i + 1][WG0_KFULL] - e[i][WG0_KFULL]),
            ("wg0.k_wait", lambda e, i: e[i][WG0_KFULL] - e[i - 1][WG0_PV_DONE]),
            ("wg0.qk", lambda e, i: e[i][WG0_SCORES] - e[i][WG0_KFULL]),
            ("wg0.softmax", lambda e, i: e[i][WG0_SOFTMAX] - e[i][WG0_SCORES]),
            ("wg0.p_free_wait", lambda e, i: e[i][WG0_PFREE] - e[i][WG0_SOFTMAX]),
            ("wg0.share", lambda e, i: e[i][WG0_PFULL] - e[i][WG0_PFREE]),
            ("wg0.pv", lambda e, i: e[i][WG0_PV_DONE] - e[i][WG0_PFULL]),
            ("wg1.p_wait", lambda e, i: e[i][WG1_PFULL] - e[i - 1][WG1_REFILL]),
            ("wg1.pv", lambda e, i: e[i][WG1_PV_DONE] - e[i][WG1_PFULL]),
            ("wg1.empty_wait", lambda e, i: e[i][WG1_EMPTY] - e[i][WG1_PV_DONE]),
            ("wg1.refill", lambda e, i: e[i][WG1_REFILL] - e[i][WG1_EMPTY]),
            ("refill_to_k", lambda e, i: e[i + 2][WG0_KFULL] - e[i][WG1_REFILL]),
            ("p_to_wg1", lambda e, i: e[i][WG1_PFULL] - e[i][WG0_PFULL]),
        ),
    },
}


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarise(buf, kernel: str = "portable") -> dict:
    """Per interval of `kernel`: median / p10 / p90 cycles over the steady-state (CTA, tile) samples."""
    k = KERNELS[kernel]
    samples = {name: [] for name, _ in k["intervals"]}
    ctas = 0
    for c in range(CTAS):
        rec = buf[c * RECORD:(c + 1) * RECORD]
        e = [rec[1 + t * EVENTS:1 + (t + 1) * EVENTS] for t in range(TILES)]
        n = min(int(rec[0]), TILES)  # the stamped segment's tiles (entries past them are an earlier segment's)
        if n < 8 or not all(e[t][x] != 0 for t in range(n) for x in k["always"]):
            continue
        ctas += 1
        for i in range(2, n - 2):  # tiles 0 .. n - 3 have a refill; i - 1 and i + 2 must exist
            if not all(e[j][x] != 0 for j in (i - 1, i) for x in k["refill"]):
                continue
            for name, f in k["intervals"]:
                samples[name].append(f(e, i))
    out = {"kernel": kernel, "ctas": ctas}
    for name, xs in samples.items():
        if xs:
            out[name] = {"median": statistics.median(xs), "p10": _pct(xs, 0.1), "p90": _pct(xs, 0.9), "n": len(xs)}
    return out


# The last tiles of a segment (its draft tiles: journal m32), per position from the end: the intervals
# of KERNELS that need no later tile, and the tile's own span, medians over the stamped CTAs.
TAIL = {
    "portable": (("qk.k_wait", "qk.mma", "qk.softmax", "qk.handoff", "pv.mma"),
                 lambda e, i: e[i][QK_PFULL] - e[i - 1][QK_PFULL]),
    "hopper": (("wg0.k_wait", "wg0.qk", "wg0.softmax", "wg0.p_free_wait", "wg0.share", "wg0.pv"),
               lambda e, i: e[i][WG0_PV_DONE] - e[i - 1][WG0_PV_DONE]),
}


def tail_intervals(kernel: str) -> tuple:
    """(name, f) of the --tail table: TAIL's names taken from KERNELS[kernel]'s intervals, then "tile"."""
    named = dict(KERNELS[kernel]["intervals"])
    names, tile = TAIL[kernel]
    return tuple((name, named[name]) for name in names) + (("tile", tile),)


def tail_summary(buf, kernel: str, k: int) -> dict:
    """Per position j = 1..k from the segment's end (j = 1: its last tile), the median cycles of
    tail_intervals(kernel) over the stamped CTAs whose segment has at least k + 1 tiles, all stamped."""
    need = KERNELS[kernel]["always"]
    intervals = tail_intervals(kernel)
    rows = {j: {name: [] for name, _ in intervals} for j in range(1, k + 1)}
    for c in range(CTAS):
        rec = buf[c * RECORD:(c + 1) * RECORD]
        n = int(rec[0])
        if n < k + 1 or n > TILES:
            continue
        e = [rec[1 + t * EVENTS:1 + (t + 1) * EVENTS] for t in range(n)]
        if not all(e[t][x] != 0 for t in range(n) for x in need):
            continue
        for j in range(1, k + 1):
            for name, f in intervals:
                rows[j][name].append(f(e, n - j))
    return {f"last-{j - 1}" if j > 1 else "last": {name: statistics.median(xs) for name, xs in v.items() if xs}
            for j, v in rows.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", help="B,H,n,L")
    ap.add_argument("--json")
    ap.add_argument("--calls", type=int, default=5, help="calls back to back; the last one's stamps are read")
    ap.add_argument("--tail", type=int, default=0, metavar="K",
                    help="also the last K tiles of each stamped segment, per position (a segment of at most 64 "
                         "tiles ends with its draft tiles: e.g. 1,8,257,2048 with KDTREE_NUM_SPLITS=1)")
    args = ap.parse_args()
    kernel = os.environ.get("KDTREE_KERNEL")
    if kernel not in KERNELS:
        print("set KDTREE_KERNEL=portable (the warp-specialised kernel) or KDTREE_KERNEL=hopper")
        return 2
    lib = ctypes.CDLL(os.environ["KDTREE_LIB"])
    reader = KERNELS[kernel]["reader"]
    if not hasattr(lib, reader):
        print(f"{os.environ['KDTREE_LIB']} has no {reader}: build it with --profiler")
        return 2
    (B, H, n, L), a = shape_batch(args.shape, seed=3)
    for _ in range(args.calls):
        verify_attention(**a)
    torch.cuda.synchronize()
    buf = (ctypes.c_longlong * (CTAS * RECORD))()
    rc = getattr(lib, reader)(buf, ctypes.sizeof(buf))
    if rc != 0:
        print(f"{reader} failed: {rc}")
        return 1
    res = {"shape": [B, H, n, L], **summarise(buf, kernel)}
    if res["ctas"] == 0:
        print(f"B={B} H={H} n={n} L={L}: no CTA stamped 8 or more tiles")
        return 1
    per = res["period"]["median"]
    print(f"B={B} H={H} n={n} L={L} ({kernel}): {res['ctas']} CTAs stamped; cycles a key tile "
          f"(median, p10-p90; % of period)")
    for name, _ in KERNELS[kernel]["intervals"]:
        v = res.get(name)
        if v:
            print(f"  {name:15s} {v['median']:7.0f}  ({v['p10']:6.0f} - {v['p90']:6.0f})  {100 * v['median'] / per:5.1f}%")
    if args.tail:
        res["tail"] = tail_summary(buf, kernel, args.tail)
        names = [name for name, _ in tail_intervals(kernel)]
        print("  the segment's last tiles (median cycles): " + " ".join(f"{x:>15s}" for x in names))
        for pos, v in res["tail"].items():
            print(f"  {pos:>8s} " + " ".join(f"{v.get(x, float('nan')):15.0f}" for x in names))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
