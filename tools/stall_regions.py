#!/usr/bin/env python3
"""Where a kernel's warps stall, by role, mma loop and synchronisation window (ncu's SASS samples).

    python tools/stall_regions.py sass-stalls-portable-32_8_64_8192.csv.gz
    python tools/stall_regions.py FILE --window refill='BAR.SYNC.DEFER_BLOCKING 0x5'..LDGDEPBAR --top 20
    python tools/stall_regions.py FILE --json out.json

FILE is what `bench/device/run.py profile PATH SHAPE` brings back (ncu --page source --csv
--print-source sass: one row an instruction, its warp-stall samples and their reasons). The report:

  * each `setmaxnreg` role (the code between USETMAXREG instructions, as tools/sass_schedule.py cuts
    it; the warp-specialised portable kernel: PV role first, then QK): samples, share of the kernel,
    the leading stall reasons;
  * each mma loop inside a role (tools/sass_schedule.py's runs of HMMA): the same;
  * each --window NAME=START..END (regular expressions on the SASS text): the samples of every
    stretch from an instruction matching START to the next one matching END, summed; the default
    windows are the portable kernel's refill (the PV stage barrier to the ids' cp.async commit) and
    its K-full waits;
  * the --top instructions by samples, each with its role, index and leading reasons;
  * hot blocks: the kernel cut into runs of --blocks instructions (default 256), those holding at least
    --min-block-share of the samples (default 2%), each with its leading reasons, how often its
    busiest instruction ran and its commonest opcodes: a map of a kernel without setmaxnreg roles
    (the Hopper kernel, journal m23), where the role cut says nothing.

A sample is one warp seen at one instruction, issued or not: a role's share is its share of the
warps' time. CPU only; `parse`, `summarise` run in the CPU tests on a fixed excerpt.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_schedule  # noqa: E402  (the same role and loop cuts as the SASS schedule report)

DEFAULT_WINDOWS = {
    # the PV warps' refill: stage barrier (named barrier 5) -> tile + 3's ids committed
    "refill": (r"BAR\.SYNC\S*\s+0x5\b", r"LDGDEPBAR"),
    # a K-full wait (mbarrier try-wait) and its retry loop
    "k_full_wait": (r"SYNCS\.PHASECHK", r"SYNCS\.PHASECHK|@!?P\d+\s+BRA"),
}


@dataclass
class Instr:
    index: int
    text: str
    samples: int
    not_issued: int
    reasons: dict  # stall reason (without "stall_") -> samples
    executed: int = 0  # ncu's "Instructions Executed" (warp-level)


@dataclass
class Block:
    name: str
    first: int
    last: int
    samples: int
    share: float  # of the kernel's samples
    reasons: list = field(default_factory=list)  # [(reason, samples)], leading first
    heaviest: str = ""


def _open(path: Path) -> str:
    data = path.read_bytes()
    return gzip.decompress(data).decode() if data[:2] == b"\x1f\x8b" else data.decode()


def parse(text: str) -> tuple[str, list[Instr]]:
    """(kernel name, instructions in address order) from ncu's source-page CSV (SASS view)."""
    lines = text.splitlines()
    kernel = ""
    start = 0
    for k, line in enumerate(lines):
        if line.startswith('"Kernel Name"'):
            kernel = next(csv.reader([line]))[1]
        if line.startswith('"Address"'):
            start = k
            break
    else:
        raise ValueError("no 'Address' header: not an ncu --page source --csv --print-source sass file")
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    reason_cols = [c for c in rows[0] if c.startswith("stall_") and not c.endswith("(Not Issued)")] if rows else []

    def num(v):
        try:
            return int(float(v))
        except (TypeError, ValueError):
            return 0

    out = []
    for r in sorted(rows, key=lambda r: int(r["Address"], 16)):
        out.append(Instr(index=len(out), text=r["Source"].strip(),
                         samples=num(r.get("Warp Stall Sampling (All Samples)")),
                         not_issued=num(r.get("Warp Stall Sampling (Not-issued Samples)")),
                         reasons={c[len("stall_"):]: num(r[c]) for c in reason_cols if num(r[c])},
                         executed=num(r.get("Instructions Executed"))))
    return kernel, out


def _block(name: str, instrs: list[Instr], first: int, last: int, total: int, n_reasons: int = 3) -> Block:
    seg = instrs[first:last + 1]
    reasons: collections.Counter = collections.Counter()
    for i in seg:
        reasons.update(i.reasons)
    samples = sum(i.samples for i in seg)
    heavy = max(seg, key=lambda i: i.samples) if seg else None
    return Block(name=name, first=first, last=last, samples=samples, share=samples / total if total else 0.0,
                 reasons=reasons.most_common(n_reasons),
                 heaviest=f"[{heavy.index}] {heavy.text} ({heavy.samples})" if heavy and heavy.samples else "")


def windows(instrs: list[Instr], start: str, end: str) -> list[tuple[int, int]]:
    """Every stretch from an instruction matching `start` to the next one (after it) matching `end`."""
    s_re, e_re = re.compile(start), re.compile(end)
    out, k = [], 0
    while k < len(instrs):
        if s_re.search(instrs[k].text):
            j = k + 1
            while j < len(instrs) and not e_re.search(instrs[j].text):
                j += 1
            if j < len(instrs):
                out.append((k, j))
                k = j
        k += 1
    return out


def opcode(text: str) -> str:
    """The SASS instruction's opcode without its predicate and modifiers ('@!P1 BRA 0x..' -> 'BRA')."""
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def hot_blocks(instrs: list[Instr], size: int, min_share: float, n_ops: int = 4) -> list[dict]:
    """The kernel in runs of `size` instructions; those with at least `min_share` of the samples."""
    total = sum(i.samples for i in instrs)
    out = []
    for first in range(0, len(instrs), size) if size > 0 else ():
        seg = instrs[first:first + size]
        b = _block(f"[{first}, {first + len(seg) - 1}]", instrs, first, first + len(seg) - 1, total)
        if not total or b.share < min_share:
            continue
        ops = collections.Counter(opcode(i.text) for i in seg if i.text)
        out.append({**asdict(b), "executed_max": max(i.executed for i in seg), "ops": ops.most_common(n_ops)})
    return out


def summarise(instrs: list[Instr], window_defs: dict, top: int = 15, min_hmma: int = 32, block_size: int = 256,
              min_block_share: float = 0.02) -> dict:
    texts = [i.text for i in instrs]
    total = sum(i.samples for i in instrs)
    cuts = sass_schedule.regions(texts)
    roles = [_block(f"role {n}: {r.setmaxnreg or 'entry'}", instrs, r.first, r.end - 1, total)
             for n, r in enumerate(cuts)]
    loops = [_block(f"mma loop [{a}, {b}]", instrs, a, b, total) for a, b in sass_schedule.mma_loops(texts, min_hmma, cuts)]
    wins = []
    for name, (start, end) in window_defs.items():
        spans = windows(instrs, start, end)
        if not spans:
            continue
        blocks = [_block(name, instrs, a, b, total) for a, b in spans]
        reasons: collections.Counter = collections.Counter()
        for b in blocks:
            reasons.update(dict(b.reasons))
        samples = sum(b.samples for b in blocks)
        wins.append({"name": name, "stretches": [[b.first, b.last, b.samples] for b in blocks], "samples": samples,
                     "share": samples / total if total else 0.0, "reasons": reasons.most_common(3)})
    region_of = {k: n for n, r in enumerate(cuts) for k in range(r.first, r.end)}
    tops = [{"index": i.index, "role": region_of.get(i.index, 0), "text": i.text, "samples": i.samples,
             "share": i.samples / total if total else 0.0,
             "reasons": collections.Counter(i.reasons).most_common(3)}
            for i in sorted(instrs, key=lambda i: -i.samples)[:top] if i.samples]
    return {"samples": total, "roles": [asdict(b) for b in roles], "loops": [asdict(b) for b in loops],
            "windows": wins, "top": tops, "blocks": hot_blocks(instrs, block_size, min_block_share)}


def _reasons(rs) -> str:
    return ", ".join(f"{r} {n}" for r, n in rs)


def render(kernel: str, s: dict) -> str:
    lines = [f"{kernel}: {s['samples']} samples"]
    for b in s["roles"]:
        lines.append(f"  {b['name']:<58} {b['samples']:>7} {100 * b['share']:5.1f}%  {_reasons(b['reasons'])}")
    for b in s["loops"]:
        lines.append(f"    {b['name']:<56} {b['samples']:>7} {100 * b['share']:5.1f}%  {_reasons(b['reasons'])}")
    for w in s["windows"]:
        lines.append(f"  window {w['name']} ({len(w['stretches'])} stretches)".ljust(62)
                     + f"{w['samples']:>7} {100 * w['share']:5.1f}%  {_reasons(w['reasons'])}")
    lines.append("  top instructions:")
    for t in s["top"]:
        lines.append(f"    [{t['index']:>5}] role {t['role']} {t['samples']:>6} {100 * t['share']:5.1f}%  "
                     f"{t['text'][:60]:<60} {_reasons(t['reasons'])}")
    if s.get("blocks"):
        lines.append("  hot blocks (instructions, samples, share, busiest instruction's executions, opcodes):")
        for b in s["blocks"]:
            ops = " ".join(f"{o} {n}" for o, n in b["ops"])
            lines.append(f"    {b['name']:<16} {b['samples']:>7} {100 * b['share']:5.1f}%  x{b['executed_max']:<9} "
                         f"{_reasons(b['reasons']):<44} {ops}")
    return "\n".join(lines)


def _window_arg(text: str) -> tuple[str, tuple[str, str]]:
    name, _, span = text.partition("=")
    start, sep, end = span.partition("..")
    if not name or not sep or not start or not end:
        raise argparse.ArgumentTypeError(f"--window {text!r}: expected NAME=START..END (regular expressions)")
    return name, (start, end)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=Path, help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    ap.add_argument("--window", type=_window_arg, action="append", default=[],
                    help="NAME=START..END: sum the samples between the two SASS patterns (replaces the defaults)")
    ap.add_argument("--top", type=int, default=15, help="instructions listed by samples (default 15)")
    ap.add_argument("--min-hmma", type=int, default=32, help="HMMA a run needs to count as an mma loop (default 32)")
    ap.add_argument("--blocks", type=int, default=256, help="instructions a hot block (default 256; 0: none)")
    ap.add_argument("--min-block-share", type=float, default=0.02,
                    help="share of the samples a block needs to be listed (default 0.02)")
    ap.add_argument("--json", type=Path, help="also write the summary as JSON")
    a = ap.parse_args(argv)
    try:
        kernel, instrs = parse(_open(a.csv))
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"stall_regions: {a.csv}: {e}")
    if a.blocks < 0 or not 0.0 <= a.min_block_share <= 1.0:
        raise SystemExit(f"stall_regions: --blocks must be >= 0 and --min-block-share within [0, 1]"
                         f" (got {a.blocks}, {a.min_block_share})")
    s = summarise(instrs, dict(a.window) or DEFAULT_WINDOWS, a.top, a.min_hmma, a.blocks, a.min_block_share)
    print(render(kernel, s))
    if a.json:
        a.json.write_text(json.dumps({"kernel": kernel, **s}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
