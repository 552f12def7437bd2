"""The SM clock and board power each kernel runs at, under sustained load (journal m46).

    (device) python3 bench/diag/clock_power.py 32,8,64,8192 [B,H,n,L ...] [--seconds 1.5] [--rounds 2]
             [--warmup 1.5] [--paths hopper] [--json PATH]

(the device driver's `power` step runs it: `bench/device/run.py power SHAPE ...`)

The benchmark times kernels in microseconds; the per-tile stamps count SM cycles. Between the two
sits the clock, which the GPU lowers under its power cap (h40b). This runs each implementation's
graph (the same rotated input sets and calls as bench_verify.py: our op on each path named, and
FlashMLA) back to back for --seconds, in rounds (ours then FlashMLA, then the other order), after
--warmup seconds of load that are not recorded, while `nvidia-smi -lms`
samples the SM clock, the power draw and the active clock-event (throttle) reasons. Per segment it
prints the median time a call over the segment's second half, the median clock and power of the
samples in that half, the reasons seen, and the time a call in SM cycles (time x clock), so two
kernels can be compared at equal clocks.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
import bench_verify as bv  # noqa: E402

# power.draw is averaged over about a second on recent drivers (it lags a segment's start);
# power.draw.instant is the current reading where the driver has it. clocks_event_reasons is the
# newer name of clocks_throttle_reasons.
QUERIES = ("clocks.sm,power.draw.instant,clocks_event_reasons.active",
           "clocks.sm,power.draw,clocks_event_reasons.active",
           "clocks.sm,power.draw,clocks_throttle_reasons.active")


def smi_fields() -> str:
    """The first of QUERIES this driver's nvidia-smi accepts."""
    for q in QUERIES:
        ok = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                            capture_output=True, text=True)
        if ok.returncode == 0 and "[N/A]" not in ok.stdout and "Not Supported" not in ok.stdout:
            return q
    return QUERIES[-1]


def smi_half_stats(text: str) -> dict:
    """The second half of `nvidia-smi --query-gpu=clocks.sm,power.draw,<reasons> -lms` samples (CSV,
    no header, no units): median SM clock (MHz) and power (W), the set of clock-event reason masks,
    and the sample count. Lines that are not three fields (a truncated last line) are dropped; a
    field nvidia-smi could not read ("[N/A]") is left out of its median."""
    rows = [[f.strip() for f in r.split(",")] for r in text.strip().splitlines()]
    rows = [r for r in rows if len(r) == 3]
    rows = rows[len(rows) // 2:]

    def num(v):
        try:
            return float(v)
        except ValueError:
            return None

    clocks = [c for c in (num(r[0]) for r in rows) if c is not None]
    power = [w for w in (num(r[1]) for r in rows) if w is not None]
    return {"sm_clock_mhz": statistics.median(clocks) if clocks else float("nan"),
            "power_w": statistics.median(power) if power else float("nan"),
            "reasons": sorted({r[2] for r in rows}), "samples": len(rows)}


def segment(g, calls_per_replay: int, seconds: float, fields: str) -> dict:
    """Replays g back to back for `seconds` (host-paced in batches of replays, each timed by events)
    while nvidia-smi samples every 25 ms; the statistics of the segment's second half."""
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-lms", "25"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    t0 = time.time()
    times, stamps = [], []
    while time.time() - t0 < seconds:
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(21)]
        evs[0].record()
        for i in range(20):
            g.replay()
            evs[i + 1].record()
        evs[-1].synchronize()
        now = time.time() - t0
        times += [evs[i].elapsed_time(evs[i + 1]) * 1e3 / calls_per_replay for i in range(20)]
        stamps += [now] * 20
    smi.terminate()
    out, _ = smi.communicate(timeout=10)
    late = [t for t, s in zip(times, stamps) if s >= seconds / 2] or times
    seg = smi_half_stats(out)
    seg.update(us_per_call=statistics.median(late), replays=len(late))
    seg["kcycles_per_call"] = seg["us_per_call"] * seg["sm_clock_mhz"] / 1e3
    return seg


def ratios(segments: list) -> dict:
    """Per kernel path, its mean time and cycles a call over the rounds divided by FlashMLA's (the
    segments of one shape; {} without FlashMLA's)."""
    def mean(name, key):
        xs = [g[key] for g in segments if g["name"] == name]
        return sum(xs) / len(xs) if xs else None

    fm_us, fm_kc = mean("flashmla", "us_per_call"), mean("flashmla", "kcycles_per_call")
    if not fm_us:
        return {}
    return {name: {"time_vs_flashmla": mean(name, "us_per_call") / fm_us,
                   "cycles_vs_flashmla": mean(name, "kcycles_per_call") / fm_kc,
                   "clock_mhz": mean(name, "sm_clock_mhz"), "flashmla_clock_mhz": mean("flashmla", "sm_clock_mhz")}
            for name in dict.fromkeys(g["name"] for g in segments) if name != "flashmla"}


def measure_shape(shape: str, args, fields: str) -> dict:
    """One shape: the graphs of our paths and FlashMLA's, an unrecorded warm-up, then the rounds."""
    B, H, n, L = (int(x) for x in shape.split(","))
    s = bv.Shape(B, H, n, L)
    from kdtree_backend.kernel import ops

    k_sets = 4
    batches = bv.input_sets(torch, [L] * B, H, n, k_sets, 12345)
    outs = [torch.empty(b.num_rows, H * bv.DV, dtype=torch.bfloat16, device=bv.DEVICE) for b in batches]
    graphs = {}
    for p in (x.strip() for x in args.paths.split(",") if x.strip()):
        with bv.kernel_path(p):
            graphs[p] = bv.capture_graph(torch, bv.ours_calls(ops.verify_attention, batches, outs))
    if not args.no_flashmla:
        import flash_mla as fm

        gen = torch.Generator(device=bv.DEVICE).manual_seed(7)
        inputs = [bv.flashmla_inputs(torch, b, s, gen) for b in batches]
        calls, _ = bv.flashmla_calls(torch, fm, batches, inputs, H, n)
        graphs["flashmla"] = bv.capture_graph(torch, calls)
    result = {"shape": shape, "segments": []}
    if args.warmup > 0:
        segment(next(iter(graphs.values())), k_sets, args.warmup, fields)
    for r in range(args.rounds):
        order = list(graphs.items()) if r % 2 == 0 else list(graphs.items())[::-1]  # odd rounds: FlashMLA first
        for name, g in order:
            seg = segment(g, k_sets, args.seconds, fields)
            seg.update(name=name, round=r)
            result["segments"].append(seg)
            print(f"{shape} round {r} {name:9s} {seg['us_per_call']:9.1f} us  clock {seg['sm_clock_mhz']:6.0f} MHz  "
                  f"power {seg['power_w']:6.1f} W  {seg['kcycles_per_call']:9.1f} kcycles  reasons {seg['reasons']}",
                  flush=True)
    result["vs_flashmla"] = ratios(result["segments"])
    for name, v in result["vs_flashmla"].items():
        print(f"{shape} {name} / FlashMLA: time {v['time_vs_flashmla']:.3f}, cycles {v['cycles_vs_flashmla']:.3f}, "
              f"clock {v['clock_mhz']:.0f} vs {v['flashmla_clock_mhz']:.0f} MHz", flush=True)
    del graphs
    torch.cuda.synchronize()
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+", help="B,H,n,L (several, or 'B,H,n,L;B,H,n,L')")
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=float, default=1.5,
                    help="seconds of the first graph's replays before the first segment, not recorded (the power "
                         "controller settles; without it the first segment runs on a cool GPU)")
    ap.add_argument("--paths", default="hopper", help="our kernel paths (KDTREE_KERNEL values), comma-separated")
    ap.add_argument("--no-flashmla", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    shapes = [x.strip() for a in args.shapes for x in a.split(";") if x.strip()]
    fields = smi_fields()
    doc = {"gpu": torch.cuda.get_device_name(), "fields": fields, "seconds": args.seconds, "rounds": args.rounds,
           "warmup": args.warmup, "paths": args.paths, "shapes": []}
    for shape in shapes:
        doc["shapes"].append(measure_shape(shape, args, fields))
        if args.json:  # rewritten after every shape, so a stopped run keeps what it measured
            Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
