#!/usr/bin/env python3
"""Plot a bench_verify.py result: speedup vs SGLang Triton, and our time / FlashMLA time, per shape.

    python bench/plot.py bench/results/<file>.json [-o out.png]

Needs only matplotlib and the JSON (runs on a machine without a GPU).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys


def plot(json_path: str, png_path: str | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(pathlib.Path(json_path).read_text())
    rows = doc["rows"]
    png_path = png_path or str(pathlib.Path(json_path).with_suffix(".png"))
    labels = [r["label"] for r in rows]
    x = list(range(len(rows)))
    sp = [r.get("speedup_vs_triton") for r in rows]
    fr = [r.get("ratio_vs_flashmla") for r in rows]
    s = doc.get("summary", {})

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(max(10, 0.32 * len(rows) + 3), 9), sharex=True)
    colors = ["tab:green" if v is not None and v >= 10 else "tab:orange" if v is not None and v >= 3 else "tab:red"
              for v in sp]
    a1.bar(x, [v if v is not None else 0 for v in sp], color=colors)
    a1.set_yscale("log")
    pos = [v for v in sp if v is not None and v > 0]
    a1.set_ylim(min([1.0] + [0.8 * v for v in pos]), max([20.0] + [1.5 * v for v in pos]))
    a1.axhline(10, color="k", ls="--", lw=0.8, label="10x (geomean target)")
    a1.axhline(3, color="r", ls=":", lw=0.8, label="3x (per-shape floor)")
    g = s.get("geomean_speedup_vs_triton")
    a1.set_ylabel("speedup vs SGLang Triton (x)")
    a1.set_title(f"ours (tree) vs SGLang Triton extend_attention_fwd (tree)"
                 + (f": geomean {g:.1f}x" if g else ""))
    a1.legend(loc="upper left", fontsize=8)
    for xi, v in zip(x, sp):
        if v is None:
            a1.text(xi, 1, "n/a", ha="center", va="bottom", fontsize=6, rotation=90)

    colors = ["tab:green" if v is not None and v <= 1.0 else "tab:orange" if v is not None and v <= 1.6 else "tab:red"
              for v in fr]
    a2.bar(x, [v if v is not None else 0 for v in fr], color=colors)
    a2.axhline(1.6, color="k", ls="--", lw=0.8, label="1.6 (geomean target)")
    a2.axhline(1.0, color="gray", ls=":", lw=0.8, label="parity")
    gf = s.get("geomean_ratio_vs_flashmla")
    a2.set_ylabel("our time / FlashMLA time")
    a2.set_title("ours (tree) vs FlashMLA dense decode (causal chain)" + (f": geomean {gf:.2f}" if gf else ""))
    a2.legend(loc="upper left", fontsize=8)
    finite = [v for v in fr if v is not None and math.isfinite(v)]
    if finite:
        a2.set_ylim(0, max(2.0, 1.1 * max(finite)))
    for xi, v in zip(x, fr):
        if v is None:
            a2.text(xi, 0.02, "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
    a2.set_xticks(x)
    a2.set_xticklabels(labels, rotation=90, fontsize=7)
    fig.suptitle(f"{doc.get('gpu', '?')}  commit {doc.get('commit', '?')}  {doc.get('date', '')}  "
                 f"(copy {doc['ceilings']['copy_tbps']:.2f} TB/s, matmul {doc['ceilings']['matmul_tflops']:.0f} TFLOP/s)",
                 fontsize=10)
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
