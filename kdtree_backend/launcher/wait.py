"""`kdtree-wait`: wait for a server's health URL while watching the process or systemd unit behind it.

For people who start SGLang some other way than the launcher. A generic wait loop reads "connection
refused" as "still starting" forever when the server has died; this one checks the process (or the
unit) on every turn of its loop and exits non-zero at once when it is gone, printing the last lines
of its log.

    kdtree-wait http://127.0.0.1:30000/health_generate --pid 4242 --log /var/log/sglang.log
    kdtree-wait --unit sglang.service --timeout 30min          # URL defaults to :30000/health_generate

Exit codes: 0 healthy; 1 the process/unit died (or was not there); 124 deadline; 2 usage error
(one line: a URL without http:// or https://, a negative --tail, a --pid that is not a process id).
Stdlib only.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from kdtree_backend.launcher.readiness import AsyncProbe

PREFIX = "kdtree-wait"
EXIT_DIED = 1
EXIT_DEADLINE = 124
DEFAULT_URL = "http://127.0.0.1:30000/health_generate"


def _duration(text: str) -> float:
    from kdtree_backend.launcher.main import LaunchConfigError, parse_duration

    try:
        return parse_duration(text, "value")
    except LaunchConfigError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive duration (e.g. 600, 90s, 20min, 1h)")


def _lines(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of lines (0 or more; 0 prints none)")
    return n


def _pid(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0:  # kill(0, ...) and kill(-1, ...) address process groups: "alive" forever
        raise argparse.ArgumentTypeError(f"{text!r} is not a process id (a positive number, e.g. $! after starting the server)")
    return n


def _url(text: str) -> str:
    if re.match(r"^https?://[^/\s?#]+", text):
        return text
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", text)
    if m:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL ({m.group(1)}://)")
    # localhost:30000, 127.0.0.1:30000/health_generate, //host:port: a scheme is missing, and urllib
    # would fail every probe until the deadline
    rest = text.lstrip("/")
    if "/" not in rest:
        rest += "/health_generate"
    raise argparse.ArgumentTypeError(f"{text!r} has no scheme; write http://{rest} (or https://)")


class _Parser(argparse.ArgumentParser):
    """Usage errors as ONE line (argparse prints the whole usage first), exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ------------------------------------------------------------------------------------------------
# What we watch
# ------------------------------------------------------------------------------------------------


class PidWatch:
    """A process we did not start: alive while it exists, is not a zombie, and keeps its start time."""

    def __init__(self, pid: int):
        self.pid = pid
        self.start_time = self._start_time()
        self.label = f"pid {pid}"

    def exists(self) -> bool:
        """Whether the process exists at all (checked once, before waiting)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # exists, owned by someone else
        return True

    def _stat(self) -> Optional[List[str]]:
        try:
            with open(f"/proc/{self.pid}/stat") as fh:
                data = fh.read()
        except OSError:
            return None
        # the command name (field 2) may hold spaces and parentheses: split after its last ')'
        rest = data[data.rfind(")") + 2:].split()
        return rest  # rest[0] = state (field 3), rest[19] = starttime (field 22)

    def _start_time(self) -> Optional[str]:
        st = self._stat()
        return st[19] if st and len(st) > 19 else None

    def check(self) -> Tuple[bool, str]:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False, f"pid {self.pid} has exited"
        except PermissionError:
            pass  # exists, owned by someone else
        st = self._stat()
        if st is not None:
            if st[0] in ("Z", "X"):
                return False, f"pid {self.pid} has exited (zombie)"
            if self.start_time is not None and len(st) > 19 and st[19] != self.start_time:
                return False, f"pid {self.pid} has exited (the number now belongs to another process)"
        elif os.path.isdir("/proc/self"):
            return False, f"pid {self.pid} has exited"
        return True, f"pid {self.pid} alive"


class UnitWatch:
    """A systemd unit: dead when it fails, goes inactive, or its main process dies (auto-restart)."""

    PROPS = ("LoadState", "ActiveState", "SubState", "Result", "MainPID", "ExecMainStatus", "NRestarts")

    def __init__(self, unit: str):
        self.unit = unit
        self.label = f"unit {unit}"
        self.systemctl = shutil.which("systemctl")
        if self.systemctl is None:
            raise SystemExit(f"{PREFIX}: error: --unit needs systemctl, which is not on PATH")
        self.first = self.show()
        self.restarts0 = self.first.get("NRestarts", "0")

    def show(self) -> Dict[str, str]:
        proc = subprocess.run([self.systemctl, "show", self.unit, "--no-pager", "-p", ",".join(self.PROPS)],
                              capture_output=True, text=True, timeout=30)
        props = {}
        for line in proc.stdout.splitlines():
            k, _, v = line.partition("=")
            props[k.strip()] = v.strip()
        if proc.returncode != 0 and not props:
            props["LoadState"] = "error: " + (proc.stderr.strip() or f"systemctl exited {proc.returncode}")
        return props

    def check(self) -> Tuple[bool, str]:
        p = self.show()
        load, active, sub = p.get("LoadState", "?"), p.get("ActiveState", "?"), p.get("SubState", "?")
        state = f"{active} ({sub})"
        if load != "loaded":
            return False, f"unit {self.unit} is not loaded (LoadState={load})"
        status = f"Result={p.get('Result', '?')}, main process status {p.get('ExecMainStatus', '?')}"
        if active == "failed":
            return False, f"unit {self.unit} failed: {status}"
        if active == "inactive":
            return False, f"unit {self.unit} is inactive (not running): {status}"
        if sub == "auto-restart" or p.get("NRestarts", "0") != self.restarts0:
            return False, f"unit {self.unit}'s main process died and systemd is restarting it: {status}"
        if active == "deactivating":
            return False, f"unit {self.unit} is stopping: {status}"
        return True, f"unit {state}, main pid {p.get('MainPID', '?')}"


# ------------------------------------------------------------------------------------------------
# Log tails
# ------------------------------------------------------------------------------------------------


def file_tail(path: str, n: int) -> List[str]:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 256 * 1024))
            data = fh.read()
    except OSError as exc:
        return [f"(cannot read {path}: {exc})"]
    lines = data.decode("utf-8", "replace").splitlines()
    return list(collections.deque(lines, maxlen=n))


def journal_tail(unit: str, n: int) -> List[str]:
    journalctl = shutil.which("journalctl")
    if journalctl is None:
        return ["(journalctl not found)"]
    try:
        proc = subprocess.run([journalctl, "-u", unit, "-n", str(n), "--no-pager", "-o", "short-iso"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"(journalctl failed: {exc})"]
    out = proc.stdout.splitlines() or [proc.stderr.strip() or "(journal empty)"]
    return out[-n:]


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


class Progress:
    """One line rewritten in place on a terminal; a line every `every` seconds otherwise."""

    def __init__(self, stream, every: float = 10.0, quiet: bool = False):
        self.stream = stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.every = every
        self.quiet = quiet
        self.last = 0.0
        self.dirty = False

    def update(self, text: str) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if self.tty:
            if now - self.last >= 0.5:
                self.stream.write("\r\033[K" + text)
                self.stream.flush()
                self.last, self.dirty = now, True
        elif now - self.last >= self.every:
            self.stream.write(text + "\n")
            self.stream.flush()
            self.last = now

    def end(self) -> None:
        if self.dirty:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.dirty = False


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="kdtree-wait",
        description="Wait for a server's health URL while watching the process or systemd unit behind it; "
                    "exit 0 when healthy, non-zero at once when the process/unit dies (with its last log lines).",
        epilog="exit codes: 0 healthy, 1 process/unit died, 124 deadline, 2 usage error",
    )
    ap.add_argument("url", nargs="?", default=DEFAULT_URL, type=_url,
                    help=f"health URL, with http:// or https:// (default {DEFAULT_URL})")
    who = ap.add_mutually_exclusive_group()
    who.add_argument("--pid", type=_pid, help="process id of the server to watch")
    who.add_argument("--unit", help="systemd unit of the server to watch (e.g. sglang.service)")
    ap.add_argument("--log", metavar="FILE", help="log file whose last lines are printed when the server dies")
    ap.add_argument("--no-journal", action="store_true",
                    help="with --unit: do not print the unit's journal tail when it dies")
    ap.add_argument("--timeout", type=_duration, default=1800.0, help="deadline (default 30min; 600, 90s, 1h ...)")
    ap.add_argument("--interval", type=_duration, default=2.0, help="seconds between probes (default 2)")
    ap.add_argument("--probe-timeout", type=_duration, default=30.0, help="timeout of one probe (default 30)")
    ap.add_argument("--tail", type=_lines, default=40, help="log lines printed on failure (default 40; 0: none)")
    ap.add_argument("--quiet", action="store_true", help="no progress line")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    err = sys.stderr

    def say(msg: str) -> None:
        progress.end()
        err.write(f"{PREFIX}: {msg}\n")
        err.flush()

    progress = Progress(err, quiet=args.quiet)

    def tail() -> None:
        if args.tail == 0:
            return
        lines: List[str] = []
        source = ""
        if args.log:
            lines, source = file_tail(args.log, args.tail), args.log
        elif args.unit and not args.no_journal:
            lines, source = journal_tail(args.unit, args.tail), f"journalctl -u {args.unit}"
        if lines:
            err.write(f"{PREFIX}: last {len(lines)} lines of {source}:\n")
            for line in lines:
                err.write(f"  | {line}\n")
            err.flush()

    watch = None
    if args.pid is not None:
        watch = PidWatch(args.pid)
        if not watch.exists():  # not "has exited": we never saw it alive
            tail()
            say(f"error: pid {args.pid} does not exist (no such process: it never existed, or exited before "
                f"kdtree-wait started); not waiting for {args.url}")
            return EXIT_DIED
    elif args.unit:
        watch = UnitWatch(args.unit)
    else:
        say("warning: no --pid or --unit given: a dead server cannot be told from a starting one")

    t0 = time.monotonic()
    prober = AsyncProbe(args.url, args.probe_timeout)
    last_probe = -1e9
    last_detail = "no probe yet"
    alive_detail = "not watched"
    poll = 0.2 if args.unit is None else 0.5
    while True:
        now = time.monotonic()
        if watch is not None:
            alive, alive_detail = watch.check()
            if not alive:
                progress.end()
                tail()
                say(f"error: {alive_detail} while waiting for {args.url} (after {now - t0:.1f} s; "
                    f"last probe: {last_detail})")
                return EXIT_DIED
        result = prober.poll()
        if result is not None:
            ok, last_detail = result
            if ok:
                if watch is not None:
                    alive, alive_detail = watch.check()
                    if not alive:
                        continue
                say(f"{args.url} is healthy ({last_detail}) after {time.monotonic() - t0:.1f} s")
                return 0
        if now - t0 > args.timeout:
            progress.end()
            tail()
            say(f"error: {args.url} was not healthy within {args.timeout:g} s (last probe: {last_detail}; "
                f"{alive_detail})")
            return EXIT_DEADLINE
        if not prober.in_flight and now - last_probe >= args.interval:
            prober.start()
            last_probe = now
        progress.update(f"{PREFIX}: waiting for {args.url}: {now - t0:.0f} s of {args.timeout:g} s, "
                        f"{alive_detail}, last probe: {last_detail}")
        time.sleep(poll)


if __name__ == "__main__":
    sys.exit(main())
