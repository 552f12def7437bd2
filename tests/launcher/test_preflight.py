"""The launcher's checks before anything heavy: mode/library first, then SGLang's own parser and resolution.

The pure flag analysis is tested in-process. The end-to-end cases run the real launcher against the
real sglang 0.5.23 (CPU build) with a local DeepSeek-V3-style config.json folder
(tests/fixtures_ops/dsv3_tiny) and HF_HUB_OFFLINE=1; each of those processes imports sglang
(5-15 s on 2 cores), so they are few. SGLang itself is never started: KDTREE_LAUNCH_CHILD_CMD points
at the fake server, and the tests check whether it was reached.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import fake_launch_env

from kdtree_backend.launcher.preflight import analyze_flags, explain_exception, suggest_flag

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "launch_with_kdtree.py"
MODEL = ROOT / "tests" / "fixtures_ops" / "dsv3_tiny"

OPTIONS = {
    "-h", "--help", "--model-path", "--port", "--host", "--speculative-algorithm", "--speculative-num-steps",
    "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--speculative-draft-model-path",
    "--enable-metrics", "--tp-size", "--tensor-parallel-size", "--mem-fraction-static", "--context-length",
}


# ------------------------------------------------------------------------------------------------
# pure
# ------------------------------------------------------------------------------------------------


def test_suggest_vllm_spelling_first():
    assert suggest_flag("--num-speculative-tokens", OPTIONS) == ("--speculative-num-draft-tokens", "vLLM's spelling")
    assert suggest_flag("--gpu-memory-utilization", OPTIONS) == ("--mem-fraction-static", "vLLM's spelling")
    assert suggest_flag("--max-model-len", OPTIONS) == ("--context-length", "vLLM's spelling")
    assert suggest_flag("--speculative_num_steps", OPTIONS)[0] == "--speculative-num-steps"
    assert suggest_flag("--speculativ-num-steps", OPTIONS)[0] == "--speculative-num-steps"
    assert suggest_flag("--completely-unrelated-xyz", OPTIONS) == (None, "")


def test_analyze_flags():
    errors, warnings = analyze_flags(["--model-path", "m", "--speculative-algo", "EAGLE", "--port=1"], OPTIONS)
    assert errors == []
    assert warnings == [
        "warning: --speculative-algo is not an SGLang flag; argparse silently reads it as an abbreviation of "
        "--speculative-algorithm. Fix: spell out --speculative-algorithm."
    ]
    errors, _ = analyze_flags(["--speculative-num", "3"], OPTIONS)
    assert errors == ["--speculative-num is ambiguous: it abbreviates --speculative-num-draft-tokens, "
                      "--speculative-num-steps|spell out the flag you mean"]
    errors, _ = analyze_flags(["--num-speculative-tokens", "4", "--bogus-flag-zz"], OPTIONS)
    assert errors == ["unknown SGLang arguments --num-speculative-tokens (vLLM's spelling), --bogus-flag-zz|"
                      "use --speculative-num-draft-tokens instead of --num-speculative-tokens; "
                      "remove --bogus-flag-zz (no similar SGLang flag; see --help)"]
    # values and everything after a bare -- are not judged
    assert analyze_flags(["--model-path", "m", "--", "--whatever"], OPTIONS) == ([], [])


def test_explain_value_error_and_generic_assertion():
    class SA:
        model_path = "/m"
        speculative_num_steps = 3
        speculative_eagle_topk = 4
        speculative_num_draft_tokens = 8

    try:
        raise ValueError("trtllm_mha backend only supports topk = 1 for speculative decoding.")
    except ValueError as exc:
        err = explain_exception(exc, SA())
    assert str(err).startswith("kdtree-backend: SGLang rejected the arguments (test_preflight.py:")
    assert str(err).endswith("): trtllm_mha backend only supports topk = 1 for speculative decoding. "
                             "Fix: change the options the message names.")
    try:
        assert SA.speculative_num_steps > 5
    except AssertionError as exc:
        err = explain_exception(exc, SA())
    assert "`assert SA.speculative_num_steps > 5`" in str(err) and err.exit_code == 78
    try:
        open("/nonexistent/config.json")
    except OSError as exc:
        err = explain_exception(exc, SA())
    assert str(err).startswith("kdtree-backend: cannot read the model configuration for --model-path /m:")


# ------------------------------------------------------------------------------------------------
# real processes
# ------------------------------------------------------------------------------------------------


def env_for(tmp_path, **extra) -> dict:
    return fake_launch_env(tmp_path, **{"FAKE_MODE": "crash", "FAKE_AFTER": "0.1", **extra})


def launch(tmp_path, args, timeout=120, **extra):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(LAUNCHER), *args], env=env_for(tmp_path, **extra),
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return proc, time.monotonic() - t0


BASE = ["--model-path", str(MODEL), "--device", "cpu"]


@pytest.mark.timeout(180)
def test_vllm_flag_gets_the_sglang_spelling(tmp_path):
    proc, _ = launch(tmp_path, [*BASE, "--speculative-algorithm", "EAGLE", "--num-speculative-tokens", "4"])
    assert proc.returncode == 78, proc.stderr
    assert proc.stderr.strip() == (
        "kdtree-backend: unknown SGLang argument --num-speculative-tokens (vLLM's spelling). "
        "Fix: use --speculative-num-draft-tokens instead of --num-speculative-tokens."
    )
    assert not (tmp_path / "record.json").exists()  # SGLang never started


@pytest.mark.timeout(180)
def test_bare_speculative_assertion_becomes_one_line(tmp_path):
    proc, _ = launch(tmp_path, [*BASE, "--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "4"])
    assert proc.returncode == 78, proc.stderr
    assert proc.stderr.strip() == (
        "kdtree-backend: --speculative-eagle-topk 4 was given without --speculative-num-steps "
        "(SGLang's bare assertion at speculative_hook.py:1162). Fix: give all three of --speculative-num-steps, "
        "--speculative-eagle-topk and --speculative-num-draft-tokens (e.g. 3, 4, 8), or none of them to let "
        "SGLang choose."
    )
    assert not (tmp_path / "record.json").exists()


@pytest.mark.timeout(180)
def test_good_arguments_pass_with_prefix_warning_and_reach_sglang_untouched(tmp_path):
    args = [*BASE, "--port", "31999", "--speculative-algo", "EAGLE", "--speculative-num-steps", "3",
            "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8", "--kdtree-tail-lines", "10"]
    proc, _ = launch(tmp_path, args)
    assert proc.returncode == 1, proc.stderr  # the fake crashes on purpose once started
    lines = proc.stderr.splitlines()
    assert lines[0] == ("kdtree launcher: warning: --speculative-algo is not an SGLang flag; argparse silently "
                        "reads it as an abbreviation of --speculative-algorithm. Fix: spell out --speculative-algorithm.")
    assert lines[1] == "kdtree launcher: preflight passed: KDTREE_VERIFY=off, SGLang arguments parsed and resolved"
    assert "waiting for http://127.0.0.1:31999/health_generate" in lines[2]  # host/port from SGLang's parser
    assert json.loads((tmp_path / "record.json").read_text())["argv"] == args[:-2]


@pytest.mark.timeout(180)
def test_validate_mode_without_enable_metrics_is_refused(tmp_path):
    result = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kdtree_backend.launcher.preflight", "--result", str(result), "--mode", "validate",
         "--", *BASE],
        env=env_for(tmp_path), capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert proc.returncode == 78, proc.stderr
    out = json.loads(result.read_text())
    from kdtree_backend.errors import KdtreeConfigError

    assert str(KdtreeConfigError(out["cause"], out["fix"])) == (
        "kdtree-backend: KDTREE_VERIFY=validate publishes its comparison through SGLang's /metrics, which exists "
        "only with --enable-metrics, and it is not set. Fix: add --enable-metrics to the SGLang arguments "
        "(or set KDTREE_VERIFY=off)."
    )


@pytest.mark.timeout(180)
def test_help_shows_launcher_and_sglang_help(tmp_path):
    proc, _ = launch(tmp_path, ["--help"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python launch_with_kdtree.py")
    assert "KDTREE_START_TIMEOUT" in proc.stdout
    assert "--speculative-num-draft-tokens" in proc.stdout  # SGLang's own help
    assert "--model-path MODEL_PATH" in proc.stdout


def test_bogus_mode_fails_first_even_for_help(tmp_path):
    proc, elapsed = launch(tmp_path, ["--help"], KDTREE_VERIFY="bogus")
    assert proc.returncode == 78
    assert proc.stdout == ""
    assert proc.stderr.strip() == (
        "kdtree-backend: KDTREE_VERIFY='bogus' is not a valid value; valid values are: off, validate, on. "
        "Fix: set KDTREE_VERIFY to one of: off, validate, on (or unset it for the default)."
    )
    assert elapsed < 5


def test_missing_library_fails_in_seconds_before_sglang_is_imported(tmp_path):
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "from kdtree_backend.launcher.main import main\n"
        "rc = main(['--model-path', 'x'])\n"
        "print('SGLANG_IMPORTED' if any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules) else 'CLEAN')\n"
        "sys.exit(rc)\n" % str(ROOT)
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=env_for(tmp_path, KDTREE_VERIFY="on",
                                                                   KDTREE_LIB="/nonexistent/libx.so"),
                          capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 78, proc.stderr
    assert "/nonexistent/libx.so" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stdout.strip() == "CLEAN"
    assert elapsed < 5
    assert not (tmp_path / "record.json").exists()
    # and the real entry script, as an operator types it
    proc, elapsed = launch(tmp_path, ["--model-path", "x"], KDTREE_VERIFY="on", KDTREE_LIB="/nonexistent/libx.so")
    assert proc.returncode == 78 and "/nonexistent/libx.so" in proc.stderr and elapsed < 5


@pytest.mark.timeout(180)
def test_on_mode_with_a_backend_that_never_reaches_the_kernel_is_refused(tmp_path):
    result = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kdtree_backend.launcher.preflight", "--result", str(result), "--mode", "on",
         "--", *BASE, "--speculative-algorithm", "EAGLE"],
        env=env_for(tmp_path), capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert proc.returncode == 78, proc.stderr
    out = json.loads(result.read_text())
    from kdtree_backend.errors import KdtreeConfigError

    assert str(KdtreeConfigError(out["cause"], out["fix"])) == (
        "kdtree-backend: KDTREE_VERIFY=on, but SGLang resolved the attention backend to 'torch_native', so target "
        "verify never reaches TritonAttnBackend and the kdtree kernel would never run. Fix: add --attention-backend triton (the kdtree kernel replaces the Triton "
        "backend's verify attention), or set KDTREE_VERIFY=off to serve without the kernel."
    )
    # and with the Triton backend and speculation the same mode passes, without warnings
    proc = subprocess.run(
        [sys.executable, "-m", "kdtree_backend.launcher.preflight", "--result", str(result), "--mode", "on",
         "--", *BASE, "--attention-backend", "triton", "--speculative-algorithm", "EAGLE",
         "--speculative-num-steps", "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"],
        env=env_for(tmp_path), capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(result.read_text())
    assert out["status"] == "ok" and out["warnings"] == [], out


@pytest.mark.timeout(180)
def test_values_sglang_silently_replaces_are_warned_about(tmp_path):
    result = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kdtree_backend.launcher.preflight", "--result", str(result), "--mode", "off",
         "--", *BASE, "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3",
         "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "8"],
        env=env_for(tmp_path), capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(result.read_text())
    assert out["warnings"] == [
        "warning: SGLang replaced --speculative-num-draft-tokens 8 by 4 while resolving the arguments. "
        "Fix: pass --speculative-num-draft-tokens 4 explicitly, or change the options that force it."
    ]


def test_broken_library_fails_in_seconds_with_one_line(tmp_path):
    lib = tmp_path / "libkdtree_verify.so"
    lib.write_bytes(b"this is not an ELF file\n")
    proc, elapsed = launch(tmp_path, ["--model-path", "x"], KDTREE_VERIFY="validate", KDTREE_LIB=str(lib))
    assert proc.returncode == 78, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(lib) in lines[0] and "Fix: " in lines[0], proc.stderr
    assert elapsed < 5
    assert not (tmp_path / "record.json").exists()
