#!/usr/bin/env python3
"""Plot a bench_verify.py result: speedup vs SGLang Triton, and our time / FlashMLA time, per shape
and per kernel path of ours (side by side when the run timed several).

    python bench/plot.py bench/results/<file>.json [-o out.png]

Needs only matplotlib and the JSON (runs on a machine without a GPU).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys


def path_series(doc: dict, key: str) -> dict:
    """{path: [row value of `key` for that path]} for "speedup_vs_triton" or "ratio_vs_flashmla";
    results without "paths" (one path, named "ours") read the row-level value."""
    paths = list(doc.get("paths") or ["ours"])
    return {p: [r.get("paths", {}).get(p, {}).get(key, r.get(key) if p == paths[0] else None) for r in doc["rows"]]
            for p in paths}


def _bars(ax, series: dict, color_of):
    n = len(series)
    width = 0.8 / n
    hatches = ("", "//", "..", "xx")
    for i, (p, vals) in enumerate(series.items()):
        xs = [x - 0.4 + width * (i + 0.5) for x in range(len(vals))]
        ax.bar(xs, [v if v is not None else 0 for v in vals], width=width, color=[color_of(v) for v in vals],
               hatch=hatches[i % len(hatches)], edgecolor="k" if n > 1 else None, linewidth=0.3,
               label=p if n > 1 else None)
        for x, v in zip(xs, vals):
            if v is None:
                ax.text(x, ax.get_ylim()[0], "n/a", ha="center", va="bottom", fontsize=5, rotation=90)


def plot(json_path: str, png_path: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(pathlib.Path(json_path).read_text())
    rows = doc["rows"]
    png_path = png_path or str(pathlib.Path(json_path).with_suffix(".png"))
    labels = [r["label"] for r in rows]
    x = list(range(len(rows)))
    sp, fr = path_series(doc, "speedup_vs_triton"), path_series(doc, "ratio_vs_flashmla")
    s = doc.get("summary", {})
    first = next(iter(sp))

    def psum(p, key):
        return s.get("paths", {}).get(p, s if p == first else {}).get(key)

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(10, 0.32 * len(rows) * max(1, len(sp) * 0.7) + 3), 9), sharex=True)
    a1.set_yscale("log")
    pos = [v for vals in sp.values() for v in vals if v is not None and v > 0]
    a1.set_ylim(min([1.0] + [0.8 * v for v in pos]), max([20.0] + [1.5 * v for v in pos]))
    _bars(a1, sp, lambda v: "tab:green" if v is not None and v >= 10 else "tab:orange" if v is not None and v >= 3
          else "tab:red")
    a1.axhline(10, color="k", ls="--", lw=0.8, label="10x (geomean target)")
    a1.axhline(3, color="r", ls=":", lw=0.8, label="3x (per-shape floor)")
    a1.set_ylabel("speedup vs SGLang Triton (x)")
    def tag(p):
        return f"{p} " if len(sp) > 1 else ""

    geo = ", ".join(f"{tag(p)}{psum(p, 'geomean_speedup_vs_triton'):.1f}x" for p in sp if psum(p, "geomean_speedup_vs_triton"))
    a1.set_title("ours (tree) vs SGLang Triton extend_attention_fwd (tree)" + (f": geomean {geo}" if geo else ""))
    a1.legend(loc="upper left", fontsize=8)

    finite = [v for vals in fr.values() for v in vals if v is not None and math.isfinite(v)]
    a2.set_ylim(0, max(2.0, 1.1 * max(finite)) if finite else 2.0)
    _bars(a2, fr, lambda v: "tab:green" if v is not None and v <= 1.0 else "tab:orange" if v is not None and v <= 1.6
          else "tab:red")
    a2.axhline(1.6, color="k", ls="--", lw=0.8, label="1.6 (geomean target)")
    a2.axhline(1.0, color="gray", ls=":", lw=0.8, label="parity")
    a2.set_ylabel("our time / FlashMLA time")
    geo = ", ".join(f"{tag(p)}{psum(p, 'geomean_ratio_vs_flashmla'):.2f}" for p in fr if psum(p, "geomean_ratio_vs_flashmla"))
    a2.set_title("ours (tree) vs FlashMLA dense decode (causal chain)" + (f": geomean {geo}" if geo else ""))
    a2.legend(loc="upper left", fontsize=8)
    a2.set_xticks(x)
    a2.set_xticklabels(labels, rotation=90, fontsize=7)
    c = doc["ceilings"]
    mma = c.get("mma_sync_tflops")
    fig.suptitle(f"{doc.get('gpu', '?')}  commit {doc.get('commit', '?')}  {doc.get('date', '')}  "
                 f"(copy {c['copy_tbps']:.2f} TB/s, matmul {c['matmul_tflops']:.0f} TFLOP/s"
                 + (f", mma.sync {mma:.0f} TFLOP/s" if mma else "") + ")", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/plot.py", description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("-o", "--out", default=None, help="PNG path (default: the JSON's path with .png)")
    a = ap.parse_args(argv)
    print(plot(a.json, a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
