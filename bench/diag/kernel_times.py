"""Per-kernel GPU time of one verify call (main kernel vs split combine), from torch.profiler.

    (device) KDTREE_KERNEL=hopper python3 bench/diag/kernel_times.py "32,8,16,8192;8,8,64,1024" [--json PATH]

Each shape runs `--calls` times with L2 flushed before every call (a 256 MB buffer rewritten), as
the benchmark's rotated input sets keep it cold; the median duration of each kernel name is
printed. The flush kernels are left out. Used to see what the split partials and their merge
cost before changing the split epilogue (docs/kernel/journal.md h37, h38). A combine launched as a
programmatic dependent (Hopper, 2-4 splits, h39b) starts before the verify kernel ends and waits
for it, so its span here includes that wait: compare such shapes end to end (bench_verify.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from smoke import shape_batch, verify_attention  # noqa: E402 (smoke puts the checkout on sys.path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", help="B,H,n,L;B,H,n,L;...")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    out = []
    for spec in args.shapes.split(";"):
        (B, H, n, L), a = shape_batch(spec, seed=5)
        for _ in range(3):
            verify_attention(**a)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                flush.zero_()
                verify_attention(**a)
            torch.cuda.synchronize()
        per = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA and ("verify" in ev.name or "combine" in ev.name):
                per.setdefault(ev.name, []).append(ev.time_range.elapsed_us())
        row = {"shape": [B, H, n, L], "kernels_us": {k: statistics.median(v) for k, v in per.items()},
               "launches": {k: len(v) for k, v in per.items()}}
        out.append(row)
        print(f"B{B} H{H} n{n} L{L}: " + "  ".join(f"{k.split('(')[0].split('<')[0][-40:]}={t:.1f}us" for k, t in row["kernels_us"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
