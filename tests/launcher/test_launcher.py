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
from conftest import fake_launch_env, free_port

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "launch_with_kdtree.py"

pytestmark = pytest.mark.timeout(60)


def launcher_env(tmp_path, **extra) -> dict:
    return fake_launch_env(tmp_path, **{"KDTREE_ARG_PREFLIGHT": "0", "KDTREE_PROBE_INTERVAL": "0.2",
                                        "KDTREE_STOP_TIMEOUT": "10", **extra})


def start(tmp_path, *args, _model="/models/none", **env):
    port = free_port()
    cmd = [sys.executable, str(LAUNCHER), "--model-path", _model, "--port", str(port), *args]
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
        self.timed = []  # (time.time() at arrival, datagram)

    def _recv(self, timeout: float):
        self.sock.settimeout(max(0.01, timeout))
        try:
            data = self.sock.recv(4096).decode()
        except (socket.timeout, BlockingIOError):
            return None
        self.messages.append(data)
        self.timed.append((time.time(), data))
        return data

    def wait_until(self, pred, timeout: float, what: str) -> float:
        """Collect datagrams until pred(datagram); returns when it arrived (monotonic)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            data = self._recv(deadline - time.monotonic())
            if data is not None and pred(data):
                return time.monotonic()
        raise AssertionError(f"no {what} in {self.messages}")

    def wait_for(self, needle: str, timeout: float) -> float:
        """Collect datagrams until one holds the line `needle`; returns when it arrived (monotonic)."""
        return self.wait_until(lambda data: needle in data.split("\n"), timeout, repr(needle))

    def collect_until(self, wall_time: float) -> None:
        """Collect datagrams until time.time() reaches `wall_time`."""
        while time.time() < wall_time:
            self._recv(wall_time - time.time())

    def keepalives(self, start: float = float("-inf"), end: float = float("inf")):
        """Arrival times (time.time()) of the datagrams holding WATCHDOG=1, within [start, end)."""
        return [t for t, m in self.timed if "WATCHDOG=1" in m.split("\n") and start <= t < end]

    def drain(self):
        while self._recv(0.05) is not None:
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
        ([], {"KDTREE_EXIT_ON_HANG": "soon"}, "KDTREE_EXIT_ON_HANG='soon' is neither a positive duration nor off"),
        (["--kdtree-serving-probe-timeout", "0"], {}, "--kdtree-serving-probe-timeout='0' is not a positive duration"),
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


# ------------------------------------------------------------------------------------------------
# health after READY: WATCHDOG=1 only while /health_generate answers
# ------------------------------------------------------------------------------------------------

# fast probing for the tests: a 0.3 s pause between probes, 1 s per probe
SERVING = dict(KDTREE_SERVING_PROBE_INTERVAL="0.3", KDTREE_SERVING_PROBE_TIMEOUT="1")


def test_watchdog_keepalives_only_while_healthy_then_stop_when_the_server_hangs(tmp_path):
    """A server that is alive but hung: the keep-alives stop, the launcher stays (systemd's watchdog acts)."""
    ns = NotifySocket(tmp_path)
    try:
        proc, port = start(tmp_path, FAKE_MODE="hang_after", FAKE_AFTER="0.5", FAKE_HANG_AFTER="2.5",
                           NOTIFY_SOCKET=ns.env_value, WATCHDOG_USEC="2000000", **SERVING)
        ns.wait_for("READY=1", timeout=20)
        assert "WATCHDOG=1" in ns.messages[-1].split("\n")  # READY=1 carries the first keep-alive
        rec = record(tmp_path)
        assert rec["watchdog_visible"] is False and rec["notify_socket_visible"] is False
        hang = rec["hang_starts_at"]
        ns.collect_until(hang + 6.0)
        assert proc.poll() is None  # a hung server does not end the launcher by itself: the watchdog does
        healthy = ns.keepalives(end=hang)
        assert len(healthy) >= 3, ns.timed  # READY's, then with each healthy probe (every 0.3 s here)
        assert all(b - a < 1.0 for a, b in zip(healthy, healthy[1:])), healthy  # never WATCHDOG_USEC/2 apart
        # the hang is noticed within one pause + one probe timeout (1.3 s): nothing after hang + 3 s
        assert ns.keepalives(start=hang + 3.0) == [], [(round(t - hang, 2), m) for t, m in ns.timed]
        assert any(m.startswith("STATUS=unhealthy: ") and "failed 1 probe(s) in a row (no answer within 1 s)" in m
                   for m in ns.messages), ns.messages
        proc.send_signal(signal.SIGABRT)  # what systemd sends to the main process when WatchdogSec passes
        rc, _, err = finish(proc)
        assert rc == 134, err
        assert record(tmp_path)["signal"] == "SIGTERM"  # SGLang was stopped, not aborted
        url = f"http://127.0.0.1:{port}/health_generate"
        assert ("sent READY=1 (mode=off); probing every 0.3 s, WATCHDOG=1 every 0.3 s while healthy "
                "(systemd's WatchdogSec=2 s)") in err
        failed = [line for line in err.splitlines() if "health probe failed while serving" in line]
        assert len(failed) >= 2, err  # one line per failed probe
        assert failed[0].startswith("kdtree launcher: warning: health probe failed while serving (1 in a row, "
                                    "last healthy answer "), failed
        assert f"): {url}: no answer within 1 s; WATCHDOG=1 withheld: systemd stops the service in " in failed[0]
        assert failed[1].startswith("kdtree launcher: warning: health probe failed while serving (2 in a row, ")
        last = err.strip().splitlines()[-1]
        assert last.startswith("kdtree launcher: error: stopped SGLang (exited with code 0) on SIGABRT, systemd's "
                               "watchdog signal (no WATCHDOG=1 within WatchdogSec; last healthy answer "), last
        assert " failed probe(s) since (last: no answer within 1 s)); exiting 134" in last, last
    finally:
        ns.close()


def test_keepalives_are_paced_at_half_the_watchdog_when_probes_are_rarer(tmp_path):
    ns = NotifySocket(tmp_path)
    try:
        proc, _ = start(tmp_path, FAKE_MODE="healthy", FAKE_AFTER="0.3", NOTIFY_SOCKET=ns.env_value,
                        WATCHDOG_USEC="2000000", KDTREE_SERVING_PROBE_INTERVAL="5", KDTREE_SERVING_PROBE_TIMEOUT="2")
        ns.wait_for("READY=1", timeout=20)
        ready = time.time()
        ns.collect_until(ready + 3.6)
        kas = ns.keepalives(start=ready - 1.0)
        assert len(kas) >= 4, ns.timed  # READY's, then every 1 s although a probe runs only every 5 s
        assert all(0.7 < b - a < 1.6 for a, b in zip(kas, kas[1:])), kas
        proc.send_signal(signal.SIGTERM)
        rc, _, err = finish(proc)
        assert rc == 0, err
        assert "WATCHDOG=1 every 1 s while healthy (systemd's WatchdogSec=2 s)" in err
    finally:
        ns.close()


def test_recovery_after_a_hang_is_one_line_and_the_keepalives_resume(tmp_path):
    ns = NotifySocket(tmp_path)
    try:
        proc, port = start(tmp_path, FAKE_MODE="hang_after", FAKE_AFTER="0.3", FAKE_HANG_AFTER="1.0",
                           FAKE_HANG_FOR="2.0", NOTIFY_SOCKET=ns.env_value, WATCHDOG_USEC="2000000", **SERVING)
        ns.wait_for("READY=1", timeout=20)
        rec = record(tmp_path)
        ns.wait_until(lambda m: m.startswith("STATUS=unhealthy: "), timeout=10, what="STATUS=unhealthy")
        ns.wait_until(lambda m: m.startswith("STATUS=serving: ") and "healthy again after" in m,
                      timeout=10, what="STATUS=serving ... healthy again")
        recovered = time.time()
        assert recovered >= rec["hang_ends_at"]
        ns.collect_until(recovered + 1.5)
        assert ns.keepalives(start=rec["hang_starts_at"] + 3.0, end=rec["hang_ends_at"]) == []
        assert len(ns.keepalives(start=recovered)) >= 1, ns.timed  # resumed
        proc.send_signal(signal.SIGTERM)
        rc, _, err = finish(proc)
        assert rc == 0, err
        again = [line for line in err.splitlines() if "healthy again" in line]
        assert len(again) == 1, err
        assert again[0].startswith(f"kdtree launcher: SGLang is healthy again: http://127.0.0.1:{port}/health_generate "
                                   f"answered HTTP 200 after "), again
        assert " failed probe(s), " in again[0] and again[0].endswith(" s without a healthy answer")
    finally:
        ns.close()


def test_exit_on_hang_without_systemd(tmp_path):
    """No NOTIFY_SOCKET: the opt-in --kdtree-exit-on-hang stops a hung SGLang and exits 124."""
    proc, port = start(tmp_path, "--kdtree-exit-on-hang", "1.5", FAKE_MODE="hang_after", FAKE_AFTER="0.3",
                       FAKE_HANG_AFTER="0.7", **SERVING)
    rc, _, err = finish(proc, timeout=30)
    exited = time.time()
    rec = record(tmp_path)
    assert rc == 124, err
    assert exited - rec["hang_starts_at"] < 8, exited - rec["hang_starts_at"]
    assert rec["signal"] == "SIGTERM"
    assert "stops SGLang after 1.5 s unhealthy (KDTREE_EXIT_ON_HANG)" in err
    assert "the launcher stops SGLang in " in err  # the failed-probe line says what will happen
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"kdtree launcher: error: SGLang has not answered http://127.0.0.1:{port}/health_generate "
                           f"healthy for "), last
    assert last.endswith("KDTREE_EXIT_ON_HANG=1.5 s: stopping SGLang; exiting 124")


def test_without_systemd_a_hang_is_reported_but_does_not_end_the_launcher(tmp_path):
    proc, _ = start(tmp_path, FAKE_MODE="hang_after", FAKE_AFTER="0.3", FAKE_HANG_AFTER="0.5", **SERVING)
    hang = record(tmp_path)["hang_starts_at"]
    time.sleep(max(0.0, hang + 3.0 - time.time()))
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    rc, _, err = finish(proc)
    assert rc == 0, err
    assert "failures are reported only (no WatchdogSec=, no KDTREE_EXIT_ON_HANG)" in err
    assert "reported only (no WatchdogSec=, no KDTREE_EXIT_ON_HANG)" in \
        [line for line in err.splitlines() if "health probe failed while serving (1 in a row" in line][0]


def test_watchdog_variables():
    from kdtree_backend.launcher import sdnotify

    pid = os.getpid()
    assert sdnotify.watchdog_usec({}) is None
    assert sdnotify.watchdog_usec({"WATCHDOG_USEC": "300000000"}) == 300000000
    assert sdnotify.watchdog_usec({"WATCHDOG_USEC": "5000000", "WATCHDOG_PID": str(pid)}) == 5000000
    assert sdnotify.watchdog_usec({"WATCHDOG_USEC": "5000000", "WATCHDOG_PID": str(pid + 1)}) is None  # not ours
    for bad in ({"WATCHDOG_USEC": "5s"}, {"WATCHDOG_USEC": "0"}, {"WATCHDOG_USEC": "1", "WATCHDOG_PID": "x"}):
        with pytest.raises(ValueError):
            sdnotify.watchdog_usec(bad)


# ------------------------------------------------------------------------------------------------
# before SGLang starts: a stop signal during the preflight, a model folder that is not there
# ------------------------------------------------------------------------------------------------

MODEL = ROOT / "tests" / "fixtures_ops" / "dsv3_tiny"


def _children(pid: int):
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(entry))
    return kids


@pytest.mark.timeout(90)
def test_sigterm_during_preflight_stops_it_and_removes_its_files(tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc, _ = start(tmp_path, _model=str(MODEL), KDTREE_ARG_PREFLIGHT="1", TMPDIR=str(tmpdir), HF_HUB_OFFLINE="1")
    child = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        kids = _children(proc.pid)
        if kids and list(tmpdir.glob("kdtree-preflight-*")):
            child = kids[0]
            break
        time.sleep(0.02)
    assert child is not None, "the preflight never started"
    time.sleep(0.3)  # it is importing sglang now (5-15 s)
    proc.send_signal(signal.SIGTERM)
    rc, _, err = finish(proc, timeout=30)
    assert rc == 143, err
    assert err.strip().splitlines() == [
        f"kdtree launcher: got SIGTERM during the SGLang argument preflight: stopped it (pid {child}) and removed its "
        f"temporary directory; SGLang was not started; exiting 143"], err
    assert not _running(child)
    assert list(tmpdir.iterdir()) == []
    assert not (tmp_path / "record.json").exists()


def test_missing_model_folder_is_named_as_a_folder_not_as_a_repo_id(tmp_path):
    models = tmp_path / "models"
    (models / "Kimi-K2.5").mkdir(parents=True)
    missing = models / "Kimi-K2.6"
    t0 = time.monotonic()
    proc, _ = start(tmp_path, _model=str(missing), KDTREE_ARG_PREFLIGHT="1")
    rc, _, err = finish(proc)
    assert rc == 78, err
    assert time.monotonic() - t0 < 10  # refused before the preflight imports sglang
    assert err.strip().splitlines() == [
        f"kdtree-backend: --model-path {missing}: no such file or directory; {models} holds Kimi-K2.5 (a path, so "
        f"SGLang would not look it up on the Hugging Face hub). Fix: point --model-path at the local folder that "
        f"holds the model's config.json (did you mean {models / 'Kimi-K2.5'}?)."], err
    assert not (tmp_path / "record.json").exists()


def test_local_path_check_cases(tmp_path):
    from kdtree_backend.launcher.main import LaunchConfigError, check_local_paths

    (tmp_path / "model").mkdir()
    check_local_paths(["--model-path", str(tmp_path / "model")])  # exists
    check_local_paths(["--model-path", "moonshotai/Kimi-K2.5"])  # a hub id: SGLang's business
    check_local_paths(["--model-path", "m", "--", "--model-path", "/nonexistent/x"])  # after --: not ours
    with pytest.raises(LaunchConfigError, match=r"--speculative-draft-model-path=?.* /nonexistent/d/e: no such file "
                                                r"or directory; /nonexistent does not exist either"):
        check_local_paths(["--model-path", str(tmp_path / "model"), "--speculative-draft-model-path=/nonexistent/d/e"])
    with pytest.raises(LaunchConfigError) as info:
        check_local_paths(["--model", "~/models/kimi"])
    assert "write the full path, e.g. " + os.path.expanduser("~/models/kimi") in str(info.value)
    with pytest.raises(LaunchConfigError, match="ProtectHome= hides /home and /root"):
        check_local_paths(["--tokenizer-path", "/home/nobody-here-kdtree/tok"])

