#!/usr/bin/env python3
"""How ptxas scheduled a kernel's mma loops and what each setmaxnreg role got (journal m19).

    python tools/sass_schedule.py --lib kdtree_backend/_lib/libkdtree_verify.so      # a built library
    python tools/sass_schedule.py --build                                           # build one first
    python tools/sass_schedule.py --lib LIB --function verify_ws_kernel --arch sm_120a --json out.json
    python tools/sass_schedule.py --lib LIB --function hopper_kernel --arch sm_90a   # the wgmma chains (h49)
    python tools/sass_schedule.py --lib FLASHMLA_SM90A.cubin --function ELi576E      # FlashMLA's, from its wheel

For every kernel whose mangled name contains --function (default: the warp-specialised portable
kernel) and every arch in the library's SASS (cuobjdump -sass):

  * its `setmaxnreg` regions (the code between USETMAXREG instructions, in program order): the
    value set, the highest register index the region names, and its local-memory stores / loads
    (STL / LDL: spills); a role whose highest index stays below the value it asked for did not use
    what it asked for;
  * each mma loop (a run of at least --min-hmma HMMA with fewer than 40 other instructions between
    two HMMA, inside one setmaxnreg region): how many HMMA before its use each HMMA's B operand was loaded by LDSM, as a
    histogram. A fragment loaded 2 HMMA ahead has ~2 HMMA issue slots to cover an ldmatrix's
    latency; under a busy MIO queue (m18: ~100-200 cycles) that is what a k-step then waits.
  * each wgmma chain (sm_90a: a run of HGMMA of one shape into one accumulator, journal h49): its
    commit groups and what stands between them and just before the chain: an mbarrier wait
    (`wait`, SYNCS.PHASECHK), a proxy fence (`membar`, MEMBAR), a wgmma drain (`drain`,
    WARPGROUP.DEPBAR). FlashMLA's QK^T waits between its groups and nothing else; a `membar` or
    `drain` between groups stalls the chain.

CPU only (cuobjdump from the CUDA toolkit or Triton's wheel). The SASS text is parsed by
`parse_functions`, `regions` and `ldsm_distances`, which the CPU tests run on a fixed excerpt.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_REG = re.compile(r"\bR(\d+)\b")
_ARCH = re.compile(r"^(?:arch =|code for) (sm_\w+)\s*$")  # a fat binary's header / a cubin's
_FUNC = re.compile(r"^\s*Function : (\S+)\s*$")
_GAP = 40  # other instructions allowed between two HMMA of one loop


@dataclass
class Region:
    first: int  # instruction index (within the function) where the region starts
    end: int  # one past its last instruction
    setmaxnreg: str  # the USETMAXREG that opens it ("" for the code before the first one)
    max_register: int  # highest Rn the region names (-1: none)
    spill_stores: int  # STL instructions
    spill_loads: int  # LDL instructions


@dataclass
class MmaLoop:
    first: int
    last: int
    hmma: int
    ldsm: int
    distance: dict = field(default_factory=dict)  # HMMA-ahead -> count (B operands loaded by LDSM)


@dataclass
class WgmmaChain:
    first: int
    last: int
    shape: str  # e.g. 64x64x16
    accumulator: str  # the destination's first register, e.g. R152
    wgmma: int
    groups: int  # commit groups (HGMMA ... gsb0)
    between: list = field(default_factory=list)  # per boundary between groups: the kinds found there
    before: list = field(default_factory=list)  # kinds in the _BEFORE instructions before the chain


@dataclass
class FunctionReport:
    arch: str
    name: str
    instructions: int
    regions: list
    loops: list
    chains: list = field(default_factory=list)


def parse_functions(sass: str) -> list[tuple[str, str, list[str]]]:
    """(arch, mangled name, instructions without their trailing ';') for each function in
    cuobjdump -sass output; a fat binary lists one `arch = sm_XX` header per embedded image, a cubin
    (and each image of a fat binary) a `code for sm_XX` line."""
    out: list[tuple[str, str, list[str]]] = []
    arch, name, instrs = "", None, []
    for line in sass.splitlines():
        m = _ARCH.match(line.strip())
        if m:
            if name is not None:
                out.append((arch, name, instrs))
                name, instrs = None, []
            arch = m.group(1)
            continue
        m = _FUNC.match(line)
        if m:
            if name is not None:
                out.append((arch, name, instrs))
            name, instrs = m.group(1), []
            continue
        if name is not None:
            m = _INSTR.search(line)
            if m:
                instrs.append(m.group(2))
    if name is not None:
        out.append((arch, name, instrs))
    return out


def regions(instrs: list[str]) -> list[Region]:
    """The function cut at every USETMAXREG, in program order."""
    cuts = [i for i, t in enumerate(instrs) if "USETMAXREG" in t]
    bounds = [0] + cuts + [len(instrs)]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        if a == b:
            continue
        seg = instrs[a:b]
        regs = [int(r) for t in seg for r in _REG.findall(t)]
        out.append(Region(first=a, end=b, setmaxnreg=seg[0].strip() if "USETMAXREG" in seg[0] else "",
                          max_register=max(regs) if regs else -1,
                          spill_stores=sum(1 for t in seg if re.search(r"\bSTL\b", t)),
                          spill_loads=sum(1 for t in seg if re.search(r"\bLDL\b", t))))
    return out


def _hmma_runs(instrs: list[str], min_hmma: int) -> list[tuple[int, int]]:
    idx = [i for i, t in enumerate(instrs) if "HMMA" in t]
    runs, start, prev = [], None, None
    for i in idx:
        if start is None:
            start = prev = i
        elif i - prev > _GAP:
            runs.append((start, prev))
            start = i
        prev = i
    if start is not None:
        runs.append((start, prev))
    return [(a, b) for a, b in runs if sum("HMMA" in instrs[i] for i in range(a, b + 1)) >= min_hmma]


def mma_loops(instrs: list[str], min_hmma: int, cuts: list[Region] | None = None) -> list[tuple[int, int]]:
    """(first, last) instruction indices of each mma loop: a run of at least `min_hmma` HMMA with at
    most _GAP other instructions between two, inside one setmaxnreg region (`cuts`, default
    regions(instrs)): one role's loop never runs into the next role's."""
    out = []
    for r in regions(instrs) if cuts is None else cuts:
        out += [(r.first + a, r.first + b) for a, b in _hmma_runs(instrs[r.first:r.end], min_hmma)]
    return out


def ldsm_distances(instrs: list[str], first: int, last: int, lookback: int = 200) -> collections.Counter:
    """For each HMMA in [first, last]: how many HMMA earlier the LDSM that wrote its B operand
    (the third register operand: D, A, B, C) was issued; operands not written by an LDSM seen since
    `lookback` instructions before the loop are not counted."""
    written: dict[int, int] = {}  # register -> HMMA count when an LDSM wrote it
    hmma = 0
    dist: collections.Counter = collections.Counter()
    for t in instrs[max(0, first - lookback): last + 1]:
        if "LDSM" in t:
            m = re.search(r"LDSM\S*\s+R(\d+)\s*,", t)
            if m:
                base = int(m.group(1))
                for k in range(4):
                    written[base + k] = hmma
        elif "HMMA" in t:
            ops = [int(r) for r in _REG.findall(t)]
            if len(ops) >= 3 and ops[2] in written:
                dist[hmma - written[ops[2]]] += 1
            if ops:  # its accumulator D (4 registers) may reuse a fragment's registers
                for k in range(4):
                    written.pop(ops[0] + k, None)
            hmma += 1
        else:
            m = re.match(r"(?:@!?U?P\w+\s+)?\w[\w.]*\s+R(\d+)\s*,", t)
            if m:  # another instruction overwrote the register: it no longer holds the LDSM's value
                written.pop(int(m.group(1)), None)
    return dist


_HGMMA = re.compile(r"HGMMA\.(\d+x\d+x\d+)\S*\s+(R\d+)")
_KINDS = (("wait", "SYNCS.PHASECHK"), ("membar", "MEMBAR"), ("drain", "WARPGROUP.DEPBAR"))
_BEFORE = 32  # instructions before a chain searched for what precedes it (the loop top's wait and fence)


def _kinds(seg: list[str]) -> list[str]:
    """The kinds present in `seg`; one that a predicated branch earlier in `seg` may jump over (h49's
    tile-0-only fence) is marked `(cond)`."""
    out = []
    for k, op in _KINDS:
        at = [j for j, t in enumerate(seg) if op in t]
        if at:
            # a predicated branch right after a try-wait is that wait's retry, not a skip
            cond = any(t.startswith("@") and re.search(r"\bBRA\b", t) and not (j and "SYNCS.PHASECHK" in seg[j - 1])
                       for j, t in enumerate(seg[:at[0]]))
            out.append(k + ("(cond)" if cond else ""))
    return out


def wgmma_chains(instrs: list[str], min_wgmma: int = 8) -> list[WgmmaChain]:
    """Runs of at least `min_wgmma` HGMMA of one shape into one accumulator, with at most _GAP other
    instructions (and no other HGMMA) between two; each with its commit groups (an HGMMA carrying
    gsb0 closes one) and the kinds of instruction between the groups and just before the run."""
    idx = [(i, m.group(1), m.group(2)) for i, t in enumerate(instrs) for m in [_HGMMA.search(t)] if m]
    runs, cur = [], []
    for i, shape, acc in idx:
        if cur and (shape, acc) == cur[-1][1:] and i - cur[-1][0] <= _GAP:
            cur.append((i, shape, acc))
        else:
            if cur:
                runs.append(cur)
            cur = [(i, shape, acc)]
    if cur:
        runs.append(cur)
    out = []
    for run in runs:
        if len(run) < min_wgmma:
            continue
        pos = [i for i, _, _ in run]
        ends = [i for i in pos if "gsb0" in instrs[i]]
        nexts = [(e, next((q for q in pos if q > e), None)) for e in ends]  # a group's end, the next group's start
        between = [_kinds(instrs[e + 1:q]) for e, q in nexts if q is not None]
        out.append(WgmmaChain(first=pos[0], last=pos[-1], shape=run[0][1], accumulator=run[0][2], wgmma=len(run),
                              groups=len(ends) + (0 if pos[-1] in ends else 1), between=between,
                              before=_kinds(instrs[max(0, pos[0] - _BEFORE):pos[0]])))
    return out


def report(sass: str, function: str, archs: set[str] | None, min_hmma: int) -> list[FunctionReport]:
    out = []
    for arch, name, instrs in parse_functions(sass):
        if function not in name or (archs and arch not in archs):
            continue
        loops = []
        cuts = regions(instrs)
        for a, b in mma_loops(instrs, min_hmma, cuts):
            d = ldsm_distances(instrs, a, b)  # the loop's own HMMA; the LDSMs before it are looked back at
            loops.append(MmaLoop(first=a, last=b, hmma=sum("HMMA" in instrs[i] for i in range(a, b + 1)),
                                 ldsm=sum("LDSM" in instrs[i] for i in range(a, b + 1)),
                                 distance=dict(sorted(d.items()))))
        out.append(FunctionReport(arch=arch, name=name, instructions=len(instrs), regions=cuts, loops=loops,
                                  chains=wgmma_chains(instrs)))
    return out


def _build_module():
    """This tree's kdtree_backend.kernel.build (cuobjdump's finder, the library build)."""
    sys.path.insert(0, str(REPO_ROOT))
    try:
        from kdtree_backend.kernel import build  # noqa: PLC0415
    finally:
        sys.path.pop(0)
    return build


def _summary(r: FunctionReport) -> str:
    lines = [f"{r.arch}  {r.name}  ({r.instructions} instructions)"]
    for g in r.regions:
        what = g.setmaxnreg or "(entry)"
        lines.append(f"  region [{g.first}, {g.end}) {what}: highest register R{g.max_register}, "
                     f"STL {g.spill_stores}, LDL {g.spill_loads}")
    for lp in r.loops:
        hist = ", ".join(f"{k}:{v}" for k, v in lp.distance.items())
        lines.append(f"  mma loop [{lp.first}, {lp.last}]: {lp.hmma} HMMA, {lp.ldsm} LDSM; "
                     f"B loaded n HMMA ahead (n:count) {hist}")
    for c in r.chains:
        between = " | ".join(",".join(k) or "-" for k in c.between)
        lines.append(f"  wgmma chain [{c.first}, {c.last}] {c.shape} {c.accumulator}: {c.wgmma} HGMMA in {c.groups} "
                     f"group(s); between groups: {between or 'none'}; before: {','.join(c.before) or '-'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--lib", type=Path, help="a built library (.so) or cubin")
    src.add_argument("--build", action="store_true", help="build this tree's library into a temporary file first")
    ap.add_argument("--function", default="verify_ws_kernel", help="substring of the mangled kernel name")
    ap.add_argument("--arch", default="", help="comma-separated archs as cuobjdump names them (sm_120a,sm_90a)")
    ap.add_argument("--min-hmma", type=int, default=32, help="smallest HMMA run reported as a loop")
    ap.add_argument("--json", type=Path, help="also write the report as JSON")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sass-schedule-") as tmp:
        build = _build_module()
        lib = args.lib
        if args.build:
            lib = Path(tmp) / "lib.so"
            build.build(lib)
        if not lib.is_file():
            raise SystemExit(f"sass_schedule: {lib}: no such file")
        cuobjdump = build.find_cuobjdump()
        if cuobjdump is None:
            raise SystemExit("sass_schedule: cuobjdump not found (CUDA toolkit or the triton wheel)")
        proc = subprocess.run([cuobjdump, "-sass", str(lib)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"sass_schedule: cuobjdump -sass {lib} failed: {proc.stderr.strip()[:400]}")
    archs = {a.strip() for a in args.arch.split(",") if a.strip()} or None
    reports = report(proc.stdout, args.function, archs, args.min_hmma)
    if not reports:
        raise SystemExit(f"sass_schedule: no kernel named *{args.function}* for {sorted(archs) if archs else 'any arch'} in {lib}")
    print("\n\n".join(_summary(r) for r in reports))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
