"""Hook modes, metrics, logs and the device-side stats ring (issue 4, item 6), on CPU.

Two parts:

* `test_backend_cases_in_subprocess` runs `tests/sglang/test_hook_backend_cpu.py` (real sglang 0.5.23
  `TritonAttnBackend`, SGLang's Triton kernel on CPU) in ONE subprocess with
  `TRITON_INTERPRET=1`, so the interpreter setting cannot leak into this process or other test
  modules, and sglang's ~10 s import is paid once.
* The rest are in-process unit tests of shadow.py / metrics.py / logs.py (no sglang import).
"""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_backend_cases_in_subprocess():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDTREE_")}
    env.update(
        TRITON_INTERPRET="1",
        KDTREE_HOOK_BACKEND_CPU="1",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W", "ignore",
         str(ROOT / "tests" / "sglang" / "test_hook_backend_cpu.py")],
        cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.split("\n")[-2], tail


# --- shadow: settings and sampler ------------------------------------------------------------
def test_read_settings_defaults_and_errors():
    from kdtree_backend.sglang import shadow
    from kdtree_backend.errors import KdtreeModeError

    s = shadow.read_settings({})
    assert (s.sample_rate, s.atol, s.rtol) == (1.0, 2e-2, 2e-2)
    s = shadow.read_settings({"KDTREE_VALIDATE_SAMPLE_RATE": " 0.25 ", "KDTREE_VALIDATE_ATOL": "1e-3",
                              "KDTREE_VALIDATE_RTOL": "0"})
    assert (s.sample_rate, s.atol, s.rtol) == (0.25, 1e-3, 0.0)
    for name, bad in [("KDTREE_VALIDATE_SAMPLE_RATE", "0"), ("KDTREE_VALIDATE_SAMPLE_RATE", "1.5"),
                      ("KDTREE_VALIDATE_SAMPLE_RATE", "x"), ("KDTREE_VALIDATE_ATOL", "-1"),
                      ("KDTREE_VALIDATE_RTOL", "nan")]:
        with pytest.raises(KdtreeModeError):
            shadow.read_settings({name: bad})


def test_sampler_is_exact():
    from kdtree_backend.sglang.shadow import Sampler

    for rate, n in [(1.0, 10), (0.5, 10), (0.25, 100), (0.1, 1000)]:
        s = Sampler(rate)
        assert sum(s() for _ in range(n)) == round(rate * n)


# --- shadow: the device stats row and ring -----------------------------------------------------
def test_compare_row_values():
    from kdtree_backend.sglang import shadow

    torch.manual_seed(0)
    ctrl = torch.randn(6, 2 * 512).to(torch.bfloat16)
    cand = ctrl.clone()
    cand[4, 512 + 7] += 0.5
    row = shadow.compare_row(cand, ctrl, rtol=0.0, heads=2).tolist()
    d = cand.float() - ctrl.float()
    assert row[shadow.F_MAX_ABS] == pytest.approx(d.abs().max().item())
    assert row[shadow.F_ARGMAX] == 4 * 1024 + 512 + 7
    assert row[shadow.F_REL] == pytest.approx(d.norm().item() / ctrl.float().norm().item(), rel=1e-6)
    assert row[shadow.F_CAND_AT] == pytest.approx(cand[4, 512 + 7].item())
    assert row[shadow.F_CTRL_AT] == pytest.approx(ctrl[4, 512 + 7].item())
    assert (row[shadow.F_ROWS], row[shadow.F_COLS], row[shadow.F_HEADS]) == (6, 1024, 2)
    assert row[shadow.F_CAND_NF] == 0 and row[shadow.F_CTRL_NF] == 0
    cand[0, 0] = float("nan")
    cand[1, 1] = float("inf")
    row = shadow.compare_row(cand, ctrl, rtol=0.0, heads=2).tolist()
    assert row[shadow.F_CAND_NF] == 2 and math.isinf(row[shadow.F_MAX_ABS])
    assert math.isinf(row[shadow.F_EXCESS])


def _store(ring=4, **settings):
    from kdtree_backend.sglang import shadow

    st = shadow.StatsStore("cpu", start_layer=3, layer_num=2, settings=shadow.Settings(**settings), ring=ring)
    st.keep_published = 100
    return st


@pytest.fixture
def reg():
    from prometheus_client import CollectorRegistry

    from kdtree_backend.sglang import logs
    from kdtree_backend.sglang import metrics

    r = CollectorRegistry()
    metrics.init(r)
    logs.reset_for_tests()
    yield r
    metrics.init(CollectorRegistry())


def _v(reg, name, **labels):
    return reg.get_sample_value(name, labels) or 0.0


def test_ring_publishes_each_sample_once_and_counts_drops(reg):
    st = _store(ring=4, atol=0.1, rtol=0.0)
    ctrl = torch.zeros(2, 512)
    for i in range(3):
        assert st.record(3, ctrl + 0.01 * i, ctrl, heads=1)
    assert st.record(4, ctrl + 1.0, ctrl, heads=1)  # exceeded
    assert not st.record(9, ctrl, ctrl, heads=1)  # layer outside the store
    assert st.poll(force=True) == 4
    assert st.poll(force=True) == 0  # nothing new: nothing republished
    assert [s["layer_id"] for s in st.published] == [3, 3, 3, 4]
    assert [s["seq"] for s in st.published] == [1, 2, 3, 1]
    assert _v(reg, "kdtree_attention_validations_total", outcome="within_tolerance") == 3
    assert _v(reg, "kdtree_attention_validations_total", outcome="exceeded") == 1
    assert _v(reg, "kdtree_attention_validation_max_abs_diff_count") == 4
    # 6 more for layer 3 between two polls with a ring of 4: 2 dropped, 4 published
    for _ in range(6):
        st.record(3, ctrl, ctrl, heads=1)
    assert st.flush() == 4
    assert _v(reg, "kdtree_attention_validations_total", outcome="dropped") == 2
    assert [s["seq"] for s in st.published[-4:]] == [6, 7, 8, 9]


def test_exceeded_is_per_element_allclose(reg):
    # |d| = 0.3 at a control value of 10: within atol=0.1 + rtol=0.05*10 = 0.6
    st = _store(atol=0.1, rtol=0.05)
    ctrl = torch.zeros(1, 512)
    ctrl[0, 5] = 10.0
    cand = ctrl.clone()
    cand[0, 5] += 0.3
    st.record(3, cand, ctrl, heads=1)
    cand2 = ctrl.clone()
    cand2[0, 6] += 0.3  # at a control value of 0: 0.3 > 0.1
    st.record(3, cand2, ctrl, heads=1)
    st.flush()
    assert [s["outcome"] for s in st.published] == ["within_tolerance", "exceeded"]


def test_exceeded_log_is_rate_limited(reg):
    from kdtree_backend.sglang import logs

    lg = logging.getLogger("kdtree_backend")
    msgs = []

    class H(logging.Handler):
        def emit(self, record):
            msgs.append(json.loads(record.getMessage()))

    h = H()
    lg.addHandler(h)
    old = lg.level
    lg.setLevel(logging.INFO)
    try:
        logs.exceeded_limiter = logs.RateLimiter(interval_s=3600, burst=2)
        st = _store(atol=0.0, rtol=0.0)
        ctrl = torch.zeros(1, 1024)
        for _ in range(4):
            st.record(4, ctrl + 1, ctrl, heads=2)
        st.flush()
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)
    ev = [m for m in msgs if m["event"] == "kdtree_validation_exceeded"]
    assert len(ev) == 2 and ev[0]["layer_id"] == 4 and ev[0]["heads"] == 2
    assert _v(reg, "kdtree_attention_validations_total", outcome="exceeded") == 4


def test_rate_limiter_refills():
    from kdtree_backend.sglang.logs import RateLimiter

    t = [0.0]
    rl = RateLimiter(interval_s=10, burst=1, clock=lambda: t[0])
    assert rl.allow() == 0
    assert rl.allow() is None and rl.allow() is None
    t[0] = 10.0
    assert rl.allow() == 2


def test_logs_are_json_through_stdlib_without_global_configure():
    import structlog

    from kdtree_backend.sglang import logs

    before = structlog.get_config()
    logs.reset_for_tests()
    lg = logging.getLogger("kdtree_backend")
    msgs = []

    class H(logging.Handler):
        def emit(self, record):
            msgs.append((record.name, record.levelno, record.getMessage()))

    h = H()
    lg.addHandler(h)
    old = lg.level
    lg.setLevel(logging.INFO)
    try:
        assert logs.fallback("kv_dtype", mode="validate", layer_id=3)
        assert not logs.fallback("kv_dtype", mode="validate", layer_id=4)
        assert logs.startup(mode="on", arch="sm_90")
        assert not logs.startup(mode="on", arch="sm_90")
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)
    assert structlog.get_config() == before
    assert [m[0] for m in msgs] == ["kdtree_backend", "kdtree_backend"]
    first = json.loads(msgs[0][2])
    assert first["event"] == "kdtree_fallback" and first["reason"] == "kv_dtype" and first["layer_id"] == 3
    assert first["level"] == "info" and "timestamp" in first
    assert json.loads(msgs[1][2])["event"] == "kdtree_startup"


def test_metrics_names_and_lazy_import():
    """Importing the hook does not import prometheus_client (main-process hazard)."""
    code = (
        "import sys, kdtree_backend.sglang.hook, kdtree_backend.sglang.shadow, kdtree_backend.sglang.metrics;"
        "assert 'prometheus_client' not in sys.modules, 'prometheus_client imported at import time'"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDTREE_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]

    from prometheus_client import CollectorRegistry, generate_latest

    from kdtree_backend.sglang import metrics

    r = CollectorRegistry()
    metrics.init(r)
    try:
        metrics.count_call("validate", "shadow")
        metrics.count_fallback("kv_dtype")
        metrics.count_validation("exceeded")
        metrics.observe_diff(0.01, 0.001)
        metrics.count_nonfinite()
        metrics.set_build_info("0.1.0", "validate", "sm_90")
        text = generate_latest(r).decode()
    finally:
        metrics.init(CollectorRegistry())
    for name in ("kdtree_attention_validation_max_abs_diff_bucket", "kdtree_attention_validation_relative_error_bucket",
                 "kdtree_attention_validations_total", "kdtree_attention_fallbacks_total",
                 "kdtree_attention_calls_total", "kdtree_attention_build_info",
                 "kdtree_attention_validation_nonfinite_total"):
        assert name in text, name
    assert 'kdtree_attention_calls_total{mode="validate",path="shadow"} 1.0' in text
    assert 'kdtree_attention_build_info{arch="sm_90",mode="validate",version="0.1.0"} 1.0' in text


def test_metrics_multiprocess_mode(tmp_path):
    """Under PROMETHEUS_MULTIPROC_DIR (SGLang --enable-metrics) the metrics land in the shared
    directory and aggregate like SGLang's own; the build-info gauge is livemax."""
    code = (
        "from kdtree_backend.sglang import metrics;"
        "metrics.count_call('on','kdtree'); metrics.set_build_info('0.1.0','on','sm_90');"
        "metrics.observe_diff(0.5, 0.01);"
        "from prometheus_client import CollectorRegistry, generate_latest, multiprocess;"
        "r=CollectorRegistry(); multiprocess.MultiProcessCollector(r);"
        "print(generate_latest(r).decode())"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDTREE_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PROMETHEUS_MULTIPROC_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert 'kdtree_attention_calls_total{mode="on",path="kdtree"} 1.0' in proc.stdout
    assert 'kdtree_attention_build_info{arch="sm_90",mode="on",version="0.1.0"} 1.0' in proc.stdout
    assert "kdtree_attention_validation_max_abs_diff_count 1.0" in proc.stdout


def test_hook_off_mode_is_passthrough():
    from kdtree_backend.sglang import hook
    from kdtree_backend.sglang import logs
    from kdtree_backend.config import Mode

    logs.reset_for_tests()
    hook.reset_for_tests(mode=Mode.OFF)
    try:
        calls = []

        def original(self, q, k, v, layer, fb, save_kv_cache=True, **kw):
            calls.append((self, q, save_kv_cache, kw))
            return "orig"

        assert hook.forward_extend_hook(original, "self", "q", "k", "v", "layer", "fb", save_kv_cache=False, sinks=None) == "orig"
        assert calls == [("self", "q", False, {"sinks": None})]
        assert hook.is_kdtree_hook(hook.forward_extend_hook)
    finally:
        hook.reset_for_tests()
