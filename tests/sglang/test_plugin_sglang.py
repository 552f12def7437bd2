"""The SGLang entry point, against the real sglang 0.5.23 (no fakes of sglang).

Each SGLang-importing check runs in its own fresh process (`load_plugins()` runs once per
process and patched attributes are not restored), and they are few: each costs ~5-15 s.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from conftest import clean_env, run_python
from kdtree_backend.sglang import plugin
from kdtree_backend.config import Mode
from kdtree_backend.errors import KdtreeConfigError

TARGET = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend"


def _fake_gpu_env(**kw):
    return clean_env(KDTREE_TESTING="1", KDTREE_FAKE_GPU_CAPABILITY="9.0", **kw)


def _result(proc):
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, (proc.returncode, proc.stdout, proc.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])


# --- in-process (no sglang import) ------------------------------------------------------------------

def test_entry_point_is_installed():
    import importlib.metadata

    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "kdtree"]
    assert eps, "kdtree-backend is not pip-installed in this interpreter: run `pip install -e .`"
    assert eps[0].value == "kdtree_backend.sglang.plugin:register"
    assert eps[0].load() is plugin.register
    plugin.check_entry_point({})


def test_entry_point_filtered_out_by_sglang_plugins_is_an_error():
    with pytest.raises(KdtreeConfigError, match="SGLANG_PLUGINS='other'"):
        plugin.check_entry_point({"SGLANG_PLUGINS": "other"})
    plugin.check_entry_point({"SGLANG_PLUGINS": "other, kdtree"})


def test_sglang_version_check(monkeypatch):
    assert plugin.check_sglang_version({}) == "0.5.23"  # the venv's real sglang
    monkeypatch.setattr(plugin, "sglang_version", lambda: "0.5.24")
    with pytest.raises(KdtreeConfigError) as info:
        plugin.check_sglang_version({})
    assert "0.5.24" in str(info.value) and "0.5.23" in str(info.value)
    assert "KDTREE_ALLOW_UNSUPPORTED_SGLANG=1" in str(info.value)
    assert plugin.check_sglang_version({"KDTREE_ALLOW_UNSUPPORTED_SGLANG": "1"}) == "0.5.24"
    monkeypatch.setattr(plugin, "sglang_version", lambda: None)
    with pytest.raises(KdtreeConfigError, match="sglang is not installed"):
        plugin.check_sglang_version({"KDTREE_ALLOW_UNSUPPORTED_SGLANG": "1"})


def test_preflight_checks(fake_libs):
    env = {"KDTREE_TESTING": "1", "KDTREE_FAKE_GPU_CAPABILITY": "9.0"}
    assert plugin.preflight_checks({**env, "KDTREE_LIB": str(fake_libs.missing)}) is Mode.OFF  # off: no checks
    assert plugin.preflight_checks({**env, "KDTREE_VERIFY": "Validate", "KDTREE_LIB": str(fake_libs.good)}) is Mode.VALIDATE
    assert plugin.preflight_checks({**env, "KDTREE_VERIFY": "on", "KDTREE_LIB": str(fake_libs.good)}) is Mode.ON
    for lib, needle in [(fake_libs.missing, r"not found: searched .* \(from KDTREE_LIB\)"), (fake_libs.wrong_abi, "ABI version"),
                        (fake_libs.sm120_only, "compute capability 9.0")]:
        with pytest.raises(KdtreeConfigError, match=needle):
            plugin.preflight_checks({**env, "KDTREE_VERIFY": "on", "KDTREE_LIB": str(lib)})
    with pytest.raises(KdtreeConfigError, match="KDTREE_VERIFY='bogus'"):
        plugin.preflight_checks({"KDTREE_VERIFY": "bogus"})
    with pytest.raises(KdtreeConfigError, match="SGLANG_PLUGINS"):
        plugin.preflight_checks({**env, "KDTREE_VERIFY": "on", "KDTREE_LIB": str(fake_libs.good), "SGLANG_PLUGINS": "x"})


# --- real sglang, fresh processes ---------------------------------------------------------------------

_VALIDATE = textwrap.dedent(
    """
    import json, sys
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    load_plugins()  # SGLang discovers the entry point and runs it, as in every server process
    import torch
    from sglang.srt.layers.attention import triton_backend
    from kdtree_backend.sglang import hook
    from kdtree_backend.sglang import plugin
    B = triton_backend.TritonAttnBackend
    fe = B.forward_extend
    cells = [c.cell_contents for c in (fe.__closure__ or ())]
    sources = {t: sorted({s.plugin_name for _, _, s in hs if s}) for t, hs in HookRegistry._hooks.items()}
    print("RESULT " + json.dumps(dict(
        original=getattr(getattr(fe, "__wrapped__", None), "__qualname__", None),
        hook_in_closure=any(c is hook.forward_extend_hook for c in cells),
        wraps=plugin.wraps_kdtree_hook(fe),
        guard=plugin.wraps_init_guard(B.__init__),
        sources=sources,
        patched=sorted(HookRegistry._patched),
        armed=plugin.armed_mode().value,
        cuda_initialized=torch.cuda.is_initialized(),
    )), flush=True)
    # A plugin that registers on forward_extend after ours is skipped by the registry: the guard
    # lets a backend be built (ours is in place) and reports the skipped hook once.
    from sglang.srt.plugins.hook_registry import HookType
    HookRegistry.register(plugin.TARGET, lambda orig, *a, **kw: orig(*a, **kw), HookType.AROUND)
    HookRegistry.apply_hooks()
    try:
        B(None)  # the guard passes; SGLang's own __init__ then fails (no server config, no model runner)
    except Exception:
        print("ORIGINAL INIT RAN", flush=True)
    # Something replaces forward_extend after the plugin loaded: building a backend must stop the
    # process (exit 78) instead of serving stock Triton.
    B.forward_extend = fe.__wrapped__
    B(None)
    print("BACKEND BUILT", flush=True)
    """
)


def test_load_plugins_wraps_forward_extend_and_guards_backend_construction(fake_libs):
    proc = run_python(_VALIDATE, _fake_gpu_env(KDTREE_VERIFY="validate", KDTREE_LIB=str(fake_libs.good)), timeout=240)
    r = _result(proc)
    assert r["original"] == "TritonAttnBackend.forward_extend"
    assert r["hook_in_closure"] and r["wraps"] and r["guard"]
    guard_target = TARGET.replace("forward_extend", "__init__")
    assert r["sources"][TARGET] == ["kdtree"] and r["sources"][guard_target] == ["kdtree"]  # run by load_plugins()
    assert TARGET in r["patched"] and guard_target in r["patched"]
    assert r["armed"] == "validate"
    assert r["cuda_initialized"] is False
    assert "KDTREE_VERIFY=validate, hook installed on " + TARGET in proc.stderr
    assert str(fake_libs.good) in proc.stderr
    # the guard: a late hook is reported, a replaced forward_extend stops the process
    assert "ORIGINAL INIT RAN" in proc.stdout
    assert "does not apply those late hooks" in proc.stderr
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert "BACKEND BUILT" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert "forward_extend is not wrapped by the kdtree hook" in last and "would serve stock Triton" in last


_OFF = textwrap.dedent(
    """
    import json, sys
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    load_plugins()
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend as B
    result = dict(
        fe_wrapped=hasattr(B.forward_extend, "__wrapped__"),
        init_wrapped=hasattr(B.__init__, "__wrapped__"),
        kdtree_hooks=[t for t, hs in HookRegistry._hooks.items() if any(s and s.plugin_name == "kdtree" for _, _, s in hs)],
        hook_module_imported="kdtree_backend.sglang.hook" in sys.modules,
        loader_imported="kdtree_backend.kernel.loader" in sys.modules,
    )
    # The verification inside register(): a target the registry cannot patch must be reported,
    # with the registry's own (otherwise swallowed) error.
    from kdtree_backend.sglang import plugin
    from kdtree_backend.errors import KdtreeConfigError
    plugin.TARGET = "builtins.int.bit_length"
    try:
        plugin._install_hooks()
        result["unpatchable"] = "no error"
    except KdtreeConfigError as err:
        result["unpatchable"] = str(err)
    print("RESULT " + json.dumps(result), flush=True)
    """
)


def test_off_leaves_triton_untouched():
    proc = run_python(_OFF, clean_env(KDTREE_VERIFY="off"), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = _result(proc)
    assert r["fe_wrapped"] is False and r["init_wrapped"] is False
    assert r["kdtree_hooks"] == []
    assert r["hook_module_imported"] is False and r["loader_imported"] is False  # zero cost
    assert "KDTREE_VERIFY=off, hook not installed" in proc.stderr  # the plugin did run
    assert "builtins.int.bit_length is not wrapped by the kdtree hook" in r["unpatchable"]
    assert "Failed to apply hooks to builtins.int.bit_length" in r["unpatchable"]


_SCHEDULER = textwrap.dedent(
    """
    import multiprocessing as mp
    from sglang.srt.managers.scheduler import run_scheduler_process
    from sglang.srt.entrypoints.engine import _wait_for_scheduler_ready
    ctx = mp.get_context("spawn")  # what SGLang uses
    reader, writer = ctx.Pipe(duplex=False)
    # SGLang's scheduler entry function; its first statement is load_plugins(). The arguments are
    # never reached when the plugin stops the process, and crash the child with exit 1 otherwise.
    proc = ctx.Process(target=run_scheduler_process, args=(None, None, 0, 0, 0, None, writer))
    proc.start()
    writer.close()
    try:
        _wait_for_scheduler_ready([reader], [proc])  # SGLang's own wait in Engine start-up
        print("PARENT: scheduler ready", flush=True)
    except RuntimeError as err:
        print("PARENT: " + str(err), flush=True)
    proc.join(30)
    print("CHILD EXIT %s" % proc.exitcode, flush=True)

    # Defence in depth: were the SystemExit ever swallowed (a future load_plugins() catching
    # BaseException, then applying the hooks as it does today), the guard registered on the way
    # out stops the first backend construction with the same error.
    from kdtree_backend.sglang import plugin
    from sglang.srt.plugins.hook_registry import HookRegistry
    try:
        plugin.register()
    except SystemExit as exc:
        print("SWALLOWED SystemExit(%s)" % exc.code, flush=True)
    HookRegistry.apply_hooks()
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    TritonAttnBackend(None)
    print("BACKEND BUILT", flush=True)
    """
)


def test_broken_library_stops_a_scheduler_process(fake_libs):
    env = clean_env(KDTREE_VERIFY="on", KDTREE_LIB=str(fake_libs.missing_symbol))
    proc = run_python(_SCHEDULER, env, timeout=300)
    assert "CHILD EXIT 78" in proc.stdout, (proc.stdout, proc.stderr[-3000:])
    assert "scheduler died during initialization (exit code: 78)" in proc.stdout
    assert "lacks the symbol(s) kdtree_verify_run" in proc.stderr
    # the swallowed-exit simulation
    assert "SWALLOWED SystemExit(78)" in proc.stdout
    assert "BACKEND BUILT" not in proc.stdout
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert "lacks the symbol(s) kdtree_verify_run" in proc.stderr.strip().splitlines()[-1]


def test_broken_library_stops_plain_sglang_launch_server(fake_libs, tmp_path):
    # The package installed, the operator starts SGLang directly (no launcher): the main process
    # stops in load_plugins(), before SGLang parses its arguments or loads a model.
    import subprocess
    import sys

    env = clean_env(KDTREE_VERIFY="validate", KDTREE_LIB=str(fake_libs.wrong_abi))
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tmp_path / "no-model"), "--port", "1"],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 78, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "has ABI version" in last and str(fake_libs.wrong_abi) in last
    assert "no-model" not in proc.stderr  # SGLang never got to its arguments


def test_plugin_warns_of_a_diagnostics_library(fake_libs):
    # A --pipe-factor (or --profiler) library runs correct but slowed or instrumented kernels: the
    # plugin's start-up says so in one line; a release library gets none.
    for lib, expect in ((fake_libs.diagnostics, True), (fake_libs.good, False)):
        env = clean_env(KDTREE_TESTING="1", KDTREE_FAKE_GPU_CAPABILITY="9.0", KDTREE_VERIFY="on", KDTREE_LIB=str(lib))
        proc = run_python("from sglang.srt.plugins import load_plugins; load_plugins()", env, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = [ln for ln in proc.stderr.splitlines() if "is a diagnostics build" in ln]
        assert len(lines) == int(expect), proc.stderr[-3000:]
        if expect:
            assert "(pipe3)" in lines[0] and "never serve with it" in lines[0] and str(lib) in lines[0]


def test_plugin_names_a_gpu_that_runs_the_jit_compiled_ptx(fake_libs):
    # A GPU newer than every SASS arch of the library (13.0) runs the portable kernel from its
    # compute_120 PTX: the plugin's start-up says so, per GPU; a GPU with SASS (12.0) gets no line.
    env = clean_env(KDTREE_TESTING="1", KDTREE_FAKE_GPU_CAPABILITY="12.0,13.0", KDTREE_VERIFY="on",
                    KDTREE_LIB=str(fake_libs.with_ptx))
    proc = run_python("from sglang.srt.plugins import load_plugins; load_plugins()", env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "has no machine code in the kernel library" in ln]
    assert len(lines) == 1 and "GPU 1" in lines[0] and "compute capability 13.0" in lines[0], proc.stderr[-3000:]
    assert "compute_120 PTX, JIT-compiled by the CUDA driver" in lines[0]
    assert "sm_90, sm_100, sm_120 + compute_120 PTX" in proc.stderr
