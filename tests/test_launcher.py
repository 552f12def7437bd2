"""The launcher's process-aware readiness, with a fake SGLang (tests/fixtures_ops/fake_server.py).

Real processes, loopback only, bounded waits. These tests never import sglang: the argument
preflight is switched off (KDTREE_ARG_PREFLIGHT=0) and KDTREE_LAUNCH_CHILD_CMD replaces
`python -m sglang.launch_server` by the fake. The preflight itself is tested in test_preflight.py.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch_with_kdtree.py"
FAKE = ROOT / "tests" / "fixtures_ops" / "fake_server.py"

pytestmark = pytest.mark.timeout(60)


def launcher_env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KDTREE_", "FAKE_", "NOTIFY_SOCKET"))}
    env.update(
        KDTREE_VERIFY="off",
        KDTREE_ARG_PREFLIGHT="0",
        KDTREE_LAUNCH_CHILD_CMD=f"{sys.executable} {FAKE}",
        KDTREE_PROBE_INTERVAL="0.2",
        KDTREE_STOP_TIMEOUT="10",
        FAKE_RECORD=str(tmp_path / "record.json"),
        PYTHONUNBUFFERED="1",
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start(tmp_path, *args, **env):
    port = free_port()
    cmd = [sys.executable, str(LAUNCHER), "--model-path", "/models/none", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env=launcher_env(tmp_path, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    return proc, port


def record(tmp_path, timeout=10.0) -> dict:
    path = tmp_path / "record.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except ValueError:
                pass
        time.sleep(0.05)
    raise AssertionError("the fake server never wrote its record")


class NotifySocket:
    """A datagram socket standing in for systemd's notification socket."""

    def __init__(self, tmp_path, abstract=False):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"kdtree-test-{os.getpid()}-{time.monotonic_ns()}"
            self.sock.bind(b"\0" + name.encode())
            self.env_value = "@" + name
        else:
            path = str(tmp_path / "notify.sock")
            self.sock.bind(path)
            self.env_value = path
        self.messages = []

    def wait_for(self, needle: str, timeout: float) -> float:
        """Collect datagrams until one contains `needle`; returns when it arrived (monotonic)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(4096).decode()
            except socket.timeout:
                break
            self.messages.append(data)
            if needle in data.split("\n"):
                return time.monotonic()
        raise AssertionError(f"no {needle!r} in {self.messages}")

    def drain(self):
        self.sock.settimeout(0.05)
        try:
            while True:
                self.messages.append(self.sock.recv(4096).decode())
        except (socket.timeout, BlockingIOError):
            pass
        return self.messages

    def close(self):
        self.sock.close()


def finish(proc, timeout=15):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"launcher did not exit:\n{out}\n{err}")
    return proc.returncode, out, err


def test_crash_during_loading_is_reported_within_3s_with_traceback(tmp_path):
    proc, _ = start(tmp_path, FAKE_MODE="crash", FAKE_AFTER="1.0")
    rc, out, err = finish(proc)
    exited_at = time.time()
    assert rc == 1, err
    # from the crash (stamped by the fake just before it raises) to the launcher's exit: < 3 s
    detection = exited_at - record(tmp_path)["crash_at"]
    assert 0 < detection < 3.0, detection
    assert "RuntimeError: fake crash during load: CUDA error: out of memory (layer 17)" in err
    assert "in load_weights" in err  # the traceback itself, repeated in the tail
    last = err.strip().splitlines()[-1]
    assert last == "kdtree launcher: error: SGLang exited with code 1 during start-up after " + \
        last.split("after ", 1)[1].split(" s ", 1)[0] + " s (its output is above); exiting 1"
    # the child's own output was teed through as it happened
    assert "fake server: loading weights" in err
    assert "fake server: pid" in out


def test_ready_only_when_healthy_then_sigterm_is_forwarded(tmp_path):
    ns = NotifySocket(tmp_path)
    try:
        t0 = time.monotonic()
        proc, port = start(tmp_path, FAKE_MODE="healthy", FAKE_AFTER="1.5", NOTIFY_SOCKET=ns.env_value)
        ready_at = ns.wait_for("READY=1", timeout=20)
        assert ready_at - t0 >= 1.5  # not before the fake answers 200
        before = ns.messages[:-1]
        assert any(m.startswith("EXTEND_TIMEOUT_USEC=") for m in before), before
        assert any("STATUS=loading" in m for m in before), before
        assert "STATUS=serving" in ns.messages[-1]
        # really serving at READY time
        import urllib.request

        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health_generate", timeout=5).status == 200
        rec = record(tmp_path)
        assert rec["notify_socket_visible"] is False  # systemd hears from the launcher only
        assert rec["pythonunbuffered"] == "1"
        proc.send_signal(signal.SIGTERM)
        rc, out, err = finish(proc)
        assert rc == 0, err
        assert record(tmp_path)["signal"] == "SIGTERM"
        assert any("STOPPING=1" in m for m in ns.drain())
        assert "SGLang stopped" in err
    finally:
        ns.close()


def test_ready_on_abstract_notify_socket(tmp_path):
    ns = NotifySocket(tmp_path, abstract=True)
    try:
        proc, _ = start(tmp_path, FAKE_MODE="healthy", FAKE_AFTER="0.3", NOTIFY_SOCKET=ns.env_value)
        ns.wait_for("READY=1", timeout=20)
        proc.send_signal(signal.SIGINT)
        rc, _, err = finish(proc)
        assert rc == 0, err
        assert record(tmp_path)["signal"] == "SIGINT"
    finally:
        ns.close()


def test_sigterm_while_loading_is_forwarded(tmp_path):
    ns = NotifySocket(tmp_path)
    try:
        proc, _ = start(tmp_path, FAKE_MODE="hang", NOTIFY_SOCKET=ns.env_value)
        record(tmp_path)  # the fake is up
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        rc, _, err = finish(proc)
        assert rc == 0, err
        assert record(tmp_path)["signal"] == "SIGTERM"
        assert not any("READY=1" in m.split("\n") for m in ns.drain())
    finally:
        ns.close()


def test_child_ignoring_sigterm_is_killed_after_stop_timeout(tmp_path):
    proc, _ = start(tmp_path, FAKE_MODE="hang", FAKE_IGNORE_TERM="1", KDTREE_STOP_TIMEOUT="1")
    pid = record(tmp_path)["pid"]
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    rc, _, err = finish(proc)
    assert rc == 128 + signal.SIGKILL, err
    assert "sending SIGKILL" in err
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_unexpected_exit_0_is_not_success(tmp_path):
    ns = NotifySocket(tmp_path)
    try:
        proc, _ = start(tmp_path, FAKE_MODE="exit0", FAKE_AFTER="0.5", NOTIFY_SOCKET=ns.env_value)
        rc, _, err = finish(proc)
        assert rc == 1, err
        assert "SGLang exited with code 0 during start-up" in err
        msgs = ns.drain()
        assert not any("READY=1" in m.split("\n") for m in msgs)
        assert any("STATUS=failed" in m for m in msgs)
    finally:
        ns.close()


def test_child_killed_by_signal(tmp_path):
    proc, _ = start(tmp_path, FAKE_MODE="sigkill", FAKE_AFTER="0.3")
    rc, _, err = finish(proc)
    assert rc == 128 + signal.SIGKILL, err
    assert "was killed by SIGKILL during start-up" in err


def test_deadline(tmp_path):
    t0 = time.monotonic()
    proc, _ = start(tmp_path, "--kdtree-start-timeout", "1.5", FAKE_MODE="hang")
    rc, _, err = finish(proc)
    assert rc == 124, err
    assert time.monotonic() - t0 < 10
    assert "was not healthy within 1.5 s (last probe: HTTP 503)" in err
    assert "KDTREE_START_TIMEOUT" in err


def test_launcher_flags_are_stripped_before_sglang_sees_argv(tmp_path):
    proc, port = start(tmp_path, "--kdtree-start-timeout=30", "--kdtree-tail-lines", "5", "--trust-remote-code",
                       FAKE_MODE="crash", FAKE_AFTER="0.2")
    rc, _, err = finish(proc)
    assert rc == 1
    argv = record(tmp_path)["argv"]
    assert argv == ["--model-path", "/models/none", "--port", str(port), "--trust-remote-code"]
    assert "(last 5 lines of its output)" in err


@pytest.mark.parametrize(
    "args, env, needle",
    [
        (["--kdtree-start-timout", "5"], {}, "unknown launcher flag --kdtree-start-timout"),
        ([], {"KDTREE_START_TIMEOUT": "soon"}, "KDTREE_START_TIMEOUT='soon' is not a positive duration"),
        ([], {"KDTREE_ARG_PREFLIGHT": "maybe"}, "KDTREE_ARG_PREFLIGHT='maybe' is not 0 or 1"),
        ([], {"KDTREE_VERIFY": "vaildate"}, "valid values are: off, validate, on"),
    ],
)
def test_launcher_configuration_errors_exit_78(tmp_path, args, env, needle):
    proc, _ = start(tmp_path, *args, FAKE_MODE="crash", **env)
    rc, out, err = finish(proc)
    assert rc == 78, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Fix: " in lines[0], err
    assert not (tmp_path / "record.json").exists()  # SGLang was never started


def test_validate_without_metrics_refused_even_without_preflight(tmp_path, monkeypatch):
    from kdtree_backend.launcher import main as launcher_main

    monkeypatch.setattr(launcher_main, "check_mode_and_library", lambda environ: "validate")
    monkeypatch.setenv("KDTREE_ARG_PREFLIGHT", "0")
    monkeypatch.setenv("KDTREE_LAUNCH_CHILD_CMD", "/bin/false")
    assert launcher_main.main(["--model-path", "x"]) == 78


def test_health_url_derivation():
    from kdtree_backend.launcher.main import LaunchConfigError, derive_health_url, health_url_for, light_address_args

    assert health_url_for(None, None) == "http://127.0.0.1:30000/health_generate"
    assert health_url_for("0.0.0.0", 8000) == "http://127.0.0.1:8000/health_generate"
    assert health_url_for("::", 8000) == "http://[::1]:8000/health_generate"
    assert health_url_for("10.0.0.5", 1, ssl=True) == "https://10.0.0.5:1/health_generate"
    addr = light_address_args(["--host", "0.0.0.0", "--port=31000", "--ssl-keyfile", "k.pem"])
    assert addr == {"host": "0.0.0.0", "port": 31000, "ssl_keyfile": "k.pem"}
    assert derive_health_url(addr) == ("https://127.0.0.1:31000/health_generate", None)
    # node rank >= 1 runs no HTTP server: wait for rank 0 (the --dist-init-addr host)
    url, note = derive_health_url(light_address_args(["--node-rank", "1", "--nnodes", "2",
                                                      "--dist-init-addr", "10.0.0.7:5000", "--port", "30000"]))
    assert url == "http://10.0.0.7:30000/health_generate" and "node rank 1 runs no HTTP server" in note
    with pytest.raises(LaunchConfigError, match="KDTREE_HEALTH_URL"):
        derive_health_url({"node_rank": 2})


def test_sd_notify_is_a_noop_without_socket(monkeypatch):
    from kdtree_backend.launcher import sdnotify

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    with pytest.raises(sdnotify.NotifyError):
        sdnotify.notify("READY=1", {"NOTIFY_SOCKET": "/nonexistent/dir/notify.sock"})


def test_configuration_error_inside_sglang_exits_78(tmp_path):
    """A scheduler stopping on a kdtree configuration error must not be restarted in a loop."""
    ns = NotifySocket(tmp_path)
    try:
        proc, _ = start(tmp_path, FAKE_MODE="configerror", FAKE_AFTER="0.2", NOTIFY_SOCKET=ns.env_value)
        rc, _, err = finish(proc)
        assert rc == 78, err
        lines = err.strip().splitlines()
        assert lines[-1] == ("kdtree-backend: the kernel library was not built for GPU 0 (sm_80); it holds sm_90. "
                             "Fix: rebuild with `python -m kdtree_backend.build` on this machine, or set "
                             "KDTREE_VERIFY=off.")
        assert "on a configuration error; exiting 78:" in lines[-2]
        assert any("STATUS=failed: configuration error: kdtree-backend: the kernel library" in m for m in ns.drain())
    finally:
        ns.close()


def test_leftover_processes_holding_the_pipes_are_ended(tmp_path):
    """Like SGLang's schedulers: a grandchild keeps the output pipes open (and ignores SIGTERM)."""
    proc, _ = start(tmp_path, FAKE_MODE="crash", FAKE_AFTER="1.0", FAKE_GRANDCHILD="1")
    rc, _, err = finish(proc)
    exited_at = time.time()
    rec = record(tmp_path)
    assert rc == 1, err
    assert exited_at - rec["crash_at"] < 3.0 + 2.0  # detection, then at most the 2 s SIGTERM grace
    assert "RuntimeError: fake crash during load" in err
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not _running(rec["grandchild"]):
            break
        time.sleep(0.05)
    else:
        os.kill(rec["grandchild"], signal.SIGKILL)
        raise AssertionError("the grandchild survived the launcher")


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whatever reaps orphans here)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def test_sighup_stops_like_sigterm(tmp_path):
    proc, _ = start(tmp_path, FAKE_MODE="hang")
    record(tmp_path)
    time.sleep(0.3)
    proc.send_signal(signal.SIGHUP)
    rc, _, err = finish(proc)
    assert rc == 0, err
    assert record(tmp_path)["signal"] == "SIGTERM"
