#!/usr/bin/env python3
"""Benchmark: our TARGET_VERIFY kernel against SGLang's Triton kernels and FlashMLA, in one run.

    python bench/bench_verify.py [--quick] [--skip-triton] [--only ours[,flashmla,...]] [--out PATH]

1. Ceilings, measured first in the same run: device-to-device copy bandwidth (bytes read +
   written) and the bf16 8192^3 torch.matmul rate, on random data.
2. For every shape of the grid (H in {8,16} x n in {16,64} x L in {1k,8k,32k} x B in {1,8,32},
   plus n=8 with H=8: 45 shapes) it times, with CUDA-graph replay and the median of many replays:
     ours        kdtree_backend.ops.verify_attention, random tree mask (uint8 FULL_MASK, int64
                 qo_indptr: SGLang's CUDA-graph inputs), scattered page-size-1 slots
     triton      SGLang 0.5.23 extend_attention_fwd, same tree inputs, called as
                 TritonAttnBackend.forward_extend calls it
     verify_mla  SGLang verify_shared_kv_fwd (Triton, grouped-head split-KV), causal chain
     flashmla    FlashMLA dense decode (sgl-flash-mla, legacy SM90 kernels), causal chain, bf16
                 cache in 64-token pages scattered at random
   When the data of one call is small, each graph replays K calls over K distinct input sets so
   that L2 (60 MB on H200) does not hold them: time per call = replay median / K.
   Each shape also checks correctness on its first request against the float64 reference
   (tree for ours/Triton, chain for verify_mla/FlashMLA).
3. Per shape: times (us), speedup vs Triton, ratio vs FlashMLA, achieved TB/s and TFLOP/s and
   % of roofline, with bytes = B*(L+n)*576*2 + B*n*H*576*2 + B*n*H*512*2 and
   FLOPs = 2*B*n*H*(L+n)*(576+512); roofline = max(bytes/copy ceiling, FLOPs/matmul ceiling).
   Geometric means and the "done when" checks of issue 3.
Writes JSON to bench/results/<date>-<gpu>-<shortcommit>.json (or --out) after every shape, and
a PNG next to it through bench/plot.py (also runnable alone: python bench/plot.py RESULT.json).
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QK, DV = 576, 512
PAGE_FLASHMLA = 64
IMPLS = ("ours", "triton", "verify_mla", "flashmla")
Shape = collections.namedtuple("Shape", "B H n L")

MAIN_HN = ((8, 16), (8, 64), (16, 16), (16, 64))
EXTRA_HN = ((8, 8),)
L_VALUES = (1024, 8192, 32768)
B_VALUES = (1, 8, 32)
QUICK = (Shape(1, 8, 16, 1024), Shape(1, 8, 16, 32768), Shape(8, 8, 16, 8192), Shape(32, 16, 64, 8192),
         Shape(8, 16, 16, 32768), Shape(32, 8, 8, 32768))
LARGE_BL = 256 * 1024  # "large shapes": B*L >= 256k
DEVICE = "cuda"  # the CPU dry-run test points this at "cpu" with fake CUDA timers


# ------------------------------------------------------------------------------------------
# pure arithmetic (tested on the CPU: tests/test_reference_cpu.py)
# ------------------------------------------------------------------------------------------
def parse_shapes(text: str) -> list:
    """"B,H,n,L;B,H,n,L;..." -> shapes (for sweeps outside the issue grid, e.g. fixed-cost fits)."""
    shapes = []
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        vals = [int(x) for x in part.split(",")]
        if len(vals) != 4 or min(vals[:3]) < 1 or vals[3] < 0:
            raise ValueError(f"shape {part!r}: want B,H,n,L with B,H,n >= 1 and L >= 0")
        shapes.append(Shape(*vals))
    if not shapes:
        raise ValueError("no shapes given")
    return shapes


def build_grid(quick: bool = False) -> list:
    if quick:
        return list(QUICK)
    return [Shape(B, H, n, L) for (H, n) in MAIN_HN + EXTRA_HN for L in L_VALUES for B in B_VALUES]


def shape_label(s: Shape) -> str:
    L = f"{s.L // 1024}k" if s.L % 1024 == 0 else str(s.L)
    return f"B{s.B} H{s.H} n{s.n} L{L}"


def shape_bytes(s: Shape) -> int:
    return s.B * (s.L + s.n) * QK * 2 + s.B * s.n * s.H * QK * 2 + s.B * s.n * s.H * DV * 2


def shape_flops(s: Shape) -> int:
    return 2 * s.B * s.n * s.H * (s.L + s.n) * (QK + DV)


def roofline_us(s: Shape, ceil: dict) -> float:
    return max(shape_bytes(s) / (ceil["copy_tbps"] * 1e12), shape_flops(s) / (ceil["matmul_tflops"] * 1e12)) * 1e6


def metrics(s: Shape, t_us: float, ceil: dict) -> dict:
    t = t_us * 1e-6
    tbps = shape_bytes(s) / t / 1e12
    tflops = shape_flops(s) / t / 1e12
    return {
        "tbps": tbps,
        "tflops": tflops,
        "pct_roofline": 100.0 * roofline_us(s, ceil) / t_us,
        "pct_copy": 100.0 * tbps / ceil["copy_tbps"],
        "pct_matmul": 100.0 * tflops / ceil["matmul_tflops"],
    }


def _shape_of(row) -> Shape:
    return Shape(**row["shape"])


def finish_row(row: dict, ceil: dict) -> dict:
    """Add derived numbers to a row holding 'shape' and 'times_us' {impl: us}."""
    s = _shape_of(row)
    t = {k: v for k, v in row.get("times_us", {}).items() if v is not None and v > 0 and math.isfinite(v)}
    row["label"] = shape_label(s)
    row["bytes"] = shape_bytes(s)
    row["flops"] = shape_flops(s)
    row["roofline_us"] = roofline_us(s, ceil)
    row["metrics"] = {k: metrics(s, v, ceil) for k, v in t.items()}
    row["speedup_vs_triton"] = t["triton"] / t["ours"] if "ours" in t and "triton" in t else None
    row["ratio_vs_flashmla"] = t["ours"] / t["flashmla"] if "ours" in t and "flashmla" in t else None
    row["triton_over_flashmla"] = t["triton"] / t["flashmla"] if "triton" in t and "flashmla" in t else None
    return row


def _geomean(xs):
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summarize(rows: list, ceil: dict) -> dict:
    sp = [r["speedup_vs_triton"] for r in rows if r.get("speedup_vs_triton")]
    fr = [r["ratio_vs_flashmla"] for r in rows if r.get("ratio_vs_flashmla")]
    main = [r for r in rows if (r["shape"]["H"], r["shape"]["n"]) in MAIN_HN]
    large = [r for r in main if r["shape"]["B"] * r["shape"]["L"] >= LARGE_BL and "ours" in r.get("metrics", {})]
    n8 = [r for r in rows if (r["shape"]["H"], r["shape"]["n"]) == (8, 8) and "ours" in r.get("metrics", {})]
    n8_large = [r for r in n8 if r["shape"]["B"] * r["shape"]["L"] >= LARGE_BL]

    def pct(rs, key):
        return {r["label"]: r["metrics"]["ours"][key] for r in rs}

    large_mm = pct(large, "pct_matmul")
    n8_copy = pct(n8, "pct_copy")
    n8_large_copy = pct(n8_large, "pct_copy")
    s = {
        "shapes": len(rows),
        "shapes_with_ours": sum(1 for r in rows if "ours" in r.get("metrics", {})),
        "geomean_speedup_vs_triton": _geomean(sp),
        "min_speedup_vs_triton": min(sp) if sp else None,
        "shapes_with_speedup": len(sp),
        "geomean_speedup_vs_triton_main_grid": _geomean([r.get("speedup_vs_triton") for r in main]),
        "geomean_ratio_vs_flashmla": _geomean(fr),
        "max_ratio_vs_flashmla": max(fr) if fr else None,
        "shapes_with_flashmla_ratio": len(fr),
        "geomean_triton_over_flashmla": _geomean([r.get("triton_over_flashmla") for r in rows]),
        "large_shapes": len(large),
        "large_shapes_pct_matmul": large_mm,
        "large_shapes_min_pct_matmul": min(large_mm.values()) if large_mm else None,
        "n8_h8_pct_copy": n8_copy,
        "n8_h8_large_min_pct_copy": min(n8_large_copy.values()) if n8_large_copy else None,
        "n8_h8_min_pct_copy": min(n8_copy.values()) if n8_copy else None,
        "ceilings": ceil,
    }

    def check(val, ok):
        return None if val is None else bool(ok(val))

    s["done_when"] = {
        "speedup_geomean_ge_10": check(s["geomean_speedup_vs_triton"], lambda v: v >= 10),
        "speedup_min_ge_3": check(s["min_speedup_vs_triton"], lambda v: v >= 3),
        "flashmla_ratio_le_1_6": check(s["geomean_ratio_vs_flashmla"], lambda v: v <= 1.6),
        # B*L >= 256k on the main grid (H in {8,16}, n in {16,64}): >= 55% of the matmul ceiling
        "large_shapes_matmul_pct_ge_55": check(s["large_shapes_min_pct_matmul"], lambda v: v >= 55),
        # the memory-bound n=8, H=8 shapes with B*L >= 256k: >= 60% of the copy ceiling
        "n8_h8_copy_pct_ge_60": check(s["n8_h8_large_min_pct_copy"], lambda v: v >= 60),
    }
    return s


def default_out_path(date: str, gpu: str, commit: str) -> str:
    safe = "".join(c if c.isalnum() or c in "._" else "-" for c in gpu).strip("-")
    return str(ROOT / "bench" / "results" / f"{date}-{safe}-{commit}.json")


def make_document(rows, ceil, summary, argv, env) -> dict:
    return {
        "date": env.get("date") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "time_utc": env.get("time_utc") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": env.get("commit", "unknown"),
        "gpu": env.get("gpu", "unknown"),
        "torch": env.get("torch"),
        "triton": env.get("triton"),
        "environment": env,
        "command": " ".join(shlex.quote(str(x)) for x in ["python3", *argv]),
        "ceilings": ceil,
        "summary": summary,
        "rows": rows,
    }


def _fmt(v, spec="9.1f"):
    return f"{v:{spec}}" if isinstance(v, (int, float)) and v is not None and math.isfinite(v) else " " * (int(spec.split(".")[0]) - 1) + "-"


def format_table(rows) -> str:
    head = (f"{'shape':<20} {'ours us':>9} {'triton us':>10} {'vmla us':>9} {'fmla us':>9} {'speedup':>8} "
            f"{'/fmla':>6} {'TB/s':>6} {'TFLOP/s':>8} {'%roof':>6} {'%copy':>6} {'%mm':>5} {'err ours':>9}")
    lines = [head]
    for r in rows:
        t = r.get("times_us", {})
        m = r.get("metrics", {}).get("ours", {})
        lines.append(
            f"{r.get('label', ''):<20} {_fmt(t.get('ours'))} {_fmt(t.get('triton'), '10.1f')} {_fmt(t.get('verify_mla'))} "
            f"{_fmt(t.get('flashmla'))} {_fmt(r.get('speedup_vs_triton'), '8.1f')} {_fmt(r.get('ratio_vs_flashmla'), '6.2f')} "
            f"{_fmt(m.get('tbps'), '6.2f')} {_fmt(m.get('tflops'), '8.1f')} {_fmt(m.get('pct_roofline'), '6.1f')} "
            f"{_fmt(m.get('pct_copy'), '6.1f')} {_fmt(m.get('pct_matmul'), '5.1f')} "
            f"{_fmt(r.get('check', {}).get('ours'), '9.1e')}")
    return "\n".join(lines)


def format_summary(s: dict) -> str:
    def f(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    dw = s["done_when"]
    return "\n".join([
        f"shapes: {s['shapes']} ({s['shapes_with_ours']} with ours, {s['shapes_with_speedup']} with Triton, "
        f"{s['shapes_with_flashmla_ratio']} with FlashMLA)",
        f"speedup vs Triton: geomean {f(s['geomean_speedup_vs_triton'])}x (main grid "
        f"{f(s['geomean_speedup_vs_triton_main_grid'])}x), min {f(s['min_speedup_vs_triton'])}x   "
        f"[>=10: {dw['speedup_geomean_ge_10']}, min>=3: {dw['speedup_min_ge_3']}]",
        f"ours / FlashMLA: geomean {f(s['geomean_ratio_vs_flashmla'])}, max {f(s['max_ratio_vs_flashmla'])}   "
        f"[<=1.6: {dw['flashmla_ratio_le_1_6']}]   (Triton / FlashMLA geomean {f(s['geomean_triton_over_flashmla'])})",
        f"large shapes (B*L>=256k, {s['large_shapes']}): min {f(s['large_shapes_min_pct_matmul'], '.1f')}% of matmul   "
        f"[>=55: {dw['large_shapes_matmul_pct_ge_55']}]",
        f"n=8 H=8: min {f(s['n8_h8_large_min_pct_copy'], '.1f')}% of copy for B*L>=256k "
        f"(all n=8 shapes: min {f(s['n8_h8_min_pct_copy'], '.1f')}%)   [>=60: {dw['n8_h8_copy_pct_ge_60']}]",
        f"ceilings: copy {s['ceilings']['copy_tbps']:.2f} TB/s, matmul {s['ceilings']['matmul_tflops']:.0f} TFLOP/s",
    ])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="bench/bench_verify.py", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} shapes")
    ap.add_argument("--shapes", default=None, help="'B,H,n,L;...' instead of the issue grid (e.g. an L sweep)")
    ap.add_argument("--skip-triton", action="store_true", help="do not time SGLang's extend_attention_fwd (slow at large shapes)")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(IMPLS)} (e.g. 'ours')")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/<date>-<gpu>-<commit>.json)")
    ap.add_argument("--no-plot", action="store_true", help="do not write the PNG (bench/plot.py can do it later)")
    ap.add_argument("--no-check", action="store_true", help="skip the per-shape float64 correctness check")
    ap.add_argument("--budget-ms", type=float, default=200.0, help="timed replays per (shape, impl), in ms (default 200)")
    ap.add_argument("--max-replays", type=int, default=200)
    ap.add_argument("--min-replays", type=int, default=5)
    ap.add_argument("--max-sets", type=int, default=48, help="largest number of rotated input sets per graph")
    ap.add_argument("--time-limit", type=float, default=270.0, help="stop starting new shapes after this many seconds (default 270)")
    ap.add_argument("--commit", default=None, help="commit id to record (default: git, else $KDTREE_COMMIT)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slots", choices=SLOT_ORDERS, default="random",
                    help="prefix slot order in SGLang's page-size-1 cache: random (default, a fragmented pool), "
                         "contiguous (each request's rows in consecutive slots, DRAM-friendly; also what "
                         "--page-size 64 gives) or runs (shuffled runs of 1-300 consecutive slots: a pool between "
                         "the two), to separate the cost of slot order from the kernel's")
    a = ap.parse_args(argv)
    if a.shapes is not None:
        try:
            a.shapes = parse_shapes(a.shapes)  # parsed once, here: main() takes the list
        except ValueError as e:
            ap.error(f"--shapes: {e}")
    if a.only is not None:
        a.only = ",".join(x.strip() for x in a.only.split(",") if x.strip())
        bad = [x for x in a.only.split(",") if x not in IMPLS]
        if bad or not a.only:
            ap.error(f"--only: unknown {bad}; choose from {', '.join(IMPLS)}")
    return a


def selected_impls(args) -> list:
    impls = list(IMPLS) if args.only is None else [x for x in IMPLS if x in args.only.split(",")]
    if args.skip_triton and "triton" in impls:
        impls.remove("triton")
    return impls


# ------------------------------------------------------------------------------------------
# GPU side
# ------------------------------------------------------------------------------------------
def _commit(explicit):
    if explicit:
        return explicit
    try:
        c = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        if c.returncode == 0 and c.stdout.strip():
            dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return c.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("KDTREE_COMMIT", "nogit")


def _environment(torch, commit):
    import importlib.metadata as md

    env = {"commit": commit, "python": platform.python_version(), "torch": torch.__version__,
           # kernel knobs (KDTREE_KERNEL, KDTREE_NUM_SPLITS, ...) change what "ours" is
           "kdtree_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KDTREE_")}}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        env["triton"] = f"unavailable: {e}"
    try:
        from kdtree_backend import ops

        env["kernel"] = ops.selected_kernel()  # the path "ours" ran: hopper or portable
    except Exception as e:  # noqa: BLE001
        env["kernel"] = f"unavailable: {e}"
    for dist in ("sglang", "sgl-flash-mla"):
        try:
            env[dist] = md.version(dist)
        except Exception:  # noqa: BLE001
            env[dist] = None
    p = torch.cuda.get_device_properties(0)
    env.update(gpu=p.name, sm_count=p.multi_processor_count, l2_bytes=getattr(p, "L2_cache_size", None),
               capability=f"{p.major}.{p.minor}", cuda=torch.version.cuda,
               driver=_smi("driver_version"), sm_clock_max_mhz=_smi("clocks.max.sm"))
    try:
        from kdtree_backend import ops

        env["kdtree_library"] = ops.library_info()
    except Exception as e:  # noqa: BLE001
        env["kdtree_library"] = f"unavailable: {e}"
    now = datetime.datetime.now(datetime.timezone.utc)
    env["date"] = now.strftime("%Y-%m-%d")
    env["time_utc"] = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return env


def _smi(field):
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", "0"],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _event_times_ms(torch, fn, reps):
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def measure_ceilings(torch):
    torch.cuda.synchronize()
    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    t = statistics.median(_event_times_ms(torch, lambda: dst.copy_(src), 20))
    copy_tbps = 2 * n / (t * 1e-3) / 1e12
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    c = torch.empty(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        torch.matmul(a, b, out=c)
    t = statistics.median(_event_times_ms(torch, lambda: torch.matmul(a, b, out=c), 20))
    mm = 2 * 8192 ** 3 / (t * 1e-3) / 1e12
    del a, b, c
    torch.cuda.empty_cache()
    return {"copy_tbps": copy_tbps, "matmul_tflops": mm, "copy_bytes_each_way": n, "matmul_n": 8192}


_CAPTURE_STREAM = None


def _graph_time(torch, calls, args):
    """Eager warm-up (compiles, allocates workspaces) on the capture stream, capture the K calls
    once, then time replays: median replay time / K, in microseconds. One capture stream for the
    whole run, as in SGLang (the op caches its workspace per stream)."""
    global _CAPTURE_STREAM
    if _CAPTURE_STREAM is None:
        _CAPTURE_STREAM = torch.cuda.Stream()
    stream = _CAPTURE_STREAM
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for c in calls:
                c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    probe = statistics.median(_event_times_ms(torch, g.replay, 2))
    reps = int(max(args.min_replays, min(args.max_replays, args.budget_ms / max(probe, 1e-3))))
    ts = _event_times_ms(torch, g.replay, reps)
    k = len(calls)
    ts_sorted = sorted(ts)
    del g
    return {
        "us": statistics.median(ts) * 1e3 / k,
        "p10_us": ts_sorted[len(ts) // 10] * 1e3 / k,
        "p90_us": ts_sorted[(len(ts) * 9) // 10] * 1e3 / k,
        "replays": reps,
        "calls_per_replay": k,
    }


def flashmla_inputs(torch, batch, s: Shape, gen):
    """FlashMLA's dense-decode inputs holding the same rows as `batch`: a bf16 cache of 64-token
    pages scattered at random ([pages, 64, 1, 576]), block_table [B, pages/request] int32 and
    cache_seqlens [B] int32 = L + n (request b's token t < L is its prefix row
    kv_cache[kv_indices[kv_indptr[b] + t]], token L + c its draft row k[b*n + c]); FlashMLA's
    causal rule (query i sees tokens <= L + i) is then the chain mask."""
    dev = batch.q.device
    S = s.L + s.n
    per = -(-S // PAGE_FLASHMLA)
    total = s.B * per
    pool = total + max(8, total // 8)
    cache = torch.randn(pool, PAGE_FLASHMLA, 1, QK, generator=gen, device=dev).to(torch.bfloat16)
    block_table = torch.randperm(pool, generator=gen, device=dev)[:total].view(s.B, per).to(torch.int32)
    tok = torch.arange(S, device=dev)
    dst = (block_table[:, tok // PAGE_FLASHMLA].long() * PAGE_FLASHMLA + tok % PAGE_FLASHMLA)  # [B, S]
    flat = cache.view(-1, QK)
    src_cache = batch.kv_cache.reshape(-1, QK)
    prefix_slots = batch.kv_indices[: s.B * s.L].view(s.B, s.L)
    flat[dst[:, : s.L].reshape(-1)] = src_cache[prefix_slots.reshape(-1)]
    flat[dst[:, s.L:].reshape(-1)] = batch.k.reshape(s.B * s.n, QK)
    seqlens = torch.full((s.B,), S, dtype=torch.int32, device=dev)
    return cache, block_table, seqlens


def call_verify_mla(vm, b, o):
    """SGLang's verify_shared_kv_fwd on a VerifyBatch, causal chain (no mask), called the way
    TritonAttnBackend.forward_extend calls it on ROCm (same arguments as extend_attention_fwd)."""
    H = b.q.shape[1]
    kb = b.kv_cache.view(b.kv_cache.shape[0], 1, QK)
    ok = vm(b.q, b.k.view(-1, 1, QK).contiguous(), b.v.contiguous(), o.view(-1, H, DV), kb, kb[..., :DV],
            b.qo_indptr, b.kv_indptr, b.kv_indices, None, True, b.mask_indptr, b.max_qo_len, b.k_scale,
            b.v_scale, b.sm_scale, logit_cap=0.0, sliding_window_size=-1, sinks=None, window_kv_offsets=None,
            xai_temperature_len=-1, max_bs=len(b.prefix_lens))
    if not ok:
        raise RuntimeError("verify_shared_kv_fwd declined this shape (can_handle False)")
    return o


SLOT_ORDERS = ("random", "contiguous", "runs")


def slot_layout_kwargs(slots: str) -> dict:
    """make_verify_batch's arguments for --slots: "random" is its default (scattered slots);
    "contiguous" and "runs" are its slot layouts of those names (contiguous: slots 1, 2, ... in request
    order, as every earlier contiguous-slot result in bench/results/ was measured)."""
    if slots not in SLOT_ORDERS:
        raise ValueError(f"--slots must be one of {SLOT_ORDERS}, got {slots!r}")
    return {} if slots == "random" else {"slot_layout": slots}


def run_shape(torch, s: Shape, impls, args, ceil, mods):
    from kdtree_backend.reference import make_verify_batch, relative_error, verify_attention_reference

    row = {"shape": s._asdict(), "times_us": {}, "timing": {}, "check": {}, "errors": {}}
    set_bytes = shape_bytes(s)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or (60 << 20)
    k_sets = int(max(1, min(args.max_sets, math.ceil(4 * l2 / set_bytes))))
    row["input_sets"] = k_sets
    sm_scale = 192 ** -0.5
    batches = []
    for i in range(k_sets):
        batches.append(make_verify_batch(
            [s.L] * s.B, num_heads=s.H, draft_lens=s.n, mask="tree", mask_dtype=torch.uint8,
            qo_indptr_dtype=torch.int64, kv_indptr_dtype=torch.int32, prefix_mask_fill="ones",
            pool_factor=1.25, extra_indices=64, seed=args.seed * 1000003 + hash(s) % 100003 + i, device=DEVICE,
            **slot_layout_kwargs(args.slots)))
    b0 = batches[0]
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed + 17)

    # float64 references on request 0 only (cheap): tree for ours/Triton, chain for the others
    ref_tree = ref_chain = None
    rows0 = torch.zeros(b0.num_rows, dtype=torch.bool, device=DEVICE)
    rows0[: s.n] = True
    if not args.no_check:
        a = b0.args()
        ref_tree = verify_attention_reference(a[0], a[1], a[2], a[3][:2], a[4][:2], a[5], a[6], a[7][:2], sm_scale)
        ref_chain = verify_attention_reference(a[0], a[1], a[2], a[3][:2], a[4][:2], a[5], None, None, sm_scale)

    failed = mods.setdefault("_failed", {})  # (impl, H, n) -> first error: do not retry (Triton recompiles)

    def record(name, calls, check_out, ref):
        if (name, s.H, s.n) in failed:
            row["errors"][name] = f"skipped: failed earlier at H={s.H} n={s.n}: {failed[(name, s.H, s.n)]}"
            return
        try:
            res = _graph_time(torch, calls, args)
            row["times_us"][name] = res["us"]
            row["timing"][name] = res
            if check_out is None:
                return
            o = check_out.reshape(b0.num_rows, -1)
            if not bool(torch.isfinite(o[: s.B * s.n]).all()):
                row["errors"][name] = "non-finite output"
            if ref is not None:
                row["check"][name] = relative_error(o, ref, rows0)
        except Exception as e:  # noqa: BLE001 - one failing competitor must not stop the run
            row["errors"][name] = f"{type(e).__name__}: {str(e)[:500]}"
            failed[(name, s.H, s.n)] = row["errors"][name][:200]
            traceback.print_exc()
        finally:
            torch.cuda.synchronize()

    outs = [torch.empty(b.num_rows, s.H * DV, dtype=torch.bfloat16, device=DEVICE) for b in batches]
    if "ours" in impls:
        if mods.get("ours") is None:
            row["errors"]["ours"] = mods.get("ours_error", "kdtree_backend.ops unavailable")
        else:
            va = mods["ours"]
            calls = [(lambda b=b, o=o: va(*b.args(), **b.kwargs(), out=o)) for b, o in zip(batches, outs)]
            record("ours", calls, outs[0], ref_tree)
    if "triton" in impls:
        if mods.get("triton_ok"):
            calls = [(lambda b=b, o=o: b.call_sglang_triton(o)) for b, o in zip(batches, outs)]
            record("triton", calls, outs[0], ref_tree)
        else:
            row["errors"]["triton"] = mods.get("triton_error", "unavailable")
    if "verify_mla" in impls:
        vm = mods.get("verify_mla")
        if vm is None:
            row["errors"]["verify_mla"] = mods.get("verify_mla_error", "unavailable")
        else:
            calls = [(lambda b=b, o=o: call_verify_mla(vm, b, o)) for b, o in zip(batches, outs)]
            record("verify_mla", calls, outs[0], ref_chain)
    if "flashmla" in impls:
        fm = mods.get("flashmla")
        if fm is None:
            row["errors"]["flashmla"] = mods.get("flashmla_error", "unavailable")
        else:
            try:
                if ("flashmla", s.H, s.n) in failed:
                    raise RuntimeError(f"skipped: failed earlier at H={s.H} n={s.n}: {failed[('flashmla', s.H, s.n)]}")
                inputs = [flashmla_inputs(torch, b, s, gen) for b in batches]
                metas = [fm.get_mla_metadata()[0] for _ in batches]
                fouts = [None] * len(batches)

                def fcall(i):
                    b = batches[i]
                    cache, bt, sl = inputs[i]
                    o, _ = fm.flash_mla_with_kvcache(b.q.view(s.B, s.n, s.H, QK), cache, bt, sl, DV, metas[i],
                                                     softmax_scale=sm_scale, causal=True, use_legacy=True)
                    fouts[i] = o
                fcall(0)  # eager: builds the scheduler metadata outside the graph
                torch.cuda.synchronize()
                calls = [(lambda i=i: fcall(i)) for i in range(len(batches))]
                # after capture fouts[0] is the graph's output tensor, rewritten by each replay
                record("flashmla", calls, None, ref_chain)
                o = fouts[0].reshape(b0.num_rows, -1)
                if not bool(torch.isfinite(o).all()):
                    row["errors"]["flashmla"] = "non-finite output"
                if ref_chain is not None:
                    row["check"]["flashmla"] = relative_error(o, ref_chain, rows0)
                del inputs
            except Exception as e:  # noqa: BLE001
                row["errors"].setdefault("flashmla", f"{type(e).__name__}: {str(e)[:500]}")
                failed.setdefault(("flashmla", s.H, s.n), row["errors"]["flashmla"][:200])
                if "skipped:" not in str(e):
                    traceback.print_exc()
    # a check failure is an error: timings of a wrong result are not comparable
    for name, err in row["check"].items():
        if err is None or not (err < 2e-2):
            row["errors"].setdefault(name, f"rel err vs float64 {err:.3e}")
    del batches, outs
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return finish_row(row, ceil)


def _load_impls(impls):
    mods = {}
    if "ours" in impls:
        try:
            from kdtree_backend import ops

            if not ops.kernel_available():
                ops.library_info()  # raises with the loader's message
            mods["ours"] = ops.verify_attention
        except Exception as e:  # noqa: BLE001
            mods["ours_error"] = f"{type(e).__name__}: {e}"
    if "triton" in impls:
        try:
            from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd  # noqa: F401

            mods["triton_ok"] = True
        except Exception as e:  # noqa: BLE001
            mods["triton_error"] = f"{type(e).__name__}: {e}"
    if "verify_mla" in impls:
        try:
            from sglang.kernels.ops.attention.verify_mla import verify_shared_kv_fwd

            mods["verify_mla"] = verify_shared_kv_fwd
        except Exception as e:  # noqa: BLE001
            mods["verify_mla_error"] = f"{type(e).__name__}: {e}"
    if "flashmla" in impls:
        try:
            import flash_mla

            if not flash_mla.has_legacy():
                raise RuntimeError("flash_mla built without the legacy (SM90 dense) kernels")
            mods["flashmla"] = flash_mla
        except Exception as e:  # noqa: BLE001
            mods["flashmla_error"] = f"{type(e).__name__}: {e}"
    return mods


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_verify: needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.time()
    impls = selected_impls(args)
    commit = _commit(args.commit)
    env = _environment(torch, commit)
    out_path = args.out or default_out_path(env["date"], env["gpu"], commit)
    pathlib.Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    argv_used = [sys.argv[0]] + (list(argv) if argv is not None else sys.argv[1:])

    print(f"GPU {env['gpu']} ({env['sm_count']} SMs), torch {env['torch']}, triton {env['triton']}, "
          f"sglang {env['sglang']}, flash-mla {env['sgl-flash-mla']}, commit {commit}", flush=True)
    ceil = measure_ceilings(torch)
    print(f"ceilings: copy {ceil['copy_tbps']:.2f} TB/s, bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s "
          f"({time.time() - t_start:.0f}s)", flush=True)
    mods = _load_impls(impls)
    for k in ("ours_error", "triton_error", "verify_mla_error", "flashmla_error"):
        if k in mods:
            print(f"note: {k[:-6]} unavailable: {mods[k]}", flush=True)

    rows, skipped = [], []

    def write_document():
        summary = summarize(rows, ceil)
        summary["skipped_for_time"] = skipped
        doc = make_document(rows, ceil, summary, argv_used, env)
        doc["impls"] = impls
        doc["wall_s"] = time.time() - t_start
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=1)
        return summary

    grid = args.shapes if args.shapes else build_grid(args.quick)
    for i, s in enumerate(grid):
        if time.time() - t_start > args.time_limit:
            skipped.append(s._asdict())
            continue
        t0 = time.time()
        row = run_shape(torch, s, impls, args, ceil, mods)
        row["seconds"] = time.time() - t0
        rows.append(row)
        t = row["times_us"]
        print(f"[{i + 1}/{len(grid)}] {row['label']:<18} " + "  ".join(f"{k} {t[k]:.1f}" for k in IMPLS if k in t)
              + (f"  x{row['speedup_vs_triton']:.1f}" if row["speedup_vs_triton"] else "")
              + (f"  /fmla {row['ratio_vs_flashmla']:.2f}" if row["ratio_vs_flashmla"] else "")
              + (f"  errors {row['errors']}" if row["errors"] else "")
              + f"  ({row['seconds']:.1f}s)", flush=True)
        write_document()  # after every shape: a run cut short still leaves its rows
    summary = write_document()
    print()
    print(format_table(rows))
    print()
    print(format_summary(summary))
    if skipped:
        print(f"skipped for time: {len(skipped)} shapes")
    print(f"JSON: {out_path}")
    if not args.no_plot:
        try:
            sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
            import plot as _plot

            print(f"PNG: {_plot.plot(out_path)}")
        except Exception as e:  # noqa: BLE001
            print(f"plot skipped ({type(e).__name__}: {e}); run: python bench/plot.py {out_path}")
    print(f"total {time.time() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
