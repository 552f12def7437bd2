#!/usr/bin/env python3
"""Benchmark: our TARGET_VERIFY kernel against SGLang's Triton kernels and FlashMLA, in one run.

    python bench/bench_verify.py [--grid main|ddtree|customer|quick[,...]] [--paths hopper,portable]
                                 [--skip-triton] [--only ours[,flashmla,...]] [--out PATH]

1. Ceilings, measured first in the same process: device-to-device copy bandwidth (bytes read +
   written), the bf16 8192^3 torch.matmul rate, and the mma.sync peak (bench/diag/mma_peak.cu,
   compiled with nvcc at run time: bf16 m16n8k16, fp32 accumulate, registers only), the ceiling
   of the portable path's instruction.
2. For every shape of the grid it times, with CUDA-graph replay and the median of many replays:
     ours        kdtree_backend.kernel.ops.verify_attention, random tree mask (uint8 FULL_MASK, int64
                 qo_indptr: SGLang's CUDA-graph inputs), scattered page-size-1 slots; with
                 --paths, each kernel path in turn (KDTREE_KERNEL set around its capture)
     triton      SGLang 0.5.23 extend_attention_fwd, same tree inputs, called as
                 TritonAttnBackend.forward_extend calls it
     verify_mla  SGLang verify_shared_kv_fwd (Triton, grouped-head split-KV), causal chain; not
                 run past 64 drafts (its kernel needs more shared memory than the GPU has)
     flashmla    FlashMLA dense decode (sgl-flash-mla, legacy SM90 kernels), causal chain, bf16
                 cache in 64-token pages scattered at random
   When the data of one call is small, each graph replays K calls over K distinct input sets so
   that L2 (60 MB on H200) does not hold them: time per call = replay median / K.
   Each shape also checks correctness on its first request against the float64 reference
   (tree for ours/Triton, chain for verify_mla/FlashMLA).
3. Per shape: times (us), speedup vs Triton, ratio vs FlashMLA, achieved TB/s and TFLOP/s and
   % of roofline and of each ceiling, with bytes = B*(L+n)*576*2 + B*n*H*576*2 + B*n*H*512*2 and
   FLOPs = 2*B*n*H*(L+n)*(576+512); roofline = max(bytes/copy ceiling, FLOPs/matmul ceiling).
   Geometric means per kernel path and per grid, and the "done when" checks of issue 3.
Writes JSON to bench/results/<date>-<gpu>-<shortcommit>.json (or --out) after every shape, and
a PNG next to it through bench/plot.py (also runnable alone: python bench/plot.py RESULT.json).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import datetime
import hashlib
import json
import math
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QK, DV = 576, 512
PAGE_FLASHMLA = 64
IMPLS = ("ours", "triton", "verify_mla", "flashmla")
KERNEL_PATHS = ("hopper", "portable", "portable-tiled")
# One letter per path in the tables' column heads.
PATH_LETTER = {"hopper": "H", "portable": "P", "portable-tiled": "T"}
VERIFY_MLA_MAX_N = 64  # verify_shared_kv_fwd is not run past this (minutes of compiling, then OutOfResources)
Shape = collections.namedtuple("Shape", "B H n L")

MAIN_HN = ((8, 16), (8, 64), (16, 16), (16, 64))
EXTRA_HN = ((8, 8),)
L_VALUES = (1024, 8192, 32768)
B_VALUES = (1, 8, 32)
QUICK = (Shape(1, 8, 16, 1024), Shape(1, 8, 16, 32768), Shape(8, 8, 16, 8192), Shape(32, 16, 64, 8192),
         Shape(8, 16, 16, 32768), Shape(32, 8, 8, 32768))
# DDTree verification (issues 25, 26): wide draft trees of 33-257 tokens over long prefixes.
DDTREE_H, DDTREE_N, DDTREE_L = (8, 16), (33, 65, 129, 257), (8192, 32768)
CUSTOMER_H, CUSTOMER_N = (8,), (65, 129, 257)  # the customer's model: 8 heads per GPU
GRIDS = ("main", "ddtree", "customer", "quick")
LARGE_BL = 256 * 1024  # "large shapes": B*L >= 256k
CHECK_TOL = 2e-2  # relative error vs float64 at or above which a shape's result is an error
DEVICE = "cuda"  # the CPU dry-run test points this at "cpu" with fake CUDA timers
MMA_PEAK_SOURCE = ROOT / "bench" / "diag" / "mma_peak.cu"
MMA_PEAK_HEADER = ROOT / "bench" / "diag" / "mma_operands.cuh"


# ------------------------------------------------------------------------------------------
# pure arithmetic (tested on the CPU: tests/testing/test_reference_cpu.py)
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


def _grid(name: str) -> list:
    if name == "main":  # issue 3: H x n in MAIN_HN, plus n = 8 with H = 8 (45 shapes)
        return [Shape(B, H, n, L) for (H, n) in MAIN_HN + EXTRA_HN for L in L_VALUES for B in B_VALUES]
    if name == "quick":
        return list(QUICK)
    if name == "ddtree":  # grouped by (H, n): each group compiles SGLang's Triton kernels once
        return [Shape(B, H, n, L) for H in DDTREE_H for n in DDTREE_N for L in DDTREE_L for B in B_VALUES]
    if name == "customer":
        return [Shape(B, H, n, L) for H in CUSTOMER_H for n in CUSTOMER_N for L in DDTREE_L for B in B_VALUES]
    raise ValueError(f"unknown grid {name!r}: choose from {', '.join(GRIDS)}")


def build_grid(grid: str = "main", quick: bool = False) -> list:
    """The shapes of one grid or of several ("main,ddtree"), in order, each shape once."""
    names = ["quick"] if quick else [g.strip() for g in grid.split(",") if g.strip()]
    if not names:
        raise ValueError("no grid given")
    shapes = []
    for name in names:
        shapes += [s for s in _grid(name) if s not in shapes]
    return shapes


def grids_of(s: Shape) -> list:
    """The named grids (other than quick) that hold this shape."""
    return [g for g in GRIDS if g != "quick" and s in _grid(g)]


def shape_label(s: Shape) -> str:
    L = f"{s.L // 1024}k" if s.L % 1024 == 0 else str(s.L)
    return f"B{s.B} H{s.H} n{s.n} L{L}"


def shape_bytes(s: Shape) -> int:
    return s.B * (s.L + s.n) * QK * 2 + s.B * s.n * s.H * QK * 2 + s.B * s.n * s.H * DV * 2


def shape_flops(s: Shape) -> int:
    return 2 * s.B * s.n * s.H * (s.L + s.n) * (QK + DV)


def is_large(s: Shape) -> bool:
    return s.B * s.L >= LARGE_BL


def roofline_us(s: Shape, ceil: dict) -> float:
    return max(shape_bytes(s) / (ceil["copy_tbps"] * 1e12), shape_flops(s) / (ceil["matmul_tflops"] * 1e12)) * 1e6


def metrics(s: Shape, t_us: float, ceil: dict) -> dict:
    t = t_us * 1e-6
    tbps = shape_bytes(s) / t / 1e12
    tflops = shape_flops(s) / t / 1e12
    mma = ceil.get("mma_sync_tflops")
    return {
        "tbps": tbps,
        "tflops": tflops,
        "pct_roofline": 100.0 * roofline_us(s, ceil) / t_us,
        "pct_copy": 100.0 * tbps / ceil["copy_tbps"],
        "pct_matmul": 100.0 * tflops / ceil["matmul_tflops"],
        "pct_mma_sync": 100.0 * tflops / mma if mma else None,
    }


def _shape_of(row) -> Shape:
    return Shape(**row["shape"])


def _ratio(t: dict, a: str, b: str):
    return t[a] / t[b] if a in t and b in t else None


def finish_row(row: dict, ceil: dict, paths=("ours",)) -> dict:
    """Add derived numbers to a row holding 'shape' and 'times_us' {impl: us}. `paths` name the
    entries of times_us that are our kernel ("ours", or one per kernel path: "hopper", ...);
    row["paths"][p] holds each one's comparisons, and the row-level speedup_vs_triton and
    ratio_vs_flashmla are the first path's."""
    s = _shape_of(row)
    t = {k: v for k, v in row.get("times_us", {}).items() if v is not None and v > 0 and math.isfinite(v)}
    row["label"] = shape_label(s)
    row["bytes"] = shape_bytes(s)
    row["flops"] = shape_flops(s)
    row["roofline_us"] = roofline_us(s, ceil)
    row["metrics"] = {k: metrics(s, v, ceil) for k, v in t.items()}
    row["paths"] = {}
    for p in paths:
        m = row["metrics"].get(p, {})
        row["paths"][p] = {
            "us": t.get(p),
            "speedup_vs_triton": _ratio(t, "triton", p),
            "ratio_vs_flashmla": _ratio(t, p, "flashmla"),
            "pct_matmul": m.get("pct_matmul"),
            "pct_mma_sync": m.get("pct_mma_sync"),
            "time_vs_first_path": _ratio(t, p, paths[0]),
        }
    first = row["paths"][paths[0]]
    row["speedup_vs_triton"] = first["speedup_vs_triton"]
    row["ratio_vs_flashmla"] = first["ratio_vs_flashmla"]
    row["triton_over_flashmla"] = _ratio(t, "triton", "flashmla")
    return row


def _geomean(xs):
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _min(xs):
    xs = [x for x in xs if x is not None]
    return min(xs) if xs else None


def _max(xs):
    xs = [x for x in xs if x is not None]
    return max(xs) if xs else None


def _check(val, ok):
    return None if val is None else bool(ok(val))


def _path_summary(rows: list, p: str) -> dict:
    """Issue 3's summary for one of our entries (a kernel path, or "ours")."""
    def get(r, key):
        return r.get("paths", {}).get(p, {}).get(key)

    timed = [r for r in rows if p in r.get("metrics", {})]
    sp = [get(r, "speedup_vs_triton") for r in rows if get(r, "speedup_vs_triton")]
    fr = [get(r, "ratio_vs_flashmla") for r in rows if get(r, "ratio_vs_flashmla")]
    main = [r for r in timed if (r["shape"]["H"], r["shape"]["n"]) in MAIN_HN]
    large = [r for r in main if is_large(_shape_of(r))]
    n8 = [r for r in timed if (r["shape"]["H"], r["shape"]["n"]) == (8, 8)]
    n8_large = [r for r in n8 if is_large(_shape_of(r))]

    def pct(rs, key):
        return {r["label"]: r["metrics"][p][key] for r in rs if r["metrics"][p].get(key) is not None}

    large_mm, large_mma = pct(large, "pct_matmul"), pct(large, "pct_mma_sync")
    n8_copy, n8_large_copy = pct(n8, "pct_copy"), pct(n8_large, "pct_copy")
    s = {
        "shapes": len(rows),
        "shapes_with_ours": len(timed),
        "geomean_speedup_vs_triton": _geomean(sp),
        "min_speedup_vs_triton": _min(sp),
        "shapes_with_speedup": len(sp),
        "geomean_speedup_vs_triton_main_grid": _geomean([get(r, "speedup_vs_triton") for r in main]),
        "geomean_ratio_vs_flashmla": _geomean(fr),
        "max_ratio_vs_flashmla": _max(fr),
        "shapes_with_flashmla_ratio": len(fr),
        "geomean_triton_over_flashmla": _geomean([r.get("triton_over_flashmla") for r in rows]),
        "large_shapes": len(large),
        "large_shapes_pct_matmul": large_mm,
        "large_shapes_min_pct_matmul": _min(large_mm.values()),
        "large_shapes_pct_mma_sync": large_mma,
        "large_shapes_min_pct_mma_sync": _min(large_mma.values()),
        "n8_h8_pct_copy": n8_copy,
        "n8_h8_large_min_pct_copy": _min(n8_large_copy.values()),
        "n8_h8_min_pct_copy": _min(n8_copy.values()),
    }
    s["done_when"] = {
        "speedup_geomean_ge_10": _check(s["geomean_speedup_vs_triton"], lambda v: v >= 10),
        "speedup_min_ge_3": _check(s["min_speedup_vs_triton"], lambda v: v >= 3),
        "flashmla_ratio_le_1_6": _check(s["geomean_ratio_vs_flashmla"], lambda v: v <= 1.6),
        # B*L >= 256k on the main grid (H in {8,16}, n in {16,64}): >= 55% of the matmul ceiling
        "large_shapes_matmul_pct_ge_55": _check(s["large_shapes_min_pct_matmul"], lambda v: v >= 55),
        # the memory-bound n=8, H=8 shapes with B*L >= 256k: >= 60% of the copy ceiling
        "n8_h8_copy_pct_ge_60": _check(s["n8_h8_large_min_pct_copy"], lambda v: v >= 60),
    }
    return s


# The open issues' bars (docs/kernel/README.md, issues 25 and 26), judged on one run: (name, what,
# the bar, "<=" or ">="). Issue 25's are the portable path's (what sm_120 runs), issue 26's the Hopper
# path's; "large" is B*L >= 256k on the main grid's H x n (as in the summary above).
ISSUE_TARGETS = {
    "portable": ("issue 25", (
        ("main_geomean_vs_flashmla", "time / FlashMLA, main grid geomean", 1.4, "<="),
        ("ddtree_geomean_vs_flashmla", "time / FlashMLA, DDTree grid geomean", 1.6, "<="),
        ("max_vs_flashmla", "time / FlashMLA, worst shape of both grids", 2.0, "<="),
        ("large_min_pct_mma_sync", "large shapes, min % of the mma.sync peak", 60.0, ">="),
        ("n8_h8_large_min_pct_copy", "n = 8, H = 8 large shapes, min % of the copy ceiling", 60.0, ">="),
        ("geomean_speedup_vs_triton", "speedup vs SGLang Triton, geomean", 10.0, ">="),
        ("min_speedup_vs_triton", "speedup vs SGLang Triton, worst shape", 3.0, ">="),
    )),
    "hopper": ("issue 26", (
        ("ddtree_geomean_vs_flashmla", "time / FlashMLA, DDTree grid geomean", 1.0, "<="),
        ("ddtree_max_vs_flashmla", "time / FlashMLA, DDTree grid worst shape", 1.10, "<="),
        ("main_geomean_vs_flashmla", "time / FlashMLA, main grid geomean", 1.0, "<="),
        ("main_max_vs_flashmla", "time / FlashMLA, main grid worst shape", 1.15, "<="),
        ("large_min_pct_matmul_minus_flashmla", "large shapes, min of (our % - FlashMLA's %) of the matmul ceiling",
         -3.0, ">="),
    )),
}


def issue_targets(rows: list, p: str) -> dict:
    """Path p's issue bars on these rows: {name: {what, bar, op, value, met}} plus "issue" and
    "met" (how many of the measured bars hold, of how many were measured). A bar whose shapes were
    not run (a grid left out, FlashMLA missing) has value None and met None."""
    if p not in ISSUE_TARGETS:
        return {}
    issue, bars = ISSUE_TARGETS[p]
    ps = _path_summary(rows, p)  # its large shapes, n = 8 shapes and Triton numbers are the issues' own
    main, ddtree = _grid_summary(_rows_in_grid(rows, "main"), p), _grid_summary(_rows_in_grid(rows, "ddtree"), p)
    flashmla = {r["label"]: r.get("metrics", {}).get("flashmla", {}).get("pct_matmul") for r in rows}
    values = {
        "main_geomean_vs_flashmla": main["geomean_ratio_vs_flashmla"],
        "ddtree_geomean_vs_flashmla": ddtree["geomean_ratio_vs_flashmla"],
        "max_vs_flashmla": _max([main["max_ratio_vs_flashmla"], ddtree["max_ratio_vs_flashmla"]]),
        "main_max_vs_flashmla": main["max_ratio_vs_flashmla"],
        "ddtree_max_vs_flashmla": ddtree["max_ratio_vs_flashmla"],
        "large_min_pct_mma_sync": ps["large_shapes_min_pct_mma_sync"],
        "n8_h8_large_min_pct_copy": ps["n8_h8_large_min_pct_copy"],
        "geomean_speedup_vs_triton": ps["geomean_speedup_vs_triton"],
        "min_speedup_vs_triton": ps["min_speedup_vs_triton"],
        "large_min_pct_matmul_minus_flashmla": _min([v - flashmla[k] for k, v in ps["large_shapes_pct_matmul"].items()
                                                     if flashmla.get(k) is not None]),
    }
    out = {"issue": issue}
    for name, what, bar, op in bars:
        v = values[name]
        out[name] = {"what": what, "bar": bar, "op": op, "value": v,
                     "met": None if v is None else (v <= bar if op == "<=" else v >= bar)}
    judged = [t["met"] for k, t in out.items() if k != "issue" and t["met"] is not None]
    out["met"] = [sum(judged), len(judged)]
    return out


def format_targets(t: dict) -> str:
    """One line: the issue, each bar as value (op bar: yes/no/-), and how many hold."""
    if not t:
        return ""
    parts = [f"{v['what']} {_f(v['value'])} ({v['op']}{v['bar']:g}: "
             f"{'-' if v['met'] is None else 'yes' if v['met'] else 'no'})"
             for k, v in t.items() if k not in ("issue", "met")]
    return f"{t['issue']} targets met {t['met'][0]} of {t['met'][1]}: " + "; ".join(parts)


def _rows_in_grid(rows: list, g: str) -> list:
    """The rows whose shape belongs to the named grid."""
    members = set(_grid(g))
    return [r for r in rows if _shape_of(r) in members]


def _grid_summary(rows: list, p: str) -> dict:
    """One grid's line for one of our entries: the FlashMLA and Triton ratios and the mma.sync %."""
    def col(key, rs=rows):
        return [r.get("paths", {}).get(p, {}).get(key) for r in rs]

    large = [r for r in rows if is_large(_shape_of(r))]
    fr, sp = col("ratio_vs_flashmla"), col("speedup_vs_triton")
    return {
        "shapes_measured": sum(1 for r in rows if p in r.get("metrics", {})),
        "geomean_ratio_vs_flashmla": _geomean(fr),
        "max_ratio_vs_flashmla": _max(fr),
        "geomean_speedup_vs_triton": _geomean(sp),
        "min_speedup_vs_triton": _min(sp),
        "large_shapes_min_pct_mma_sync": _min(col("pct_mma_sync", large)),
        "max_pct_mma_sync": _max(col("pct_mma_sync")),
        "large_shapes_min_pct_matmul": _min(col("pct_matmul", large)),
    }


def emulated_pipe_summary(rows: list, p: str, factor: int) -> dict:
    """Under a --pipe-factor F library every portable mma.sync costs the tensor pipe F times: the share of
    the (slowed) pipe the kernel keeps busy is F x its % of the measured mma.sync peak. F ~2.5-3 is
    sm_120's mma.sync rate per SM-clock against the H200's (docs/kernel/portable.md)."""
    def pct(r):
        v = r.get("paths", {}).get(p, {}).get("pct_mma_sync")
        return factor * v if v is not None else None

    by_shape = {r["label"]: pct(r) for r in rows if pct(r) is not None}
    large = [pct(r) for r in rows if is_large(_shape_of(r))]
    return {"factor": factor, "path": p, "what": "F x % of the mma.sync peak: the slowed pipe's busy share",
            "pct_by_shape": by_shape, "large_shapes_min_pct": _min(large), "large_shapes_max_pct": _max(large)}


def summarize(rows: list, ceil: dict, paths=("ours",)) -> dict:
    """Per path (summary["paths"][p]) and per named grid (summary["grids"][grid][p]); the top
    level repeats the first path's numbers (the layout of single-path results)."""
    per_path = {p: _path_summary(rows, p) for p in paths}
    for p in paths:
        per_path[p]["targets"] = issue_targets(rows, p)
    s = dict(per_path[paths[0]])
    s["paths"] = per_path
    s["grids"] = {}
    for g in GRIDS:
        if g == "quick":
            continue
        rs = _rows_in_grid(rows, g)
        if rs:
            s["grids"][g] = {"shapes": len(_grid(g)), "shapes_run": len(rs), **{p: _grid_summary(rs, p) for p in paths}}
    s["path_time_ratios"] = {
        f"{p}/{paths[0]}": _geomean([r.get("paths", {}).get(p, {}).get("time_vs_first_path") for r in rows])
        for p in paths[1:]}
    s["ceilings"] = ceil
    return s


def default_out_path(date: str, gpu: str, commit: str) -> str:
    safe = "".join(c if c.isalnum() or c in "._" else "-" for c in gpu).strip("-")
    return str(ROOT / "bench" / "results" / f"{date}-{safe}-{commit}.json")


def make_document(rows, ceil, summary, argv, env, paths=("ours",)) -> dict:
    return {
        "date": env.get("date") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "time_utc": env.get("time_utc") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": env.get("commit", "unknown"),
        "gpu": env.get("gpu", "unknown"),
        "torch": env.get("torch"),
        "triton": env.get("triton"),
        "environment": env,
        "command": " ".join(shlex.quote(str(x)) for x in ["python3", *argv]),
        "paths": list(paths),
        "ceilings": ceil,
        "summary": summary,
        "rows": rows,
    }


def doc_paths(doc: dict) -> list:
    """Our entries in a result document: its "paths", or ["ours"] for single-path results."""
    return list(doc.get("paths") or ["ours"])


def _fmt(v, spec="9.1f"):
    width = int(spec.split(".")[0])
    return f"{v:{spec}}" if isinstance(v, (int, float)) and math.isfinite(v) else " " * (width - 1) + "-"


def _abbrev(paths):
    """Column prefixes: none for a single path, else the path's initial (H = hopper, P = portable)."""
    return {p: "" if len(paths) == 1 else PATH_LETTER[p] + " " for p in paths}


def table_columns(paths=("ours",)) -> list:
    """(header, format spec, getter) of the printed table, for our entries `paths`."""
    ab = _abbrev(paths)

    def t(k):
        return lambda r: r.get("times_us", {}).get(k)

    def pv(p, key):
        return lambda r: r.get("paths", {}).get(p, {}).get(key)

    def mv(p, key):
        return lambda r: r.get("metrics", {}).get(p, {}).get(key)

    cols = [(f"{p} us", "9.1f", t(p)) for p in paths]
    cols += [("triton us", "10.1f", t("triton")), ("vmla us", "9.1f", t("verify_mla")), ("fmla us", "9.1f", t("flashmla"))]
    for p in paths:
        cols += [(ab[p] + "speedup", "8.1f", pv(p, "speedup_vs_triton")), (ab[p] + "/fmla", "6.2f", pv(p, "ratio_vs_flashmla"))]
    cols += [(f"{PATH_LETTER[p]}/{PATH_LETTER[paths[0]]}", "5.2f", pv(p, "time_vs_first_path")) for p in paths[1:]]
    for p in paths:
        cols += [(ab[p] + head, spec, mv(p, key)) for head, spec, key in (
            ("TB/s", "6.2f", "tbps"), ("TFLOP/s", "8.1f", "tflops"), ("%roof", "6.1f", "pct_roofline"),
            ("%copy", "6.1f", "pct_copy"), ("%mm", "5.1f", "pct_matmul"), ("%mma", "5.1f", "pct_mma_sync"))]
    cols += [(f"err {p}", "9.1e", lambda r, p=p: r.get("check", {}).get(p)) for p in paths]
    return cols


def format_table(rows, paths=("ours",)) -> str:
    cols = []
    for head, spec, get in table_columns(paths):
        width, _, prec = spec.partition(".")
        cols.append((head, f"{max(int(width), len(head))}.{prec}", get))
    lines = [f"{'shape':<20} " + " ".join(f"{h:>{s.split('.')[0]}}" for h, s, _ in cols)]
    for r in rows:
        lines.append(f"{r.get('label', ''):<20} " + " ".join(_fmt(get(r), s) for _, s, get in cols))
    if len(paths) > 1:
        lines.append("(" + ", ".join(f"{PATH_LETTER[p]} = {p} path" for p in paths)
                     + "; " + ", ".join(f"{PATH_LETTER[p]}/{PATH_LETTER[paths[0]]} = {p} time / {paths[0]} time"
                                        for p in paths[1:]) + ")")
    return "\n".join(lines)


def _f(v, spec=".2f"):
    return "-" if v is None else format(v, spec)


def format_summary(s: dict, paths=("ours",)) -> str:
    lines = []
    for p in paths:
        ps = s.get("paths", {}).get(p, s)
        dw = ps["done_when"]
        tag = "" if len(paths) == 1 else f"[{p}] "
        lines += [
            f"{tag}shapes: {ps['shapes']} ({ps['shapes_with_ours']} with ours, {ps['shapes_with_speedup']} with Triton, "
            f"{ps['shapes_with_flashmla_ratio']} with FlashMLA)",
            f"{tag}speedup vs Triton: geomean {_f(ps['geomean_speedup_vs_triton'])}x (main grid "
            f"{_f(ps['geomean_speedup_vs_triton_main_grid'])}x), min {_f(ps['min_speedup_vs_triton'])}x   "
            f"[>=10: {dw['speedup_geomean_ge_10']}, min>=3: {dw['speedup_min_ge_3']}]",
            f"{tag}ours / FlashMLA: geomean {_f(ps['geomean_ratio_vs_flashmla'])}, max {_f(ps['max_ratio_vs_flashmla'])}   "
            f"[<=1.6: {dw['flashmla_ratio_le_1_6']}]   (Triton / FlashMLA geomean {_f(ps['geomean_triton_over_flashmla'])})",
            f"{tag}large shapes (B*L>=256k, {ps['large_shapes']}): min {_f(ps['large_shapes_min_pct_matmul'], '.1f')}% of "
            f"matmul [>=55: {dw['large_shapes_matmul_pct_ge_55']}], min {_f(ps['large_shapes_min_pct_mma_sync'], '.1f')}% "
            f"of mma.sync (large_shapes_min_pct_mma_sync)",
            f"{tag}n=8 H=8: min {_f(ps['n8_h8_large_min_pct_copy'], '.1f')}% of copy for B*L>=256k "
            f"(all n=8 shapes: min {_f(ps['n8_h8_min_pct_copy'], '.1f')}%)   [>=60: {dw['n8_h8_copy_pct_ge_60']}]",
        ]
    for g, gs in s.get("grids", {}).items():
        for p in paths:
            v = gs[p]
            tag = g if len(paths) == 1 else f"{g} [{p}]"
            lines.append(
                f"{tag} grid ({v['shapes_measured']}/{gs['shapes']} shapes): time/FlashMLA geomean "
                f"{_f(v['geomean_ratio_vs_flashmla'])} max {_f(v['max_ratio_vs_flashmla'])}; speedup vs Triton geomean "
                f"{_f(v['geomean_speedup_vs_triton'])}x min {_f(v['min_speedup_vs_triton'])}x; mma.sync % large-shape "
                f"min {_f(v['large_shapes_min_pct_mma_sync'], '.1f')} best {_f(v['max_pct_mma_sync'], '.1f')}")
    for k, v in s.get("path_time_ratios", {}).items():
        lines.append(f"time {k}: geomean {_f(v, '.3f')} (same run, same inputs)")
    for p in paths:
        t = s.get("paths", {}).get(p, s).get("targets")
        if t:
            lines.append(("" if len(paths) == 1 else f"[{p}] ") + format_targets(t))
    c = s["ceilings"]
    mma = c.get("mma_sync_tflops")
    lines.append(f"ceilings: copy {c['copy_tbps']:.2f} TB/s, matmul {c['matmul_tflops']:.0f} TFLOP/s, mma.sync "
                 + (f"{mma:.0f} TFLOP/s" if mma else f"unmeasured ({c.get('mma_sync_error', 'not run')})"))
    return "\n".join(lines)


def parse_paths(text) -> list:
    if text is None:
        return []
    paths = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in paths if p not in KERNEL_PATHS]
    if bad or not paths or len(set(paths)) != len(paths):
        raise ValueError(f"want distinct kernel paths from {', '.join(KERNEL_PATHS)}, got {text!r}")
    return paths


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="bench/bench_verify.py", description=__doc__.splitlines()[0])
    ap.add_argument("--grid", default="main",
                    help="main (issue 3's 45 shapes, default), ddtree (n 33-257, 48 shapes), customer (H 8, "
                         "n 65-257, 18 shapes), quick (6); several with commas: main,ddtree")
    ap.add_argument("--quick", action="store_true", help=f"the quick grid ({len(QUICK)} shapes)")
    ap.add_argument("--shapes", default=None, help="'B,H,n,L;...' instead of a grid (e.g. an L sweep)")
    ap.add_argument("--paths", default=None,
                    help="time these kernel paths of ours in this run, e.g. hopper,portable (default: the one "
                         "KDTREE_KERNEL selects, recorded as 'ours')")
    ap.add_argument("--skip-triton", action="store_true", help="do not time SGLang's extend_attention_fwd (slow at large shapes)")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(IMPLS)} (e.g. 'ours')")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/<date>-<gpu>-<commit>.json)")
    ap.add_argument("--no-plot", action="store_true", help="do not write the PNG (bench/plot.py can do it later)")
    ap.add_argument("--no-check", action="store_true", help="skip the per-shape float64 correctness check")
    ap.add_argument("--no-mma-peak", action="store_true", help="do not measure the mma.sync ceiling")
    ap.add_argument("--mma-peak-ms", type=float, default=50.0, help="shortest mma.sync peak launch, ms (default 50)")
    ap.add_argument("--budget-ms", type=float, default=200.0, help="timed replays per (shape, impl), in ms (default 200)")
    ap.add_argument("--max-replays", type=int, default=200)
    ap.add_argument("--min-replays", type=int, default=5)
    ap.add_argument("--max-sets", type=int, default=48, help="largest number of rotated input sets per graph")
    ap.add_argument("--sets", type=int, default=None,
                    help="exactly this many input sets (calls) per graph, e.g. 61 for the calls of one step of a "
                         "61-layer model (default: enough to defeat L2, at most --max-sets)")
    ap.add_argument("--time-limit", type=float, default=270.0, help="stop starting new shapes after this many seconds (default 270)")
    ap.add_argument("--commit", default=None, help="commit id to record (default: git, else $KDTREE_COMMIT)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slots", choices=SLOT_ORDERS, default="random",
                    help="prefix slot order in SGLang's page-size-1 cache: random (default, a fragmented pool), "
                         "contiguous (each request's rows in consecutive slots, DRAM-friendly; also what "
                         "--page-size 64 gives) or runs (shuffled runs of 1-300 consecutive slots: a pool between "
                         "the two), to separate the cost of slot order from the kernel's")
    a = ap.parse_args(argv)
    if a.quick:
        a.grid = "quick"
    if a.sets is not None and a.sets < 1:
        ap.error(f"--sets: {a.sets} < 1")
    try:
        build_grid(a.grid)
    except ValueError as e:
        ap.error(f"--grid: {e}")
    if a.shapes is not None:
        try:
            a.shapes = parse_shapes(a.shapes)  # parsed once, here: main() takes the list
        except ValueError as e:
            ap.error(f"--shapes: {e}")
    try:
        a.paths = parse_paths(a.paths)
    except ValueError as e:
        ap.error(f"--paths: {e}")
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


def ours_keys(args) -> list:
    """The times_us keys of our kernel: one per --paths entry, else "ours"."""
    return list(args.paths) if args.paths else ["ours"]


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
        from kdtree_backend.kernel import ops

        env["kernel"] = ops.selected_kernel()  # the path "ours" runs without --paths: hopper or portable
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
        from kdtree_backend.kernel import ops

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


def measure_ceilings(torch, mma_peak_ms=50.0):
    """Copy bandwidth, bf16 matmul rate and (mma_peak_ms > 0) the mma.sync peak, on this GPU."""
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
    ceil = {"copy_tbps": copy_tbps, "matmul_tflops": mm, "copy_bytes_each_way": n, "matmul_n": 8192}
    if mma_peak_ms > 0:
        ceil.update(measure_mma_sync_peak(torch, mma_peak_ms))
    else:
        ceil.update(mma_sync_tflops=None, mma_sync_error="not measured (--no-mma-peak)")
    return ceil


def mma_peak_compile_command(nvcc: str, arch: str, out) -> list:
    """nvcc for bench/diag/mma_peak.cu as a shared library for one architecture ("90", "120")."""
    return [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
            f"-gencode=arch=compute_{arch},code=sm_{arch}", str(MMA_PEAK_SOURCE), "-o", str(out)]


def mma_peak_library(capability) -> pathlib.Path:
    """bench/diag/mma_peak.cu compiled for this compute capability, cached per source digest."""
    from kdtree_backend.kernel.build import find_nvcc

    arch = f"{capability[0]}{capability[1]}"
    # The source and the header it includes (bench/diag/mma_operands.cuh) name the cached build.
    digest = hashlib.sha256(MMA_PEAK_SOURCE.read_bytes() + MMA_PEAK_HEADER.read_bytes()).hexdigest()[:12]
    out = pathlib.Path(tempfile.gettempdir()) / f"kdtree-mma-peak-{digest}-sm{arch}.so"
    if out.exists():
        return out
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (needed to build bench/diag/mma_peak.cu)")
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    r = subprocess.run(mma_peak_compile_command(nvcc, arch, tmp), capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"nvcc failed on mma_peak.cu: {(r.stdout + r.stderr)[-400:]}")
    os.replace(tmp, out)
    return out


def measure_mma_sync_peak(torch, min_ms=50.0, repeats=5) -> dict:
    """The mma.sync peak (bench/diag/mma_peak.cu) in this process: every SM busy, launches of at
    least min_ms, median of `repeats`. A failure is recorded, not raised: the run goes on."""
    try:
        lib = ctypes.CDLL(str(mma_peak_library(torch.cuda.get_device_capability(0))))
        lib.mma_peak.restype = ctypes.c_int
        lib.mma_peak.argtypes = [ctypes.c_double, ctypes.c_int, ctypes.POINTER(ctypes.c_double),
                                 ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_longlong),
                                 ctypes.POINTER(ctypes.c_int)]
        lib.mma_peak_error_string.restype = ctypes.c_char_p
        tflops, ms, iters, blocks = ctypes.c_double(), ctypes.c_double(), ctypes.c_longlong(), ctypes.c_int()
        torch.cuda.synchronize()
        rc = lib.mma_peak(float(min_ms), int(repeats), ctypes.byref(tflops), ctypes.byref(ms), ctypes.byref(iters),
                          ctypes.byref(blocks))
        if rc != 0:
            raise RuntimeError(f"mma_peak: {lib.mma_peak_error_string(rc).decode(errors='replace')}")
        return {"mma_sync_tflops": tflops.value, "mma_sync_launch_ms": ms.value, "mma_sync_iters": iters.value,
                "mma_sync_blocks": blocks.value,
                "mma_sync_instruction": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"}
    except Exception as e:  # noqa: BLE001 - the other ceilings and the grid still run
        return {"mma_sync_tflops": None, "mma_sync_error": f"{type(e).__name__}: {e}"[:500]}


_CAPTURE_STREAM = None


def capture_graph(torch, calls):
    """The calls warmed up eagerly twice (compiles, allocates workspaces) on the capture stream, then
    captured once into a CUDA graph, replayed once; one capture stream for the whole run, as in SGLang
    (the op caches its workspace per stream)."""
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
    return g


def _graph_time(torch, calls, args):
    """The K calls captured (capture_graph), then replays timed: median replay time / K, in
    microseconds."""
    g = capture_graph(torch, calls)
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
    """FlashMLA's dense-decode inputs for a uniform shape: flashmla_inputs_for with every prefix L long."""
    return flashmla_inputs_for(torch, batch, [s.L] * s.B, s.n, gen)


def flashmla_inputs_for(torch, batch, prefixes, n: int, gen):
    """FlashMLA's dense-decode inputs holding the same rows as `batch` (prefix lengths `prefixes`, n
    drafts a request): a bf16 cache of 64-token pages scattered at random ([pages, 64, 1, 576]),
    block_table [B, pages of the longest request] int32 and cache_seqlens [B] int32 = L_b + n
    (request b's token t < L_b is its prefix row kv_cache[kv_indices[kv_indptr[b] + t]], token L_b + c
    its draft row k[b*n + c]); FlashMLA's causal rule (query i sees tokens <= L_b + i) is then the
    chain mask."""
    dev = batch.q.device
    B = len(prefixes)
    seq = [int(L) + n for L in prefixes]
    per = -(-max(seq) // PAGE_FLASHMLA)
    total = B * per
    pool = total + max(8, total // 8)
    cache = torch.randn(pool, PAGE_FLASHMLA, 1, QK, generator=gen, device=dev).to(torch.bfloat16)
    block_table = torch.randperm(pool, generator=gen, device=dev)[:total].view(B, per).to(torch.int32)
    flat = cache.view(-1, QK)
    src_cache = batch.kv_cache.reshape(-1, QK)
    kv_indptr = [int(x) for x in batch.kv_indptr.tolist()]
    for b, L in enumerate(int(x) for x in prefixes):
        tok = torch.arange(L + n, device=dev)
        dst = block_table[b, tok // PAGE_FLASHMLA].long() * PAGE_FLASHMLA + tok % PAGE_FLASHMLA
        flat[dst[:L]] = src_cache[batch.kv_indices[kv_indptr[b]: kv_indptr[b] + L].long()]
        flat[dst[L:]] = batch.k.reshape(B * n, QK)[b * n: (b + 1) * n]
    seqlens = torch.tensor(seq, dtype=torch.int32, device=dev)
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


@contextlib.contextmanager
def kernel_path(path: str):
    """KDTREE_KERNEL = `path` inside the block (the op reads it at every call; a captured graph keeps
    the path it was captured with). "ours" leaves the environment as it is."""
    if path not in KERNEL_PATHS:
        yield
        return
    old = os.environ.get("KDTREE_KERNEL")
    os.environ["KDTREE_KERNEL"] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KDTREE_KERNEL", None)
        else:
            os.environ["KDTREE_KERNEL"] = old


def request0_reference(batch, n: int, chain: bool):
    """The float64 reference of request 0 alone ([n, H*512], on the batch's device): its n rows of
    q and k, its prefix and its mask block (tree), or no mask (chain). Its cost does not grow with
    B, and a score block is at most ~256 MB however large n*L gets (the reference chunks heads)."""
    from kdtree_backend.testing.reference import verify_attention_reference

    q, k, cache, qo, kvp, kvi, mask, mi, sm_scale = batch.args()
    if chain:
        mask = mi = None
    else:
        mi = mi[:2]
    return verify_attention_reference(q[:n], k[:n], cache, qo[:2], kvp[:2], kvi, mask, mi, sm_scale)


VERIFY_MLA_SKIP = (f"skipped: n > {VERIFY_MLA_MAX_N} drafts: verify_shared_kv_fwd needs more shared memory than "
                   f"the GPU has (OutOfResources, after minutes of Triton compiling)")


def input_sets(torch, prefixes, H: int, n: int, count: int, seed: int, **layout) -> list:
    """`count` rotated input sets of one batch (random tree, uint8 mask, SGLang's index dtypes), set i
    drawn with seed + i; `layout`: make_verify_batch's slot layout arguments (slot_layout_kwargs)."""
    from kdtree_backend.testing.batches import make_verify_batch

    return [make_verify_batch(
        list(prefixes), num_heads=H, draft_lens=n, mask="tree", mask_dtype=torch.uint8, qo_indptr_dtype=torch.int64,
        kv_indptr_dtype=torch.int32, prefix_mask_fill="ones", pool_factor=1.25, extra_indices=64, seed=seed + i,
        device=DEVICE, **layout) for i in range(count)]


def flashmla_calls(torch, fm, batches, inputs, H: int, n: int) -> tuple:
    """FlashMLA's calls on each input set (`inputs`: flashmla_inputs_for's), causal chains at the set's own
    softmax scale (as ours and the float64 reference use), and the list their outputs land in. The first
    call runs eagerly here (it builds the scheduler metadata outside the graph); after capture, outs[0] is
    the graph's output tensor, rewritten by each replay."""
    metas = [fm.get_mla_metadata()[0] for _ in batches]
    outs = [None] * len(batches)

    def fcall(i):
        cache, bt, sl = inputs[i]
        o, _ = fm.flash_mla_with_kvcache(batches[i].q.view(sl.numel(), n, H, QK), cache, bt, sl, DV, metas[i],
                                         softmax_scale=batches[i].sm_scale, causal=True, use_legacy=True)
        outs[i] = o

    fcall(0)
    torch.cuda.synchronize()
    return [(lambda i=i: fcall(i)) for i in range(len(batches))], outs


def ours_calls(va, batches, outs) -> list:
    """One call of our op a rotated input set, each writing its own output (the graph replays them)."""
    return [(lambda b=b, o=o: va(*b.args(), **b.kwargs(), out=o)) for b, o in zip(batches, outs)]


def run_shape(torch, s: Shape, impls, args, ceil, mods, paths=("ours",)):
    from kdtree_backend.testing import sglang_calls
    from kdtree_backend.testing.reference import relative_error

    row = {"shape": s._asdict(), "grids": grids_of(s), "times_us": {}, "timing": {}, "check": {}, "errors": {}}
    set_bytes = shape_bytes(s)
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or (60 << 20)
    k_sets = int(max(1, min(args.max_sets, math.ceil(4 * l2 / set_bytes)))) if args.sets is None else args.sets
    row["input_sets"] = k_sets
    batches = input_sets(torch, [s.L] * s.B, s.H, s.n, k_sets, args.seed * 1000003 + hash(s) % 100003,
                         **slot_layout_kwargs(args.slots))
    b0 = batches[0]
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed + 17)

    # float64 references of request 0: tree for ours/Triton, chain for the others
    ref_tree = ref_chain = None
    if not args.no_check:
        ref_tree = request0_reference(b0, s.n, chain=False)
        ref_chain = request0_reference(b0, s.n, chain=True)

    failed = mods.setdefault("_failed", {})  # (impl, H, n) -> first error: do not retry (Triton recompiles)

    def check(name, out, ref):
        o = out.reshape(b0.num_rows, -1)
        if not bool(torch.isfinite(o[: s.B * s.n]).all()):
            row["errors"][name] = "non-finite output"
        if ref is not None:
            row["check"][name] = relative_error(o[: s.n], ref)

    def record(name, calls, check_out, ref):
        if (name, s.H, s.n) in failed:
            row["errors"][name] = f"skipped: failed earlier at H={s.H} n={s.n}: {failed[(name, s.H, s.n)]}"
            return
        try:
            res = _graph_time(torch, calls, args)
            row["times_us"][name] = res["us"]
            row["timing"][name] = res
            if check_out is not None:
                check(name, check_out, ref)
        except Exception as e:  # noqa: BLE001 - one failing competitor must not stop the run
            row["errors"][name] = f"{type(e).__name__}: {str(e)[:500]}"
            failed[(name, s.H, s.n)] = row["errors"][name][:200]
            traceback.print_exc()
        finally:
            torch.cuda.synchronize()

    outs = [torch.empty(b.num_rows, s.H * DV, dtype=torch.bfloat16, device=DEVICE) for b in batches]
    if "ours" in impls:
        va = mods.get("ours")
        for p in paths:
            if va is None:
                row["errors"][p] = mods.get("ours_error", "kdtree_backend.kernel.ops unavailable")
                continue
            with kernel_path(p):
                record(p, ours_calls(va, batches, outs), outs[0], ref_tree)
    if "triton" in impls:
        if mods.get("triton_ok"):
            calls = [(lambda b=b, o=o: sglang_calls.call_sglang_triton(b, o)) for b, o in zip(batches, outs)]
            record("triton", calls, outs[0], ref_tree)
        else:
            row["errors"]["triton"] = mods.get("triton_error", "unavailable")
    if "verify_mla" in impls:
        vm = mods.get("verify_mla")
        if s.n > VERIFY_MLA_MAX_N:
            row["errors"]["verify_mla"] = VERIFY_MLA_SKIP
        elif vm is None:
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
                calls, fouts = flashmla_calls(torch, fm, batches, inputs, s.H, s.n)
                record("flashmla", calls, None, ref_chain)
                if "flashmla" in row["times_us"]:
                    check("flashmla", fouts[0], ref_chain)
                del inputs
            except Exception as e:  # noqa: BLE001
                row["errors"].setdefault("flashmla", f"{type(e).__name__}: {str(e)[:500]}")
                failed.setdefault(("flashmla", s.H, s.n), row["errors"]["flashmla"][:200])
                if "skipped:" not in str(e):
                    traceback.print_exc()
    # a check failure is an error: timings of a wrong result are not comparable
    for name, err in row["check"].items():
        if err is None or not (err < CHECK_TOL):
            row["errors"].setdefault(name, f"rel err vs float64 {err:.3e}")
    del batches, outs
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return finish_row(row, ceil, paths)


def _load_impls(impls):
    mods = {}
    if "ours" in impls:
        try:
            from kdtree_backend.kernel import ops

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


def _progress_line(i, total, row, paths) -> str:
    t = row["times_us"]
    keys = [*paths, "triton", "verify_mla", "flashmla"]
    parts = [f"[{i}/{total}] {row['label']:<18}", "  ".join(f"{k} {t[k]:.1f}" for k in keys if k in t)]
    for p in paths:
        v = row["paths"][p]
        tag = "" if len(paths) == 1 else f" {p}"
        if v["speedup_vs_triton"]:
            parts.append(f"x{v['speedup_vs_triton']:.1f}{tag}")
        if v["ratio_vs_flashmla"]:
            parts.append(f"/fmla {v['ratio_vs_flashmla']:.2f}{tag}")
    if row["errors"]:
        parts.append(f"errors {row['errors']}")
    parts.append(f"({row['seconds']:.1f}s)")
    return "  ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_verify: needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.time()
    impls = selected_impls(args)
    paths = ours_keys(args)
    commit = _commit(args.commit)
    env = _environment(torch, commit)
    out_path = args.out or default_out_path(env["date"], env["gpu"], commit)
    pathlib.Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    argv_used = [sys.argv[0]] + (list(argv) if argv is not None else sys.argv[1:])

    print(f"GPU {env['gpu']} ({env['sm_count']} SMs), torch {env['torch']}, triton {env['triton']}, "
          f"sglang {env['sglang']}, flash-mla {env['sgl-flash-mla']}, commit {commit}, ours: {', '.join(paths)}",
          flush=True)
    ceil = measure_ceilings(torch, 0.0 if args.no_mma_peak else args.mma_peak_ms)
    mma = ceil.get("mma_sync_tflops")
    print(f"ceilings: copy {ceil['copy_tbps']:.2f} TB/s, bf16 matmul {ceil['matmul_tflops']:.0f} TFLOP/s, mma.sync "
          + (f"{mma:.0f} TFLOP/s" if mma else f"unmeasured ({ceil.get('mma_sync_error')})")
          + f" ({time.time() - t_start:.0f}s)", flush=True)
    mods = _load_impls(impls)
    for k in ("ours_error", "triton_error", "verify_mla_error", "flashmla_error"):
        if k in mods:
            print(f"note: {k[:-6]} unavailable: {mods[k]}", flush=True)

    rows, skipped = [], []

    lib_info = env.get("kdtree_library")
    factor = lib_info.get("pipe_factor", 1) if isinstance(lib_info, dict) else 1  # ops.library_info()
    portable = [p for p in paths if p == "portable" or (p == "ours" and env.get("kernel") == "portable")]
    if factor > 1:
        print(f"note: a --pipe-factor {factor} diagnostics library: each portable mma.sync costs the pipe {factor}x "
              f"(times are not the release kernel's; the slowed pipe's busy share = {factor} x % of mma.sync)", flush=True)

    def write_document():
        summary = summarize(rows, ceil, paths)
        summary["skipped_for_time"] = skipped
        if factor > 1:
            summary["emulated_pipe"] = {p: emulated_pipe_summary(rows, p, factor) for p in portable}
        doc = make_document(rows, ceil, summary, argv_used, env, paths)
        doc["grid"] = "shapes" if args.shapes else args.grid
        doc["impls"] = impls
        doc["wall_s"] = time.time() - t_start
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=1)
        return summary

    grid = args.shapes if args.shapes else build_grid(args.grid)
    for i, s in enumerate(grid):
        if time.time() - t_start > args.time_limit:
            skipped.append(s._asdict())
            continue
        t0 = time.time()
        row = run_shape(torch, s, impls, args, ceil, mods, paths)
        row["seconds"] = time.time() - t0
        rows.append(row)
        print(_progress_line(i + 1, len(grid), row, paths), flush=True)
        write_document()  # after every shape: a run cut short still leaves its rows
    summary = write_document()
    print()
    print(format_table(rows, paths))
    print()
    print(format_summary(summary, paths))
    for p, em in summary.get("emulated_pipe", {}).items():
        print(f"[{p}] --pipe-factor {em['factor']} library: the slowed pipe busy {_f(em['large_shapes_min_pct'], '.1f')}-"
              f"{_f(em['large_shapes_max_pct'], '.1f')}% on the large shapes (F x % of mma.sync)")
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
