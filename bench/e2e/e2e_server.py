#!/usr/bin/env python3
"""Release check with a REAL SGLang 0.5.23 server on the GPU machine (issues 24 and 27).

Every server is started the way operators start it, `python3 -m kdtree_backend.launcher <sglang
args>`, with dummy weights (bench/e2e/README.md has the device commands). Suites (`--suite`):

  serve   item 1: the tiny DeepSeek-V3 (2 layers + MTP, EAGLE topk 2, 4 drafts) in `--modes`
          (default off, validate:hopper, validate:portable, on:hopper, on:portable). Per start: READY
          (sd_notify) only when serving, greedy outputs token-identical to off, kernel calls ==
          verify steps x layers, no fallback but the draft model's/prefill's, validate's comparisons
          within tolerance and on /metrics, clean SIGTERM with no leftover process.
  shape   item 2: the customer's shape, H = 8 and a tree of more than 64 drafts (default steps 8,
          topk 8, 80 drafts) in `on` on both paths, with graph-replayed AND eager verify steps
          (a batch above the largest captured batch size); zero fallbacks expected.
  faults  item 3: KDTREE_VERIFY=onn, KDTREE_LIB=/nonexistent, a library built for sm_120 only:
          exit 78, one line with cause and fix, before any model loading. Plus, on a running
          server: SIGKILL of the scheduler (launcher exits non-zero within seconds, with the
          cause) and a hang after READY (the launcher's watchdog, when the launcher has one).
          `--stop-with PHASE=kill-scheduler|hang` runs these on a server another suite started
          (saves a start); otherwise the faults suite starts its own.
  speed   item 4: a Kimi-K2-attention model (61 layers, H = 8, Kimi's MLA dims, small MoE, MTP)
          with an offline tokenizer; off vs on (both paths), measured with SGLang's own client
          (`python3 -m sglang.bench_serving --backend sglang --dataset-name random-ids
          --tokenize-prompt`): output tokens/s, TPOT/ITL, the verify step's time from SGLang's
          per-step log, and the attention share of the step estimated from the kernel benchmark.

One JSON (plus logs and, for speed, a PNG) goes to --out. Exit 0: every check passed and nothing
was skipped; 1: a check failed; 2: no failure but something was skipped (budget, no watchdog).
Pure logic lives in e2e_lib.py (tested on the CPU by tests/test_e2e_cpu.py with a fake server).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import glob
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import e2e_lib as L  # noqa: E402

SUITES = ("serve", "shape", "faults", "speed")
FAULTS = ("bad-mode", "missing-lib", "wrong-arch", "kill-scheduler", "hang")
STOP_ACTIONS = ("sigterm", "kill-scheduler", "hang")
DEFAULT_MODES = "off,validate:hopper,validate:portable,on:hopper,on:portable"
# rough cost of one phase (start + traffic + stop), used to skip what the budget cannot hold
COST_TINY_FIRST, COST_TINY, COST_KIMI_FIRST, COST_KIMI = 130.0, 85.0, 230.0, 150.0

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class PhaseError(Exception):
    """A phase cannot go on (server died, timeout); recorded as a failed check."""


# ------------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------------


def log(msg: str) -> None:
    sys.stderr.write(f"[e2e {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def http(method: str, url: str, body: Optional[dict] = None, timeout: float = 60.0) -> Tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc).encode()


def gzip_file(path: Path) -> Path:
    import gzip
    import shutil

    try:
        gz = path.with_name(path.name + ".gz")
        with open(path, "rb") as src, gzip.open(gz, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        path.unlink()
        return gz
    except OSError:
        return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_info() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
        return {"nvidia_smi": out.splitlines()}
    except Exception as exc:
        return {"nvidia_smi": None, "error": f"{type(exc).__name__}: {exc}"}


def gpu_pids() -> Optional[set]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode != 0:
            return None
        return {int(x) for x in out.stdout.split() if x.strip().isdigit()}
    except Exception:
        return None


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    try:
        import importlib.metadata as md

        for name in ("sglang", "sglang-kernel", "torch", "triton", "transformers", "kdtree-backend"):
            try:
                out[name] = md.version(name)
            except Exception:
                out[name] = None
    except Exception:
        pass
    return out


def _launcher_source_has(text: str) -> bool:
    for path in glob.glob(str(ROOT / "kdtree_backend" / "launcher" / "*.py")):
        try:
            if text in Path(path).read_text():
                return True
        except OSError:
            pass
    return False


def launcher_has_watchdog() -> bool:
    """Post-READY /health_generate probing with systemd WATCHDOG=1 keep-alives."""
    return _launcher_source_has("WATCHDOG=1")


def launcher_has_exit_on_hang() -> bool:
    """--kdtree-exit-on-hang: the launcher itself stops a hung server (exit 124)."""
    return _launcher_source_has("--kdtree-exit-on-hang")


class Budget:
    def __init__(self, deadline_epoch: float):
        self.deadline = deadline_epoch

    def remaining(self) -> float:
        return self.deadline - time.time()

    def fits(self, cost: float) -> bool:
        return self.remaining() >= cost


# ------------------------------------------------------------------------------------------------
# sd_notify receiver
# ------------------------------------------------------------------------------------------------


class NotifySocket:
    """A fake systemd notification socket: records every datagram the launcher sends."""

    def __init__(self, path: str):
        self.path = path
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.messages: List[Tuple[float, str]] = []
        self._stop = False
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                break
            self.messages.append((time.monotonic(), data.decode("utf-8", "replace")))

    def first(self, key: str) -> Optional[float]:
        for t, m in self.messages:
            if any(line.strip() == key for line in m.splitlines()):
                return t
        return None

    def times(self, key: str) -> List[float]:
        return [t for t, m in self.messages if any(line.strip() == key for line in m.splitlines())]

    def close(self) -> None:
        self._stop = True
        self._t.join(1.0)
        try:
            self.sock.close()
            os.unlink(self.path)
        except OSError:
            pass


# ------------------------------------------------------------------------------------------------
# one server start through the launcher
# ------------------------------------------------------------------------------------------------


class Server:
    def __init__(self, name: str, mode: str, kernel: Optional[str], sglang_args: Sequence[str], port: int,
                 run_dir: Path, log_path: Path, env_extra: Mapping[str, str], start_timeout: float,
                 stop_timeout: float, arg_preflight: bool, python: str, tp: int = 1,
                 launcher_extra: Sequence[str] = ()):
        self.name, self.mode, self.kernel = name, mode, kernel
        self.port, self.run_dir, self.log_path = port, run_dir, log_path
        self.base = f"http://127.0.0.1:{port}"
        self.tp = tp
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.prom_dir = run_dir / "prometheus"
        self.prom_dir.mkdir(parents=True, exist_ok=True)
        self.notify = NotifySocket(tempfile.mktemp(prefix="e2e-notify-", suffix=".sock", dir="/tmp"))
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("KDTREE_") or k in ("KDTREE_LAUNCH_CHILD_CMD", "KDTREE_TESTING",
                                                       "KDTREE_FAKE_GPU_CAPABILITY", "KDTREE_LIB")}
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        env.update({
            "KDTREE_VERIFY": mode,
            "KDTREE_VALIDATE_SAMPLE_RATE": "1",
            "PROMETHEUS_MULTIPROC_DIR": str(self.prom_dir),
            "NOTIFY_SOCKET": self.notify.path,
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        })
        if kernel:
            env["KDTREE_KERNEL"] = kernel
        if tp > 1:
            env["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off (KINDS.md of the device pool)
        env.update(env_extra)
        self.env = env
        launcher_flags = [f"--kdtree-start-timeout={int(start_timeout)}", f"--kdtree-stop-timeout={int(stop_timeout)}"]
        if not arg_preflight:
            launcher_flags.append("--kdtree-no-arg-preflight")
        launcher_flags += list(launcher_extra)
        self.cmd = [python, "-m", "kdtree_backend.launcher", *launcher_flags, *sglang_args]
        self.proc: Optional[subprocess.Popen] = None
        self.lines: List[Tuple[float, str]] = []
        self._lock = threading.Lock()
        self.t0 = 0.0
        self.known: Dict[int, Tuple[float, str]] = {}  # pid -> (create_time, cmdline) of the tree
        self.rc: Optional[int] = None
        self.result: dict = {"name": name, "mode": mode, "kernel": kernel, "port": port,
                             "command": " ".join(shlex.quote(c) for c in self.cmd),
                             "env": {k: env[k] for k in sorted(env) if k.startswith(("KDTREE_", "NCCL_"))}}

    # -- process and output ---------------------------------------------------------------------

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._logfh = open(self.log_path, "w", buffering=1, errors="replace")
        self.proc = subprocess.Popen(self.cmd, cwd=str(ROOT), env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        log(f"{self.name}: launcher pid {self.proc.pid}: {self.result['command']}")

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            t = time.monotonic()
            with self._lock:
                self.lines.append((t, line))
            try:
                self._logfh.write(f"{t - self.t0:9.3f} {line}\n")
            except ValueError:
                pass

    def text_lines(self, since: int = 0) -> List[str]:
        with self._lock:
            return [line for _, line in self.lines[since:]]

    def n_lines(self) -> int:
        with self._lock:
            return len(self.lines)

    def find_line(self, pattern, since: int = 0) -> Optional[Tuple[int, float, str]]:
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        with self._lock:
            for i in range(since, len(self.lines)):
                t, line = self.lines[i]
                if rx.search(line):
                    return i, t, line
        return None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 30) -> List[str]:
        return self.text_lines()[-n:]

    def snapshot_tree(self) -> None:
        """Remember every process of the server's tree (for the leftover check after stopping)."""
        try:
            import psutil
        except ImportError:
            return
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            return
        for p in procs:
            try:
                self.known.setdefault(p.pid, (p.create_time(), " ".join(p.cmdline())[:160]))
            except psutil.Error:
                pass

    def schedulers(self) -> Dict[int, str]:
        """pid -> rank name of SGLang's scheduler processes (process title sglang::scheduler[_TPn])."""
        import psutil

        out = {}
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return out
        for p in procs:
            try:
                title = " ".join(p.cmdline()) or p.name()
            except psutil.Error:
                continue
            m = re.search(r"sglang::scheduler(\S*)", title)
            if m:
                out[p.pid] = (m.group(1).strip("_") or "TP0")
        return out

    def leftovers(self) -> List[str]:
        try:
            import psutil
        except ImportError:
            return ["psutil missing: leftover check not done"]
        left = []
        for pid, (ct, cmd) in self.known.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - ct) > 0.01:
                    continue  # pid reused
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                left.append(f"{pid} {cmd}")
            except psutil.Error:
                continue
        return left

    def kill_leftovers(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        for pid, (ct, _cmd) in self.known.items():
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - ct) <= 0.01:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
            except psutil.Error:
                pass

    # -- readiness ----------------------------------------------------------------------------

    def wait_ready(self) -> dict:
        """READY (sd_notify) or the launcher's READY line; then check the order and probe."""
        deadline = self.t0 + self.start_timeout + 30
        info: dict = {}
        last_snap = 0.0
        while time.monotonic() < deadline:
            if self.notify.first("READY=1") is not None or self.find_line(L.READY_LINE_RE):
                break
            if time.monotonic() - last_snap > 2.0:  # know the tree even if it never gets ready
                self.snapshot_tree()
                last_snap = time.monotonic()
            if not self.alive():
                raise PhaseError(f"launcher exited {self.proc.returncode} before READY; last lines: {self.tail(25)}")
            time.sleep(0.1)
        else:
            raise PhaseError(f"no READY within {self.start_timeout + 30:.0f} s; last lines: {self.tail(25)}")
        # the datagram and the line come from the same moment; give the other one a second
        t_end = time.monotonic() + 3
        while time.monotonic() < t_end and (self.notify.first("READY=1") is None or not self.find_line(L.READY_LINE_RE)):
            time.sleep(0.05)
        t_probe = time.monotonic()
        code, body = http("GET", self.base + "/health_generate", timeout=30)
        t_probe_done = time.monotonic()
        t_notify = self.notify.first("READY=1")
        ready_line = self.find_line(L.READY_LINE_RE)
        started = self.find_line(r"kdtree launcher: started SGLang as pid")
        access_200 = self.find_line(r'"GET /health_generate HTTP/1\.[01]" 200')
        info.update({
            "ready_notify_s": None if t_notify is None else round(t_notify - self.t0, 2),
            "ready_line_s": None if not ready_line else round(ready_line[1] - self.t0, 2),
            "launcher_says_healthy_after_s": None if not ready_line else float(L.READY_LINE_RE.search(ready_line[2]).group(3)),
            "probe_after_ready": {"code": code, "seconds": round(t_probe_done - t_probe, 2), "body": body[:80].decode("utf-8", "replace")},
            "status_messages_before_ready": sum(1 for t, m in self.notify.messages if "STATUS=loading" in m and (t_notify is None or t <= t_notify)),
            "sglang_access_log_200_before_ready_line": None if not (access_200 and ready_line) else access_200[0] < ready_line[0],
        })
        checks = [
            L.Check("READY=1 sent over NOTIFY_SOCKET", t_notify is not None, f"datagrams: {[m for _, m in self.notify.messages][-3:]}"),
            L.Check("launcher's READY line: /health_generate answered HTTP 200 first", bool(ready_line) and "HTTP 200" in ready_line[2],
                    ready_line[2] if ready_line else "no line"),
            L.Check("READY only after SGLang was started (order of the launcher's lines)",
                    bool(started and ready_line) and started[0] < ready_line[0], f"started at line {started and started[0]}, READY at {ready_line and ready_line[0]}"),
            L.Check("/health_generate answers 200 right after READY", code == 200, f"HTTP {code} in {t_probe_done - t_probe:.2f} s"),
        ]
        if access_200 and ready_line:
            checks.append(L.Check("SGLang logged a 200 /health_generate before the READY line", access_200[0] < ready_line[0],
                                  f"access line {access_200[0]}, READY line {ready_line[0]}"))
        info["ready_s"] = info["ready_notify_s"] if info["ready_notify_s"] is not None else info["ready_line_s"]
        self.snapshot_tree()
        return {"info": info, "checks": checks}

    def wait_fired_up(self, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.find_line(re.escape(L.FIRED_UP)):
                return True
            if not self.alive():
                raise PhaseError(f"launcher exited {self.proc.returncode}; last lines: {self.tail(25)}")
            time.sleep(0.1)
        return False

    def wait_quiet(self, quiet: float = 1.2, timeout: float = 60.0) -> None:
        """Until no decode step was logged for `quiet` seconds (steps and counters settle)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                last = max((t for t, line in self.lines if "Decode batch" in line), default=self.t0)
            if time.monotonic() - last >= quiet:
                return
            if not self.alive():
                raise PhaseError(f"launcher exited {self.proc.returncode}; last lines: {self.tail(25)}")
            time.sleep(0.1)

    # -- metrics and requests ----------------------------------------------------------------

    def metrics_text(self) -> str:
        code, body = http("GET", self.base + "/metrics", timeout=30)
        if code != 200:
            raise PhaseError(f"/metrics answered {code}: {body[:200]!r}")
        return body.decode("utf-8", "replace")

    def counts(self) -> L.KdtreeCounts:
        return L.KdtreeCounts.from_text(self.metrics_text())

    def generate(self, input_ids, max_new_tokens: int, timeout: float = 120.0):
        body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                            "ignore_eos": True}}
        code, raw = http("POST", self.base + "/generate", body, timeout=timeout)
        if code != 200:
            raise PhaseError(f"/generate answered {code}: {raw[:300]!r}")
        return json.loads(raw)

    # -- stopping ----------------------------------------------------------------------------

    def _wait_exit(self, timeout: float) -> Optional[int]:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop_sigterm(self) -> dict:
        self.snapshot_tree()
        t = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        rc = self._wait_exit(self.stop_timeout + 30)
        took = time.monotonic() - t
        time.sleep(0.5)
        left = self.leftovers()
        on_gpu = gpu_pids()
        ours_on_gpu = sorted(set(self.known) & on_gpu) if on_gpu is not None else None
        res = {"action": "sigterm", "rc": rc, "seconds": round(took, 2), "leftovers": left, "gpu_pids_left": ours_on_gpu}
        checks = [
            L.Check("SIGTERM: launcher exits 0 (or 143) in time", rc in (0, 143), f"rc={rc} after {took:.1f} s"),
            L.Check("SIGTERM: no leftover process of the server's tree", not left, f"{left}"),
        ]
        if ours_on_gpu is not None:
            checks.append(L.Check("SIGTERM: no process of ours left on the GPU", not ours_on_gpu, f"{ours_on_gpu}"))
        if rc is None or left:
            self.kill_leftovers()
            if rc is None:
                self.proc.kill()
        res["checks"] = checks
        return res

    def stop_kill_scheduler(self, within: float = 30.0) -> dict:
        """SIGKILL the scheduler while serving: the launcher must exit non-zero within seconds,
        naming the cause (its summary line and SGLang's own output before it)."""
        self.snapshot_tree()
        sched = self.schedulers()
        res: dict = {"action": "kill-scheduler", "schedulers": {str(k): v for k, v in sched.items()}}
        if not sched:
            res["checks"] = [L.Check("kill-scheduler: scheduler process found (sglang::scheduler)", False,
                                     f"processes: {[c for _, c in self.known.values()]}")]
            return res
        pid = sorted(sched, key=lambda p: sched[p])[0]
        mark = self.n_lines()
        t = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        rc = self._wait_exit(within + 60)
        took = time.monotonic() - t
        after = self.text_lines(mark)
        summary = [l for l in after if l.startswith("kdtree launcher: error:")]
        time.sleep(0.5)
        left = self.leftovers()
        res.update({"killed_pid": pid, "rank": sched[pid], "rc": rc, "seconds": round(took, 2),
                    "launcher_summary": summary[-1:] if summary else [], "last_lines": after[-12:], "leftovers": left})
        res["checks"] = [
            L.Check("kill-scheduler: launcher exits non-zero", rc not in (None, 0), f"rc={rc}"),
            L.Check(f"kill-scheduler: within {within:g} s", rc is not None and took <= within, f"{took:.1f} s"),
            L.Check("kill-scheduler: the launcher names the cause (SGLang died while serving)",
                    any("while serving" in l for l in summary), f"{summary[-1:] or after[-5:]}"),
            L.Check("kill-scheduler: no leftover process", not left, f"{left}"),
        ]
        if rc is None or left:
            self.kill_leftovers()
            if rc is None:
                self.proc.kill()
        return res

    def stop_hang(self, detect_within: float, watchdog_usec: int, expect_exit: bool, keepalive_stop_within: float) -> dict:
        """SIGSTOP every scheduler (the HTTP server stays up, generation hangs). The launcher's
        post-READY watchdog must notice: withhold WATCHDOG=1 (systemd would then stop the unit after
        WatchdogSec) and, with --kdtree-exit-on-hang, stop SGLang itself and exit 124."""
        self.snapshot_tree()
        sched = self.schedulers()
        res: dict = {"action": "hang", "schedulers": {str(k): v for k, v in sched.items()}}
        if not sched:
            res["checks"] = [L.Check("hang: scheduler process found", False, "none")]
            return res
        keepalives_before = len(self.notify.times("WATCHDOG=1"))
        t = time.monotonic()
        for pid in sched:
            os.kill(pid, signal.SIGSTOP)
        rc = self._wait_exit(detect_within)
        took = time.monotonic() - t
        if rc is None:
            time.sleep(0.2)
        ka = [x - t for x in self.notify.times("WATCHDOG=1") if x > t]
        last_ka = max(ka) if ka else 0.0
        silent = (took - last_ka) if rc is None else None
        warn = [l for l in self.text_lines() if "health probe failed while serving" in l]
        summary = [l for l in self.text_lines() if l.startswith("kdtree launcher: error:")]
        res.update({"rc": rc, "seconds": round(took, 2), "keepalives_before_hang": keepalives_before,
                    "keepalives_after_hang_s": [round(x, 2) for x in ka], "probe_failures_reported": len(warn),
                    "launcher_summary": summary[-1:], "last_lines": self.text_lines()[-12:]})
        res["checks"] = [
            L.Check("hang: WATCHDOG=1 keep-alives while serving", keepalives_before > 0, f"{keepalives_before} before the hang"),
            L.Check(f"hang: keep-alives withheld within {keepalive_stop_within:g} s of the hang (systemd would stop the unit)",
                    last_ka <= keepalive_stop_within and (rc is not None or (silent is not None and silent >= watchdog_usec / 1e6)),
                    f"last WATCHDOG=1 {last_ka:.1f} s after the hang; {took:.1f} s observed"),
            L.Check("hang: failed probes reported on the launcher's output", bool(warn), f"{warn[-1:] or 'none'}"),
        ]
        if expect_exit:
            res["checks"].append(L.Check(f"hang: launcher stops SGLang and exits 124 within {detect_within:g} s (--kdtree-exit-on-hang)",
                                         rc == 124, f"rc={rc} after {took:.1f} s; {summary[-1:]}"))
        for pid in sched:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if rc is None:
            self.proc.send_signal(signal.SIGTERM)
            if self._wait_exit(30) is None:
                self.proc.kill()
        time.sleep(0.5)
        self.kill_leftovers()
        return res

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.snapshot_tree()
            self.proc.kill()
            self.proc.wait(10)
        self.kill_leftovers()
        self.notify.close()
        try:
            self._logfh.close()
        except Exception:
            pass
        self.log_path = gzip_file(self.log_path)  # a start with --decode-log-interval 1 logs a line per step


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------


class Run:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.work = Path(args.workdir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.budget = Budget(args.deadline_epoch or (time.time() + args.budget_s))
        self.starts = 0
        self.phases: List[dict] = []
        self.stop_with = dict(args.stop_with or [])
        self.references: Dict[str, Tuple[str, Dict[str, List[int]]]] = {}  # suite -> (phase, outputs)
        self._lib120_proc: Optional[subprocess.Popen] = None
        self.t_start = time.time()
        self.date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
        self._gpu: Optional[dict] = None
        self._versions = versions()
        self.active: List["Server"] = []

    # -- bookkeeping --------------------------------------------------------------------------

    def record(self, phase: dict) -> None:
        checks = phase.get("checks", [])
        ok, failed = L.summarize([c if isinstance(c, L.Check) else L.Check(**c) for c in checks])
        phase["ok"] = ok and not phase.get("skipped")
        phase["failed"] = failed
        phase["checks"] = [c.to_json() if isinstance(c, L.Check) else c for c in checks]
        self.phases.append(phase)
        state = "SKIPPED" if phase.get("skipped") else ("ok" if ok else "FAILED")
        log(f"{phase['name']}: {state}" + ("" if ok else "; " + " | ".join(failed[:6])))
        try:
            self.write(final=False)
        except Exception as exc:  # never lose the run over the partial file
            log(f"could not write the partial result: {exc}")

    def skip(self, name: str, why: str) -> None:
        self.record({"name": name, "skipped": why, "checks": []})

    def model_dir(self, kind: str) -> Tuple[Path, dict]:
        if kind == "tiny":
            cfg = L.tiny_config(heads=16)
        elif kind == "tiny-h8":
            cfg = L.tiny_config(heads=self.args.shape_heads)
        elif kind == "kimi":
            cfg = L.kimi_like_config(layers=self.args.speed_layers, heads=8)
        else:
            raise ValueError(kind)
        d = self.work / f"model-{kind}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg, indent=1))
        if kind == "kimi" and not (d / "tokenizer.json").exists():
            subprocess.run([sys.executable, str(HERE / "make_tokenizer.py"), str(d)], check=True)
        return d, cfg

    def new_server(self, name: str, mode: str, kernel: Optional[str], sg_args: List[str], port: int,
                   start_timeout: float, env_extra: Optional[dict] = None) -> Server:
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        run_dir = self.work / "runs" / f"{safe}-{int(time.time())}"
        arg_preflight = self.args.preflight == "every" or (self.args.preflight == "first" and self.starts == 0)
        self.starts += 1
        env, flags = dict(env_extra or {}), []
        if self.stop_with.get(name) == "hang" and launcher_has_watchdog():
            # systemd's watchdog, faked: WATCHDOG_USEC makes the launcher send WATCHDOG=1 while healthy
            env["WATCHDOG_USEC"] = str(self.args.watchdog_usec)
            flags += [f"--kdtree-serving-probe-interval={self.args.hang_probe_interval:g}",
                      f"--kdtree-serving-probe-timeout={self.args.hang_probe_timeout:g}"]
            if launcher_has_exit_on_hang():
                flags.append(f"--kdtree-exit-on-hang={self.args.hang_exit_s:g}")
        srv = Server(name, mode, kernel, sg_args, port, run_dir, self.out / "logs" / f"{safe}.log",
                     env, start_timeout, self.args.stop_timeout, arg_preflight, self.args.python,
                     tp=self.args.tp_size, launcher_extra=flags)
        self.active.append(srv)
        return srv

    def finish(self, srv: Server, phase: dict, default: str = "sigterm") -> None:
        action = self.stop_with.get(srv.name, default)
        if action == "kill-scheduler":
            stop = srv.stop_kill_scheduler(within=self.args.kill_within)
        elif action == "hang":
            if not launcher_has_watchdog():
                stop = srv.stop_sigterm()
                stop["hang"] = ("skipped: the launcher has no post-READY watchdog (no WATCHDOG=1 in "
                                "kdtree_backend/launcher); hook: Server.stop_hang, env WATCHDOG_USEC set at start")
                phase.setdefault("skipped_parts", []).append("hang")
            else:
                expect_exit = launcher_has_exit_on_hang()
                # exit-on-hang after the last healthy probe, then the launcher's own SIGTERM/SIGKILL of SGLang
                within = (self.args.hang_exit_s + self.args.hang_probe_timeout + self.args.hang_probe_interval
                          + self.args.stop_timeout + 10
                          if expect_exit else 2 * self.args.watchdog_usec / 1e6 + self.args.hang_probe_timeout + 10)
                stop = srv.stop_hang(within, self.args.watchdog_usec, expect_exit,
                                     self.args.hang_probe_interval + self.args.hang_probe_timeout + 3)
        else:
            stop = srv.stop_sigterm()
        phase["checks"] += stop.pop("checks", [])
        phase["stop"] = stop

    # -- the result file (rewritten after every phase: a run cut short still leaves its JSON) -----

    def verdict(self) -> Tuple[List[str], List[str]]:
        failed = [p["name"] for p in self.phases if not p.get("skipped") and not p.get("ok")]
        skipped = [p["name"] for p in self.phases if p.get("skipped")] + \
                  [f"{p['name']}:{x}" for p in self.phases for x in p.get("skipped_parts", [])]
        return failed, skipped

    def out_json(self) -> Path:
        a = self.args
        tag = a.tag or "-".join(a.suite)
        if self._gpu is None:
            self._gpu = gpu_info()
        gpu_tag = "h200" if any("H200" in (l or "") for l in (self._gpu.get("nvidia_smi") or [])) else "gpu"
        return self.out / f"{self.date}-{gpu_tag}-{a.commit}-e2e-{tag}.json"

    def write(self, final: bool) -> None:
        a = self.args
        if self._gpu is None:
            self._gpu = gpu_info()
        result = {
            "kind": "e2e-server",
            "date": self.date,
            "time_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": a.commit,
            "gpu": self._gpu,
            "versions": self._versions,
            "command": " ".join(shlex.quote(x) for x in [sys.executable, *sys.argv]),
            "device_command": os.environ.get("E2E_DEVICE_COMMAND"),
            "suites": a.suite,
            "tp_size": a.tp_size,
            "launcher_has_watchdog": launcher_has_watchdog(),
            "launcher_has_exit_on_hang": launcher_has_exit_on_hang(),
            "step_count_method": ("SGLang --decode-log-interval 1: one 'Decode batch' line per verify step (per decode "
                                  "forward), counted between two quiet points; kernel calls must equal steps x target "
                                  "layers x TP ranks"),
            "wall_s": round(time.time() - self.t_start, 1),
            "phases": self.phases,
        }
        if "speed" in a.suite:
            files = a.kernel_times if a.kernel_times is not None else default_kernel_time_files()
            result["attention_share"] = {
                "method": attention_share.__doc__.strip(),
                "layers": a.speed_layers,
                "kernel_time_files": [os.path.relpath(f, ROOT) if f.startswith(str(ROOT)) else f for f in files],
                "rows": attention_share(self.phases, kernel_times(files), a.speed_layers, a.speed_spec[2]),
            }
        failed, skipped = self.verdict()
        result["verdict"] = ("fail" if failed else ("incomplete" if skipped else "pass")) if final else "running"
        result["failed_phases"], result["skipped"] = failed, skipped
        path = self.out_json()
        if "speed" in a.suite and final:
            result["plot"] = plot_speed(self.phases, path.with_suffix(".png"))
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        os.replace(tmp, path)

    # -- traffic --------------------------------------------------------------------------------

    def settle(self, srv: Server) -> L.KdtreeCounts:
        srv.wait_quiet()
        return srv.counts()

    def measured(self, srv: Server, mode: str, layers: int, traffic, require_eager=False, require_graph=True,
                 atol: float = 2e-2) -> dict:
        """Run `traffic(srv) -> outputs` between two quiet points and judge the window."""
        res: dict = {"checks": []}
        before = self.settle(srv)
        per_pid_before = self._per_pid(srv)
        mark = srv.n_lines()
        t = time.monotonic()
        outputs, meta = traffic(srv)
        res["traffic_s"] = round(time.monotonic() - t, 2)
        srv.wait_quiet()
        after = srv.counts()
        per_pid_after = self._per_pid(srv)
        steps = L.count_decode_steps(srv.text_lines(mark))
        d = L.delta(before, after)
        res["steps"] = steps.to_json()
        res["delta"] = d.to_json()
        res["spec_verify_ct_per_request"] = meta
        res["checks"] += L.check_kernel_counts(mode, d, steps, layers, self.args.tp_size,
                                               require_eager=require_eager, require_graph=require_graph)
        res["checks"].append(L.Check("SGLang's spec_verify_calls_total (per request) >= verify steps",
                                     d.spec_verify_calls >= steps.total or d.spec_verify_calls == 0,
                                     f"+{d.spec_verify_calls:g} per-request verify counts, {steps.total} steps"))
        if mode == "validate":
            flushed = after
            for i in range(12):
                df = L.delta(before, flushed)
                if df.validations_total() >= d.calls.get("validate/shadow", 0.0):
                    break
                srv.generate(L.prompt_ids(900 + i, 8), 3, timeout=60)
                time.sleep(0.3)
                flushed = srv.counts()
            res["flush_rounds"] = i
            res["delta_flushed"] = L.delta(before, flushed).to_json()
            res["checks"] += L.check_validations(d, L.delta(before, flushed), atol, lifetime=flushed)
        if self.args.tp_size > 1 and per_pid_before is not None:
            rank_of = srv.schedulers()
            res["checks"] += L.check_per_rank(mode, per_pid_before, per_pid_after, rank_of, steps, layers, self.args.tp_size)
        res["outputs"] = outputs
        res["outputs_digest"] = L.outputs_digest(outputs)
        return res

    def _per_pid(self, srv: Server):
        if self.args.tp_size <= 1:
            return None
        try:
            return L.per_pid_samples(str(srv.prom_dir))
        except Exception as exc:
            log(f"per-rank metrics unreadable: {exc}")
            return None

    def serve_traffic(self, srv: Server, n_new: int, eager_bs: int, graph_bs: int, vocab: int = 32000):
        """Sequential requests (graph bs 1), one batch at a captured size, one batch above the
        largest captured size (eager), and two requests sent at the same moment from threads."""
        outputs: Dict[str, List[int]] = {}
        meta: Dict[str, int] = {}

        def put(key, r):
            outputs[key] = list(r["output_ids"])
            meta[key] = int((r.get("meta_info") or {}).get("spec_verify_ct", -1))

        for i, n in enumerate((21, 37)):
            put(f"s{i}", srv.generate(L.prompt_ids(i, n, vocab), n_new))
        for tag, bs, base in (("g", graph_bs, 10), ("e", eager_bs, 20)):
            if bs <= 0:
                continue
            rs = srv.generate([L.prompt_ids(base + j, 13 + 5 * j, vocab) for j in range(bs)], n_new)
            for j, r in enumerate(rs):
                put(f"{tag}{bs}_{j}", r)
        errs: List[str] = []

        def one(i):
            try:
                put(f"c{i}", srv.generate(L.prompt_ids(40 + i, 17 + 9 * i, vocab), n_new))
            except Exception as exc:
                errs.append(str(exc))

        ts = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(180)
        if errs:
            raise PhaseError(f"concurrent requests failed: {errs}")
        return outputs, meta

    def compare(self, suite: str, name: str, outputs: Dict[str, List[int]], hard: bool) -> List[L.Check]:
        ref = self.references.get(suite)
        if ref is None:
            self.references[suite] = (name, outputs)
            return [L.Check("outputs recorded (reference for this suite)", bool(outputs), f"{len(outputs)} requests")]
        diffs = L.compare_outputs(ref[1], outputs)
        c = L.Check(f"greedy outputs token-identical to {ref[0]}", not diffs, "; ".join(diffs[:4]) or "identical")
        if not hard and diffs:
            return [L.Check(c.name + " (informational: two kernels, near-ties may differ)", True, c.detail)]
        return [c]

    # -- suites ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def phase_guard(self, srv: "Server", phase: dict):
        """Whatever happens inside, the phase's failure is a check, the server is closed and the phase
        recorded (with the launcher's exit code and its log)."""
        try:
            yield
        except PhaseError as exc:
            phase["checks"].append(L.Check("phase ran to the end", False, str(exc)[:2000]))
        except Exception as exc:  # a bug of this script: still record, still clean up
            phase["checks"].append(L.Check("phase ran to the end", False, f"{type(exc).__name__}: {exc}"))
        finally:
            phase["launcher_rc"] = srv.proc.returncode if srv.proc else None
            srv.close()
            phase["server"] = srv.result
            phase["log"] = os.path.relpath(srv.log_path, self.out)
            self.record(phase)

    @staticmethod
    def start_server(srv: "Server", phase: dict) -> None:
        """Start the launcher, wait for its READY and for SGLang's "fired up" line (its warm-up done); the
        phase records both."""
        srv.start()
        ready = srv.wait_ready()
        phase["start"] = ready["info"]
        phase["checks"] += ready["checks"]
        phase["fired_up"] = srv.wait_fired_up()

    def one_server_phase(self, suite: str, spec_text: str, kind: str, spec: L.Spec, graph_bs: Sequence[int],
                         eager_bs: int, cost: float, hard_compare: bool, require_eager: bool) -> None:
        mode, kernel = L.parse_mode(spec_text)
        name = f"{suite}/{spec_text}"
        if not self.budget.fits(cost):
            self.skip(name, f"budget: {self.budget.remaining():.0f} s left, a start needs ~{cost:.0f} s")
            return
        model, cfg = self.model_dir(kind)
        layers = L.target_layers(cfg)
        port = free_port()
        sg = L.sglang_args(str(model), port, spec, graph_bs=graph_bs, tp=self.args.tp_size,
                           mem_fraction=self.args.mem_fraction, extra=self.args.sglang_extra)
        srv = self.new_server(name, mode, kernel, sg, port, self.args.start_timeout)
        phase: dict = {"name": name, "suite": suite, "mode": mode, "kernel": kernel, "model": kind,
                       "config": {k: cfg[k] for k in ("num_hidden_layers", "num_attention_heads", "hidden_size", "kv_lora_rank",
                                                       "qk_rope_head_dim", "n_routed_experts")},
                       "spec": vars(spec), "graph_bs": list(graph_bs), "eager_bs": eager_bs, "checks": []}
        with self.phase_guard(srv, phase):
            self.start_server(srv, phase)
            m = self.measured(srv, mode, layers,
                              lambda s: self.serve_traffic(s, self.args.max_new_tokens, eager_bs, max(graph_bs)),
                              require_eager=require_eager, require_graph=True)
            phase["checks"] += m.pop("checks")
            phase.update(m)
            events = L.startup_events(srv.text_lines())
            phase["startup_events"] = events
            phase["checks"] += L.check_startup_events(mode, kernel, events, self.args.tp_size)
            phase["checks"] += L.check_build_info(mode, srv.counts().build_info, self.args.tp_size)
            phase["checks"] += self.compare(suite, name, phase["outputs"], hard_compare)
            self.finish(srv, phase)

    def suite_serve(self) -> None:
        for i, m in enumerate(self.args.modes):
            cost = COST_TINY_FIRST if self.starts == 0 else COST_TINY
            self.one_server_phase("serve", m, "tiny", L.Spec(2, 2, 4), graph_bs=(1, 2, 3, 4), eager_bs=6, cost=cost,
                                  hard_compare=True, require_eager=True)

    def suite_shape(self) -> None:
        steps, topk, n = self.args.shape_spec
        for m in self.args.shape_modes:
            cost = COST_TINY_FIRST if self.starts == 0 else COST_TINY
            self.one_server_phase("shape", m, "tiny-h8", L.Spec(steps, topk, n), graph_bs=(1, 2), eager_bs=4, cost=cost,
                                  hard_compare=False, require_eager=True)

    # faults ------------------------------------------------------------------------------------

    def _lib120(self) -> Tuple[Optional[str], str]:
        path = self.args.lib120
        if os.path.exists(path):
            return path, "reused"
        if self._lib120_proc is None:
            self.start_lib120_build()
        try:
            rc = self._lib120_proc.wait(max(10.0, min(300.0, self.budget.remaining() - 30)))
        except subprocess.TimeoutExpired:
            self._lib120_proc.kill()
            return None, "build did not finish in time"
        return (path, "built") if rc == 0 and os.path.exists(path) else (None, f"build failed rc={rc} (see logs/lib120-build.log)")

    def start_lib120_build(self) -> None:
        if os.path.exists(self.args.lib120) or self._lib120_proc is not None:
            return
        logf = open(self.out / "logs" / "lib120-build.log", "w")
        self._lib120_proc = subprocess.Popen([self.args.python, "-m", "kdtree_backend.build", "--arch", "120",
                                              "--out", self.args.lib120], cwd=str(ROOT), stdout=logf, stderr=subprocess.STDOUT)

    def refused_start(self, name: str, env_extra: dict, expect_in_line: Sequence[str]) -> None:
        """The launcher must refuse with exit 78 and ONE line naming cause and fix, before SGLang."""
        model, cfg = self.model_dir("tiny")
        port = free_port()
        sg = L.sglang_args(str(model), port, L.Spec(2, 2, 4), tp=self.args.tp_size, extra=self.args.sglang_extra)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KDTREE_") or k in ("KDTREE_TESTING", "KDTREE_FAKE_GPU_CAPABILITY", "KDTREE_LAUNCH_CHILD_CMD")}
        env.update(env_extra)
        cmd = [self.args.python, "-m", "kdtree_backend.launcher", *sg]
        t = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=120)
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as exc:
            rc, out, err = None, exc.stdout or "", exc.stderr or ""
            out = out.decode() if isinstance(out, bytes) else out
            err = err.decode() if isinstance(err, bytes) else err
        took = time.monotonic() - t
        (self.out / "logs" / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.log").write_text(out + "\n--- stderr ---\n" + err)
        lines = [l for l in (out + "\n" + err).splitlines() if l.strip()]
        kd = [l for l in lines if l.startswith("kdtree-backend:")]
        loading = [l for l in lines if any(mk in l for mk in L.MODEL_LOADING_MARKERS)]
        started = [l for l in lines if "started SGLang as pid" in l]
        last = kd[-1] if kd else ""
        checks = [
            L.Check("exit code 78", rc == 78, f"rc={rc}"),
            L.Check("ONE line naming cause and fix", len(kd) == 1 and ". Fix: " in last, f"{kd}"),
            L.Check("the line names the problem", all(s.lower() in last.lower() for s in expect_in_line),
                    f"expected {list(expect_in_line)} in {last!r}"),
            L.Check(f"refused within {self.args.refuse_within:g} s", took <= self.args.refuse_within, f"{took:.2f} s"),
            L.Check("before any model loading (no SGLang start, no loading lines)", not loading and not started,
                    f"loading lines {loading[:3]}, started {started[:1]}"),
        ]
        self.record({"name": name, "suite": "faults", "rc": rc, "seconds": round(took, 2), "line": last,
                     "env": env_extra, "checks": checks})

    def suite_faults(self) -> None:
        faults = self.args.faults
        if "bad-mode" in faults:
            self.refused_start("faults/bad-mode", {"KDTREE_VERIFY": "onn"}, ["KDTREE_VERIFY", "onn"])
        if "missing-lib" in faults:
            self.refused_start("faults/missing-lib", {"KDTREE_VERIFY": "on", "KDTREE_LIB": "/nonexistent/libkdtree_verify.so"},
                               ["/nonexistent/libkdtree_verify.so"])
        if "wrong-arch" in faults:
            lib, how = self._lib120()
            if lib is None:
                self.record({"name": "faults/wrong-arch", "suite": "faults",
                             "checks": [L.Check("a library built for sm_120 only", False, how)]})
            else:
                self.refused_start("faults/wrong-arch", {"KDTREE_VERIFY": "on", "KDTREE_LIB": lib}, ["120"])
                self.phases[-1]["lib120"] = how
        # faults on a running server: only those no --stop-with assigned to another suite's server
        assigned = set(self.stop_with.values())
        for action in ("kill-scheduler", "hang"):
            if action not in faults or action in assigned:
                continue
            if action == "hang" and not launcher_has_watchdog():
                self.skip("faults/hang", "the launcher has no post-READY watchdog yet (no WATCHDOG=1 in "
                                         "kdtree_backend/launcher/*.py); the check is Server.stop_hang")
                continue
            name = f"faults/{action}"
            self.stop_with[name] = action
            self.one_server_phase_plain(name, action)

    def one_server_phase_plain(self, name: str, action: str) -> None:
        """A tiny `on` server, a few requests, then the fault as its stop."""
        cost = COST_TINY_FIRST if self.starts == 0 else COST_TINY
        if not self.budget.fits(cost):
            self.skip(name, f"budget: {self.budget.remaining():.0f} s left")
            return
        model, cfg = self.model_dir("tiny")
        port = free_port()
        sg = L.sglang_args(str(model), port, L.Spec(2, 2, 4), tp=self.args.tp_size, mem_fraction=self.args.mem_fraction,
                           extra=self.args.sglang_extra)
        srv = self.new_server(name, "on", "auto", sg, port, self.args.start_timeout)
        phase: dict = {"name": name, "suite": "faults", "mode": "on", "checks": []}
        try:
            srv.start()
            ready = srv.wait_ready()
            phase["start"] = ready["info"]
            phase["checks"] += ready["checks"]
            srv.generate(L.prompt_ids(1, 16), 8)
            self.finish(srv, phase)
        except PhaseError as exc:
            phase["checks"].append(L.Check("phase ran to the end", False, str(exc)[:2000]))
        finally:
            srv.close()
            phase["server"] = srv.result
            phase["log"] = os.path.relpath(srv.log_path, self.out)
            self.record(phase)

    # speed ---------------------------------------------------------------------------------------

    def bench_cmd(self, port: int, bs: int, ctx: int, out_len: int, result: Path) -> List[str]:
        # SGLang's own client, `python -m sglang.bench_serving`, run through bench_client.py (a `datasets`
        # import stand-in when Hugging Face datasets is missing; nothing else differs)
        return [self.args.python, str(HERE / "bench_client.py"), "--backend", "sglang", "--host", "127.0.0.1",
                "--port", str(port), "--dataset-name", "random-ids", "--tokenize-prompt",
                "--random-input-len", str(ctx), "--random-output-len", str(out_len), "--random-range-ratio", "1",
                "--num-prompts", str(bs), "--max-concurrency", str(bs), "--request-rate", "inf",
                "--warmup-requests", "0", "--seed", "1", "--disable-tqdm", "--ready-check-timeout-sec", "30",
                "--output-file", str(result)]

    def suite_speed(self) -> None:
        steps, topk, n = self.args.speed_spec
        spec = L.Spec(steps, topk, n)
        cases = self.args.speed_cases
        graph_bs = sorted({1} | {bs for bs, _ in cases if bs <= 8})  # few captures: a shorter start
        max_ctx = max(ctx for _, ctx in cases) + self.args.speed_output_len + 256
        for m in self.args.speed_modes:
            mode, kernel = L.parse_mode(m)
            name = f"speed/{m}"
            cost = COST_KIMI_FIRST if not any(p.get("suite") == "speed" and not p.get("skipped") for p in self.phases) else COST_KIMI
            if not self.budget.fits(cost):
                self.skip(name, f"budget: {self.budget.remaining():.0f} s left, a 61-layer start + bench needs ~{cost:.0f} s")
                continue
            model, cfg = self.model_dir("kimi")
            layers = L.target_layers(cfg)
            port = free_port()
            sg = L.sglang_args(str(model), port, spec, tokenizer=True, graph_bs=graph_bs, tp=self.args.tp_size,
                               mem_fraction=self.args.speed_mem_fraction, max_running=max(max(graph_bs) + 1, max(bs for bs, _ in cases)),
                               context_length=max_ctx, extra=self.args.sglang_extra)
            srv = self.new_server(name, mode, kernel, sg, port, self.args.speed_start_timeout)
            phase: dict = {"name": name, "suite": "speed", "mode": mode, "kernel": kernel, "model": "kimi",
                           "config": {k: cfg[k] for k in ("num_hidden_layers", "num_attention_heads", "hidden_size", "q_lora_rank",
                                                           "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                                           "n_routed_experts", "moe_intermediate_size")},
                           "spec": vars(spec), "graph_bs": graph_bs, "checks": [], "cases": []}
            with self.phase_guard(srv, phase):
                self.start_server(srv, phase)

                eager_bs = max(graph_bs) + 1

                def small(s):
                    """One request (graph-replayed verify) and a batch one above the largest captured
                    size (eager verify): the customer's shape (H 8, 61 layers) in both."""
                    out, meta = {}, {}
                    r = s.generate(L.prompt_ids(7, 64), 16)
                    out["s0"], meta["s0"] = list(r["output_ids"]), r["meta_info"].get("spec_verify_ct")
                    rs = s.generate([L.prompt_ids(60 + j, 40 + 3 * j) for j in range(eager_bs)], 12)
                    for j, r in enumerate(rs):
                        out[f"e{eager_bs}_{j}"], meta[f"e{eager_bs}_{j}"] = list(r["output_ids"]), r["meta_info"].get("spec_verify_ct")
                    return out, meta

                m0 = self.measured(srv, mode, layers, small, require_graph=True, require_eager=True)
                phase["checks"] += [L.Check("correctness window: " + c.name, c.ok, c.detail) for c in m0.pop("checks")]
                phase["correctness"] = m0
                phase["checks"] += self.compare("speed", name, m0["outputs"], hard=False)
                for bs, ctx in cases:
                    if not self.budget.fits(25):
                        phase["cases"].append({"bs": bs, "ctx": ctx, "skipped": "budget"})
                        phase.setdefault("skipped_parts", []).append(f"{bs}x{ctx}")
                        continue
                    phase["cases"].append(self.bench_case(srv, mode, layers, bs, ctx, phase))
                self.finish(srv, phase)

    def bench_case(self, srv: Server, mode: str, layers: int, bs: int, ctx: int, phase: dict) -> dict:
        res_path = srv.run_dir / f"bench-{bs}x{ctx}.jsonl"
        cmd = self.bench_cmd(srv.port, bs, ctx, self.args.speed_output_len, res_path)
        srv.wait_quiet()
        before = srv.counts()
        mark = srv.n_lines()
        t = time.monotonic()
        timeout = min(self.args.bench_timeout, max(20.0, self.budget.remaining() - 40))
        case: dict = {"bs": bs, "ctx": ctx, "output_len": self.args.speed_output_len,
                      "client_command": " ".join(shlex.quote(c) for c in cmd)}
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        try:
            p = subprocess.run(cmd, cwd=str(srv.run_dir), env=env, capture_output=True, text=True, timeout=timeout)
            case["client_rc"] = p.returncode
            case["client_tail"] = (p.stdout + p.stderr).splitlines()[-25:]
        except subprocess.TimeoutExpired:
            case["client_rc"] = None
            case["client_tail"] = [f"timeout after {timeout:.0f} s"]
        case["seconds"] = round(time.monotonic() - t, 1)
        srv.wait_quiet()
        after = srv.counts()
        steps = L.count_decode_steps(srv.text_lines(mark))
        d = L.delta(before, after)
        case["steps"] = steps.to_json()
        # steady state: the steps that ran the whole batch (else the fullest batch seen)
        top = bs if any(n == bs for n, _ in steps.step_ms) else max((n for n, _ in steps.step_ms), default=0)
        full = [ms for n, ms in steps.step_ms if n == top]
        case["server_step_ms_median"] = _median(full) if full else None
        case["server_step_ms_samples"] = len(full)
        case["server_step_running_reqs"] = top
        case["accept_len_mean"] = (sum(steps.accept_lens) / len(steps.accept_lens)) if steps.accept_lens else None
        result = None
        if res_path.exists():
            try:
                result = json.loads(res_path.read_text().strip().splitlines()[-1])
            except (ValueError, IndexError):
                result = None
        keys = ("completed", "duration", "total_output_tokens", "output_throughput", "median_ttft_ms", "mean_tpot_ms",
                "median_tpot_ms", "median_itl_ms", "p90_itl_ms", "mean_e2e_latency_ms", "accept_length", "concurrency")
        case["client"] = {k: result.get(k) for k in keys} if result else None
        checks = [L.Check(f"{bs}x{ctx}: SGLang's bench client completed {bs} requests", bool(result) and result.get("completed") == bs,
                          f"rc={case['client_rc']}, completed={result and result.get('completed')}")]
        checks += [L.Check(f"{bs}x{ctx}: " + c.name, c.ok, c.detail) for c in L.check_kernel_counts(mode, d, steps, layers, self.args.tp_size)]
        phase["checks"] += checks
        return case


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


# ------------------------------------------------------------------------------------------------
# speed summary: attention share and plot
# ------------------------------------------------------------------------------------------------


def kernel_times(paths: Sequence[str]) -> Dict[Tuple[str, int, int, int, int], float]:
    """{(impl, B, H, n, L): us per call} from kernel benchmark JSONs (bench/results/*-{hopper,portable}.json):
    impl `hopper` / `portable` (our kernel, by the file's path) and `triton`."""
    out: Dict[Tuple[str, int, int, int, int], float] = {}
    for path in paths:
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        which = "portable" if "portable" in Path(path).name else "hopper"
        for r in d.get("rows", []):
            s = r.get("shape") or {}
            key = (int(s.get("B", 0)), int(s.get("H", 0)), int(s.get("n", 0)), int(s.get("L", 0)))
            for impl, us in (r.get("times_us") or {}).items():
                if not us:
                    continue
                name = which if impl == "ours" else impl
                out[(name, *key)] = float(us)
    return out


def default_kernel_time_files() -> List[str]:
    files = sorted(glob.glob(str(ROOT / "bench" / "results" / "*-h200-*-hopper.json")) +
                   glob.glob(str(ROOT / "bench" / "results" / "*-h200-*-portable.json")))
    return files


def attention_share(phases: Sequence[dict], times: Mapping[Tuple[str, int, int, int, int], float], layers: int,
                    n_draft: int, heads: int = 8) -> List[dict]:
    """Per (case, mode): the verify attention's share of the step, estimated two ways.

    (a) kernel benchmark: per-call time of the same (B, H, n, L) shape (L = context rounded to the
        benchmark's 1k/8k/32k) x layers, divided by the measured step time.
    (b) measured difference: off and on differ only in the verify attention, so
        step_off - step_on = layers x (t_triton - t_ours); with the benchmark's ratio
        r = t_triton / t_ours, t_ours = (step_off - step_on) / (layers x (r - 1)).
    """
    by = {}
    for ph in phases:
        if ph.get("suite") != "speed" or ph.get("skipped"):
            continue
        impl = "triton" if ph["mode"] == "off" else (ph.get("kernel") if ph.get("kernel") in ("hopper", "portable") else "hopper")
        for c in ph.get("cases", []):
            step = c.get("server_step_ms_median")
            if step is None and c.get("client"):
                tpot = c["client"].get("median_tpot_ms")
                acc = c["client"].get("accept_length") or 1.0
                step = tpot * acc if tpot else None
            by[(c["bs"], c["ctx"], ph["name"])] = (impl, step)
    out = []
    for (bs, ctx, name), (impl, step) in sorted(by.items()):
        L_bench = min((1024, 8192, 32768), key=lambda v: abs(v - ctx))
        us = times.get((impl, bs, heads, n_draft, L_bench))
        row = {"phase": name, "bs": bs, "ctx": ctx, "impl": impl, "step_ms": step,
               "bench_shape": f"B{bs} H{heads} n{n_draft} L{L_bench // 1024}k", "bench_us_per_call": us}
        row["share_from_bench"] = (us * layers / 1000.0 / step) if (us and step) else None
        off = by.get((bs, ctx, "speed/off"))
        if impl != "triton" and off and off[1] and step:
            t_tri = times.get(("triton", bs, heads, n_draft, L_bench))
            if t_tri and us and t_tri > us:
                r = t_tri / us
                ours = (off[1] - step) / (layers * (r - 1))
                row["ours_us_from_difference"] = 1000.0 * ours
                row["share_from_difference"] = ours * layers / step
                row["off_share_from_difference"] = ours * r * layers / off[1]
        out.append(row)
    return out


def plot_speed(phases: Sequence[dict], path: Path) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"no plot: {exc}"
    rows = [(ph["name"].split("/", 1)[1], c) for ph in phases if ph.get("suite") == "speed" and not ph.get("skipped")
            for c in ph.get("cases", []) if c.get("client")]
    if not rows:
        return "no plot: no completed case"
    cases = sorted({(c["bs"], c["ctx"]) for _, c in rows})
    modes = sorted({m for m, _ in rows}, key=lambda m: (m != "off", m))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    w = 0.8 / max(1, len(modes))
    for k, m in enumerate(modes):
        tput, step = [], []
        for case in cases:
            c = next((c for mm, c in rows if mm == m and (c["bs"], c["ctx"]) == case), None)
            tput.append((c["client"].get("output_throughput") or 0) if c else 0)
            step.append((c.get("server_step_ms_median") or (c["client"].get("median_tpot_ms") or 0)) if c else 0)
        xs = [i + k * w for i in range(len(cases))]
        axes[0].bar(xs, tput, w, label=m)
        axes[1].bar(xs, step, w, label=m)
    for ax, title in ((axes[0], "output tokens/s (sglang.bench_serving)"), (axes[1], "decode step (draft + verify), ms")):
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(cases))])
        ax.set_xticklabels([f"bs {b}\n{c // 1024}k" for b, c in cases])
        ax.set_title(title)
        ax.legend()
    axes[1].set_yscale("log")
    fig.suptitle("Kimi-K2-attention dummy model (61 layers, H=8, MLA 576/512), H200")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


# ------------------------------------------------------------------------------------------------
# arguments and main
# ------------------------------------------------------------------------------------------------


def _csv(text: str) -> List[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _spec3(text: str) -> Tuple[int, int, int]:
    parts = [int(x) for x in _csv(text)]
    if len(parts) != 3 or min(parts) < 1:
        raise argparse.ArgumentTypeError("STEPS,TOPK,DRAFTS, e.g. 8,8,80")
    return parts[0], parts[1], parts[2]


def _cases(text: str) -> List[Tuple[int, int]]:
    out = []
    for c in _csv(text):
        m = re.fullmatch(r"(\d+)x(\d+)(k?)", c)
        if not m:
            raise argparse.ArgumentTypeError(f"case {c!r}: BSxCTX, e.g. 8x8192 or 8x32k")
        out.append((int(m.group(1)), int(m.group(2)) * (1024 if m.group(3) else 1)))
    return out


def _modes(text: str) -> List[str]:
    ms = _csv(text)
    for m in ms:
        try:
            L.parse_mode(m)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc))
    return ms


def _stop_with(text: str) -> Tuple[str, str]:
    phase, _, action = text.partition("=")
    if action not in STOP_ACTIONS or "/" not in phase:
        raise argparse.ArgumentTypeError(f"{text!r}: SUITE/MODE=ACTION with ACTION in {STOP_ACTIONS}, "
                                         "e.g. serve/on:portable=kill-scheduler")
    return phase, action


def _subset(allowed: Sequence[str]):
    def parse(text: str) -> List[str]:
        xs = _csv(text)
        bad = [x for x in xs if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(allowed)}")
        return xs
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--suite", type=_subset(SUITES), default=["serve"], help="comma list of serve, shape, faults, speed")
    ap.add_argument("--modes", type=_modes, default=_modes(DEFAULT_MODES), help=f"serve suite (default {DEFAULT_MODES})")
    ap.add_argument("--shape-modes", type=_modes, default=_modes("on:hopper,on:portable"))
    ap.add_argument("--shape-spec", type=_spec3, default=(8, 8, 80), help="STEPS,TOPK,DRAFTS of the shape suite (default 8,8,80)")
    ap.add_argument("--shape-heads", type=int, default=8)
    ap.add_argument("--speed-modes", type=_modes, default=_modes("off,on:hopper,on:portable"))
    ap.add_argument("--speed-cases", type=_cases, default=_cases("1x8192,8x8192,8x32768"), help="BSxCTX list")
    ap.add_argument("--speed-spec", type=_spec3, default=(3, 4, 16), help="STEPS,TOPK,DRAFTS (default 3,4,16: the kernel benchmark's n16 shapes)")
    ap.add_argument("--speed-layers", type=int, default=61)
    ap.add_argument("--speed-output-len", type=int, default=64)
    ap.add_argument("--speed-mem-fraction", type=float, default=0.4)
    ap.add_argument("--speed-start-timeout", type=float, default=420.0)
    ap.add_argument("--bench-timeout", type=float, default=240.0)
    ap.add_argument("--kernel-times", nargs="*", default=None, help="kernel benchmark JSONs (default: bench/results/*-h200-*-{hopper,portable}.json)")
    ap.add_argument("--faults", type=_subset(FAULTS), default=list(FAULTS))
    ap.add_argument("--stop-with", type=_stop_with, action="append", metavar="SUITE/MODE=ACTION",
                    help="end that server by kill-scheduler or hang instead of SIGTERM (repeatable)")
    ap.add_argument("--lib120", default="/tmp/lib120.so", help="a library built for sm_120 only (built when missing)")
    ap.add_argument("--refuse-within", type=float, default=15.0, help="seconds a refused start may take")
    ap.add_argument("--kill-within", type=float, default=30.0)
    ap.add_argument("--hang-exit-s", type=float, default=20.0, help="hang fault: --kdtree-exit-on-hang (default 20)")
    ap.add_argument("--hang-probe-interval", type=float, default=2.0, help="hang fault: --kdtree-serving-probe-interval")
    ap.add_argument("--hang-probe-timeout", type=float, default=10.0, help="hang fault: --kdtree-serving-probe-timeout")
    ap.add_argument("--watchdog-usec", type=int, default=20_000_000, help="hang fault: WATCHDOG_USEC given to the launcher")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--mem-fraction", type=float, default=0.3)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--stop-timeout", type=float, default=30.0)
    ap.add_argument("--preflight", choices=("first", "every", "never"), default="first",
                    help="SGLang argument preflight on the first start only (default), every start, or never "
                         "(the launcher then warns; for the CPU dry run)")
    ap.add_argument("--sglang-extra", type=shlex.split, default=[], help="extra SGLang arguments, one string")
    ap.add_argument("--budget-s", type=float, default=570.0, help="wall-clock budget from now (ignored with --deadline-epoch)")
    ap.add_argument("--deadline-epoch", type=float, default=None, help="absolute deadline (time.time())")
    ap.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT") or None)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "out" / "e2e"))
    ap.add_argument("--workdir", default="/tmp/e2e")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--tag", default=None, help="file name tag (default: the suites)")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.commit is None:
        try:
            args.commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                         text=True, timeout=10).stdout.strip() or "unknown"
        except Exception:
            args.commit = "unknown"
    run = Run(args)

    def on_term(signum, _frame):  # the device's time limit: leave no server behind, keep the JSON
        log(f"got {signal.Signals(signum).name}: stopping the servers, writing the partial result")
        for srv in run.active:
            try:
                srv.close()
            except Exception:
                pass
        if run._lib120_proc is not None and run._lib120_proc.poll() is None:
            run._lib120_proc.kill()
        run.write(final=False)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    if "wrong-arch" in args.faults and "faults" in args.suite:
        run.start_lib120_build()  # ~1 min of nvcc, in the background while servers run
    for suite in SUITES:  # fixed order: serve, shape, faults, speed
        if suite in args.suite:
            log(f"suite {suite}: {run.budget.remaining():.0f} s of budget left")
            getattr(run, f"suite_{suite}")()
    run.write(final=True)
    failed, skipped = run.verdict()
    log(f"verdict {'fail' if failed else ('incomplete' if skipped else 'pass')}: failed {failed}, skipped {skipped}; "
        f"wrote {run.out_json()}")
    return 1 if failed else (2 if skipped else 0)


if __name__ == "__main__":
    sys.exit(main())
