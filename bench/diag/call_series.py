"""Per-call times of the op on one shape, in order, to see whether a call's time depends on what
the GPU did just before it (h40: the HBM-bound H8 n16 shapes' replays are bimodal).

    (device) python3 bench/diag/call_series.py 32,8,16,32768 --calls 200 [--gap-ms 5] [--json PATH]

Without --gap-ms the calls run back to back in one stream, each between two CUDA events (no
sync), as the benchmark's graph replays do; with it, every call is followed by a synchronize and
a host sleep of that many milliseconds, so each one starts on an idle GPU. Prints the median,
p10 and p90 and, for runs of calls, where in the sequence the slow ones fall.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from smoke import shape_batch, verify_attention  # noqa: E402 (smoke puts the checkout on sys.path)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", help="B,H,n,L")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--gap-ms", type=float, default=0.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    (B, H, n, L), a = shape_batch(args.shape, seed=3)
    for _ in range(5):
        verify_attention(**a)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 if args.gap_ms > 0 else args.calls + 1)]
    times = []
    if args.gap_ms > 0:
        for _ in range(args.calls):
            ev[0].record()
            verify_attention(**a)
            ev[1].record()
            torch.cuda.synchronize()
            times.append(ev[0].elapsed_time(ev[1]) * 1e3)
            time.sleep(args.gap_ms / 1e3)
    else:
        ev[0].record()
        for i in range(args.calls):
            verify_attention(**a)
            ev[i + 1].record()
        torch.cuda.synchronize()
        times = [ev[i].elapsed_time(ev[i + 1]) * 1e3 for i in range(args.calls)]
    srt = sorted(times)
    med = statistics.median(times)
    print(f"B={B} H={H} n={n} L={L} calls {args.calls} gap {args.gap_ms} ms: median {med:.1f} us, "
          f"p10 {srt[len(srt) // 10]:.1f}, p90 {srt[(len(srt) * 9) // 10]:.1f}, min {srt[0]:.1f}, max {srt[-1]:.1f}")
    # The sequence in blocks of 10 calls (median of each), so a drift or a switch between modes shows.
    blocks = [statistics.median(times[i:i + 10]) for i in range(0, len(times), 10)]
    print("  by blocks of 10: " + " ".join(f"{b:.0f}" for b in blocks))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": [B, H, n, L], "gap_ms": args.gap_ms, "times_us": times}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
