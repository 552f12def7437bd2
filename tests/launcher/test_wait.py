"""kdtree-wait: waits for a URL while watching a PID or a systemd unit (real processes, loopback only).

The unit case uses stand-in `systemctl`/`journalctl` scripts on PATH (no systemd runs in CI).
The console script `kdtree-wait` is `python -m kdtree_backend.launcher.wait`; the module form is used here
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

ROOT = Path(__file__).resolve().parents[2]
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
    proc = subprocess.run([sys.executable, "-m", "kdtree_backend.launcher.wait", *args], capture_output=True, text=True,
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


def test_pid_that_does_not_exist_is_not_called_exited(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # reaped: the number is free
    (tmp_path / "server.log").write_text("Traceback (most recent call last):\nRuntimeError: died at once\n")
    proc, elapsed = wait_cmd(url(free_port()), "--pid", str(p.pid), "--log", str(tmp_path / "server.log"),
                             "--timeout", "30")
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"kdtree-wait: error: pid {p.pid} does not exist (no such process: it never existed, "
                           f"or exited before kdtree-wait started)"), proc.stderr
    assert "has exited" not in proc.stderr
    assert "RuntimeError: died at once" in proc.stderr  # a server that died before the wait: its log still helps
    assert elapsed < 5  # at once, not after --timeout


@pytest.mark.parametrize(
    "args, needle",
    [
        # a negative --tail used to crash with a traceback when the server died
        (["--tail", "-1"], "kdtree-wait: error: argument --tail: '-1' is not a number of lines (0 or more"),
        (["--tail", "many"], "kdtree-wait: error: argument --tail: 'many' is not a number of lines"),
        # a URL without a scheme used to be probed (and fail) until the deadline
        (["localhost:30000"], "kdtree-wait: error: argument url: 'localhost:30000' has no scheme; "
                              "write http://localhost:30000/health_generate (or https://)"),
        (["127.0.0.1:8000/health"], "has no scheme; write http://127.0.0.1:8000/health (or https://)"),
        (["ftp://127.0.0.1/x"], "'ftp://127.0.0.1/x' is not an http(s) URL"),
        # kill(0, ...) and kill(-1, ...) address process groups: "alive" forever
        (["--pid", "0"], "kdtree-wait: error: argument --pid: '0' is not a process id"),
        (["--pid", "-1"], "kdtree-wait: error: argument --pid: '-1' is not a process id"),
    ],
)
def test_usage_errors_are_one_line_and_immediate(args, needle):
    proc, elapsed = wait_cmd(*args, "--timeout", "30")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("kdtree-wait: error: ") and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert elapsed < 5


def test_tail_0_prints_no_log_lines(tmp_path):
    fake, port = start_fake(tmp_path, "crash", after="0.3")
    try:
        proc, _ = wait_cmd(url(port), "--pid", str(fake.pid), "--log", str(tmp_path / "server.log"), "--tail", "0",
                           "--interval", "0.2")
        assert proc.returncode == 1, proc.stderr
        assert "RuntimeError" not in proc.stderr and "has exited" in proc.stderr
    finally:
        fake.kill()
        fake.wait()


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
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


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
    proc = subprocess.Popen([sys.executable, "-m", "kdtree_backend.launcher.wait", url(port), "--unit", "sglang.service",
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
