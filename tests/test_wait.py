"""kdtree-wait: waits for a URL while watching a PID or a systemd unit (real processes, loopback only).

The unit case uses stand-in `systemctl`/`journalctl` scripts on PATH (no systemd runs in CI).
The console script `kdtree-wait` is `python -m kdtree_backend.wait`; the module form is used here
so the tests do not depend on the package's scripts being installed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "fixtures_ops" / "fake_server.py"

pytestmark = pytest.mark.timeout(60)


def start_fake(tmp_path, mode, after="1.0", **env):
    port = free_port()
    log = open(tmp_path / "server.log", "wb")
    e = dict(os.environ, FAKE_MODE=mode, FAKE_AFTER=after, PYTHONUNBUFFERED="1", **env)
    proc = subprocess.Popen([sys.executable, str(FAKE), "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env=e)
    log.close()
    return proc, port


def wait_cmd(*args, env=None, timeout=40):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kdtree_backend.wait", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)
    return proc, time.monotonic() - t0


def url(port):
    return f"http://127.0.0.1:{port}/health_generate"


def test_healthy_process(tmp_path):
    fake, port = start_fake(tmp_path, "healthy", after="1.0")
    try:
        proc, elapsed = wait_cmd(url(port), "--pid", str(fake.pid), "--interval", "0.2")
        assert proc.returncode == 0, proc.stderr
        assert f"{url(port)} is healthy (HTTP 200) after" in proc.stderr
        assert "waiting for" in proc.stderr  # the progress line
        assert elapsed >= 1.0
    finally:
        fake.kill()
        fake.wait()


def test_dead_process_is_reported_at_once_with_log_tail(tmp_path):
    rec = tmp_path / "record.json"
    fake, port = start_fake(tmp_path, "crash", after="1.0", FAKE_RECORD=str(rec))
    try:
        proc, _ = wait_cmd(url(port), "--pid", str(fake.pid), "--log", str(tmp_path / "server.log"),
                           "--interval", "0.2")
        exited_at = time.time()
        assert proc.returncode == 1, proc.stderr
        detection = exited_at - json.loads(rec.read_text())["crash_at"]
        assert 0 < detection < 3.0, detection
        assert "last" in proc.stderr and "RuntimeError: fake crash during load" in proc.stderr
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"kdtree-wait: error: pid {fake.pid} has exited")
        assert "last probe: connection refused" in last
    finally:
        fake.kill()
        fake.wait()


def test_missing_pid(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # reaped: the number is free
    proc, elapsed = wait_cmd(url(free_port()), "--pid", str(p.pid))
    assert proc.returncode == 1 and f"pid {p.pid} has exited" in proc.stderr
    assert elapsed < 5


def test_deadline(tmp_path):
    fake, port = start_fake(tmp_path, "hang")
    try:
        proc, _ = wait_cmd(url(port), "--pid", str(fake.pid), "--timeout", "1", "--interval", "0.2",
                           "--log", str(tmp_path / "server.log"))
        assert proc.returncode == 124, proc.stderr
        assert "was not healthy within 1 s (last probe: HTTP 503" in proc.stderr
        assert "fake server: loading weights" in proc.stderr  # log tail on the deadline too
    finally:
        fake.kill()
        fake.wait()


def test_usage_error():
    proc, _ = wait_cmd("--timeout", "soon")
    assert proc.returncode == 2 and "not a positive duration" in proc.stderr


def _fake_systemd(tmp_path) -> dict:
    """systemctl/journalctl stand-ins reading the unit's state from files the test writes."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    state = tmp_path / "unit.state"
    (bindir / "systemctl").write_text(
        "#!/bin/sh\n"
        f"cat {state}\n"
    )
    (bindir / "journalctl").write_text(
        "#!/bin/sh\n"
        "echo 'Nov 30 sglang[42]: Traceback (most recent call last):'\n"
        "echo 'Nov 30 sglang[42]: RuntimeError: scheduler died during initialization'\n"
    )
    for f in ("systemctl", "journalctl"):
        (bindir / f).chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return env, state


def _unit_state(active, sub, result="success", restarts=0, status=0):
    return (f"LoadState=loaded\nActiveState={active}\nSubState={sub}\nResult={result}\nMainPID=42\n"
            f"ExecMainStatus={status}\nNRestarts={restarts}\n")


def test_unit_that_fails_is_reported_with_journal(tmp_path):
    env, state = _fake_systemd(tmp_path)
    state.write_text(_unit_state("activating", "start"))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kdtree_backend.wait", url(port), "--unit", "sglang.service",
                             "--interval", "0.2"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    assert proc.poll() is None  # still waiting while the unit is activating
    t_fail = time.monotonic()
    state.write_text(_unit_state("failed", "failed", result="exit-code", status=1))
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 1, err
    assert time.monotonic() - t_fail < 3
    assert "RuntimeError: scheduler died during initialization" in err
    assert "unit sglang.service failed: Result=exit-code, main process status 1" in err.strip().splitlines()[-1]


def test_unit_auto_restart_counts_as_death(tmp_path):
    env, state = _fake_systemd(tmp_path)
    state.write_text(_unit_state("activating", "auto-restart", result="exit-code", restarts=1, status=1))
    proc, _ = wait_cmd(url(free_port()), "--unit", "sglang.service", "--no-journal", env=env)
    assert proc.returncode == 1
    assert "main process died and systemd is restarting it" in proc.stderr
    assert "journalctl" not in proc.stderr


def test_unit_active_and_healthy(tmp_path):
    env, state = _fake_systemd(tmp_path)
    state.write_text(_unit_state("active", "running"))
    fake, port = start_fake(tmp_path, "healthy", after="0.3")
    try:
        proc, _ = wait_cmd(url(port), "--unit", "sglang.service", "--interval", "0.2", env=env)
        assert proc.returncode == 0, proc.stderr
    finally:
        fake.send_signal(signal.SIGTERM)
        fake.wait()
