#!/usr/bin/env python3
"""The device driver: every GPU job of this repository in ONE command line, run from the checkout
root on the GPU machine (a copy of the tree without .git; the carried wheels in .whl/).

    python3 bench/device/run.py [--commit SHA] [--budget S] [--dry-run] STEP [ARG ...] [STEP [ARG ...]] ...

A step name starts a step and the words after it, up to the next step name, are its arguments.
`NAME:SECONDS` gives the step its own time budget. Steps:

  setup                        install .whl/*.whl into /tmp/site, build the library for this GPU
                               (`python3 -m kdtree_backend.build --check`), record GPU and library info
  tests PATHS                  GPU pytest (-m gpu tests/) once per kernel path: KDTREE_KERNEL=path, the
                               kernel tests of that path and every other GPU test
  sanitize PATHS [part=N/M]    per path: racecheck over the smoke cases (bench/diag/smoke.py --small) and
                               the sanitizer-sized consecutive-slot, part-schedule, two-piece merge,
                               extra-CTA, short-segment and one-row-tile tests, memcheck over the path's
                               sanitizer-sized kernel tests (KDTREE_TEST_SMALL=1). The racecheck of those
                               tests outgrew one call (session 35, H200: ~29 s a test on the portable
                               path, 18 tests; ~55 s a test on Hopper, whose P hand-off reports print):
                               `part=N/M` runs the N-th of M runs of their families, the smoke cases'
                               racecheck with part 1 and memcheck with part M (part=1/2, 2/2 portable;
                               1/3 .. 3/3 Hopper, a call each)
  bench GRID PATHS [OPT ...]   bench/bench_verify.py --grid GRID --paths PATHS, its --time-limit taken from
                               the step's budget; OPTs go to bench_verify.py as they are
  modes [OPT ...]              bench/bench_modes.py (--bs 8,128 unless OPTs give --bs)
  power SHAPE ... [paths=P] [seconds=S] [rounds=R]
                               bench/diag/clock_power.py: each shape's graphs of our op (paths P, default
                               hopper) and of FlashMLA replayed back to back under sustained load, with
                               nvidia-smi's SM clock, power and clock-event reasons: time, cycles and
                               clock a call against FlashMLA at the power cap (journal m46); power.json
  ragged [PATHS] [OPT ...]     bench/diag/ragged.py: ragged batches (requests of different prefix lengths)
                               on our kernel paths (default hopper,portable) against FlashMLA, float64-checked
  profile PATH SHAPE           ncu --clock-control none on one kernel path and one B,H,n,L shape:
                               sections, stall reasons, per-instruction (SASS) stall samples as CSV,
                               summed by role, mma loop, sync window and hot block (tools/stall_regions.py)
  ab NAME=LIB ... [paths=P] [shapes=S] [slots=random|contiguous|runs]
                               the smoke shapes (or S: 'B,H,n,L;...') timed with variant libraries
                               against this checkout's build: LIB is a built .so, or a directory
                               holding another checkout (built into WORK/lib_NAME.so, which later
                               calls keep while the machine stays warm); geometric-mean time ratio
                               per variant and path
  stamps PATH SHAPE ... [from=DIR]
                               per-tile stamps (bench/diag/tile_timeline.py) of the warp-specialised
                               portable kernel or the Hopper kernel: this checkout's (or DIR's, another
                               checkout) --profiler library for this GPU's arch, then one process a
                               B,H,n,L shape; each shape's table is echoed, its JSON kept in the logs
  probe NAME [ARG ...]         a standalone diagnostic, bench/diag/NAME.cu: built with nvcc for this GPU's
                               arch-specific target (sm_90a on an H100/H200), run with ARGs, its output
                               echoed; a probe that takes --json writes probe-NAME.json into $OUT.
                               Needs no setup (no wheels, no library): journal m39's call is
                               `probe mma_phase 4000 probe mma_issue probe mma_phase 4000`

PATHS is hopper, portable, hopper,portable (or both); hopper is dropped on a GPU that is not
compute capability 9.0. Any step takes `lib=FILE` (KDTREE_LIB for its commands); profile takes
`name=REGEX` (the kernel-name filter). Budgets: --budget (default 570 s) is the whole command's;
a step without its own gets its default (setup 240, tests 150 and sanitize 300 per path, modes 150,
profile 240, ab 300 s), and `bench` steps share what is left after the later steps' budgets. A
step that cannot get 20 s is skipped and reported. Builds, timings and the portable racecheck carry
measured floors (BUILD_FLOOR_S ...): a plan whose step budgets or --budget cannot hold them is refused
before anything runs (the error names the budget to give), and a step given lib=FILE that is not
there (its build failed) is skipped.

Output: under $OUT (or --out), at most 8 files: run.json (commit, command, each step's and
command's exit code, seconds and summary lines), logs.tar.gz (every log and file of the work
directory, rewritten after each step) and the result JSONs (bench-GRID.json, modes.json, ab.json, ragged.json, power.json;
bench_verify.py rewrites its JSON after every shape). Logs live in --work (default
/tmp/kdtree-device). --dry-run prints the commands without running anything (no GPU needed).
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.bench_verify import SLOT_ORDERS  # noqa: E402  (ab's slots=: smoke.py --slots takes the same; stdlib only)
KERNEL_PATHS = ("hopper", "portable", "portable-tiled")
# "both": the two paths an H200 serves by default (portable-tiled, the other GPUs' fallback, by name).
DEFAULT_PATHS = ("hopper", "portable")
# The word that names each path in the kernel tests' ids (test_kernel_gpu.py's kernel_path ids): no
# path's word is a substring of another's.
PATH_TEST_ID = {"hopper": "hopper", "portable": "portable", "portable-tiled": "tiled"}
PYTHON = "python3"
SITE = "/tmp/site"
DEFAULT_BUDGET = 570.0  # the device allows 600 s per command
MIN_STEP_S = 20.0
BENCH_TAIL_S = 60.0  # bench_verify.py: start-up before its clock, the shape in flight at the limit, the table
MAX_RESULT_FILES = 6  # + run.json + logs.tar.gz = the 8 files $OUT brings back
# Floors (H200, session 29): a command given less than these times out and the step's later commands
# run against nothing (session 29's first call lost 416 s of device time that way: four variant
# builds of 26-31 s each in an `ab:200` step). The library for three archs: 22-31 s; for this GPU's
# arch only (--profiler): 20 s; smoke timings of 11 shapes: 16-24 s a library; the warp-specialised
# portable kernel's racecheck over the slot / part / merge tests: 255-270 s (session 29; 18 tests since
# s6, ~29 s each: 12 of them in 346 s, session 35).
BUILD_FLOOR_S = 30.0
ONE_ARCH_BUILD_FLOOR_S = 20.0
SMOKE_FLOOR_S = 22.0
# the racecheck probe's build and each of its three runs: 1-2 s on the H200, the build 7 s on a loaded CI machine
PROBE_FLOOR_S = 10.0
# The schedule cache's 2 tests (m35; a tenth of their keys when small) take 60-95 s each under racecheck
# (session 37: one finished in the first 95 s, on either path), so the family adds ~180 s.
RACECHECK_SLOTS_FLOOR_S = {"portable": 700.0}  # all seven families (20 tests); a part's is its families' share
# The racecheck selection of `sanitize`: test-name families of tests/kernel/test_kernel_gpu.py (s1: the
# part schedule's walks, the merge of pieces; s3: the extra CTAs; s6: the covering parts with idle extra
# CTAs; m35: the schedule cache), in the order `part=N/M` cuts them.
RACECHECK_FAMILIES = ("consecutive_slots", "parts_span", "two_split_merge", "extra_ctas", "many_short_segments",
                      "one_row_tile", "schedule_cache")
KERNEL_NAME_RE = {"hopper": "hopper_kernel", "portable": "verify_ws_kernel", "portable-tiled": "verify_attention_kernel"}
NCU_SECTIONS = ("SpeedOfLight", "WarpStateStats", "SchedulerStats", "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis",
                "MemoryWorkloadAnalysis_Tables", "LaunchStats", "Occupancy", "SourceCounters")
# step name -> (default budget in seconds, per kernel path?); None: shares what is left (bench)
DEFAULT_BUDGETS = {"setup": (240.0, False), "tests": (150.0, True), "sanitize": (300.0, True), "bench": (None, False),
                   "modes": (150.0, False), "profile": (240.0, False), "ab": (300.0, False), "stamps": (120.0, False),
                   "ragged": (150.0, False), "probe": (120.0, False), "power": (150.0, False)}
# the kernel paths whose tile loops stamp their hand-offs (csrc/common/tile_stamps.cuh)
STAMP_PATHS = ("portable", "hopper")
STEPS = tuple(DEFAULT_BUDGETS)
TEST_SUMMARY = r"^(FAILED|ERROR)\b|\d+ (passed|failed|deselected)|no tests ran"


class UsageError(ValueError):
    pass


@dataclasses.dataclass
class Command:
    """One process of a step (or, with `call`, a piece of work done in the driver itself)."""
    label: str
    argv: list
    log: str
    share: float = 1.0  # this command's part of the step's budget
    floor_s: float = 0.0  # the least it needs on the H200 (measured); the plan is refused below the sum
    env: dict = dataclasses.field(default_factory=dict)
    echo: str = r"."  # lines of its log printed after it ends (regex)
    echo_last: int = 4
    cwd: Optional[str] = None
    fatal: bool = False  # a failure stops the whole run (setup)
    call: Optional[Callable] = None


@dataclasses.dataclass
class Step:
    name: str
    args: list
    budget: Optional[float] = None  # seconds given as NAME:SECONDS
    index: int = 0

    def option(self, key: str) -> Optional[str]:
        """A `key=value` argument (lib=..., name=..., paths=...)."""
        vals = [a.split("=", 1)[1] for a in self.args if a.startswith(key + "=")]
        return vals[-1] if vals else None

    def plain(self) -> list:
        """The arguments that are not `key=value` options of the driver."""
        return [a for a in self.args if not re.match(r"^(lib|name|paths|shapes|slots|from|part|seconds|rounds)=", a)]


# ------------------------------------------------------------------------------------------
# parsing
# ------------------------------------------------------------------------------------------
def parse_steps(words: list) -> list:
    steps = []
    for w in words:
        name, _, secs = w.partition(":")
        if name in STEPS:
            budget = None
            if secs:
                try:
                    budget = float(secs)
                except ValueError:
                    raise UsageError(f"{w!r}: the budget after ':' must be seconds") from None
            steps.append(Step(name, [], budget, len(steps)))
        elif not steps:
            raise UsageError(f"{w!r} is not a step: the command line starts with one of {', '.join(STEPS)}")
        else:
            steps[-1].args.append(w)
    if not steps:
        raise UsageError(f"no steps given: choose from {', '.join(STEPS)}")
    for s in steps:
        _check_step(s)
    outs = [result_file(s, steps) for s in steps]
    outs = [o for o in outs if o]
    if len(outs) > MAX_RESULT_FILES:
        raise UsageError(f"{len(outs)} result files ({', '.join(outs)}): $OUT brings back {MAX_RESULT_FILES} besides "
                         f"run.json and logs.tar.gz; put the grids of one path set into one bench step (main,ddtree)")
    return steps


def parse_paths(text: str) -> list:
    if text == "both":
        return list(DEFAULT_PATHS)
    paths = [p for p in text.split(",") if p]
    if not paths or any(p not in KERNEL_PATHS for p in paths) or len(set(paths)) != len(paths):
        raise UsageError(f"kernel paths {text!r}: want hopper, portable, portable-tiled, a comma list of them, or both (hopper,portable)")
    return paths


def _check_shape(step: str, shape: str) -> None:
    if not re.fullmatch(r"\d+,\d+,\d+,\d+", shape):
        raise UsageError(f"step {step}: shape {shape!r} (B,H,n,L)")


def _check_step(s: Step) -> None:
    plain = s.plain()
    need = {"tests": 1, "sanitize": 1, "bench": 2, "profile": 2, "stamps": 2, "probe": 1, "power": 1}.get(s.name, 0)
    if len(plain) < need:
        usage = {"tests": "tests PATHS", "sanitize": "sanitize PATHS", "bench": "bench GRID PATHS [OPT ...]",
                 "profile": "profile PATH SHAPE", "stamps": "stamps PATH SHAPE ... [from=DIR]",
                 "probe": "probe NAME [ARG ...]", "power": "power SHAPE ... [paths=P] [seconds=S] [rounds=R]"}[s.name]
        raise UsageError(f"step {s.name}: want `{usage}`, got {s.args}")
    if s.name == "probe" and not (re.fullmatch(r"[A-Za-z0-9_]+", plain[0]) and probe_source(plain[0]).is_file()):
        have = sorted(p.stem for p in (ROOT / "bench" / "diag").glob("*.cu"))
        raise UsageError(f"step probe: no bench/diag/{plain[0]}.cu (the probes: {', '.join(have)})")
    if s.name in ("tests", "sanitize", "bench"):
        parse_paths(plain[1] if s.name == "bench" else plain[0])
    if s.name in ("tests", "sanitize") and len(plain) > 1:
        raise UsageError(f"step {s.name}: unexpected {plain[1:]}")
    for opt in ("seconds", "rounds"):
        if s.option(opt) is not None and s.name != "power":
            raise UsageError(f"step {s.name}: {opt}= is the power step's option")
    if s.option("part") is not None:
        if s.name != "sanitize":
            raise UsageError(f"step {s.name}: part= is the sanitize step's option")
        sanitize_part(s)
    if s.name == "bench" and not re.fullmatch(r"[a-z]+(,[a-z]+)*", plain[0]):
        raise UsageError(f"step bench: grid {plain[0]!r} (main, ddtree, customer, quick, or several: main,ddtree)")
    if s.name == "profile":
        if plain[0] not in KERNEL_PATHS:
            raise UsageError(f"step profile: path {plain[0]!r} (hopper, portable or portable-tiled)")
        _check_shape("profile", plain[1])
    if s.name == "stamps":
        if plain[0] not in STAMP_PATHS:
            raise UsageError(f"step stamps: path {plain[0]!r} (portable or hopper: the kernels that stamp their tiles)")
        for shape in plain[1:]:
            _check_shape("stamps", shape)
    if s.name == "ab":
        variants = [a for a in plain if "=" in a]
        if not variants or len(variants) != len(plain):
            raise UsageError(f"step ab: want NAME=LIB|CHECKOUT_DIR ... [paths=P], got {s.args}")
        for v in variants:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", v.split("=", 1)[0]) or v.split("=", 1)[0] == "default":
                raise UsageError(f"step ab: variant name {v.split('=', 1)[0]!r} (letters, digits, . _ -; not default)")
        if s.option("paths"):
            parse_paths(s.option("paths"))
        if s.option("slots") and s.option("slots") not in SLOT_ORDERS:
            raise UsageError(f"step ab: slots={s.option('slots')} (one of {', '.join(SLOT_ORDERS)})")
    if s.name == "power":
        for shape in plain:
            _check_shape("power", shape)
        if s.option("paths"):
            parse_paths(s.option("paths"))
        for opt, kind in (("seconds", float), ("rounds", int)):
            if s.option(opt) is not None:
                try:
                    ok = kind(s.option(opt)) > 0
                except ValueError:
                    ok = False
                if not ok:
                    raise UsageError(f"step power: {opt}={s.option(opt)} (a positive number)")
    if s.name == "ragged":
        try:
            parse_paths(ragged_args(plain)[0])
        except ValueError as e:
            raise UsageError(f"step ragged: {e}") from None
    if s.name == "setup" and plain:
        raise UsageError(f"step setup takes no arguments, got {plain}")


def result_file(s: Step, steps: list) -> Optional[str]:
    """The file this step writes straight into $OUT (None: only logs)."""
    if s.name == "bench":
        base = "bench-" + s.plain()[0].replace(",", "-")
        same = [t for t in steps if t.name == "bench" and t.plain()[0] == s.plain()[0]]
        return base + (f"-{same.index(s) + 1}" if len(same) > 1 else "") + ".json"
    if s.name in ("modes", "ab", "ragged", "power"):
        same = [t for t in steps if t.name == s.name]
        return s.name + (f"-{same.index(s) + 1}" if len(same) > 1 else "") + ".json"
    if s.name == "probe" and probe_takes_json(s.plain()[0]):
        same = [t for t in steps if t.name == "probe" and t.plain()[0] == s.plain()[0]]
        return f"probe-{s.plain()[0]}" + (f"-{same.index(s) + 1}" if len(same) > 1 else "") + ".json"
    return None


def probe_source(name: str) -> Path:
    return ROOT / "bench" / "diag" / f"{name}.cu"


def probe_takes_json(name: str) -> bool:
    """Whether the probe's command line takes `--json PATH` (its source parses the flag)."""
    return '"--json"' in probe_source(name).read_text()


# ------------------------------------------------------------------------------------------
# budgets
# ------------------------------------------------------------------------------------------
def nominal_budget(s: Step) -> Optional[float]:
    if s.budget is not None:
        return s.budget
    base, per_path = DEFAULT_BUDGETS[s.name]
    if base is None:
        return None
    return base * (len(parse_paths(s.plain()[0])) if per_path else 1)


def step_budget(steps: list, i: int, remaining: float) -> float:
    """Seconds for steps[i] when `remaining` seconds are left: its own budget (at most what is
    left), or for a bench step without one an equal share of what the later steps leave."""
    own = nominal_budget(steps[i])
    if own is not None:
        return max(0.0, min(own, remaining))
    later = steps[i + 1:]
    reserved = sum(b for b in (nominal_budget(s) for s in later) if b is not None)
    sharing = 1 + sum(1 for s in later if nominal_budget(s) is None)
    return max(0.0, (remaining - reserved) / sharing)


# ------------------------------------------------------------------------------------------
# the commands of each step
# ------------------------------------------------------------------------------------------
class Context:
    def __init__(self, work: Path, out: Path, commit: str, dry_run: bool, capability: Optional[str] = None,
                 wheels: str = ".whl"):
        self.work, self.out, self.commit, self.dry_run = work, out, commit, dry_run
        self._capability = capability
        self.wheels = wheels

    def capability(self) -> str:
        if self._capability is None:
            self._capability = "9.0" if self.dry_run else _nvidia_smi("compute_cap").splitlines()[0].strip()
        return self._capability

    def paths(self, text: str) -> list:
        """The kernel paths of `text` this GPU has (hopper only on compute capability 9.0)."""
        return [p for p in parse_paths(text) if p != "hopper" or self.capability() == "9.0"]

    def base_env(self) -> dict:
        # The checkout first: a wheel set that carries the project itself (bench/e2e/prepare-wheels.sh,
        # for SGLang's entry point) must not shadow the sources under test.
        return {"PYTHONPATH": f"{ROOT}:{SITE}:{ROOT}/.whl/placeholder", "PYTHONUNBUFFERED": "1",
                "KDTREE_COMMIT": self.commit}


def _nvidia_smi(fields: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"


def _pytest(*args) -> list:
    return [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]


def commands_setup(s: Step, ctx: Context) -> list:
    wheels = sorted(glob.glob(str(ROOT / ctx.wheels / "*.whl"))) or [str(ROOT / ctx.wheels / "*.whl")]
    return [
        Command("install the carried wheels", [PYTHON, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                               "--no-compile", "--no-cache-dir", "--upgrade", "--target", SITE, *wheels],
                "setup-pip.log", share=0.3, fatal=True, echo=r"ERROR|error"),
        Command("GPU", ["nvidia-smi", "--query-gpu=name,driver_version,compute_cap,clocks.sm,clocks.max.sm,power.limit",
                        "--format=csv,noheader"], "setup-gpu.log", share=0.05),
        Command("build the library", [PYTHON, "-m", "kdtree_backend.build", "--check"], "setup-build.log", share=0.6,
                fatal=True, echo=r"built|error|warning|failed|spill", floor_s=BUILD_FLOOR_S),
        Command("doctor", [PYTHON, "-m", "kdtree_backend", "doctor"], "setup-doctor.log", share=0.05,
                echo=r"library|GPU|version|ABI|arch", echo_last=8),
    ]


def commands_tests(s: Step, ctx: Context) -> list:
    """Every GPU test once per path: the kernel tests' ids name their path (a module-scoped fixture
    runs each on both), so `-k "not <the other path>"` keeps this path's and every test that names
    no path; KDTREE_KERNEL=path sends the SGLang backend tests through it."""
    paths = ctx.paths(s.plain()[0])  # (a CPU test module that fails to import must not stop the GPU tests)
    tag = _lib_tag(s)
    return [Command(f"GPU tests, {p} path", _pytest("-m", "gpu", "--continue-on-collection-errors", "tests/", "-k",
                                                    _not_other_paths(p), f"--junitxml={ctx.work}/junit-{p}{tag}.xml"),
                    f"tests-{p}{tag}.log", share=1 / len(paths), env={"KDTREE_KERNEL": p}, echo=TEST_SUMMARY)
            for p in paths]


def _lib_tag(s: Step) -> str:
    """'-<library stem>' for a step given lib=..., else '': two tests or profile steps with different
    libraries in one call keep their own logs and reports."""
    return f"-{Path(s.option('lib')).stem}" if s.option("lib") else ""


def _not_other_paths(p: str) -> str:
    return " and ".join(f"not {PATH_TEST_ID[q]}" for q in KERNEL_PATHS if q != p)


def sanitize_part(s: Step) -> tuple:
    """(N, M) of the sanitize step's `part=N/M` ((1, 1) without it): 1 <= N <= M <= the families."""
    text = s.option("part") or "1/1"
    m = re.fullmatch(r"(\d+)/(\d+)", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)) <= len(RACECHECK_FAMILIES):
        raise UsageError(f"step sanitize: part={text!r} (N/M with 1 <= N <= M <= {len(RACECHECK_FAMILIES)})")
    return int(m.group(1)), int(m.group(2))


def racecheck_families(n: int, m: int) -> tuple:
    """The families of part n of m: consecutive runs of RACECHECK_FAMILIES, as even as whole families go."""
    k = len(RACECHECK_FAMILIES)
    return RACECHECK_FAMILIES[(n - 1) * k // m:n * k // m]


def commands_sanitize(s: Step, ctx: Context) -> list:
    out = []
    paths = ctx.paths(s.plain()[0])
    san = ["compute-sanitizer", "--print-limit", "20"]
    n, m = sanitize_part(s)
    if "hopper" in paths and n == 1:
        # issue 26: does racecheck understand the Hopper kernel's named-barrier hand-off? The protocol
        # alone, in three forms (bench/diag/racecheck_probe.cu), under racecheck; first, it takes seconds.
        probe = str(ctx.work / "racecheck_probe")
        # Floors: their shares of a 300 s step (3-6 s) sat below the 5 s under which a command is
        # skipped, so a slower nvcc build left mode 0 out (CI, session 35); each takes 1-2 s on the H200.
        out.append(Command("build the racecheck probe", ["nvcc", "-O3", "-std=c++17", "-arch=sm_90a", "-o", probe,
                                                         "bench/diag/racecheck_probe.cu"], "probe-build.log",
                           share=0.02, floor_s=PROBE_FLOOR_S))
        for mode in (0, 1, 2):
            out.append(Command(f"racecheck probe, mode {mode}", [*san, "--tool", "racecheck", probe, str(mode), "4"],
                               f"probe-racecheck-{mode}.log", share=0.01, echo=r"RACECHECK SUMMARY|RESULT",
                               floor_s=PROBE_FLOOR_S))
    families = racecheck_families(n, m)
    for p in paths:
        small = {"KDTREE_KERNEL": p, "KDTREE_TEST_SMALL": "1"}
        tests = ["tests/kernel/test_kernel_gpu.py"]
        if n == 1:
            out.append(Command(f"racecheck, smoke cases ({p})", [*san, "--tool", "racecheck", PYTHON, "bench/diag/smoke.py",
                                                                 "--small", "--no-triton"],
                               f"racecheck-{p}.log", share=0.15 / len(paths), env={"KDTREE_KERNEL": p},
                               echo=r"RACECHECK SUMMARY|smoke"))
        tag = "" if m == 1 else f"-part{n}of{m}"
        out.append(Command(f"racecheck, {' / '.join(families)} ({p})", [*san, "--tool", "racecheck", *_pytest(
            "-x", *tests, "-k", f"({' or '.join(families)}) and {PATH_TEST_ID[p]}")],
            f"racecheck-slots-{p}{tag}.log", share=0.6 / len(paths), env=small, echo=r"RACECHECK SUMMARY|passed|failed",
            floor_s=RACECHECK_SLOTS_FLOOR_S.get(p, 0.0) * len(families) / len(RACECHECK_FAMILIES)))
        if n == m:
            out.append(Command(f"memcheck ({p})", [*san, "--tool", "memcheck", *_pytest("-x", *tests, "-k", PATH_TEST_ID[p])],
                               f"memcheck-{p}.log", share=0.2 / len(paths), env=small, echo=r"ERROR SUMMARY|passed|failed"))
    return out


def commands_bench(s: Step, ctx: Context, budget: float, out_name: str) -> list:
    grid, paths, *opts = s.plain()
    run_paths = ctx.paths(paths)
    if not run_paths:
        return [_nothing(f"bench {grid}: none of {paths} runs on compute capability {ctx.capability()}")]
    limit = max(10.0, budget - BENCH_TAIL_S)
    argv = [PYTHON, "bench/bench_verify.py", "--grid", grid, "--paths", ",".join(run_paths), "--no-plot",
            "--commit", ctx.commit, "--time-limit", f"{limit:.0f}", "--out", str(ctx.out / out_name), *opts]
    return [Command(f"bench {grid} ({','.join(run_paths)})", argv, f"bench-{grid.replace(',', '-')}.log",
                    echo=r"^\[|speedup vs Triton|FlashMLA|large shapes|grid \(|^time |ceilings|skipped|JSON|^total",
                    echo_last=40)]


def _nothing(why: str) -> Command:
    return Command(f"nothing to run: {why}", [], "nothing.log", call=lambda: why)


def commands_modes(s: Step, ctx: Context, out_name: str) -> list:
    opts = s.plain()
    if not any(o == "--bs" or o.startswith("--bs=") for o in opts):
        opts = ["--bs", "8,128", *opts]
    return [Command("modes", [PYTHON, "bench/bench_modes.py", "--json", str(ctx.out / out_name), *opts], "modes.log",
                    echo=r"^(mode|stock|off|validate|on)\b|forward_extend per call", echo_last=16)]


def ragged_args(plain: list) -> tuple:
    """The ragged step's (PATHS, OPTs): its first word unless that is an option, else both paths."""
    if plain and not plain[0].startswith("-"):
        return plain[0], plain[1:]
    return "hopper,portable", plain


def commands_ragged(s: Step, ctx: Context, out_name: str) -> list:
    paths, opts = ragged_args(s.plain())
    return [Command("ragged batches vs FlashMLA", [PYTHON, "bench/diag/ragged.py", "--paths", paths, "--json",
                                                   str(ctx.out / out_name), *opts], "ragged.log",
                    echo=r"x FlashMLA|geomean|ERROR|Error", echo_last=12)]


def commands_power(s: Step, ctx: Context, out_name: str) -> list:
    opts = [f"--{o}={s.option(o)}" for o in ("paths", "seconds", "rounds") if s.option(o)]
    return [Command("clock and power at the cap", [PYTHON, "bench/diag/clock_power.py", *s.plain(), *opts, "--json",
                                                     str(ctx.out / out_name)], "power.log",
                    echo=r"/ FlashMLA|Error|error", echo_last=4)]


def commands_profile(s: Step, ctx: Context) -> list:
    path, shape = s.plain()[:2]
    tag = f"{path}-{shape.replace(',', '_')}{_lib_tag(s)}"
    rep = ctx.work / f"prof-{tag}"
    name_re = s.option("name") or KERNEL_NAME_RE[path]
    sections = [a for sec in NCU_SECTIONS for a in ("--section", sec)]
    sass = ctx.work / f"sass-stalls-{tag}.csv"
    return [
        Command(f"ncu {path} {shape}", ["ncu", "--clock-control", "none", "--kernel-name", f"regex:{name_re}",
                                        "--launch-skip", "1", "--launch-count", "1", *sections, "--import-source", "no",
                                        "-f", "-o", str(rep), PYTHON, "bench/diag/smoke.py", "--profile-shape", shape],
                f"ncu-run-{tag}.log", share=0.8, env={"KDTREE_KERNEL": path}, echo=r"==PROF==|error|Error"),
        Command("ncu report", ["ncu", "-i", f"{rep}.ncu-rep", "--print-units", "base"], f"ncu-{tag}.log", share=0.1,
                echo=r"Duration|Throughput|Warp Cycles|Issue Slots|No Eligible|Registers|Tensor|DRAM", echo_last=14),
        Command("SASS stall samples", ["sh", "-c", f"ncu -i {rep}.ncu-rep --page source --csv --print-source sass > {sass}"
                                       f" && gzip -f {sass} && echo sass csv: {sass}.gz"],
                f"sass-{tag}.log", share=0.08),
        # the samples by role, mma loop and the refill / K-full windows, echoed into the call's output
        Command("stall regions", [PYTHON, "tools/stall_regions.py", f"{sass}.gz", "--json",
                                  str(ctx.work / f"stall-regions-{tag}.json")],
                f"stall-regions-{tag}.log", share=0.02, echo=r".", echo_last=42),
    ]


def commands_probe(s: Step, ctx: Context, out_name: Optional[str]) -> list:
    name, args = s.plain()[0], s.plain()[1:]
    arch = ctx.capability().replace(".", "") + "a"  # the probes use setmaxnreg, wgmma, clusters: the `a` targets
    binary = str(ctx.work / f"probe_{name}")
    run = [binary, *args] + (["--json", str(ctx.out / out_name)] if out_name else [])
    return [Command(f"build bench/diag/{name}.cu for sm_{arch}",
                    ["nvcc", "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v",
                     str(probe_source(name)), "-o", binary], f"probe-{s.index + 1}-{name}-build.log", share=0.4,
                    floor_s=PROBE_FLOOR_S, echo=r"error|warning|[1-9]\d* bytes spill"),
            Command(f"{name} {' '.join(args)}".rstrip(), run, f"probe-{s.index + 1}-{name}.log", share=0.6,
                    floor_s=PROBE_FLOOR_S, echo=r".", echo_last=60)]


def _build_in(checkout: Path, lib: Path, label: str, log: str, share: float, *flags: str) -> Command:
    """The kernel library of another checkout (its own sources and Python package first on the path)
    built into `lib` (ab's variants, the stamps step's --profiler library)."""
    floor = ONE_ARCH_BUILD_FLOOR_S if "--arch" in flags else BUILD_FLOOR_S
    return Command(label, [PYTHON, "-m", "kdtree_backend.build", *flags, "--out", str(lib)], log, share=share,
                   cwd=str(checkout), env={"PYTHONPATH": f"{checkout}:{SITE}:{ROOT}/.whl/placeholder"},
                   echo=r"built|error", floor_s=floor)


def commands_stamps(s: Step, ctx: Context) -> list:
    path, shapes = s.plain()[0], s.plain()[1:]
    src = s.option("from")
    checkout = (Path(src) if Path(src).is_absolute() else ROOT / src) if src else ROOT
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(src).name) if src else "tree"
    lib = ctx.work / f"lib_stamps_{tag}.so"
    arch = ctx.capability().replace(".", "")
    cmds = [_build_in(checkout, lib, f"--profiler build of {src or 'this checkout'}", f"stamps-build-{tag}.log", 0.4,
                      "--profiler", "--arch", arch, "--no-ptx")]
    for shape in shapes:
        name = f"stamps-{path}-{tag}-{shape.replace(',', '_')}"
        cmds.append(Command(f"stamps {path} {shape}", [PYTHON, "bench/diag/tile_timeline.py", shape, "--json",
                                                       str(ctx.work / f"{name}.json")],
                            f"{name}.log", share=0.6 / len(shapes), env={"KDTREE_LIB": str(lib), "KDTREE_KERNEL": path},
                            echo=r".", echo_last=16))
    return cmds


def commands_ab(s: Step, ctx: Context, out_name: str) -> list:
    paths = ctx.paths(s.option("paths") or "hopper")
    smoke_args = ["--shapes", s.option("shapes")] if s.option("shapes") else []
    smoke_args += ["--slots", s.option("slots")] if s.option("slots") else []
    variants = [a.split("=", 1) for a in s.plain()]
    cmds, libs = [], {"default": None}
    for name, target in variants:
        lib = ctx.work / f"lib_{name}.so"
        if target.endswith(".so"):
            libs[name] = str(Path(target) if Path(target).is_absolute() else ROOT / target)
            continue
        checkout = Path(target) if Path(target).is_absolute() else ROOT / target
        libs[name] = str(lib)
        cmds.append(_build_in(checkout, lib, f"build {name} from {target}", f"ab-build-{name}.log", 0.45 / len(variants)))
    # A build takes 20-32 s on the H200 (the library with four warp-specialised instantiations: 32 s,
    # which 0.3 of a 150 s step did not give it in session 24), a shape list's timings 15-20 s a library.
    timing_share = 0.5 / len(libs)
    for name, lib in libs.items():
        cmds.append(Command(f"smoke timings, {name}", [PYTHON, "bench/diag/smoke.py", "--no-triton", "--configs",
                                                       ",".join(paths), "--json", str(ctx.work / f"ab-{name}.json"),
                                                       *smoke_args],
                            f"ab-{name}.log", share=timing_share, env={"KDTREE_LIB": lib} if lib else {},
                            echo=r"BAD|smoke (PASSED|FAILED)", floor_s=SMOKE_FLOOR_S))
    # Every variant's line is echoed (the default 4 dropped the first variants of a longer A/B from the
    # printout and run.json; ab.json had them all).
    cmds.append(Command("A/B summary", [], "ab-summary.log", share=0.05,
                        call=lambda: ab_summary(ctx.work, list(libs), paths, ctx.out / out_name),
                        echo_last=max(4, (len(libs) - 1) * len(paths))))
    return cmds


def ab_summary(work: Path, names: list, paths: list, out: Path) -> str:
    """Per variant and path: geometric mean over the smoke shapes of its time / the default build's."""
    def timings(name):
        return json.loads((work / f"ab-{name}.json").read_text())["timings"]

    base = timings("default")
    res, lines = {}, []
    for name in names[1:]:
        try:
            t = timings(name)
        except (OSError, ValueError, KeyError) as e:
            res[name] = {"error": f"{type(e).__name__}: {e}"}
            lines.append(f"{name}: no timings ({e})")
            continue
        res[name] = {}
        for p in paths:
            r = [a["by_config"][p] / b["by_config"][p] for a, b in zip(t, base)]
            g = math.exp(sum(map(math.log, r)) / len(r))
            res[name][p] = {"geomean_time_vs_default": g, "per_shape": r}
            lines.append(f"{name}/{p} time vs default: geomean {g:.3f} " + str([round(x, 3) for x in r]))
    out.write_text(json.dumps({"paths": paths, "variants": res, "default": base}, indent=1))
    return "\n".join(lines)


def step_commands(s: Step, steps: list, ctx: Context, budget: float) -> list:
    if s.name == "bench":
        cmds = commands_bench(s, ctx, budget, result_file(s, steps))
    elif s.name in ("modes", "ab", "ragged", "probe", "power"):
        cmds = {"modes": commands_modes, "ab": commands_ab, "ragged": commands_ragged,
                "probe": commands_probe, "power": commands_power}[s.name](s, ctx, result_file(s, steps))
    else:
        cmds = {"setup": commands_setup, "tests": commands_tests, "sanitize": commands_sanitize,
                "profile": commands_profile, "stamps": commands_stamps}[s.name](s, ctx)
    lib = s.option("lib")
    if lib:
        lib = lib if Path(lib).is_absolute() else str(ROOT / lib)
        for c in cmds:
            c.env.setdefault("KDTREE_LIB", lib)
    return cmds


def check_plan(steps: list, ctx: Context, budget: float) -> None:
    """Refuse, before any device time is spent, a plan whose steps cannot hold their commands' floors
    (Command.floor_s): each step with a budget of its own against its commands' sum, and the whole
    run against every step's."""
    total = 0.0
    for s in steps:
        own = nominal_budget(s)
        cmds = step_commands(s, steps, ctx, own if own is not None else budget)
        floors = [c for c in cmds if c.floor_s > 0]
        need = sum(c.floor_s for c in floors)
        total += need
        if own is not None and own < need:
            parts = {}
            for c in floors:
                kind = re.sub(r"^smoke timings, .*", "smoke timings", re.sub(r"^build \S+ from .*", "variant build", c.label))
                n, f = parts.get(kind, (0, c.floor_s))
                parts[kind] = (n + 1, f)
            what = ", ".join(f"{n} x {kind} ({f:.0f} s)" for kind, (n, f) in parts.items())
            raise UsageError(f"step {s.name}:{own:.0f} cannot hold its commands on the H200: {what} need "
                             f"{need:.0f} s; give it {s.name}:{math.ceil(need * 1.1 + 5)} or more")
    if total > budget:
        raise UsageError(f"the steps need at least {total:.0f} s on the H200 (their commands' floors) and "
                         f"--budget is {budget:.0f}: raise it or split the call")


def missing_library(s: Step, ctx: Context) -> Optional[str]:
    """Why a step given lib=FILE cannot run, when FILE is not there (an earlier step's build failed or
    timed out); None when it can. A dry run does not look."""
    lib = s.option("lib")
    if not lib or ctx.dry_run:
        return None
    path = Path(lib) if Path(lib).is_absolute() else ROOT / lib
    return None if path.exists() else f"lib={lib} does not exist (did the step that builds it fail?)"


# ------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------
def command_timeout(cmds: list, k: int, budget: float, step_left: float, total_left: float) -> float:
    """cmds[k]'s timeout: what is left of the step less the shares of the commands after it (time a
    command did not use goes to the next), and never past the step's or the whole run's end."""
    later = sum(max(c.share * budget, c.floor_s) for c in cmds[k + 1:] if c.call is None)
    own = max(cmds[k].share * budget, cmds[k].floor_s)
    return max(0.0, min(max(step_left - later, min(own, step_left)), step_left, total_left))


def describe(c: Command, timeout: float) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(c.env.items()))
    cwd = f"(cd {c.cwd}) " if c.cwd else ""
    what = "(driver) " + c.label if c.call else " ".join(shlex.quote(str(a)) for a in c.argv)
    return f"  {cwd}{env + ' ' if env else ''}{what}  [timeout {timeout:.0f}s, log {c.log}]"


def _echo(text: str, pattern: str, last: int) -> list:
    rx = re.compile(pattern)
    return [ln for ln in text.splitlines() if rx.search(ln)][-last:]


def run_command(c: Command, ctx: Context, timeout: float) -> dict:
    t0 = time.time()
    log = ctx.work / c.log
    if c.call is not None:
        try:
            text, rc = c.call(), 0
        except Exception as e:  # noqa: BLE001 - reported like a failed process
            text, rc = f"{type(e).__name__}: {e}", 1
        log.write_text(text + "\n")
    else:
        env = {**os.environ, **ctx.base_env(), **c.env}
        with open(log, "w") as f:
            try:
                rc = subprocess.run(c.argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=c.cwd or str(ROOT),
                                    timeout=max(1.0, timeout)).returncode
            except subprocess.TimeoutExpired:
                rc = 124
            except OSError as e:
                f.write(f"cannot start: {e}\n")
                rc = 127
        text = log.read_text(errors="replace")
    shown = _echo(text, c.echo, c.echo_last)
    res = {"label": c.label, "rc": rc, "seconds": round(time.time() - t0, 1), "log": c.log, "summary": shown}
    print(f"  {c.label}: rc={rc}{' (timed out)' if rc == 124 else ''} in {res['seconds']:.0f}s", flush=True)
    for ln in shown:
        print(f"    {ln}", flush=True)
    return res


def is_variant_library(path: Path) -> bool:
    """A library `ab` built (WORK/lib_NAME.so): kept for the next call while the machine stays warm
    (a later call's `lib=/tmp/kdtree-device/lib_NAME.so` finds it), never put in logs.tar.gz."""
    return path.name.startswith("lib_") and path.suffix == ".so"


def bundle(ctx: Context, doc: dict) -> None:
    """run.json and logs.tar.gz into $OUT (rewritten after every step: a run killed later keeps them)."""
    (ctx.work / "run.json").write_text(json.dumps(doc, indent=1))
    (ctx.out / "run.json").write_text(json.dumps(doc, indent=1))
    tmp = ctx.out / ".logs.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for p in sorted(ctx.work.iterdir()):
            if p.is_file() and not p.name.endswith(".ncu-rep") and not is_variant_library(p):
                tar.add(p, arcname=p.name)
    tmp.replace(ctx.out / "logs.tar.gz")


def run(steps: list, ctx: Context, budget: float, argv: list) -> int:
    start = time.time()
    deadline = start + budget
    doc = {"commit": ctx.commit, "command": " ".join(shlex.quote(a) for a in ["python3", "bench/device/run.py", *argv]),
           "budget_s": budget, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)), "steps": []}
    if not ctx.dry_run:
        ctx.work.mkdir(parents=True, exist_ok=True)
        for old in ctx.work.iterdir():  # an earlier call's logs on a machine kept warm
            if old.is_file() and not is_variant_library(old):
                old.unlink()
        ctx.out.mkdir(parents=True, exist_ok=True)
        doc["gpu"] = _nvidia_smi("name,driver_version,compute_cap,clocks.max.sm,power.limit")
    files = [f for f in (result_file(s, steps) for s in steps) if f] + ["run.json", "logs.tar.gz"]
    print(f"budget {budget:.0f}s, commit {ctx.commit}, back in {ctx.out}: {', '.join(files)}"
          + ("\n(dry run: nothing runs; each command's timeout is shown as if the ones before it took no time)"
             if ctx.dry_run else ""), flush=True)
    worst, stop = 0, False
    for i, s in enumerate(steps):
        remaining = deadline - time.time()
        b = step_budget(steps, i, remaining)
        label = " ".join([s.name, *s.args])
        rec = {"step": label, "budget_s": round(b), "commands": []}
        doc["steps"].append(rec)
        missing = missing_library(s, ctx)
        if stop or b < MIN_STEP_S or missing:
            rec["skipped"] = ("an earlier step failed fatally" if stop else missing
                              or f"no time left ({remaining:.0f}s)")
            print(f"[{i + 1}/{len(steps)}] {label}: skipped ({rec['skipped']})", flush=True)
            continue
        print(f"[{i + 1}/{len(steps)}] {label} (budget {b:.0f}s)", flush=True)
        cmds = step_commands(s, steps, ctx, b)
        step_end = time.time() + b
        for k, c in enumerate(cmds):
            timeout = command_timeout(cmds, k, b, step_end - time.time(), deadline - time.time())
            if ctx.dry_run:
                print(describe(c, timeout), flush=True)
                continue
            if timeout < 5:
                rec["commands"].append({"label": c.label, "skipped": "no time left in the step"})
                print(f"  {c.label}: skipped (no time left in the step)", flush=True)
                continue
            res = run_command(c, ctx, timeout)
            rec["commands"].append(res)
            if res["rc"] != 0:
                worst = worst or res["rc"]
                if c.fatal:
                    stop = True
                    break
        rec["seconds"] = round(time.time() - (step_end - b), 1)
        if not ctx.dry_run:
            bundle(ctx, doc)
    doc["wall_s"] = round(time.time() - start, 1)
    if not ctx.dry_run:
        bundle(ctx, doc)
    print(f"total {doc['wall_s']:.0f}s; exit codes in run.json", flush=True)
    return 1 if worst else 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="bench/device/run.py", allow_abbrev=False, description=__doc__.splitlines()[0],
                                 usage="%(prog)s [options] STEP [ARG ...] [STEP [ARG ...]] ...",
                                 epilog="Steps: " + ", ".join(STEPS) + " (see the module docstring)")
    ap.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT", "nogit"),
                    help="commit recorded in the results (default $KDTREE_COMMIT; the device copy has no .git)")
    ap.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help=f"seconds for everything (default {DEFAULT_BUDGET:.0f})")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="where results come back (default $OUT)")
    ap.add_argument("--work", default="/tmp/kdtree-device", help="logs and scratch files")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--capability", default=None, help="GPU compute capability to assume (default: nvidia-smi; 9.0 in a dry run)")
    ap.add_argument("--wheels", default=".whl", help="the carried wheel folder setup installs (default .whl; "
                    "bench/e2e/prepare-wheels.sh makes .whl-e2e, which also runs a real SGLang server)")
    # the driver's options come before the first step; everything after belongs to the steps
    first = next((i for i, w in enumerate(argv) if w.partition(":")[0] in STEPS), len(argv))
    opts, stray = ap.parse_known_args(argv[:first])
    try:
        if stray:
            raise UsageError(f"{stray[0]!r} is neither an option of the driver nor a step ({', '.join(STEPS)})")
        steps = parse_steps(argv[first:])
    except UsageError as e:
        ap.error(str(e))
    if not opts.out and not opts.dry_run:
        ap.error("no $OUT: give --out DIR")
    ctx = Context(Path(opts.work), Path(opts.out or "/tmp/out"), opts.commit, opts.dry_run, opts.capability,
                  opts.wheels)
    try:
        check_plan(steps, ctx, opts.budget)
    except UsageError as e:
        ap.error(str(e))
    return run(steps, ctx, opts.budget, argv)


if __name__ == "__main__":
    sys.exit(main())
