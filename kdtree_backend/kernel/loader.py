"""Load the compiled kernel library, loudly.

`load_library()` either returns a checked `KernelLibrary` or raises `KdtreeLibraryError` naming
the cause (path searched, the dynamic loader's message, the missing symbol, both ABI versions,
both compute capabilities) and the fix. It imports neither torch nor anything that creates a
CUDA context: the GPUs are listed through the CUDA driver API (`libcuda.so.1`) with ctypes,
where `cuInit` initialises the driver but creates no context, so it is safe before SGLang's
scheduler has chosen its GPU.
"""
from __future__ import annotations

import ctypes
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Tuple

from kdtree_backend.kernel import abi
# The compute capabilities (x10) the kernels build for: the build module's list (it imports only abi).
from kdtree_backend.kernel.build import SUPPORTED_ARCHS as BUILDABLE_ARCHS
from kdtree_backend.config import (
    ENV_FAKE_GPU_CAPABILITY,
    ENV_LIB,
    ENV_MODE,
    ENV_TESTING,
    testing_enabled,
)
from kdtree_backend.errors import KdtreeLibraryError, KdtreeModeError

GpuInfo = Tuple[int, str, Tuple[int, int]]  # (index, name, (major, minor))

_BUILD_FIX = "build it with `python -m kdtree_backend.build` (needs nvcc)"
_OFF_FIX = f"or set {ENV_MODE}=off to serve without the kernel"


@dataclass(frozen=True)
class KernelLibrary:
    """A loaded, checked `libkdtree_verify.so`."""

    cdll: ctypes.CDLL = field(repr=False)
    path: Path
    abi_version: int
    built_archs: Tuple[int, ...]  # SASS compute capabilities, major*10+minor, e.g. (90, 100, 120)
    version: str
    ptx_arch: int = 0  # the portable kernels' embedded PTX (JIT-compiled on newer GPUs); 0: none

    def archs_text(self) -> str:
        return abi.archs_text(self.built_archs, self.ptx_arch)

    def code_for(self, capability: Tuple[int, int]) -> Optional["DeviceCode"]:
        return code_for(self.built_archs, self.ptx_arch, capability)

    def diagnostics(self) -> Optional[str]:
        """What kind of diagnostics build this is (its version names it, build.diagnostics_suffix:
        "+profiler" stamps the kernels, "+pipeF" costs every portable mma.sync F times, journal m27), or
        None for a release build."""
        kinds = re.findall(r"\+(profiler|pipe\d+)\b", self.version or "")
        return ", ".join(kinds) or None

    def pipe_factor(self) -> int:
        """F of a `--pipe-factor F` diagnostics build, 1 for any other."""
        m = re.search(r"\+pipe(\d+)\b", self.version or "")
        return int(m.group(1)) if m else 1

    def diagnostics_warning(self) -> Optional[str]:
        """The warning doctor and the plugin's start-up line give for a diagnostics build (None for a
        release build), to follow "a " or "the kernel library PATH is a "."""
        kinds = self.diagnostics()
        if kinds is None:
            return None
        return (f"diagnostics build ({kinds}): kernels instrumented or slowed on purpose; never serve with it "
                f"(rebuild: python -m kdtree_backend.build)")


def default_library_path() -> Path:
    """Where `python -m kdtree_backend.build` puts the library: inside the package."""
    return Path(__file__).resolve().parent.parent / "_lib" / abi.LIB_FILENAME


def library_path(environ: Optional[Mapping[str, str]] = None) -> Path:
    """`KDTREE_LIB` when set and non-empty (made absolute), else `default_library_path()`."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_LIB, "").strip()
    if not raw:
        return default_library_path()
    return Path(os.path.abspath(os.path.expanduser(raw)))


def _path_origin(path: Path, environ: Optional[Mapping[str, str]]) -> str:
    env = os.environ if environ is None else environ
    if env.get(ENV_LIB, "").strip():
        return f"from {ENV_LIB}"
    return "the default location inside the package"


# --- compute capabilities ------------------------------------------------------------------

def parse_archs(text: str) -> Tuple[int, ...]:
    """"90,120" -> (90, 120). Raises ValueError on anything else."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"empty arch list {text!r}")
    archs = []
    for p in parts:
        if not p.isdigit():
            raise ValueError(f"arch {p!r} in {text!r} is not a number like 90 or 120")
        archs.append(int(p))
    return tuple(archs)


def arch_runs_on(arch: int, capability: Tuple[int, int]) -> bool:
    """SASS built for sm_XY runs on devices of major X with minor >= Y."""
    major, minor = capability
    return arch // 10 == major and arch % 10 <= minor


def ptx_runs_on(ptx_arch: int, capability: Tuple[int, int]) -> bool:
    """PTX for compute_XY JIT-compiles for every device of capability X.Y or newer."""
    return ptx_arch > 0 and capability[0] * 10 + capability[1] >= ptx_arch


@dataclass(frozen=True)
class DeviceCode:
    """What a GPU runs from the library: machine code built for `arch` (kind "sass"), or the PTX of
    `arch` JIT-compiled by the CUDA driver on first use (kind "ptx")."""

    kind: str
    arch: int

    def describe(self) -> str:
        if self.kind == "sass":
            return f"sm_{self.arch} code"
        return (f"compute_{self.arch} PTX, JIT-compiled by the CUDA driver at the first kernel call "
                f"(the portable kernel only; it can take minutes once, then the driver's compute cache "
                f"holds it)")


def code_for(archs: Sequence[int], ptx_arch: int, capability: Tuple[int, int]) -> Optional[DeviceCode]:
    """The library's code for a GPU of `capability`: the newest SASS arch that runs on it, else its
    PTX when that JIT-compiles there, else None (the GPU cannot run the library)."""
    sass = [a for a in archs if arch_runs_on(a, capability)]
    if sass:
        return DeviceCode("sass", max(sass))
    if ptx_runs_on(ptx_arch, capability):
        return DeviceCode("ptx", ptx_arch)
    return None


@dataclass(frozen=True)
class GpuProbe:
    gpus: List[GpuInfo]
    note: str = ""  # why the list is empty, or where a fake list came from
    fake: bool = False


_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
_CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


def _cu_error(cuda, rc: int) -> str:
    name = ctypes.c_char_p()
    try:
        if cuda.cuGetErrorName(rc, ctypes.byref(name)) == 0 and name.value:
            return f"{name.value.decode()} ({rc})"
    except Exception:
        pass
    return f"CUresult {rc}"


def _parse_fake(raw: str) -> GpuProbe:
    text = raw.strip().lower()
    if text in ("none", ""):
        return GpuProbe([], f"no GPU ({ENV_FAKE_GPU_CAPABILITY}={raw!r}, test mode)", fake=True)
    gpus: List[GpuInfo] = []
    for i, part in enumerate(p.strip() for p in text.split(",")):
        try:
            major_s, minor_s = part.split(".")
            cap = (int(major_s), int(minor_s))
        except ValueError:
            raise KdtreeModeError(ENV_FAKE_GPU_CAPABILITY, raw, "a list like 9.0 or 9.0,12.0, or none") from None
        gpus.append((i, f"fake GPU {cap[0]}.{cap[1]} ({ENV_FAKE_GPU_CAPABILITY})", cap))
    return GpuProbe(gpus, f"fake GPUs from {ENV_FAKE_GPU_CAPABILITY} (test mode)", fake=True)


def probe_gpus(environ: Optional[Mapping[str, str]] = None) -> GpuProbe:
    """The visible GPUs and their compute capability, through the CUDA driver API.

    No libcuda or a driver without devices means an empty list (with the reason in `note`).
    `KDTREE_FAKE_GPU_CAPABILITY` replaces the real list only when `KDTREE_TESTING=1`.
    """
    env = os.environ if environ is None else environ
    if ENV_FAKE_GPU_CAPABILITY in env and testing_enabled(env):
        return _parse_fake(env[ENV_FAKE_GPU_CAPABILITY])
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return GpuProbe([], f"no GPU (libcuda.so.1 not loadable: {e})")
    rc = cuda.cuInit(0)
    if rc != 0:
        return GpuProbe([], f"no GPU (cuInit: {_cu_error(cuda, rc)})")
    count = ctypes.c_int(0)
    rc = cuda.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0:
        return GpuProbe([], f"no GPU (cuDeviceGetCount: {_cu_error(cuda, rc)})")
    gpus: List[GpuInfo] = []
    for i in range(count.value):
        dev = ctypes.c_int(0)
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        buf = ctypes.create_string_buffer(256)
        for what, rc in (
            ("cuDeviceGet", cuda.cuDeviceGet(ctypes.byref(dev), i)),
            ("cuDeviceGetAttribute", cuda.cuDeviceGetAttribute(
                ctypes.byref(major), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)),
            ("cuDeviceGetAttribute", cuda.cuDeviceGetAttribute(
                ctypes.byref(minor), _CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)),
        ):
            if rc != 0:
                raise KdtreeLibraryError(
                    f"the CUDA driver failed to describe GPU {i}: {what}: {_cu_error(cuda, rc)}",
                    f"check the GPU and driver with nvidia-smi, {_OFF_FIX}",
                )
        name = "unknown GPU"
        if cuda.cuDeviceGetName(buf, len(buf), dev) == 0:
            name = buf.value.decode(errors="replace")
        gpus.append((i, name, (major.value, minor.value)))
    note = "" if gpus else "no GPU (the CUDA driver reports 0 devices)"
    return GpuProbe(gpus, note)


def visible_gpus(environ: Optional[Mapping[str, str]] = None) -> List[GpuInfo]:
    """[(index, name, (major, minor))] of every GPU this process can see; [] without a GPU."""
    return probe_gpus(environ).gpus


# --- the library ---------------------------------------------------------------------------

def load_library(
    path=None,
    *,
    check_devices: bool = True,
    environ: Optional[Mapping[str, str]] = None,
) -> KernelLibrary:
    """dlopen the library and check symbols, ABI version and (optionally) the GPUs' archs.

    Raises `KdtreeLibraryError` with cause and fix on any failure.
    """
    p = library_path(environ) if path is None else Path(os.path.abspath(os.fspath(path)))
    origin = _path_origin(p, environ) if path is None else "given path"
    if not p.is_file():
        raise KdtreeLibraryError(
            f"kernel library not found: searched {p} ({origin})",
            f"{_BUILD_FIX}, or point {ENV_LIB} at a built {abi.LIB_FILENAME}, {_OFF_FIX}",
            path=p,
        )
    try:
        cdll = ctypes.CDLL(str(p))
    except OSError as e:
        raise KdtreeLibraryError(
            f"kernel library {p} failed to load (dlopen): {e}",
            f"rebuild it on this machine ({_BUILD_FIX}) and check its dependencies with `ldd {p}`, {_OFF_FIX}",
            path=p,
        ) from None

    missing = [name for name in abi.REQUIRED_SYMBOLS if not hasattr(cdll, name)]
    if missing:
        raise KdtreeLibraryError(
            f"kernel library {p} lacks the symbol(s) {', '.join(missing)} "
            f"(required by kdtree_backend ABI {abi.ABI_VERSION})",
            f"rebuild it from this package's sources ({_BUILD_FIX}), {_OFF_FIX}",
            path=p,
        )
    abi.declare_signatures(cdll)

    lib_abi = int(cdll.kdtree_abi_version())
    if lib_abi != abi.ABI_VERSION:
        raise KdtreeLibraryError(
            f"kernel library {p} has ABI version {lib_abi} but this kdtree_backend expects "
            f"ABI version {abi.ABI_VERSION}",
            f"rebuild the library from this package's sources ({_BUILD_FIX}) or install the "
            f"matching kdtree_backend, {_OFF_FIX}",
            path=p,
        )

    raw_archs = (cdll.kdtree_built_archs() or b"").decode(errors="replace")
    try:
        archs = parse_archs(raw_archs)
    except ValueError as e:
        raise KdtreeLibraryError(
            f"kernel library {p} reports unusable built archs: {e}",
            f"rebuild it ({_BUILD_FIX}), {_OFF_FIX}",
            path=p,
        ) from None
    version = (cdll.kdtree_library_version() or b"").decode(errors="replace")
    ptx_arch = int(cdll.kdtree_ptx_arch()) if hasattr(cdll, "kdtree_ptx_arch") else 0
    if ptx_arch < 0:
        raise KdtreeLibraryError(
            f"kernel library {p} reports an unusable PTX arch {ptx_arch}",
            f"rebuild it ({_BUILD_FIX}), {_OFF_FIX}",
            path=p,
        )
    lib = KernelLibrary(cdll=cdll, path=p, abi_version=lib_abi, built_archs=archs, version=version,
                        ptx_arch=ptx_arch)

    if check_devices:
        check_library_devices(lib, probe_gpus(environ).gpus)
    return lib


def check_library_devices(lib: KernelLibrary, gpus: Sequence[GpuInfo]) -> None:
    """Raise KdtreeLibraryError when a GPU's compute capability has no kernel image in `lib`
    (neither SASS that runs on it nor PTX that JIT-compiles for it)."""
    for index, name, cap in gpus:
        if lib.code_for(cap) is None:
            raise KdtreeLibraryError(
                f"kernel library {lib.path} was built for {lib.archs_text()} but GPU {index} "
                f"({name}) has compute capability {cap[0]}.{cap[1]} (needs sm_{cap[0]}x with "
                f"x <= {cap[1]}, or PTX of compute capability {cap[0]}.{cap[1]} or older)",
                rebuild_fix(cap),
                path=lib.path,
            )




def rebuild_fix(cap: Tuple[int, int]) -> str:
    """How to get code for a GPU of `cap`: the build arch whose SASS runs there, else the PTX of
    the newest buildable arch at or below it, else none (older than the kernels' sm_90 floor)."""
    sass = [a for a in BUILDABLE_ARCHS if arch_runs_on(a, cap)]
    if sass:
        return (f"rebuild the library including sm_{max(sass)} on this machine "
                f"(`python -m kdtree_backend.build`), {_OFF_FIX}")
    ptx = [a for a in BUILDABLE_ARCHS if ptx_runs_on(a, cap)]
    if ptx:
        flags = " ".join(f"--arch {a}" for a in BUILDABLE_ARCHS if a <= max(ptx))
        return (f"rebuild the library with the PTX of compute_{max(ptx)}, the newest arch of the build "
                f"(`python -m kdtree_backend.build {flags}`; the driver JIT-compiles it for this GPU), {_OFF_FIX}")
    return (f"the kernels need compute capability 9.0 or newer (they build for "
            f"{', '.join(f'sm_{a}' for a in BUILDABLE_ARCHS)}); set {ENV_MODE}=off on this GPU")


_cached: Optional[KernelLibrary] = None
_cache_lock = threading.Lock()


def get_library() -> KernelLibrary:
    """The process's library: loaded and checked once (from `library_path()`), then cached.

    A failure is not cached: it raises `KdtreeLibraryError` on every call.
    """
    global _cached
    if _cached is not None:
        return _cached
    with _cache_lock:
        if _cached is None:
            _cached = load_library()
        return _cached


def _reset_cache_for_tests() -> None:
    global _cached
    with _cache_lock:
        _cached = None


__all__ = [
    "KernelLibrary",
    "GpuProbe",
    "default_library_path",
    "library_path",
    "load_library",
    "get_library",
    "visible_gpus",
    "probe_gpus",
    "check_library_devices",
    "parse_archs",
    "arch_runs_on",
    "ptx_runs_on",
    "code_for",
    "DeviceCode",
    "rebuild_fix",
    "BUILDABLE_ARCHS",
    "ENV_TESTING",
]
