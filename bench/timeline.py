"""Where a Hopper kernel CTA's time goes, from %globaltimer stamps (a diagnostics build only).

    (device) python3 -c "from kdtree_backend.build import build; build('/tmp/lib_tl.so', extra_flags=('-DKDTREE_TIMELINE',))"
    (device) KDTREE_LIB=/tmp/lib_tl.so KDTREE_KERNEL=hopper python3 bench/timeline.py 8,16,64,1024 [--json PATH]

Threads 0 and 128 of every CTA stamp its milestones (hopper_kernel.cuh, KDTREE_TIMELINE); this
runs the op on one shape with a cold L2 (a 256 MB buffer is rewritten before the measured call),
copies the stamps out with `kdtree_timeline_copy` and prints, per milestone, the median and max
over CTAs of its time since the CTA started, plus the CTAs' start spread and the kernel's span.
One shape per process: the stamp buffer starts zeroed only when the library is loaded.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from smoke import make_batch  # noqa: E402

from kdtree_backend.ops import verify_attention  # noqa: E402

SLOTS, CTAS = 10, 8192
# (name, slot): slot 2 and 8 are WG1's, the rest WG0's (thread 0).
MILESTONES = (("request loaded", 1), ("WG1 prologue tiles out", 2), ("Q visible", 3), ("K tile 0 landed", 4),
              ("tile loop done", 5), ("final barrier", 6), ("WG0 output stored", 7), ("WG1 output stored", 8))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", help="B,H,n,L")
    ap.add_argument("--json")
    args = ap.parse_args()
    B, H, n, L = (int(x) for x in args.shape.split(","))
    a = make_batch(B, H, n, [L] * B, seed=3, pool_extra=L)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        verify_attention(**a)
    flush.zero_()
    torch.cuda.synchronize()
    verify_attention(**a)
    torch.cuda.synchronize()
    lib = ctypes.CDLL(os.environ["KDTREE_LIB"])
    buf = (ctypes.c_ulonglong * (CTAS * SLOTS))()
    rc = lib.kdtree_timeline_copy(buf, ctypes.sizeof(buf))
    if rc != 0:
        print(f"kdtree_timeline_copy failed: {rc}")
        return 1
    rows = [buf[i * SLOTS:(i + 1) * SLOTS] for i in range(CTAS) if buf[i * SLOTS + 9] > 0]
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


if __name__ == "__main__":
    sys.exit(main())
