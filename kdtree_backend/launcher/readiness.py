"""Process-aware readiness: run SGLang as a child, probe it, and tell the truth about it.

The failure this module exists for: a server crashed during start-up while a loop polled
`/health` for ten minutes, reading "connection refused" as "still starting". Here every turn of
the loop first asks whether the child is still alive (every `poll` seconds, 0.2 s by default), and
the HTTP probe runs in a background thread so that a slow `/health_generate` (it generates a real
token) never delays noticing a dead child.

After READY=1 the probing goes on, slower (every 10 s, 60 s per probe), for the server's whole life:
a server that is alive but hung (a stuck scheduler, a collective that never returns) is as much a
failure as a dead one. Each failed probe and each recovery is one line on stderr and a STATUS=; with
systemd's watchdog (`WatchdogSec=`, hence `$WATCHDOG_USEC`) the launcher sends `WATCHDOG=1` only while
the probes succeed, so systemd kills and restarts a hung server. Without systemd nothing but the
child's death ends the launcher, unless `exit_on_hang` (KDTREE_EXIT_ON_HANG) is set.

Stdlib only: the launcher is the unit's main process for the whole life of the server, so it stays
small and imports nothing heavy.
"""
from __future__ import annotations

import collections
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Deque, List, Mapping, Optional, Sequence, TextIO, Tuple

from kdtree_backend.launcher import sdnotify

__all__ = [
    "probe",
    "AsyncProbe",
    "OutputTail",
    "WatchConfig",
    "Supervisor",
    "describe_returncode",
    "exit_code_for_death",
    "EXIT_DEADLINE",
]

PREFIX = "kdtree launcher"
EXIT_DEADLINE = 124  # like timeout(1): the server did not become healthy before the deadline
EXIT_UNEXPECTED_ZERO = 1  # the child exited 0 although nobody asked it to stop
EXIT_CONFIG = 78  # a kdtree configuration error reported by an SGLang process (EX_CONFIG)


# ------------------------------------------------------------------------------------------------
# HTTP probe
# ------------------------------------------------------------------------------------------------

# No proxies: an http_proxy variable in a service environment must not route a loopback probe.
# https (SGLang's --ssl-keyfile): the probe checks our own server's liveness and sends nothing
# secret, and a certificate rarely names 127.0.0.1, so it does not verify the certificate.
def _unverified_context():
    import ssl

    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                      urllib.request.HTTPSHandler(context=_unverified_context()))


def probe(url: str, timeout: float) -> Tuple[bool, str]:
    """GET `url`; (True, "HTTP 200") on a 2xx answer, else (False, why)."""
    try:
        with _OPENER.open(urllib.request.Request(url, method="GET"), timeout=timeout) as resp:
            code = resp.status
            resp.read(65536)
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, ConnectionRefusedError):
            return False, "connection refused"
        if isinstance(reason, (TimeoutError, OSError)) and "timed out" in str(reason):
            return False, f"no answer within {timeout:g} s"
        return False, f"{reason}"
    except (TimeoutError, OSError) as exc:  # socket.timeout while reading, resets
        if "timed out" in str(exc):
            return False, f"no answer within {timeout:g} s"
        return False, f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # malformed answers (http.client.BadStatusLine, ...)
        return False, f"{type(exc).__name__}: {exc}"
    if 200 <= code < 300:
        return True, f"HTTP {code}"
    return False, f"HTTP {code}"


class AsyncProbe:
    """One probe at a time in a daemon thread; `poll()` returns its result once, then None."""

    def __init__(self, url: str, timeout: float, probe_fn: Callable[[str, float], Tuple[bool, str]] = probe):
        self.url = url
        self.timeout = timeout
        self._probe_fn = probe_fn
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[Tuple[bool, str]] = None
        self.started_at: Optional[float] = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._result is None

    def start(self) -> None:
        if self.in_flight:
            return
        self._result = None
        self.started_at = time.monotonic()

        def run() -> None:
            try:
                self._result = self._probe_fn(self.url, self.timeout)
            except Exception as exc:  # never let a probe bug look like "still starting"
                self._result = (False, f"probe error {type(exc).__name__}: {exc}")

        self._thread = threading.Thread(target=run, name="kdtree-probe", daemon=True)
        self._thread.start()

    def poll(self) -> Optional[Tuple[bool, str]]:
        if self._thread is None or self._result is None:
            return None
        result, self._result, self._thread = self._result, None, None
        return result


# ------------------------------------------------------------------------------------------------
# Output tee
# ------------------------------------------------------------------------------------------------


class OutputTail:
    """Copies a child's stdout/stderr through to ours and keeps the last lines of both.

    Reads raw chunks (not lines) so progress bars and partial lines are forwarded at once; the
    pipes are always drained, even when our own stdout is gone, so the child never blocks.
    """

    # A configuration error printed by the plugin inside an SGLang process (errors.fail_fast):
    # "kdtree-backend: <cause>. Fix: <fix>." It may scroll out of the tail, so it is kept apart.
    CONFIG_ERROR = re.compile(rb"kdtree-backend: .+\. Fix: .+")

    def __init__(self, max_lines: int = 40):
        self.max_lines = max(1, max_lines)
        self.config_error: Optional[str] = None
        self._lines: Deque[bytes] = collections.deque(maxlen=self.max_lines)
        self._partial = {}  # stream name -> bytes of an unfinished line
        self._lock = threading.Lock()
        self._threads: List[threading.Thread] = []

    def attach(self, name: str, pipe, sink) -> None:
        t = threading.Thread(target=self._pump, args=(name, pipe, sink), name=f"kdtree-tee-{name}", daemon=True)
        self._threads.append(t)
        t.start()

    def _pump(self, name: str, pipe, sink) -> None:
        fd = pipe.fileno()
        sink_ok = sink is not None
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            if sink_ok:
                try:
                    sink.write(chunk)
                    sink.flush()
                except (OSError, ValueError):
                    sink_ok = False  # keep draining; the tail still records everything
            self._record(name, chunk)
        self._record(name, b"", final=True)
        try:
            pipe.close()
        except OSError:
            pass

    def _record(self, name: str, chunk: bytes, final: bool = False) -> None:
        with self._lock:
            data = self._partial.pop(name, b"") + chunk
            parts = data.split(b"\n")
            rest = parts.pop()
            for line in parts:
                self._lines.append(line)
                if self.config_error is None and b"kdtree-backend: " in line:
                    m = self.CONFIG_ERROR.search(line)
                    if m:
                        self.config_error = m.group(0).rstrip(b"\r").decode("utf-8", "replace")
            if rest:
                if final or len(rest) > 65536:
                    self._lines.append(rest)
                else:
                    self._partial[name] = rest

    def join(self, timeout: float) -> None:
        """Wait (bounded) for the pipes to reach EOF: grandchildren may keep them open."""
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def lines(self) -> List[str]:
        with self._lock:
            raw = list(self._lines) + [p for p in self._partial.values() if p]
        out = []
        for line in raw[-self.max_lines:]:
            # a progress bar redraws with \r: show its last state
            text = line.rstrip(b"\r").split(b"\r")[-1].decode("utf-8", "replace")
            out.append(text)
        return out


# ------------------------------------------------------------------------------------------------
# Exit codes
# ------------------------------------------------------------------------------------------------


def describe_returncode(rc: int) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"was killed by {name}"
    return f"exited with code {rc}"


def exit_code_for_death(rc: int) -> int:
    """Our exit code after an UNEXPECTED child exit: never 0."""
    if rc < 0:
        return 128 + (-rc)
    if rc == 0:
        return EXIT_UNEXPECTED_ZERO
    return rc


# ------------------------------------------------------------------------------------------------
# The supervisor
# ------------------------------------------------------------------------------------------------


@dataclass
class WatchConfig:
    health_url: str
    start_timeout: float = 1800.0  # seconds until the server must answer the health URL
    probe_interval: float = 2.0  # seconds between probe starts
    probe_timeout: float = 30.0  # one /health_generate may take a while (a real generation)
    # After READY=1: a pause of serving_probe_interval between probes, each allowed serving_probe_timeout
    # (longer than SGLang's own 20 s /health_generate limit, after which it answers 503 itself).
    serving_probe_interval: float = 10.0
    serving_probe_timeout: float = 60.0
    exit_on_hang: Optional[float] = None  # stop SGLang when unhealthy this long after READY (None: never)
    stop_timeout: float = 90.0  # after a forwarded stop, SIGKILL the child's process group
    tail_lines: int = 40
    poll: float = 0.2  # child liveness check period
    status_interval: float = 5.0  # STATUS=/EXTEND_TIMEOUT_USEC= period while loading
    progress_interval: float = 60.0  # a progress line on stderr while loading
    mode: str = "off"  # shown in STATUS=


def _set_pdeathsig_and_pgroup() -> None:  # runs in the child between fork and exec
    os.setpgid(0, 0)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except Exception:
        pass


class Supervisor:
    """Runs the child and watches it. `run()` returns the launcher's exit code."""

    # SIGABRT is what systemd's watchdog sends (WatchdogSignal=, default SIGABRT) to the main process
    # when the keep-alives stopped: SGLang is stopped like on SIGTERM, and the launcher exits 134.
    FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGABRT)

    def __init__(
        self,
        cmd: Sequence[str],
        config: WatchConfig,
        env: Optional[Mapping[str, str]] = None,
        stdout=None,
        stderr_bin=None,
        log: Optional[TextIO] = None,
        notify_env: Optional[Mapping[str, str]] = None,
    ):
        self.cmd = list(cmd)
        self.cfg = config
        self.env = dict(os.environ if env is None else env)
        self.notify_env = dict(os.environ if notify_env is None else notify_env)
        # systemd hears only from us (NotifyAccess=main): the child gets no socket, and no watchdog
        # variables (they name us, and a child that believed them would send keep-alives).
        for var in ("NOTIFY_SOCKET",) + sdnotify.WATCHDOG_VARS:
            self.env.pop(var, None)
        self.watchdog_problem: Optional[str] = None
        try:
            usec = sdnotify.watchdog_usec(self.notify_env)
        except ValueError as exc:
            usec, self.watchdog_problem = None, str(exc)
        if usec is not None:
            try:
                has_socket = sdnotify.socket_address(self.notify_env) is not None
            except sdnotify.NotifyError:
                has_socket = True  # reported by notify() when the first message fails
            if not has_socket:
                usec, self.watchdog_problem = None, "WATCHDOG_USEC is set but NOTIFY_SOCKET is not"
        # seconds of systemd's watchdog (WatchdogSec=), None without one
        self.watchdog: Optional[float] = None if usec is None else usec / 1e6
        self.env.setdefault("PYTHONUNBUFFERED", "1")  # a crash's last lines must reach the pipe
        self.stdout = stdout if stdout is not None else getattr(sys.stdout, "buffer", None)
        self.stderr_bin = stderr_bin if stderr_bin is not None else getattr(sys.stderr, "buffer", None)
        self.log = log if log is not None else sys.stderr
        self.child: Optional[subprocess.Popen] = None
        self.tail = OutputTail(config.tail_lines)
        self.stop_signal: Optional[int] = None
        self.stop_requested_at: Optional[float] = None
        self._notify_warned = False
        self.ready = False
        # health after READY
        self.ready_at: Optional[float] = None
        self.last_ok: float = 0.0  # when the last probe that succeeded returned
        self.fail_streak = 0
        self.last_fail_detail = ""
        self.last_keepalive: float = -1e9

    # -- output ------------------------------------------------------------------------------

    def say(self, msg: str) -> None:
        try:
            self.log.write(f"{PREFIX}: {msg}\n")
            self.log.flush()
        except (OSError, ValueError):
            pass

    def notify(self, state: str) -> None:
        try:
            sdnotify.notify(state, self.notify_env)
        except sdnotify.NotifyError as exc:
            if not self._notify_warned:
                self._notify_warned = True
                self.say(f"warning: systemd notification failed ({exc}); systemd will not see READY=1")

    def print_tail(self, header: str) -> None:
        lines = self.tail.lines()
        if not lines:
            self.say(f"{header}: (the child printed nothing)")
            return
        self.say(f"{header} (last {len(lines)} lines of its output):")
        try:
            for line in lines:
                self.log.write(f"  | {line}\n")
            self.log.flush()
        except (OSError, ValueError):
            pass

    # -- signals -------------------------------------------------------------------------------

    def _on_signal(self, signum, _frame) -> None:
        first = self.stop_signal is None
        self.stop_signal = signum
        if self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()
        child = self.child
        if child is not None and child.poll() is None:
            forward = signal.SIGTERM if signum in (signal.SIGHUP, signal.SIGABRT) else signum
            try:
                os.kill(child.pid, forward)
            except ProcessLookupError:
                pass
        if first:
            why = " (systemd's watchdog)" if signum == signal.SIGABRT else ""
            self.notify(f"STOPPING=1\nSTATUS=stopping: got {signal.Signals(signum).name}{why}, forwarded to SGLang")

    def _install_signals(self):
        previous = {}
        for sig in self.FORWARDED:
            try:
                previous[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):  # not the main thread
                pass
        return previous

    # -- process group cleanup -------------------------------------------------------------

    def _kill_group(self, sig: int) -> bool:
        """Signal the child's process group; False when nothing is left in it."""
        if self.child is None:
            return False
        try:
            os.killpg(self.child.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _reap_leftovers(self, grace: float = 2.0) -> None:
        """After the child exits, end what it left behind (e.g. orphaned scheduler processes)."""
        if not self._kill_group(signal.SIGTERM):
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if not self._kill_group(0):
                return
            time.sleep(0.05)
        self._kill_group(signal.SIGKILL)

    # -- main loop ---------------------------------------------------------------------------

    def start_child(self) -> None:
        self.child = subprocess.Popen(
            self.cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self.env,
            preexec_fn=_set_pdeathsig_and_pgroup,
            close_fds=True,
        )
        self.tail.attach("stdout", self.child.stdout, self.stdout)
        self.tail.attach("stderr", self.child.stderr, self.stderr_bin)

    def run(self) -> int:
        previous = self._install_signals()
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                try:
                    signal.signal(sig, handler)
                except (ValueError, OSError, TypeError):
                    pass

    def _run(self) -> int:
        cfg = self.cfg
        t0 = time.monotonic()
        try:
            self.start_child()
        except OSError as exc:
            self.say(f"error: cannot start {self.cmd[0]!r}: {exc}")
            self.notify(f"STATUS=failed: cannot start SGLang: {exc}")
            return 70
        assert self.child is not None
        self.say(f"started SGLang as pid {self.child.pid} (mode={cfg.mode}); waiting for {cfg.health_url} "
                 f"(deadline {cfg.start_timeout:g} s)")
        if self.watchdog_problem:
            self.say(f"warning: systemd's watchdog is not used: {self.watchdog_problem}")
        prober = AsyncProbe(cfg.health_url, cfg.probe_timeout)
        extend_usec = int(max(60.0, 3 * cfg.status_interval, cfg.probe_timeout + cfg.probe_interval) * 1e6)
        last_probe_start = -1e9
        last_status = -1e9
        last_progress = t0
        last_detail = "no probe yet"
        self.notify(f"EXTEND_TIMEOUT_USEC={extend_usec}\nSTATUS=loading: started SGLang (pid {self.child.pid}), mode={cfg.mode}")

        while True:
            now = time.monotonic()
            rc = self.child.poll()
            if rc is not None:
                return self._child_exited(rc, now - t0)
            if self.stop_signal is not None:
                return self._wait_stop()

            if not self.ready:
                result = prober.poll()
                if result is not None:
                    ok, last_detail = result
                    if ok:
                        # the child must still be alive at the moment we say READY
                        if self.child.poll() is None:
                            self._enter_serving(time.monotonic(), time.monotonic() - t0, last_detail)
                            continue
                if not prober.in_flight and now - last_probe_start >= cfg.probe_interval:
                    prober.start()
                    last_probe_start = now
                if now - t0 > cfg.start_timeout:
                    return self._deadline(now - t0, last_detail)
                if now - last_status >= cfg.status_interval:
                    last_status = now
                    self.notify(
                        f"EXTEND_TIMEOUT_USEC={extend_usec}\n"
                        f"STATUS=loading: {now - t0:.0f} s, waiting for {cfg.health_url} ({last_detail}), mode={cfg.mode}"
                    )
                if now - last_progress >= cfg.progress_interval:
                    last_progress = now
                    self.say(f"still loading: {now - t0:.0f} s of {cfg.start_timeout:g} s, pid {self.child.pid} alive, "
                             f"last probe: {last_detail}")
            elif self._serving_tick(now):
                return self._hung(now)
            time.sleep(cfg.poll)

    # -- health after READY ------------------------------------------------------------------

    def _enter_serving(self, now: float, took: float, detail: str) -> None:
        cfg = self.cfg
        self.ready = True
        self.ready_at = self.last_ok = now
        self.serving_prober = AsyncProbe(cfg.health_url, cfg.serving_probe_timeout)
        self._serving_last_end = now
        if self.watchdog is not None:
            guard = (f"WATCHDOG=1 every {self.keepalive_period():g} s while healthy (systemd's WatchdogSec="
                     f"{self.watchdog:g} s)")
        elif cfg.exit_on_hang is not None:
            guard = f"stops SGLang after {cfg.exit_on_hang:g} s unhealthy (KDTREE_EXIT_ON_HANG)"
        else:
            guard = "failures are reported only (no WatchdogSec=, no KDTREE_EXIT_ON_HANG)"
        self.say(f"SGLang is serving: {cfg.health_url} answered {detail} after {took:.1f} s; sent READY=1 "
                 f"(mode={cfg.mode}); probing every {cfg.serving_probe_interval:g} s, {guard}")
        keepalive = ""
        if self.watchdog is not None:
            keepalive, self.last_keepalive = "\nWATCHDOG=1", now
        self.notify(f"READY=1{keepalive}\nSTATUS=serving: {cfg.health_url} healthy after {took:.0f} s, mode={cfg.mode}")

    def keepalive_period(self) -> float:
        """Seconds between WATCHDOG=1: with every healthy probe, and never less often than WatchdogSec/2.

        Sending with each probe (not just at WatchdogSec/2) makes systemd act about WatchdogSec after
        the server stopped answering, whenever in the keep-alive cycle that happened.
        """
        assert self.watchdog is not None
        return min(self.watchdog / 2, self.cfg.serving_probe_interval)

    def healthy(self, now: float) -> bool:
        """The last probe succeeded, and recently enough that the next one cannot be overdue."""
        cfg = self.cfg
        fresh = cfg.serving_probe_interval + cfg.serving_probe_timeout + 2 * cfg.poll + 1.0
        return self.fail_streak == 0 and now - self.last_ok <= fresh

    def _consequence(self, now: float) -> str:
        parts = []
        if self.watchdog is not None:
            left = max(0.0, self.last_keepalive + self.watchdog - now)
            parts.append(f"WATCHDOG=1 withheld: systemd stops the service in {left:.0f} s unless it recovers")
        if self.cfg.exit_on_hang is not None:
            left = max(0.0, self.last_ok + self.cfg.exit_on_hang - now)
            parts.append(f"the launcher stops SGLang in {left:.0f} s unless it recovers (KDTREE_EXIT_ON_HANG)")
        if not parts:
            parts.append("reported only (no WatchdogSec=, no KDTREE_EXIT_ON_HANG)")
        return "; ".join(parts)

    def _serving_tick(self, now: float) -> bool:
        """One turn of the health loop after READY; True when KDTREE_EXIT_ON_HANG says to stop."""
        cfg = self.cfg
        prober = self.serving_prober
        result = prober.poll()
        if result is None and prober.in_flight and prober.started_at is not None \
                and now - prober.started_at > cfg.serving_probe_timeout + 5.0:
            # the probe's own timeout did not fire (a stuck resolver, a trickling answer): a failure,
            # and a fresh prober (the old thread is a daemon and is left behind)
            result = (False, f"no answer within {now - prober.started_at:.0f} s (the probe did not return)")
            self.serving_prober = prober = AsyncProbe(cfg.health_url, cfg.serving_probe_timeout)
        if result is not None:
            ok, detail = result
            self._serving_last_end = now
            if ok:
                if self.fail_streak:
                    self.say(f"SGLang is healthy again: {cfg.health_url} answered {detail} after {self.fail_streak} "
                             f"failed probe(s), {now - self.last_ok:.0f} s without a healthy answer")
                    self.notify(f"STATUS=serving: {cfg.health_url} healthy again after {self.fail_streak} failed "
                                f"probe(s), mode={cfg.mode}")
                self.fail_streak = 0
                self.last_ok = now
            else:
                self.fail_streak += 1
                self.last_fail_detail = detail
                self.say(f"warning: health probe failed while serving ({self.fail_streak} in a row, last healthy "
                         f"answer {now - self.last_ok:.0f} s ago): {cfg.health_url}: {detail}; {self._consequence(now)}")
                self.notify(f"STATUS=unhealthy: {cfg.health_url} failed {self.fail_streak} probe(s) in a row ({detail}), "
                            f"last healthy {now - self.last_ok:.0f} s ago, mode={cfg.mode}")
        if not prober.in_flight and now - self._serving_last_end >= cfg.serving_probe_interval:
            prober.start()
        healthy = self.healthy(now)
        if self.watchdog is not None and healthy and now - self.last_keepalive >= self.keepalive_period():
            self.last_keepalive = now
            self.notify("WATCHDOG=1")
        return cfg.exit_on_hang is not None and not healthy and now - self.last_ok >= cfg.exit_on_hang

    def health_summary(self, now: float) -> str:
        if not self.ready:
            return "not ready yet"
        if self.fail_streak == 0:
            return f"last healthy answer {now - self.last_ok:.0f} s ago"
        return (f"last healthy answer {now - self.last_ok:.0f} s ago, {self.fail_streak} failed probe(s) since "
                f"(last: {self.last_fail_detail})")

    def _hung(self, now: float) -> int:
        cfg = self.cfg
        assert self.child is not None
        self.print_tail(f"SGLang (pid {self.child.pid}) stopped answering {cfg.health_url}")
        self.say(f"error: SGLang has not answered {cfg.health_url} healthy for {now - self.last_ok:.0f} s "
                 f"({self.health_summary(now)}); KDTREE_EXIT_ON_HANG={cfg.exit_on_hang:g} s: stopping SGLang; "
                 f"exiting {EXIT_DEADLINE}")
        self.notify(f"STATUS=failed: no healthy answer for {now - self.last_ok:.0f} s (KDTREE_EXIT_ON_HANG)")
        self._terminate_child(cfg.stop_timeout)
        return EXIT_DEADLINE

    def _child_exited(self, rc: int, elapsed: float) -> int:
        self.tail.join(0.5)
        if self.stop_signal is not None:
            return self._stopped(rc)
        phase = "while serving" if self.ready else "during start-up"
        code = exit_code_for_death(rc)
        self.print_tail(f"SGLang (pid {self.child.pid}) {describe_returncode(rc)} {phase}")
        config_error = self.tail.config_error
        if config_error is not None:
            # One of SGLang's processes stopped on a kdtree configuration error (e.g. the GPU
            # arch check in a scheduler): exit 78 so systemd does not restart it in a loop.
            code = EXIT_CONFIG
            self.say(f"error: SGLang {describe_returncode(rc)} {phase} after {elapsed:.1f} s on a configuration "
                     f"error; exiting {code}:")
            self._write_line(config_error)
            self.notify(f"STATUS=failed: configuration error: {config_error[:200]}")
        else:
            where = "its output is above" if self.tail.lines() else "it printed nothing"
            self.say(f"error: SGLang {describe_returncode(rc)} {phase} after {elapsed:.1f} s ({where}); "
                     f"exiting {code}")
            self.notify(f"STATUS=failed: SGLang {describe_returncode(rc)} {phase}")
        self._reap_leftovers()
        return code

    def _write_line(self, line: str) -> None:
        try:
            self.log.write(line + "\n")
            self.log.flush()
        except (OSError, ValueError):
            pass

    def _deadline(self, elapsed: float, last_detail: str) -> int:
        self.print_tail(f"SGLang (pid {self.child.pid}) did not become healthy")
        self.say(f"error: {self.cfg.health_url} was not healthy within {self.cfg.start_timeout:g} s "
                 f"(last probe: {last_detail}); stopping SGLang. Fix: raise KDTREE_START_TIMEOUT "
                 f"(and TimeoutStartSec) if loading is just slow; exiting {EXIT_DEADLINE}")
        self.notify(f"STATUS=failed: not healthy within {self.cfg.start_timeout:g} s")
        self._terminate_child(min(self.cfg.stop_timeout, 30.0))
        return EXIT_DEADLINE

    def _terminate_child(self, grace: float) -> None:
        """SIGTERM to SGLang, SIGKILL to its process group after `grace` seconds, then the leftovers."""
        assert self.child is not None
        try:
            os.kill(self.child.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.child.wait(grace)
        except subprocess.TimeoutExpired:
            self._kill_group(signal.SIGKILL)
            self.child.wait()
        self.tail.join(0.5)
        self._reap_leftovers()

    def _wait_stop(self) -> int:
        """A stop was requested (signal forwarded): wait, bounded, then end the group."""
        assert self.child is not None and self.stop_requested_at is not None
        name = signal.Signals(self.stop_signal).name
        if self.stop_signal == signal.SIGABRT:
            self.say(f"got SIGABRT (systemd's watchdog signal: no WATCHDOG=1 within WatchdogSec; "
                     f"{self.health_summary(time.monotonic())}): sent SIGTERM to SGLang (pid {self.child.pid}); "
                     f"waiting up to {self.cfg.stop_timeout:g} s")
        else:
            self.say(f"got {name}: forwarded to SGLang (pid {self.child.pid}); waiting up to {self.cfg.stop_timeout:g} s")
        while True:
            rc = self.child.poll()
            if rc is not None:
                self.tail.join(0.5)
                return self._stopped(rc)
            if time.monotonic() - self.stop_requested_at > self.cfg.stop_timeout:
                self.say(f"SGLang did not exit within {self.cfg.stop_timeout:g} s of {name}: sending SIGKILL to its process group")
                self._kill_group(signal.SIGKILL)
                rc = self.child.wait()
                self.tail.join(0.5)
                self._reap_leftovers()
                return 128 + signal.SIGKILL
            time.sleep(self.cfg.poll)

    def _stopped(self, rc: int) -> int:
        sig = self.stop_signal
        self._reap_leftovers()
        if sig == signal.SIGABRT:  # the watchdog (or an operator's kill -ABRT): never a clean stop
            code = 128 + signal.SIGABRT
            self.print_tail(f"SGLang {describe_returncode(rc)} after SIGABRT")
            self.say(f"error: stopped SGLang ({describe_returncode(rc)}) on SIGABRT, systemd's watchdog signal "
                     f"(no WATCHDOG=1 within WatchdogSec; {self.health_summary(time.monotonic())}); exiting {code}")
            return code
        clean = rc == 0 or rc in (-signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT)
        if sig is not None:
            clean = clean or rc in (-sig, 128 + sig)
        if clean:
            self.say(f"SGLang stopped ({describe_returncode(rc)}) after {signal.Signals(sig).name}; exiting 0")
            return 0
        code = exit_code_for_death(rc)
        self.print_tail(f"SGLang {describe_returncode(rc)} while stopping")
        self.say(f"error: SGLang {describe_returncode(rc)} while stopping; exiting {code}")
        return code
