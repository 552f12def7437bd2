"""Build the kernel library (`libkdtree_verify.so`) with nvcc, and check what was built.

    python -m kdtree_backend.build                 # sm_90, sm_100, sm_120 + compute_120 PTX into kdtree_backend/_lib/
    python -m kdtree_backend.build --arch 90       # only what this H100/H200 needs (+ compute_90 PTX)
    python -m kdtree_backend.build --no-ptx        # machine code only (no JIT fallback for newer GPUs)
    python -m kdtree_backend.build --check         # also fail on spills / missing archs
    python -m kdtree_backend.build --profiler      # diagnostics: milestone stamps (bench/diag/timeline.py)
    python -m kdtree_backend.build --pipe-factor 3 # diagnostics: the portable kernels on an sm_120-like tensor pipe

The build is a plain nvcc command (no CMake, no torch extension): the library is loaded with
ctypes, links the CUDA runtime statically and exports a C ABI (csrc/kdtree_api.h), so one .so
works for any torch build on the machine. The compiler's resource report is parsed so that CI can
refuse register spills and shared memory over sm_120's limit without a GPU.

Besides machine code (SASS) for each arch, the library embeds the portable kernels' PTX for the
newest arch built: a GPU newer than every SASS arch (compute capability >= that arch, e.g. 12.1 is
covered by sm_120 SASS, a 13.x GPU by the PTX only) gets them JIT-compiled by the CUDA driver on
first use. The library reports both (kdtree_built_archs, kdtree_ptx_arch), so the loader and
doctor name what each GPU will run.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kdtree_backend.kernel import abi

KERNEL_DIR = Path(__file__).resolve().parent
PACKAGE_DIR = KERNEL_DIR.parent
CSRC_DIR = KERNEL_DIR / "csrc"
DEFAULT_OUTPUT = PACKAGE_DIR / "_lib" / abi.LIB_FILENAME
DEFAULT_ARCHS = (90, 100, 120)
# Spills fail the build check here: sm_120 (the first customer's GPU, RTX PRO 6000) and sm_100
# (B200: issue 25 asks the same checks of it). sm_90 runs the Hopper kernel by default.
STRICT_SPILL_ARCHS = (100, 120)
# The compute capabilities the kernels are written for (x10). Anything else fails at once, naming these,
# instead of as hundreds of ptxas errors (the kernels need sm_90+ instructions and their shared memory).
SUPPORTED_ARCHS = (90, 100, 120)
PROFILER_FLAGS = ("-DKDTREE_PROFILER",)
# The diagnostics build of journal m27: every portable mma.sync costs the tensor pipe F times its time
# (exact results; csrc/portable/mma.cuh), the regime of sm_120's slower mma.sync, measured on the H200.
MAX_PIPE_FACTOR = 8


def pipe_factor_flags(factor: int) -> tuple[str, ...]:
    """The nvcc flags of a --pipe-factor build (none for 1, the release form); BuildError otherwise."""
    if isinstance(factor, bool) or not isinstance(factor, int) or not 1 <= factor <= MAX_PIPE_FACTOR:
        raise BuildError(f"pipe factor {factor!r}: an integer from 1 (release) to {MAX_PIPE_FACTOR}")
    return () if factor == 1 else (f"-DKDTREE_PIPE_FACTOR={factor}",)


def diagnostics_suffix(extra: tuple[str, ...]) -> str:
    """What the library's version string adds for a diagnostics build, so doctor and the start-up line
    show it: "+profiler", "+pipeF"; empty for a release build."""
    out = ""
    if "-DKDTREE_PROFILER" in extra:
        out += "+profiler"
    for f in extra:
        m = re.fullmatch(r"-DKDTREE_PIPE_FACTOR=(\d+)", f)
        if m:
            out += f"+pipe{m.group(1)}"
    return out


class BuildError(RuntimeError):
    pass


def check_archs(archs) -> tuple[int, ...]:
    """The requested archs as ints; BuildError naming the supported ones for anything else."""
    try:
        out = tuple(int(a) for a in archs)
    except (TypeError, ValueError):
        raise BuildError(f"archs {archs!r} are not compute capabilities x10 (e.g. 90, 120)") from None
    bad = [a for a in out if a not in SUPPORTED_ARCHS]
    if bad or not out:
        raise BuildError(f"unsupported arch {', '.join(map(str, bad)) or '(none)'}: the kernels build for "
                         f"{', '.join(str(a) for a in SUPPORTED_ARCHS)} (sm_90 also builds the sm_90a Hopper kernel)")
    return out


@dataclasses.dataclass
class KernelResources:
    arch: int
    kernel: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int


@dataclasses.dataclass
class BuildReport:
    path: Path
    archs: tuple[int, ...]
    command: list[str]
    resources: list[KernelResources]
    ptxas_log: str
    ptx_arch: int = 0  # the arch whose PTX the library embeds (0: none)

    def spills(self, archs=None) -> list[str]:
        """Kernels with spills or a stack frame (on `archs`, default all)."""
        out = []
        for r in self.resources:
            if archs is not None and r.arch not in archs:
                continue
            if r.spill_stores or r.spill_loads or r.stack_bytes:
                out.append(
                    f"sm_{r.arch} {r.kernel}: {r.registers} registers, {r.spill_stores} B spill stores, "
                    f"{r.spill_loads} B spill loads, {r.stack_bytes} B stack"
                )
        return out

    def problems(self) -> list[str]:
        """What CI refuses: any spill on sm_120 (the first customer's GPU) or sm_100, and a setmaxnreg
        that ptxas dropped.

        Other archs' spills are reported as warnings (the portable configuration spills 8 B on
        sm_90 and is still faster there than the spill-free 16-key variant: docs/kernel/journal.md).
        """
        strict = self.spills(archs=STRICT_SPILL_ARCHS)
        # The Hopper kernel (sm_90a) keeps O and S in registers by design: a spill there is a bug.
        strict += [s for s in self.spills(archs=(90,)) if "hopper" in s.split(":")[0] and s not in strict]
        # ptxas may drop a kernel's setmaxnreg and say so only as "info" (C7506: a bulk copy to a
        # shared::cluster address on sm_120a, journal p24; C7507: a budget below what shared code
        # needs, h18; C7508: no known register count at entry, NVIDIA/cutlass#3406): the register
        # split the kernel was designed around is then gone.
        strict += [f"ptxas ignored setmaxnreg: {line.strip()}" for line in self.ptxas_log.splitlines()
                   if any(code in line for code in ("C7506", "C7507", "C7508", "'setmaxnreg' ignored"))]
        # The warp-specialised kernel's setmaxnreg plan redistributes exactly its launch registers: launched
        # at another count, a warp's setmaxnreg.inc waits for registers nobody releases (a hang, not an
        # error). The device probe refuses such a binary too (portable/launch_ws.cu).
        want = ws_launch_registers()
        strict += [f"sm_{r.arch}a {r.kernel}: launched at {r.registers} registers a thread; its setmaxnreg plan "
                   f"needs {want} (WsConfig::kLaunchRegs), or setmaxnreg.inc would wait forever"
                   for r in self.resources if "verify_ws_kernel" in r.kernel and r.registers != want]
        return strict

    def warnings(self) -> list[str]:
        refused = self.problems()  # once: it reads kernel_ws.cuh for the launch-register plan
        return [w for w in self.spills() if w not in refused]


def ws_launch_registers() -> int:
    """WsConfig::kLaunchRegs of the warp-specialised kernel, read from its source (one number, one place)."""
    m = re.search(r"static constexpr int kLaunchRegs = (\d+);", PORTABLE_WS_KERNEL.read_text())
    if m is None:
        raise BuildError(f"{PORTABLE_WS_KERNEL}: no `static constexpr int kLaunchRegs = N;` (the setmaxnreg plan)")
    return int(m.group(1))


def find_nvcc() -> str | None:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def find_cuobjdump() -> str | None:
    """cuobjdump from the CUDA toolkit, or the copy Triton's wheel carries."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = find_nvcc()
    if nvcc:
        cand = Path(nvcc).resolve().parent / "cuobjdump"
        if cand.is_file():
            return str(cand)
    try:
        import triton  # noqa: PLC0415

        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if cand.is_file():
            return str(cand)
    except Exception:
        pass
    return None


def source_files() -> list[Path]:
    """Every CUDA/C++ source under csrc/ (common/, portable/, hopper/, combine/ and the C API)."""
    return sorted(p for p in CSRC_DIR.rglob("*") if p.is_file() and p.suffix in (".cu", ".cuh", ".h"))


def source_digest() -> str:
    h = hashlib.sha256()
    for p in source_files():
        h.update(p.relative_to(CSRC_DIR).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def _package_version() -> str:
    try:
        from importlib.metadata import version  # noqa: PLC0415

        return version("kdtree-backend")
    except Exception:
        return "0.0.0"


# The translation units: the C API (host code only), the portable tiled kernels (built for every arch
# of the library, with PTX), the portable warp-specialised kernel (its own object, the arch-specific
# target of every arch built, no PTX: portable/launch.h) and the Hopper kernel (its own object, sm_90a
# only).
API_SOURCE = CSRC_DIR / "kdtree_api.cu"
PORTABLE_SOURCE = CSRC_DIR / "portable" / "launch.cu"
PORTABLE_WS_SOURCE = CSRC_DIR / "portable" / "launch_ws.cu"
PORTABLE_WS_KERNEL = CSRC_DIR / "portable" / "kernel_ws.cuh"
HOPPER_SOURCE = CSRC_DIR / "hopper" / "launch.cu"
HOPPER_GENCODE = "-gencode=arch=compute_90a,code=sm_90a"


def with_hopper(archs: tuple[int, ...]) -> bool:
    """The Hopper (wgmma) kernel is built whenever sm_90 is: H100/H200 select it at run time."""
    return 90 in archs


def _common_flags() -> list[str]:
    """Flags of every nvcc call: the library link and the object compiles alike."""
    return ["-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden", "-lineinfo", "-Xptxas", "-v"]


def ptx_arch_for(archs: tuple[int, ...], ptx: bool = True) -> int:
    """The arch whose PTX the library embeds: the newest one built (PTX JIT-compiles for that compute
    capability and every later one), or 0 without PTX."""
    return max(archs) if ptx else 0


def api_object_command(nvcc: str, out_obj: Path, archs: tuple[int, ...], hopper: bool,
                       extra: tuple[str, ...] = (), ptx_arch: int = 0) -> list[str]:
    """Compile the C API as host C++ (`-x c++`: it holds no device code, so it adds no device image),
    with the archs, the PTX arch and the version it reports, and the Hopper dispatch when that kernel
    is built."""
    lib_version = f"{_package_version()}+src.{source_digest()}{diagnostics_suffix(tuple(extra))}"
    return [
        nvcc,
        "-x",
        "c++",
        *_common_flags(),
        f'-DKDTREE_BUILT_ARCHS="{",".join(str(a) for a in archs)}"',
        f"-DKDTREE_PTX_ARCH={ptx_arch}",
        f'-DKDTREE_LIBRARY_VERSION="{lib_version}"',
        *(["-DKDTREE_WITH_HOPPER"] if hopper else []),
        *extra,
        "-c",
        "-o",
        str(out_obj),
        str(API_SOURCE),
    ]


def hopper_object_command(nvcc: str, out_obj: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """Compile the Hopper translation unit for sm_90a only (wgmma exists on no other target)."""
    return [nvcc, *_common_flags(), HOPPER_GENCODE, *extra, "-c", "-o", str(out_obj), str(HOPPER_SOURCE)]


def portable_ws_object_command(nvcc: str, out_obj: Path, archs: tuple[int, ...],
                               extra: tuple[str, ...] = ()) -> list[str]:
    """Compile the warp-specialised portable kernel for the arch-specific target of each arch
    (sm_90a, sm_100a, sm_120a: setmaxnreg exists on no other), without PTX: a GPU of another compute
    capability finds no image of it and runs the tiled kernel."""
    gencodes = [f"-gencode=arch=compute_{a}a,code=sm_{a}a" for a in archs]
    return [nvcc, *_common_flags(), *gencodes, *extra, "-c", "-o", str(out_obj), str(PORTABLE_WS_SOURCE)]


def nvcc_command(nvcc: str, out: Path, archs: tuple[int, ...], extra: tuple[str, ...] = (),
                 objects: tuple[Path, ...] = (), ptx_arch: int = 0) -> list[str]:
    """The library: the portable kernels' translation unit for every arch (SASS) and, with
    `ptx_arch`, that arch's PTX, linked with `objects` (the C API's, the warp-specialised portable
    kernel's, the Hopper kernel's)."""
    gencodes = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    if ptx_arch:
        gencodes.append(f"-gencode=arch=compute_{ptx_arch},code=compute_{ptx_arch}")
    return [
        nvcc,
        *_common_flags(),
        "-shared",
        "-cudart",
        "static",
        *gencodes,
        *extra,
        "-o",
        str(out),
        str(PORTABLE_SOURCE),
        *(str(o) for o in objects),
    ]


_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)' for 'sm_(?P<arch>\d+)a?'")
_SPILL = re.compile(r"(?P<stack>\d+) bytes stack frame, (?P<st>\d+) bytes spill stores, (?P<ld>\d+) bytes spill loads")
_REGS = re.compile(r"Used (?P<regs>\d+) registers")


def parse_ptxas(log: str) -> list[KernelResources]:
    out: list[KernelResources] = []
    cur = None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            cur = KernelResources(int(m["arch"]), m["name"], 0, 0, 0, 0)
            out.append(cur)
            continue
        if cur is None:
            continue
        m = _SPILL.search(line)
        if m:
            cur.stack_bytes, cur.spill_stores, cur.spill_loads = int(m["stack"]), int(m["st"]), int(m["ld"])
        m = _REGS.search(line)
        if m:
            cur.registers = int(m["regs"])
    return out


def build_library(out: Path | str | None = None, archs=None, *, extra_flags=(), verbose: bool = False,
                  check: bool = False, profiler: bool = False, ptx: bool = True, pipe_factor: int = 1) -> Path:
    """Compile the library; returns its path. Raises BuildError with nvcc's output on failure."""
    return build(out, archs, extra_flags=extra_flags, verbose=verbose, check=check, profiler=profiler, ptx=ptx,
                 pipe_factor=pipe_factor).path


def build(out: Path | str | None = None, archs=None, *, extra_flags=(), verbose: bool = False,
          check: bool = False, profiler: bool = False, ptx: bool = True, pipe_factor: int = 1) -> BuildReport:
    """Compile the library for `archs` (default 90, 100, 120) with the newest one's PTX (`ptx`:
    ptx_arch_for). `profiler`: the diagnostics build, whose
    Hopper kernel stamps its milestones and which exports kdtree_timeline_copy (csrc/common/profiler.cuh,
    bench/diag/timeline.py); never ship it. `pipe_factor` F > 1: the diagnostics build whose portable
    mma.sync each cost the tensor pipe F times (journal m27; never ship it). `extra_flags` go to every
    nvcc call."""
    archs = check_archs(archs or DEFAULT_ARCHS)
    ptx_arch = ptx_arch_for(archs, ptx)
    diagnostics = (PROFILER_FLAGS if profiler else ()) + pipe_factor_flags(pipe_factor)  # refused before nvcc
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found: install the CUDA toolkit (13.0 is tested) or set NVCC=/path/to/nvcc")
    extra_flags = tuple(extra_flags) + diagnostics
    out = Path(out) if out is not None else DEFAULT_OUTPUT
    out.parent.mkdir(parents=True, exist_ok=True)
    # Compile next to the target, then rename: a process loading the old library never sees a
    # half-written file.
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out.parent)
    os.close(fd)
    log = ""
    with tempfile.TemporaryDirectory(prefix="kdtree-build-") as objdir:
        hopper = with_hopper(archs)
        objects = [Path(objdir) / "kdtree_api.o"]
        compiles = [api_object_command(nvcc, objects[0], archs, hopper, tuple(extra_flags), ptx_arch)]
        objects.append(Path(objdir) / "portable_launch_ws.o")
        compiles.append(portable_ws_object_command(nvcc, objects[-1], archs, tuple(extra_flags)))
        if hopper:
            objects.append(Path(objdir) / "hopper_launch.o")
            compiles.append(hopper_object_command(nvcc, objects[-1], tuple(extra_flags)))
        # The objects compile side by side (each nvcc is one process, mostly ptxas); their logs join
        # in a fixed order.
        procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in compiles]
        outs = [p.communicate()[0] for p in procs]
        for ccmd, p, text in zip(compiles, procs, outs):
            log += text
            if p.returncode != 0:
                Path(tmp).unlink(missing_ok=True)
                raise BuildError(f"nvcc failed (exit {p.returncode}):\n{' '.join(ccmd)}\n{text}")
        cmd = nvcc_command(nvcc, Path(tmp), archs, tuple(extra_flags), tuple(objects), ptx_arch)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log += proc.stdout + proc.stderr
    if proc.returncode != 0:
        Path(tmp).unlink(missing_ok=True)
        raise BuildError(f"nvcc failed (exit {proc.returncode}):\n{' '.join(cmd)}\n{log}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    report = BuildReport(out, archs, cmd, parse_ptxas(log), log, ptx_arch)
    if verbose:
        print(" ".join(cmd))
        for r in report.resources:
            print(f"  sm_{r.arch:<4} {r.kernel[:60]:<60} regs={r.registers} spill={r.spill_stores}/{r.spill_loads} "
                  f"stack={r.stack_bytes}")
    if verbose:
        for w in report.warnings():
            print(f"  warning: spill outside the strict archs: {w}")
    if check:
        problems = report.problems()
        missing = sorted(set(archs) - set(elf_archs(out) or archs))
        if missing:
            problems.append(f"archs missing from the fat binary: {missing}")
        embedded = ptx_archs(out)
        if embedded is not None and sorted(embedded) != ([ptx_arch] if ptx_arch else []):
            problems.append(f"the fat binary's PTX is {embedded or 'none'}, the build asked for "
                            f"{ptx_arch or 'none'}")
        if problems:
            raise BuildError("build check failed:\n  " + "\n  ".join(problems))
    return report


def _listed_archs(path: Path | str, what: str, pattern: str) -> list[int] | None:
    """The archs `cuobjdump --list-<what>` names in the library's fat binary (None when cuobjdump is
    unavailable; [] when it holds none of that kind)."""
    tool = find_cuobjdump()
    if tool is None:
        return None
    proc = subprocess.run([tool, f"--list-{what}", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        if "does not contain" in (proc.stdout + proc.stderr):
            return []
        raise BuildError(f"cuobjdump --list-{what} failed: {proc.stderr.strip()}")
    return sorted({int(m) for m in re.findall(pattern, proc.stdout)})


def elf_archs(path: Path | str) -> list[int] | None:
    """SASS architectures inside the library's fat binary (None when cuobjdump is unavailable)."""
    return _listed_archs(path, "elf", r"\.sm_(\d+)a?\.")


def ptx_archs(path: Path | str) -> list[int] | None:
    """PTX architectures inside the library's fat binary (None when cuobjdump is unavailable)."""
    return _listed_archs(path, "ptx", r"\.sm_(\d+)a?\.ptx")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdtree_backend.build", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help=f"output path (default {DEFAULT_OUTPUT})")
    ap.add_argument("--arch", type=int, action="append",
                    help=f"compute capability x10, one of {', '.join(map(str, SUPPORTED_ARCHS))} (repeatable)")
    ap.add_argument("--check", action="store_true", help="fail on spills, stack frames or missing archs")
    ap.add_argument("--no-ptx", action="store_true",
                    help="machine code only: no PTX of the newest arch for the driver to JIT-compile on newer GPUs")
    ap.add_argument("--profiler", action="store_true",
                    help="diagnostics build: milestone stamps + kdtree_timeline_copy (bench/diag/timeline.py); never ship it")
    ap.add_argument("--pipe-factor", type=int, default=1, metavar="F",
                    help="diagnostics build: every portable mma.sync costs the tensor pipe F times (exact results), "
                         "sm_120's regime on an H200 at F = 3 (journal m27); never ship it")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    try:
        report = build(args.out, args.arch, verbose=not args.quiet, check=args.check, profiler=args.profiler,
                       ptx=not args.no_ptx, pipe_factor=args.pipe_factor)
    except BuildError as e:
        print(f"kdtree-backend build: {e}", file=sys.stderr)
        return 1
    print(f"built {report.path} for {abi.archs_text(report.archs, report.ptx_arch)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
