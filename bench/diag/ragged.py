"""Ragged batches against FlashMLA: requests of different prefix lengths in one call, as a serving
batch has them (bench_verify.py's grids are uniform: every request L long).

    python bench/diag/ragged.py [--paths hopper,portable] [--json out.json] [--batches 'NAME;NAME']

Each named batch (RAGGED below) is timed on our kernel paths (random tree mask) and on FlashMLA (the
same rows as causal chains, per-request cache_seqlens), by CUDA-graph replay of a few rotated input
sets, with bench_verify.py's timing and FlashMLA input builder; request 0 of each is checked against
the float64 reference (tree for ours, chain for FlashMLA). The ratio time / FlashMLA is the number
to compare with the uniform grids' (docs/kernel/performance.md): a plan that balances uniform
batches but not ragged ones shows here.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import types

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from bench import bench_verify as bv  # noqa: E402


def _lognormal(B: int, median: int, seed: int, lo: int = 256, hi: int = 32768) -> list:
    rng = random.Random(seed)
    return [int(min(hi, max(lo, median * math.exp(rng.gauss(0.0, 1.0))))) for _ in range(B)]


def _spread(B: int, lo: int, hi: int) -> list:
    return [int(round(lo * (hi / lo) ** (i / (B - 1)))) for i in range(B)]


# name -> (H, n, prefix lengths): one long request among short ones, a geometric spread, lognormal
# (a serving mix), at the customer's H = 8 and DDTree sizes, and two main-grid head counts.
RAGGED = {
    "B8 H8 n65 [32k, 1k x7]": (8, 65, [32768] + [1024] * 7),
    "B8 H8 n65 spread 1k-32k": (8, 65, _spread(8, 1024, 32768)),
    "B32 H8 n65 lognormal 4k": (8, 65, _lognormal(32, 4096, 1)),
    "B8 H8 n129 lognormal 8k": (8, 129, _lognormal(8, 8192, 2)),
    "B4 H8 n257 [16k, 8k, 4k, 2k]": (8, 257, [16384, 8192, 4096, 2048]),
    "B64 H8 n33 lognormal 2k": (8, 33, _lognormal(64, 2048, 3)),
    "B32 H16 n16 [32k, 1k x31]": (16, 16, [32768] + [1024] * 31),
    "B16 H8 n8 spread 1k-16k": (8, 8, _spread(16, 1024, 16384)),
}


def batch_flops(H: int, n: int, prefixes) -> float:
    return float(sum(bv.shape_flops(bv.Shape(1, H, n, L)) for L in prefixes))


def run_batch(torch, name: str, H: int, n: int, prefixes, paths, mods, args) -> dict:
    from kdtree_backend.testing.reference import relative_error

    B = len(prefixes)
    row = {"name": name, "B": B, "H": H, "n": n, "prefixes": list(prefixes), "keys": int(sum(prefixes)),
           "longest": int(max(prefixes)), "flops": batch_flops(H, n, prefixes), "times_us": {}, "check": {},
           "errors": {}}
    sets = bv.input_sets(torch, prefixes, H, n, args.sets, args.seed * 1000003 + hash(name) % 100003)
    b0 = sets[0]
    ref_tree = bv.request0_reference(b0, n, chain=False)
    ref_chain = bv.request0_reference(b0, n, chain=True)
    outs = [torch.empty(b.num_rows, H * bv.DV, dtype=torch.bfloat16, device=bv.DEVICE) for b in sets]

    def check(key, out, ref):
        o = out.reshape(b0.num_rows, -1)
        err = relative_error(o[:n], ref)
        row["check"][key] = err
        if not bool(torch.isfinite(o[: B * n]).all()):
            row["errors"][key] = "non-finite output"
        elif not err < bv.CHECK_TOL:
            row["errors"][key] = f"rel err vs float64 {err:.3e}"

    va = mods.get("ours")
    for p in (paths if va is not None else []):
        with bv.kernel_path(p):
            row["times_us"][p] = bv._graph_time(torch, bv.ours_calls(va, sets, outs), args)["us"]
        check(p, outs[0], ref_tree)
    if va is None:
        row["errors"].update({p: mods.get("ours_error", "kdtree_backend.kernel.ops unavailable") for p in paths})
    fm = mods.get("flashmla")
    if fm is None:
        row["errors"]["flashmla"] = mods.get("flashmla_error", "unavailable")
    else:
        gen = torch.Generator(device=bv.DEVICE).manual_seed(args.seed + 17)
        inputs = [bv.flashmla_inputs_for(torch, b, prefixes, n, gen) for b in sets]
        calls, fouts = bv.flashmla_calls(torch, fm, sets, inputs, H, n)
        row["times_us"]["flashmla"] = bv._graph_time(torch, calls, args)["us"]
        check("flashmla", fouts[0], ref_chain)
    t = row["times_us"]
    row["ratio_vs_flashmla"] = {p: t[p] / t["flashmla"] for p in paths if p in t and "flashmla" in t}
    row["tflops"] = {k: row["flops"] / (v * 1e-6) / 1e12 for k, v in t.items()}
    del sets, outs
    torch.cuda.synchronize()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default="hopper,portable")
    ap.add_argument("--batches", default=None, help=f"names separated by ';' (default all): {'; '.join(RAGGED)}")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sets", type=int, default=4, help="rotated input sets a graph (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-ms", type=float, default=200.0)
    ap.add_argument("--min-replays", type=int, default=5)
    ap.add_argument("--max-replays", type=int, default=200)
    args = ap.parse_args(argv)
    paths = bv.parse_paths(args.paths)
    names = list(RAGGED) if args.batches is None else [x.strip() for x in args.batches.split(";") if x.strip()]
    unknown = [x for x in names if x not in RAGGED]
    if unknown:
        ap.error(f"unknown batch(es) {unknown}; choose from {list(RAGGED)}")
    import torch

    if not torch.cuda.is_available():
        print("ragged: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    mods = bv._load_impls(["ours", "flashmla"])
    env = bv._environment(torch, bv._commit(None))
    rows = []
    for name in names:
        H, n, prefixes = RAGGED[name]
        row = run_batch(torch, name, H, n, prefixes, paths, mods, args)
        rows.append(row)
        r = row["ratio_vs_flashmla"]
        print(f"{name:30s} " + " ".join(f"{k} {v:9.1f} us" for k, v in row["times_us"].items())
              + "  x FlashMLA: " + ", ".join(f"{p} {v:.3f}" for p, v in r.items())
              + (f"  ERRORS {row['errors']}" if row["errors"] else ""), flush=True)
    summary = {p: bv._geomean([r["ratio_vs_flashmla"].get(p) for r in rows]) for p in paths}
    summary["max"] = {p: bv._max([r["ratio_vs_flashmla"].get(p) for r in rows]) for p in paths}
    print("geomean time / FlashMLA: " + ", ".join(f"{p} {summary[p]:.3f} (max {summary['max'][p]:.3f})"
                                                  for p in paths if summary[p] is not None))
    doc = {"date": env.get("date"), "commit": env.get("commit"), "gpu": env.get("gpu"), "environment": env,
           "command": " ".join(["python3", *(sys.argv if argv is None else ["bench/diag/ragged.py", *argv])]),
           "paths": paths, "summary": summary, "rows": rows, "wall_s": time.time() - t0}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"JSON: {args.json}")
    failed = [r["name"] for r in rows if r["errors"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
