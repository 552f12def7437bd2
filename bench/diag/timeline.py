"""Where a Hopper kernel CTA's time goes, from %globaltimer stamps (a diagnostics build only).

    (device) python3 -m kdtree_backend.build --profiler --out /tmp/lib_tl.so    # the stamped build
    (device) KDTREE_LIB=/tmp/lib_tl.so KDTREE_KERNEL=hopper python3 bench/diag/timeline.py 8,16,64,1024 [--json PATH]

(from Python: `kdtree_backend.kernel.build.build("/tmp/lib_tl.so", archs, profiler=True)`.)

Threads 0 and 128 of every CTA stamp its milestones (csrc/common/profiler.cuh, the profiler build); this
runs the op on one shape with a cold L2 (a 256 MB buffer is rewritten before the measured call),
copies the stamps out with `kdtree_timeline_copy` and prints, per milestone, the median and max
over CTAs of its time since the CTA started, plus the CTAs' start spread and the kernel's span.
One shape per process: the stamp buffer starts zeroed only when the library is loaded.

`--replays N` (no cold L2: calls back to back, as the benchmark's replays run) stamps N calls one
by one and prints, per call, its span, the CTAs' tile-loop time per tile (median, p10, p90), the SM
clock each CTA's loop ran at (clock64 over %globaltimer) and how far apart the row tiles that
share a request's keys ran (the loop-start skew inside each (request, split) group); `--json`
then holds every CTA's numbers per call. It was written for the bimodal replays of the HBM-bound
H8 n16 shapes (docs/kernel/journal.md h40).

`--ragged NAME` stamps one of bench/diag/ragged.py's ragged batches instead of a B,H,n,L shape (journal
m30: a batch of one row tile a request whose CTAs run longer than their parts predict); the per-CTA
records of `--replays --json` then show which CTAs end late and where their time went.
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
from smoke import make_batch, shape_batch, verify_attention  # noqa: E402 (smoke puts the checkout on sys.path)

SLOTS, CTAS = 12, 8192  # = kProfilerSlots, kProfilerMaxCtas (kdtree_backend/kernel/csrc/common/profiler.cuh)
# (name, slot): slot 2 and 8 are WG1's, the rest WG0's (thread 0).
MILESTONES = (("request loaded", 1), ("WG1 prologue tiles out", 2), ("Q visible", 3), ("K tile 0 landed", 4),
              ("tile loop done", 5), ("final barrier", 6), ("WG0 output stored", 7), ("WG1 output stored", 8))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", help="B,H,n,L (or --ragged NAME)")
    ap.add_argument("--ragged", metavar="NAME", help="a ragged batch of bench/diag/ragged.py (its RAGGED names)")
    ap.add_argument("--json")
    ap.add_argument("--replays", type=int, default=0, help="stamp this many calls one by one (see above)")
    ap.add_argument("--warm", type=int, default=0,
                    help="with --replays: run this many calls back to back before each stamped one, which "
                         "follows them with no gap (a call inside a busy stream, not after an idle one)")
    args = ap.parse_args()
    if (args.shape is None) == (args.ragged is None):
        ap.error("give a B,H,n,L shape or --ragged NAME (one of them)")
    if args.ragged is not None:
        from ragged import RAGGED  # noqa: PLC0415 (bench/diag is on sys.path)

        if args.ragged not in RAGGED:
            ap.error(f"--ragged: unknown batch {args.ragged!r}; choose from {list(RAGGED)}")
        H, n, prefixes = RAGGED[args.ragged]
        B, L = len(prefixes), max(prefixes)  # L: the longest prefix (for the printout)
        a = make_batch(B, H, n, list(prefixes), seed=3, pool_extra=L)
    else:
        (B, H, n, L), a = shape_batch(args.shape, seed=3)
    if args.replays:
        return replays(a, (B, H, n, L), args.replays, args.json, args.warm)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        verify_attention(**a)
    flush.zero_()
    torch.cuda.synchronize()
    verify_attention(**a)
    torch.cuda.synchronize()
    try:
        buf = _copy_stamps(ctypes.CDLL(os.environ["KDTREE_LIB"]))
    except RuntimeError as e:
        print(e)
        return 1
    rows = [buf[i * SLOTS:(i + 1) * SLOTS] for i in range(CTAS) if buf[i * SLOTS + 9] > 0]
    for r in rows:
        r[9] &= 0xFFFFFFFF  # the tile count (the SM id is in the high half)
    t0 = min(r[0] for r in rows)
    end = max(max(r[7], r[8]) for r in rows)
    res = {"shape": [B, H, n, L], "ctas": len(rows), "span_us": (end - t0) / 1e3,
           "start_spread_us": (max(r[0] for r in rows) - t0) / 1e3,
           "tiles_median": statistics.median(r[9] for r in rows), "milestones_us": {}}
    for name, slot in MILESTONES:
        d = [(r[slot] - r[0]) / 1e3 for r in rows]
        res["milestones_us"][name] = {"median": statistics.median(d), "max": max(d)}
    loop = [(r[5] - r[4]) / 1e3 / max(1, r[9]) for r in rows]
    res["loop_us_per_tile_median"] = statistics.median(loop)
    print(f"B={B} H={H} n={n} L={L}: {res['ctas']} CTAs, {res['tiles_median']} tiles (median), kernel span "
          f"{res['span_us']:.1f} us, CTA starts spread over {res['start_spread_us']:.1f} us, "
          f"loop {res['loop_us_per_tile_median']:.2f} us/tile")
    for name, v in res["milestones_us"].items():
        print(f"  {name:22s} median {v['median']:7.2f} us   max {v['max']:7.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def _copy_stamps(lib):
    buf = (ctypes.c_ulonglong * (CTAS * SLOTS))()
    rc = lib.kdtree_timeline_copy(buf, ctypes.sizeof(buf))
    if rc != 0:
        raise RuntimeError(f"kdtree_timeline_copy failed: {rc}")
    return buf


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def replays(a, shape, count, json_path, warm=0) -> int:
    B, H, n, L = shape
    row_tiles = (H * n + 63) // 64
    lib = ctypes.CDLL(os.environ["KDTREE_LIB"])
    for _ in range(5):
        verify_attention(**a)
    torch.cuda.synchronize()
    # Every call of one shape runs the same CTAs, and each CTA rewrites its whole row of stamps.
    out = []
    for rep in range(count):
        for _ in range(warm):  # the stamps of these calls are overwritten by the last one's
            verify_attention(**a)
        verify_attention(**a)
        torch.cuda.synchronize()
        buf = _copy_stamps(lib)
        ctas = []
        for i in range(CTAS):
            r = buf[i * SLOTS:(i + 1) * SLOTS]
            if r[9] == 0 or r[0] == 0:
                continue
            tiles, smid = r[9] & 0xFFFFFFFF, r[9] >> 32
            ns = max(1, r[5] - r[4])
            ctas.append({"cta": i, "rt": i % row_tiles, "grp": i // row_tiles, "sm": int(smid), "tiles": int(tiles),
                         "start": r[0], "loop0": r[4], "loop1": r[5], "end": max(r[7], r[8]),
                         "us_per_tile": ns / 1e3 / max(1, tiles), "ghz": (r[11] - r[10]) / ns})
        t0 = min(c["start"] for c in ctas)
        span = (max(c["end"] for c in ctas) - t0) / 1e3
        per = [c["us_per_tile"] for c in ctas]
        ghz = [c["ghz"] for c in ctas]
        groups = {}
        for c in ctas:
            groups.setdefault(c["grp"], []).append(c)

        def spread_us(stamp):  # per (request, split) group of row tiles: how far apart they reached `stamp`
            return [(max(c[stamp] for c in g) - min(c[stamp] for c in g)) / 1e3 for g in groups.values() if len(g) > 1]

        skew, endskew = spread_us("loop0"), spread_us("loop1")
        rec = {"call": rep, "ctas": len(ctas), "sms": len({c["sm"] for c in ctas}), "span_us": span,
               "tile_us_median": statistics.median(per), "tile_us_p10": _pct(per, 0.1), "tile_us_p90": _pct(per, 0.9),
               "ghz_median": statistics.median(ghz), "ghz_min": min(ghz),
               "loop_start_skew_us_median": statistics.median(skew) if skew else 0.0,
               "loop_start_skew_us_max": max(skew) if skew else 0.0,
               "loop_end_skew_us_median": statistics.median(endskew) if endskew else 0.0,
               "per_cta": [{k: (v - t0 if k in ("start", "loop0", "loop1", "end") else v) for k, v in c.items()}
                           for c in ctas]}
        out.append(rec)
        print(f"call {rep:3d}: span {span:7.1f} us  tile {rec['tile_us_median']:.3f} us "
              f"(p10 {rec['tile_us_p10']:.3f} p90 {rec['tile_us_p90']:.3f})  SM clock {rec['ghz_median']:.3f} GHz "
              f"(min {rec['ghz_min']:.3f})  row-tile skew start {rec['loop_start_skew_us_median']:.2f}/"
              f"{rec['loop_start_skew_us_max']:.2f} us end {rec['loop_end_skew_us_median']:.2f} us  "
              f"{rec['ctas']} CTAs on {rec['sms']} SMs")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"shape": list(shape), "calls": out}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
