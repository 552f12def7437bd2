"""`python -m kdtree_backend doctor` / `kdtree-doctor`: exit 0 only when the mode can run here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import clean_env


def _doctor(env, *, console_script=False):
    if console_script:
        exe = Path(sys.executable).parent / "kdtree-doctor"
        assert exe.is_file(), f"console script {exe} is missing: pip install -e . into this interpreter"
        cmd = [str(exe)]
    else:
        cmd = [sys.executable, "-m", "kdtree_backend", "doctor"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def test_off_is_ok_anywhere_even_without_a_library(fake_libs):
    proc = _doctor(clean_env(KDTREE_LIB=str(fake_libs.missing)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "KDTREE_VERIFY=off (default: unset)" in out
    assert "0.5.23 (supported)" in out
    assert str(fake_libs.missing) in out and "loads: NO" in out
    assert "not installed (KDTREE_VERIFY=off)" in out
    assert "RESULT: OK" in out


def test_validate_with_a_good_library_and_a_covered_gpu_is_ok(fake_libs):
    env = clean_env(KDTREE_VERIFY="validate", KDTREE_LIB=str(fake_libs.good), KDTREE_TESTING="1",
                    KDTREE_FAKE_GPU_CAPABILITY="9.0")
    proc = _doctor(env, console_script=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    from kdtree_backend.kernel import abi

    assert f"loads: yes; version fake-for-tests; ABI {abi.ABI_VERSION}; built for sm_90, sm_120" in out
    assert "compute capability 9.0 (supported by the library: sm_90 code)" in out
    assert "kernel path: portable" in out  # the fake library has no Hopper kernel: auto -> portable
    assert "TEST MODE" in out
    assert "would be active (validate) on sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend" in out
    assert "entry point" in out and "(installed)" in out


def test_a_diagnostics_library_is_flagged(fake_libs):
    # A --pipe-factor build loads and runs (correct, slowed on purpose): doctor says so, it is not an error.
    env = clean_env(KDTREE_VERIFY="validate", KDTREE_LIB=str(fake_libs.diagnostics), KDTREE_TESTING="1",
                    KDTREE_FAKE_GPU_CAPABILITY="9.0")
    proc = _doctor(env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "version 0.1.0+src.fake+pipe3" in proc.stdout
    assert "WARNING: a diagnostics build (pipe3)" in proc.stdout and "never serve with it" in proc.stdout
    good = _doctor(clean_env(KDTREE_VERIFY="validate", KDTREE_LIB=str(fake_libs.good), KDTREE_TESTING="1",
                             KDTREE_FAKE_GPU_CAPABILITY="9.0"))
    assert "diagnostics build" not in good.stdout


def test_on_without_a_gpu_fails(fake_libs):
    env = clean_env(KDTREE_VERIFY="on", KDTREE_LIB=str(fake_libs.good), KDTREE_TESTING="1",
                    KDTREE_FAKE_GPU_CAPABILITY="none")
    proc = _doctor(env)
    assert proc.returncode == 1
    assert "no GPU" in proc.stdout and "RESULT: KDTREE_VERIFY=on cannot run here" in proc.stdout


def test_on_with_an_uncovered_gpu_fails_naming_both(fake_libs):
    env = clean_env(KDTREE_VERIFY="on", KDTREE_LIB=str(fake_libs.sm120_only), KDTREE_TESTING="1",
                    KDTREE_FAKE_GPU_CAPABILITY="9.0")
    proc = _doctor(env)
    assert proc.returncode == 1
    assert "(NOT supported by the library)" in proc.stdout
    assert "built for sm_120" in proc.stdout and "compute capability 9.0" in proc.stdout


def test_validate_with_a_broken_library_fails(fake_libs):
    env = clean_env(KDTREE_VERIFY="validate", KDTREE_LIB=str(fake_libs.missing_symbol), KDTREE_TESTING="1",
                    KDTREE_FAKE_GPU_CAPABILITY="9.0")
    proc = _doctor(env)
    assert proc.returncode == 1
    assert "lacks the symbol(s) kdtree_verify_run" in proc.stdout
    assert "NOT active" in proc.stdout


def test_bad_mode_fails_naming_valid_values():
    proc = _doctor(clean_env(KDTREE_VERIFY="vaildate"))
    assert proc.returncode == 1
    assert "KDTREE_VERIFY='vaildate'" in proc.stdout and "off, validate, on" in proc.stdout


def test_fake_gpus_are_ignored_outside_test_mode(fake_libs):
    env = clean_env(KDTREE_VERIFY="validate", KDTREE_LIB=str(fake_libs.good), KDTREE_FAKE_GPU_CAPABILITY="9.0")
    proc = _doctor(env)
    assert "is set but ignored" in proc.stdout
    assert "TEST MODE" not in proc.stdout


def test_doctor_imports_neither_sglang_nor_torch():
    code = ("import sys, contextlib, io\nfrom kdtree_backend import doctor\n"
            "with contextlib.redirect_stdout(io.StringIO()): doctor.main([])\n"
            "print(sorted(m for m in ('sglang', 'torch') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_main_module_without_command_prints_usage():
    proc = subprocess.run([sys.executable, "-m", "kdtree_backend"], env=clean_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "doctor" in proc.stdout


def test_forced_hopper_path_without_the_hopper_kernel_fails_naming_the_fix(fake_libs):
    env = clean_env(KDTREE_VERIFY="on", KDTREE_KERNEL="hopper", KDTREE_LIB=str(fake_libs.good), KDTREE_TESTING="1",
                    KDTREE_FAKE_GPU_CAPABILITY="9.0")
    proc = _doctor(env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "kernel path: NONE" in proc.stdout
    assert "built without the Hopper kernel" in proc.stdout and "--arch 90" in proc.stdout


def test_bad_kernel_choice_fails_naming_valid_values(fake_libs):
    env = clean_env(KDTREE_VERIFY="validate", KDTREE_KERNEL="fastest", KDTREE_LIB=str(fake_libs.good),
                    KDTREE_TESTING="1", KDTREE_FAKE_GPU_CAPABILITY="9.0")
    proc = _doctor(env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "KDTREE_KERNEL" in proc.stdout and "'fastest'" in proc.stdout and "auto, portable, hopper" in proc.stdout


def test_doctor_runs_the_launchers_validation_of_every_variable(fake_libs):
    """Today's bug: the doctor said OK for KDTREE_VALIDATE_SAMPLE_RATE=abc, which the launcher refuses."""
    base = dict(KDTREE_VERIFY="validate", KDTREE_LIB=str(fake_libs.good), KDTREE_TESTING="1",
                KDTREE_FAKE_GPU_CAPABILITY="9.0")
    for extra, needle in [({"KDTREE_VALIDATE_SAMPLE_RATE": "abc"}, "KDTREE_VALIDATE_SAMPLE_RATE='abc'"),
                          ({"KDTREE_VALIDATE_ATOL": "-1"}, "KDTREE_VALIDATE_ATOL='-1'"),
                          ({"KDTREE_START_TIMEOUT": "soon"}, "KDTREE_START_TIMEOUT")]:
        proc = _doctor(clean_env(**base, **extra))
        assert proc.returncode == 1, proc.stdout
        assert needle in proc.stdout and "cannot run here" in proc.stdout, proc.stdout
    proc = _doctor(clean_env(**base, KDTREE_VERIFIY="on"))
    assert proc.returncode == 0 and "KDTREE_VERIFIY is not a kdtree-backend variable" in proc.stdout, proc.stdout


@pytest.mark.parametrize("cap, runs", [
    ("10.3", "(supported by the library: sm_100 code)"),  # B300: sm_100 SASS runs on 10.x
    ("12.1", "(supported by the library: sm_120 code)"),
    ("13.0", "(supported by the library: compute_120 PTX, JIT-compiled by the CUDA driver"),
])
def test_doctor_names_what_each_gpu_runs(fake_libs, cap, runs):
    env = clean_env(KDTREE_VERIFY="on", KDTREE_LIB=str(fake_libs.with_ptx), KDTREE_TESTING="1",
                    KDTREE_FAKE_GPU_CAPABILITY=cap)
    proc = _doctor(env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "built for sm_90, sm_100, sm_120 + compute_120 PTX" in proc.stdout
    assert f"compute capability {cap} {runs}" in proc.stdout
    assert "kernel path: portable" in proc.stdout


def test_doctor_refuses_a_gpu_that_neither_sass_nor_ptx_covers(fake_libs):
    # 11.0 (Jetson Thor): no sm_11x SASS, and compute_120 PTX does not JIT for an older capability.
    env = clean_env(KDTREE_VERIFY="on", KDTREE_LIB=str(fake_libs.with_ptx), KDTREE_TESTING="1",
                    KDTREE_FAKE_GPU_CAPABILITY="11.0")
    proc = _doctor(env)
    assert proc.returncode == 1
    assert "compute capability 11.0 (NOT supported by the library)" in proc.stdout
    assert "--arch 90 --arch 100" in proc.stdout  # the build whose newest arch's PTX JITs there
