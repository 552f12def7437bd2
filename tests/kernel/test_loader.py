"""The kernel library loader: every failure is loud, named, and stops the plugin (exit 78)."""
from __future__ import annotations

import ctypes
import dataclasses
import os
import shutil

import pytest

from conftest import clean_env, run_python
from kdtree_backend.kernel import abi
from kdtree_backend.kernel import loader
from kdtree_backend.config import ENV_FAKE_GPU_CAPABILITY, ENV_LIB, ENV_TESTING
from kdtree_backend.errors import KdtreeLibraryError, KdtreeModeError


def test_default_path_is_inside_the_package():
    p = loader.default_library_path()
    assert p.name == abi.LIB_FILENAME == "libkdtree_verify.so"
    assert p.parent.name == "_lib" and p.parent.parent == loader.default_library_path().parent.parent
    assert (p.parent.parent / "kernel" / "loader.py").is_file()


def test_library_path_honours_kdtree_lib(tmp_path, monkeypatch):
    assert loader.library_path({}) == loader.default_library_path()
    assert loader.library_path({ENV_LIB: "  "}) == loader.default_library_path()
    assert loader.library_path({ENV_LIB: str(tmp_path / "x.so")}) == tmp_path / "x.so"
    monkeypatch.chdir(tmp_path)
    assert loader.library_path({ENV_LIB: "rel/lib.so"}) == tmp_path / "rel" / "lib.so"  # made absolute


@pytest.mark.parametrize(
    "text, archs", [("90,120", (90, 120)), ("90", (90,)), (" 100 , 120 ", (100, 120)), ("1", (1,))]
)
def test_parse_archs(text, archs):
    assert loader.parse_archs(text) == archs


@pytest.mark.parametrize("text", ["", ",", "sm_90", "9.0", "90;120"])
def test_parse_archs_rejects(text):
    with pytest.raises(ValueError):
        loader.parse_archs(text)


@pytest.mark.parametrize(
    "arch, cap, runs",
    [(90, (9, 0), True), (90, (9, 1), True), (120, (12, 0), True), (120, (12, 1), True),
     (121, (12, 0), False), (120, (9, 0), False), (90, (12, 0), False), (80, (8, 6), True),
     (86, (8, 0), False), (1, (9, 0), False), (100, (10, 3), True)],
)
def test_arch_runs_on(arch, cap, runs):
    assert loader.arch_runs_on(arch, cap) is runs


@pytest.mark.parametrize(
    "archs, ptx, cap, expect",
    [((90, 100, 120), 120, (9, 0), ("sass", 90)), ((90, 100, 120), 120, (10, 3), ("sass", 100)),
     ((90, 100, 120), 120, (12, 1), ("sass", 120)), ((90, 100, 120), 120, (13, 0), ("ptx", 120)),
     ((90, 100, 120), 120, (11, 0), None), ((90, 100, 120), 120, (8, 9), None),
     ((90, 120), 0, (13, 0), None), ((90,), 90, (12, 0), ("ptx", 90)), ((90,), 90, (8, 6), None)],
)
def test_code_for_prefers_sass_then_ptx(archs, ptx, cap, expect):
    code = loader.code_for(archs, ptx, cap)
    assert (None if code is None else (code.kind, code.arch)) == expect


def test_loader_buildable_archs_are_the_build_modules():
    from kdtree_backend.kernel import build

    assert loader.BUILDABLE_ARCHS == build.SUPPORTED_ARCHS


@pytest.mark.parametrize("cap, fix", [
    ((10, 3), "including sm_100"), ((13, 0), "PTX of compute_120"),
    ((11, 0), "--arch 90 --arch 100"), ((8, 6), "compute capability 9.0 or newer"),
])
def test_rebuild_fix_names_what_would_cover_the_gpu(cap, fix):
    assert fix in loader.rebuild_fix(cap)


def test_diagnostics_build_is_named_by_its_version(fake_libs):
    env = {ENV_TESTING: "1", ENV_FAKE_GPU_CAPABILITY: "9.0"}
    assert loader.load_library(fake_libs.diagnostics, environ=env).diagnostics() == "pipe3"
    assert loader.load_library(fake_libs.good, environ=env).diagnostics() is None
    lib = loader.load_library(fake_libs.good, environ=env)
    for version, kind in (("0.1.0+src.ab12+profiler", "profiler"), ("0.1.0+src.ab12+profiler+pipe2", "profiler, pipe2"),
                          ("0.1.0+src.ab12", None), ("", None), ("0.1.0+src.pipeline", None)):
        assert dataclasses.replace(lib, version=version).diagnostics() == kind, version
    for version, factor in (("0.1.0+src.abc123+pipe3", 3), ("0.1.0+src.abc123+profiler+pipe2", 2),
                            ("0.1.0+src.abc123", 1), ("", 1), ("0.1.0+src.pipeline", 1)):
        assert dataclasses.replace(lib, version=version).pipe_factor() == factor, version
    assert dataclasses.replace(lib, version=None).pipe_factor() == 1
    assert lib.diagnostics_warning() is None
    assert "diagnostics build (pipe3)" in loader.load_library(fake_libs.diagnostics, environ=env).diagnostics_warning()


def test_library_with_ptx_covers_newer_gpus(fake_libs):
    env = {ENV_TESTING: "1", ENV_FAKE_GPU_CAPABILITY: "9.0,10.0,12.0,13.0"}
    lib = loader.load_library(fake_libs.with_ptx, environ=env)
    assert lib.built_archs == (90, 100, 120) and lib.ptx_arch == 120
    assert lib.archs_text() == "sm_90, sm_100, sm_120 + compute_120 PTX"
    assert lib.code_for((13, 0)).kind == "ptx" and "JIT" in lib.code_for((13, 0)).describe()
    with pytest.raises(KdtreeLibraryError) as info:
        loader.load_library(fake_libs.with_ptx, environ={ENV_TESTING: "1", ENV_FAKE_GPU_CAPABILITY: "11.0"})
    assert "compute capability 11.0" in str(info.value) and "compute_120 PTX" in str(info.value)


def test_library_without_the_ptx_symbol_reads_as_no_ptx(fake_libs):
    # A library built before kdtree_ptx_arch existed (same ABI): no PTX, so a 13.0 GPU is refused.
    lib = loader.load_library(fake_libs.good, check_devices=False, environ={ENV_TESTING: "1"})
    assert lib.ptx_arch == 0 and lib.archs_text() == "sm_90, sm_120"
    with pytest.raises(KdtreeLibraryError, match="13.0"):
        loader.check_library_devices(lib, [(0, "fake", (13, 0))])


def test_good_fake_library_loads(fake_libs):
    env = {ENV_TESTING: "1", ENV_FAKE_GPU_CAPABILITY: "9.0,12.0"}
    lib = loader.load_library(fake_libs.good, environ=env)
    assert lib.path == fake_libs.good
    assert lib.abi_version == abi.ABI_VERSION
    assert lib.built_archs == (90, 120)
    assert lib.version == "fake-for-tests"
    assert isinstance(lib.cdll, ctypes.CDLL)
    assert lib.cdll.kdtree_error_string(1) == b"fake library: no kernel"  # signatures declared


def test_fake_gpus_are_honoured_only_in_test_mode():
    probe = loader.probe_gpus({ENV_TESTING: "1", ENV_FAKE_GPU_CAPABILITY: "9.0, 12.0"})
    assert probe.fake and [g[2] for g in probe.gpus] == [(9, 0), (12, 0)] and [g[0] for g in probe.gpus] == [0, 1]
    assert loader.probe_gpus({ENV_TESTING: "1", ENV_FAKE_GPU_CAPABILITY: "none"}).gpus == []
    assert not loader.probe_gpus({ENV_FAKE_GPU_CAPABILITY: "9.0"}).fake  # without KDTREE_TESTING=1: real GPUs
    with pytest.raises(KdtreeModeError, match=ENV_FAKE_GPU_CAPABILITY):
        loader.probe_gpus({ENV_TESTING: "1", ENV_FAKE_GPU_CAPABILITY: "sm90"})


def test_real_gpu_probe_runs_without_torch_cuda():
    # On a CPU machine: [] with a reason; on a GPU machine: every device with a capability.
    probe = loader.probe_gpus({})
    assert not probe.fake
    if probe.gpus:
        assert all(len(g) == 3 and g[2][0] >= 5 for g in probe.gpus)
    else:
        assert probe.note.startswith("no GPU")
    proc = run_python(
        "import sys; from kdtree_backend.kernel import loader; loader.visible_gpus(); print('torch' in sys.modules)",
        clean_env(),
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


def test_arch_mismatch_in_process(fake_libs):
    env = {ENV_TESTING: "1", ENV_FAKE_GPU_CAPABILITY: "9.0"}
    with pytest.raises(KdtreeLibraryError) as info:
        loader.load_library(fake_libs.sm120_only, environ=env)
    text = str(info.value)
    assert "sm_120" in text and "9.0" in text and "sm_90" in text
    # the same library without the device check (the doctor's first step) loads
    assert loader.load_library(fake_libs.sm120_only, check_devices=False, environ=env).built_archs == (120,)


def test_get_library_is_cached_per_process(fake_libs, monkeypatch):
    monkeypatch.setenv(ENV_LIB, str(fake_libs.good))
    monkeypatch.setenv(ENV_TESTING, "1")
    monkeypatch.setenv(ENV_FAKE_GPU_CAPABILITY, "9.0")
    loader._reset_cache_for_tests()
    try:
        first = loader.get_library()
        assert loader.get_library() is first and first.path == fake_libs.good
    finally:
        loader._reset_cache_for_tests()
    monkeypatch.setenv(ENV_LIB, str(fake_libs.missing))
    for _ in range(2):  # a failure is not cached
        with pytest.raises(KdtreeLibraryError):
            loader.get_library()


# --- each failure, through the plugin's entry point, in a fresh process ------------------------

_REGISTER = "from kdtree_backend.sglang import plugin; plugin.register(); print('REGISTER RETURNED')"


def _register_with(lib_path, mode="on", gpu="9.0"):
    env = clean_env(KDTREE_VERIFY=mode, KDTREE_LIB=str(lib_path), KDTREE_TESTING="1",
                    KDTREE_FAKE_GPU_CAPABILITY=gpu)
    return run_python(_REGISTER, env)


def _assert_stopped(proc, *needles):
    assert proc.returncode == 78, (proc.returncode, proc.stdout, proc.stderr)
    assert "REGISTER RETURNED" not in proc.stdout
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("kdtree-backend: ") and " Fix: " in line, line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def test_missing_file_names_the_path(fake_libs):
    _assert_stopped(_register_with(fake_libs.missing), str(fake_libs.missing), "not found", f"(from {ENV_LIB})")


def test_dlopen_failure_prints_the_loaders_error(fake_libs):
    line = _assert_stopped(_register_with(fake_libs.not_elf, mode="validate"), str(fake_libs.not_elf), "dlopen")
    assert "invalid ELF header" in line or "file too short" in line  # glibc's dlerror() text


def test_missing_symbol_is_named(fake_libs):
    line = _assert_stopped(_register_with(fake_libs.missing_symbol), "kdtree_verify_run", str(fake_libs.missing_symbol))
    assert "kdtree_verify_plan" not in line  # only the missing one is named


def test_wrong_abi_version_prints_both(fake_libs):
    _assert_stopped(
        _register_with(fake_libs.wrong_abi),
        f"ABI version {abi.ABI_VERSION + 1}",
        f"expects ABI version {abi.ABI_VERSION}",
    )


def test_arch_mismatch_prints_both_capabilities(fake_libs):
    _assert_stopped(_register_with(fake_libs.sm120_only, gpu="9.0"), "sm_120", "compute capability 9.0", "sm_90")


def test_kdtree_lib_unset_searches_the_package_location(tmp_path, monkeypatch):
    default = tmp_path / "kdtree_backend" / "_lib" / abi.LIB_FILENAME  # a package copy without a build
    monkeypatch.setattr(loader, "default_library_path", lambda: default)
    with pytest.raises(KdtreeLibraryError) as info:
        loader.load_library(environ={})
    assert str(default) in str(info.value) and "default location" in str(info.value)
    assert "python -m kdtree_backend.build" in str(info.value)


# --- the real library ----------------------------------------------------------------------------

def _build_module():
    try:
        from kdtree_backend.kernel import build
    except ImportError as e:  # the kernel engineer's module is not there yet
        pytest.skip(f"kdtree_backend/build.py (build_library) is not available yet: {e}")
    return build


@pytest.mark.timeout(900)
def test_real_library_built_by_nvcc_loads(tmp_path):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the real library cannot be built here")
    build = _build_module()
    out = tmp_path / abi.LIB_FILENAME
    path = build.build_library(out=out, archs=[90])
    lib = loader.load_library(path, check_devices=False)
    assert lib.abi_version == abi.ABI_VERSION
    assert lib.built_archs == (90,)
    assert lib.version
    for name in abi.REQUIRED_SYMBOLS:
        assert hasattr(lib.cdll, name)
    # and the device check: an H200 (9.0) runs the sm_90 code; an RTX PRO 6000 (12.0) only the
    # embedded compute_90 PTX (JIT), and nothing without it
    assert lib.ptx_arch == 90
    loader.check_library_devices(lib, [(0, "H200", (9, 0))])
    assert lib.code_for((9, 0)).kind == "sass" and lib.code_for((12, 0)).kind == "ptx"
    loader.check_library_devices(lib, [(0, "RTX PRO 6000", (12, 0))])
    with pytest.raises(KdtreeLibraryError, match="compute capability 12.0"):
        loader.check_library_devices(dataclasses.replace(lib, ptx_arch=0), [(0, "RTX PRO 6000", (12, 0))])


# --- on a GPU machine ----------------------------------------------------------------------------

@pytest.mark.gpu
def test_driver_api_gpu_list_matches_torch():
    import torch

    gpus = loader.visible_gpus({})
    assert len(gpus) == torch.cuda.device_count() > 0
    for index, name, cap in gpus:
        assert cap == torch.cuda.get_device_capability(index)
        assert name == torch.cuda.get_device_name(index)


def _entry_point_site(tmp_path: Path) -> str:
    """A folder that makes the `kdtree` entry point discoverable when the package is only on
    PYTHONPATH (the GPU machine runs the checkout without pip-installing it)."""
    from importlib.metadata import entry_points

    if any(ep.name == "kdtree" for ep in entry_points(group="sglang.srt.plugins")):
        return ""
    dist = tmp_path / "site" / "kdtree_backend-0.0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kdtree-backend\nVersion: 0.0.0\n")
    (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\nkdtree = kdtree_backend.sglang.plugin:register\n")
    return str(tmp_path / "site")


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_real_library_on_this_gpu_and_no_cuda_context_at_plugin_load(tmp_path):
    # The real library for the default archs loads with the device check on this GPU, and SGLang's
    # load_plugins() with it installs the hook without creating a CUDA context (the scheduler has
    # not chosen its GPU yet when it loads plugins; a context there would sit on GPU 0).
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the real library cannot be built here")
    build = _build_module()
    path = build.build_library(out=tmp_path / abi.LIB_FILENAME)
    lib = loader.load_library(path, environ={})
    assert set(lib.built_archs) >= {90, 120}
    code = (
        "import ctypes\n"
        "from sglang.srt.plugins import load_plugins; load_plugins()\n"
        "ctx = ctypes.c_void_p(); cuda = ctypes.CDLL('libcuda.so.1'); cuda.cuCtxGetCurrent(ctypes.byref(ctx))\n"
        "from sglang.srt.layers.attention.triton_backend import TritonAttnBackend as B\n"
        "from kdtree_backend.sglang import plugin\n"
        "print('RESULT', plugin.wraps_kdtree_hook(B.forward_extend), bool(ctx.value))\n"
    )
    env = clean_env(KDTREE_VERIFY="on", KDTREE_LIB=str(path))
    site = _entry_point_site(tmp_path)
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH", "")) if p)
    proc = run_python(code, env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT True False" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
