"""`python launch_with_kdtree.py <sglang args>` (same as `python -m kdtree_backend.launcher`).

Order of work, each step failing loudly with one line and a non-zero exit:
1. our own `--kdtree-*` flags are taken out of argv (SGLang never sees them) and, with the
   `KDTREE_*` variables, validated;
2. mode and kernel library: `kdtree_backend.sglang.plugin.preflight_checks()` (bad KDTREE_VERIFY, missing or
   broken library, ABI or GPU arch mismatch) -> exit 78, before anything of SGLang is imported;
3. `--help`: our section, then SGLang's own help;
4. SGLang argument preflight: a model/tokenizer path that cannot exist is refused at once, then
   SGLang's own parser and resolution in a subprocess (`preflight.py`) -> exit 78 with one line; a
   SIGTERM/SIGINT/SIGHUP meanwhile stops that subprocess, removes its files, exits 128+N with one line;
5. `python -m sglang.launch_server <the untouched argument list>` as a child, watched by
   `readiness.Supervisor` (child liveness on every probe, /health_generate before and after READY=1,
   sd_notify READY/STATUS/WATCHDOG, signals).
"""
from __future__ import annotations

import difflib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from kdtree_backend.launcher import readiness
from kdtree_backend.launcher.readiness import PREFIX

EX_CONFIG = 78
EX_SOFTWARE = 70

ENV_CHILD_CMD = "KDTREE_LAUNCH_CHILD_CMD"  # test/advanced: replaces `python -m sglang.launch_server`
ENV_ARG_PREFLIGHT = "KDTREE_ARG_PREFLIGHT"


@dataclass(frozen=True)
class Opt:
    key: str
    flag: str
    env: Optional[str]
    kind: str  # duration | duration_off | int | url | bool_off
    default: object
    help: str


OPTIONS: Tuple[Opt, ...] = (
    Opt("start_timeout", "--kdtree-start-timeout", "KDTREE_START_TIMEOUT", "duration", 1800.0,
        "deadline for the server to answer its health URL (seconds, or 90s/20min/1h; default 30min)"),
    Opt("health_url", "--kdtree-health-url", "KDTREE_HEALTH_URL", "url", None,
        "URL probed for readiness (default http://<--host>:<--port>/health_generate, 0.0.0.0 -> 127.0.0.1)"),
    Opt("probe_interval", "--kdtree-probe-interval", "KDTREE_PROBE_INTERVAL", "duration", 2.0, "seconds between probes (default 2)"),
    Opt("probe_timeout", "--kdtree-probe-timeout", "KDTREE_PROBE_TIMEOUT", "duration", 30.0,
        "timeout of one probe; /health_generate runs a real generation (default 30)"),
    Opt("serving_probe_interval", "--kdtree-serving-probe-interval", "KDTREE_SERVING_PROBE_INTERVAL", "duration", 10.0,
        "after READY=1: pause between health probes (default 10)"),
    Opt("serving_probe_timeout", "--kdtree-serving-probe-timeout", "KDTREE_SERVING_PROBE_TIMEOUT", "duration", 60.0,
        "after READY=1: timeout of one probe; SGLang answers 503 itself after 20 s without scheduler output (default 60)"),
    Opt("exit_on_hang", "--kdtree-exit-on-hang", "KDTREE_EXIT_ON_HANG", "duration_off", None,
        "after READY=1: stop SGLang and exit 124 when no probe succeeded for this long (default off: only "
        "systemd's watchdog, WatchdogSec=, acts on a hung server)"),
    Opt("stop_timeout", "--kdtree-stop-timeout", "KDTREE_STOP_TIMEOUT", "duration", 90.0,
        "after forwarding SIGTERM/SIGINT, SIGKILL SGLang's process group after this long (default 90)"),
    Opt("tail_lines", "--kdtree-tail-lines", "KDTREE_LOG_TAIL_LINES", "int", 40,
        "lines of SGLang's output repeated when it dies (default 40)"),
    Opt("arg_preflight", "--kdtree-no-arg-preflight", ENV_ARG_PREFLIGHT, "bool_off", True,
        "skip the SGLang argument preflight (env: KDTREE_ARG_PREFLIGHT=0); a warning is printed"),
    Opt("preflight_timeout", "--kdtree-preflight-timeout", "KDTREE_PREFLIGHT_TIMEOUT", "duration", 300.0,
        "deadline of the argument preflight (default 300 s)"),
)
_BY_FLAG = {o.flag: o for o in OPTIONS}


class LaunchConfigError(Exception):
    """A launcher-level configuration error (our own flags and variables); exit 78."""

    exit_code = EX_CONFIG

    def __init__(self, cause: str, fix: str):
        from kdtree_backend.errors import KdtreeConfigError

        self.inner = KdtreeConfigError(cause, fix)
        self.cause, self.fix = self.inner.cause, self.inner.fix
        super().__init__(str(self.inner))

    def __str__(self) -> str:
        return str(self.inner)


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|sec|m|min|h)?\s*$", re.I)
_UNITS = {None: 1.0, "ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(text: str, what: str) -> float:
    m = _DURATION.match(str(text))
    if not m or float(m.group(1)) <= 0:
        raise LaunchConfigError(f"{what}={text!r} is not a positive duration",
                                f"set {what} to seconds (e.g. 1800) or with a unit: 90s, 20min, 1h")
    return float(m.group(1)) * _UNITS[(m.group(2) or "").lower() or None]


def _convert(opt: Opt, raw: str, source: str):
    if opt.kind == "duration":
        return parse_duration(raw, source)
    if opt.kind == "duration_off":
        if raw.strip().lower() in ("off", "no", "none", "0"):
            return None
        try:
            return parse_duration(raw, source)
        except LaunchConfigError:
            raise LaunchConfigError(f"{source}={raw!r} is neither a positive duration nor off",
                                    f"set {source} to seconds (e.g. 600), with a unit (90s, 20min, 1h), or off")
    if opt.kind == "int":
        try:
            v = int(raw)
        except ValueError:
            v = 0
        if v <= 0:
            raise LaunchConfigError(f"{source}={raw!r} is not a positive integer", f"set {source} to e.g. {opt.default}")
        return v
    if opt.kind == "url":
        if not re.match(r"^https?://[^/\s]+", raw):
            raise LaunchConfigError(f"{source}={raw!r} is not an http(s) URL",
                                    f"set {source} like http://127.0.0.1:30000/health_generate")
        return raw
    if opt.kind == "bool_off":  # env form: 1/0
        v = raw.strip().lower()
        if v in ("1", "true", "yes", "on"):
            return True
        if v in ("0", "false", "no", "off"):
            return False
        raise LaunchConfigError(f"{source}={raw!r} is not 0 or 1", f"set {source}=0 to skip the preflight or unset it")
    raise AssertionError(opt.kind)


def split_args(argv: Sequence[str], environ: Mapping[str, str]) -> Tuple[Dict[str, object], List[str]]:
    """Our settings (flag > env > default) and SGLang's argv with every `--kdtree-*` token removed."""
    values: Dict[str, object] = {}
    for opt in OPTIONS:
        if opt.env and opt.env in environ and environ[opt.env].strip() != "":
            values[opt.key] = _convert(opt, environ[opt.env], opt.env)
        else:
            values[opt.key] = opt.default
    rest: List[str] = []
    i = 0
    argv = list(argv)
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            rest.extend(argv[i:])
            break
        if tok.startswith("--kdtree-"):
            name, eq, val = tok.partition("=")
            opt = _BY_FLAG.get(name)
            if opt is None:
                close = difflib.get_close_matches(name, list(_BY_FLAG), n=1, cutoff=0.5)
                hint = f"did you mean {close[0]}?" if close else "remove it"
                raise LaunchConfigError(f"unknown launcher flag {name} (launcher flags: {', '.join(_BY_FLAG)})",
                                        f"{hint} (see --help)")
            if opt.kind == "bool_off":
                if eq:
                    raise LaunchConfigError(f"{name} takes no value", f"write {name} alone")
                values[opt.key] = False
            else:
                if not eq:
                    if i + 1 >= len(argv):
                        raise LaunchConfigError(f"{name} needs a value", f"write {name}=VALUE")
                    i += 1
                    val = argv[i]
                values[opt.key] = _convert(opt, val, name)
            i += 1
            continue
        rest.append(tok)
        i += 1
    return values, rest


def wants_help(sglang_args: Sequence[str]) -> bool:
    for tok in sglang_args:
        if tok == "--":
            return False
        if tok in ("-h", "--help"):
            return True
    return False


def launcher_help() -> str:
    lines = [
        "usage: python launch_with_kdtree.py [--kdtree-* options] <sglang arguments>",
        "       (same as: python -m kdtree_backend.launcher ...)",
        "",
        "Runs `python -m sglang.launch_server <sglang arguments>` as a watched child: checks KDTREE_VERIFY and the",
        "kernel library first, then SGLang's own argument parsing and resolution (exit 78 on a configuration",
        "error), then waits for /health_generate while checking that SGLang is alive, tells systemd READY=1",
        "(Type=notify) only when it serves, and exits non-zero within seconds if SGLang dies. After READY=1 it",
        "keeps probing and, under systemd's watchdog (WatchdogSec=), sends WATCHDOG=1 only while the server answers.",
        "",
        "environment:",
        "  KDTREE_VERIFY            off (default) | validate | on",
        "  KDTREE_LIB               path of libkdtree_verify.so (default: inside the package)",
        "",
        "launcher options (flag or environment variable; flags are removed before SGLang sees argv):",
    ]
    for o in OPTIONS:
        env = f" [{o.env}]" if o.env else ""
        lines.append(f"  {o.flag}{env}")
        lines.append(f"      {o.help}")
    lines += [
        f"  {ENV_CHILD_CMD} (env, test/advanced): command run instead of `python -m sglang.launch_server`;",
        "      the SGLang arguments are appended to it",
        "",
        "exit codes: 0 stopped on request; 78 configuration error (do not restart; also when an SGLang process",
        "stopped on a kdtree-backend configuration error); 124 not healthy before the deadline (or, with",
        "--kdtree-exit-on-hang, unhealthy that long while serving); 134 stopped by systemd's watchdog (SIGABRT);",
        "70 launcher error; 128+N stopped by signal N before SGLang started; otherwise SGLang's own code",
        "(128+N when killed by signal N, 1 when it exited 0 without being asked to stop).",
        "",
        "SGLang's arguments (passed to sglang.launch_server unchanged):",
        "",
    ]
    return "\n".join(lines)


def say(msg: str) -> None:
    sys.stderr.write(f"{PREFIX}: {msg}\n")
    sys.stderr.flush()


def say_error(err) -> None:
    """A configuration error: its own one line ("kdtree-backend: <cause>. Fix: <fix>.")."""
    sys.stderr.write(f"{err}\n")
    sys.stderr.flush()


# ------------------------------------------------------------------------------------------------
# step 2: mode and library
# ------------------------------------------------------------------------------------------------


def check_mode_and_library(environ: Mapping[str, str]) -> str:
    """The mode as a string; raises the plugin's KdtreeConfigError (one line, exit 78)."""
    try:
        from kdtree_backend.sglang import plugin
    except Exception as exc:  # the package is broken: that is an installation (configuration) error
        raise LaunchConfigError(
            f"cannot import kdtree_backend.sglang.plugin ({type(exc).__name__}: {exc})",
            "reinstall kdtree-backend into this Python environment (pip install -e . in its checkout)",
        ) from exc
    mode = plugin.preflight_checks(environ)
    return str(getattr(mode, "value", mode)).lower()


# ------------------------------------------------------------------------------------------------
# step 4: argument preflight (subprocess)
# ------------------------------------------------------------------------------------------------

# Flags naming a model or tokenizer folder. A value that can only be a local path and does not exist
# is refused here, in the launcher's own words: SGLang would try it as a Hugging Face repo id and
# answer "Repo id must be in the form 'repo_name' or 'namespace/repo_name'".
PATH_FLAGS = {"--model-path": "--model-path", "--model": "--model-path",
              "--speculative-draft-model-path": "--speculative-draft-model-path",
              "--speculative-draft-model": "--speculative-draft-model-path",
              "--tokenizer-path": "--tokenizer-path"}
# Under systemd these are hidden by ProtectHome= (the complete unit sets it).
_HOME_DIRS = ("/home/", "/root/", "/run/user/")


def _looks_local(value: str) -> bool:
    """True for a value no Hugging Face repo id can be ("org/name" has at most one slash, no leading one)."""
    return value.startswith(("/", "./", "../", "~")) or value in (".", "..") or value.count("/") >= 2


def _path_problem(flag: str, value: str) -> Optional[LaunchConfigError]:
    try:
        os.stat(value)
        return None
    except FileNotFoundError:
        what = "no such file or directory"
    except PermissionError:
        what = f"permission denied for user {_user_name()}"
    except OSError as exc:
        what = exc.strerror or type(exc).__name__
    # the deepest folder on the way that does exist, and what it holds that looks like the name
    parent = os.path.dirname(os.path.abspath(value)) if not value.startswith("~") else ""
    hint, close = "", []
    if value.startswith("~"):
        fix = (f"write the full path, e.g. {os.path.expanduser(value)} (~ is expanded by a shell, and neither "
               f"systemd nor SGLang runs one)")
    else:
        if os.path.isdir(parent):
            try:
                entries = sorted(os.listdir(parent))
            except OSError:
                entries = []
            close = difflib.get_close_matches(os.path.basename(value.rstrip("/")), entries, n=3, cutoff=0.6)
            if close:
                hint = f"; {parent} holds {', '.join(close)}"
        else:
            missing = parent
            while os.path.dirname(missing) != missing and not os.path.isdir(os.path.dirname(missing)):
                missing = os.path.dirname(missing)
            hint = f"; {missing} does not exist either"
        fix = f"point {PATH_FLAGS[flag]} at the local folder that holds the model's config.json"
        if close:
            fix += f" (did you mean {os.path.join(parent, close[0])}?)"
    if value.startswith(_HOME_DIRS):
        hint += ("; under systemd, ProtectHome= hides /home and /root (docs/operations.md, Sandbox: "
                 "ProtectHome=tmpfs with BindReadOnlyPaths=)")
    return LaunchConfigError(
        f"{flag} {value}: {what}{hint} (a path, so SGLang would not look it up on the Hugging Face hub)", fix)


def _user_name() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except Exception:
        return str(os.geteuid())


def check_local_paths(sglang_args: Sequence[str]) -> None:
    """Raise LaunchConfigError for the first model/tokenizer path flag naming a local path that is not there."""
    args = list(sglang_args)
    for i, tok in enumerate(args):
        if tok == "--":
            return
        name, eq, val = tok.partition("=")
        if name not in PATH_FLAGS:
            continue
        if not eq:
            if i + 1 >= len(args):
                continue
            val = args[i + 1]
        if val and _looks_local(val):
            problem = _path_problem(name, val)
            if problem is not None:
                raise problem


class PreflightInterrupted(Exception):
    """SIGTERM/SIGINT/SIGHUP arrived before SGLang was started (the preflight child is gone by now)."""

    def __init__(self, signum: int, pid: Optional[int]):
        super().__init__(signum)
        self.signum, self.pid = signum, pid


class StopGuard:
    """Until SGLang runs: a stop signal is remembered and passed on to the preflight child.

    Without it SIGTERM during the preflight (5-15 s of `import sglang`) killed the launcher on the spot,
    leaving the preflight running and its temporary directory behind.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self):
        self.signum: Optional[int] = None
        self.child: Optional[subprocess.Popen] = None
        self._previous: Dict[int, object] = {}

    def __enter__(self) -> "StopGuard":
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except (ValueError, OSError):  # not the main thread (tests calling main() from a thread)
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            try:
                signal.signal(sig, handler)
            except (ValueError, OSError, TypeError):
                pass

    def _handler(self, signum, _frame) -> None:
        if self.signum is None:
            self.signum = signum
        self.forward()

    def forward(self) -> None:
        child = self.child
        if self.signum is None or child is None or child.returncode is not None:
            return
        try:
            os.kill(child.pid, signal.SIGINT if self.signum == signal.SIGINT else signal.SIGTERM)
        except ProcessLookupError:
            pass


def _wait_preflight(proc: subprocess.Popen, timeout: float, guard: Optional[StopGuard]) -> Optional[int]:
    """The preflight's exit code; None when it ran past `timeout` (then it is killed)."""
    deadline = time.monotonic() + timeout
    stop_seen: Optional[float] = None
    if guard is not None:
        guard.child = proc
        guard.forward()  # a signal that came while the child was being started
    while True:
        try:
            return proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if guard is not None and guard.signum is not None:
            if stop_seen is None:
                stop_seen = now
            elif now - stop_seen > 10.0:  # it ignored SIGTERM
                proc.kill()
        elif now > deadline:
            proc.kill()
            proc.wait()
            return None


def _package_root() -> str:
    import kdtree_backend

    return os.path.dirname(os.path.dirname(os.path.abspath(kdtree_backend.__file__)))


def _in_site_packages(path: str) -> bool:
    """True when `path` is a site-packages directory (never put one before the stdlib)."""
    import site

    dirs = list(getattr(site, "getsitepackages", lambda: [])())
    try:
        dirs.append(site.getusersitepackages())
    except Exception:
        pass
    real = os.path.realpath(path)
    return any(os.path.realpath(d) == real for d in dirs)


def run_arg_preflight(sglang_args: Sequence[str], mode: str, environ: Mapping[str, str], timeout: float,
                      guard: Optional[StopGuard] = None) -> dict:
    """Run preflight.py in a subprocess; returns its outcome dict (status ok | help | error).

    Raises PreflightInterrupted (after the child has exited and the temporary directory is gone)
    when `guard` caught a stop signal.
    """
    env = dict(environ)
    env["KDTREE_VERIFY"] = "off"  # the launcher already checked mode and library; keep the preflight light
    env.pop("NOTIFY_SOCKET", None)
    root = _package_root()
    if not _in_site_packages(root):  # a checkout run as `python launch_with_kdtree.py`, or editable
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory(prefix="kdtree-preflight-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        log_path = os.path.join(tmp, "output.log")
        cmd = [sys.executable, "-m", "kdtree_backend.launcher.preflight", "--result", result_path,
               "--mode", mode, "--", *sglang_args]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                rc = _wait_preflight(proc, timeout, guard)
            finally:
                if proc.returncode is None:  # an exception in the wait: never leave it running
                    proc.kill()
                    proc.wait()
        if guard is not None and guard.signum is not None:
            raise PreflightInterrupted(guard.signum, proc.pid)  # leaving the with-block removes tmp
        with open(log_path, "rb") as fh:
            output = fh.read().decode("utf-8", "replace")
        outcome = None
        if os.path.exists(result_path):
            try:
                with open(result_path) as fh:
                    outcome = json.load(fh)
            except ValueError:
                outcome = None
    if outcome is None:
        tail = output.strip().splitlines()[-30:]
        for line in tail:
            sys.stderr.write(f"  | {line}\n")
        what = f"did not finish within {timeout:g} s" if rc is None else f"exited with code {rc} without a result"
        return {
            "status": "error",
            "cause": f"the SGLang argument preflight {what} (its output is above)",
            "fix": "fix the cause shown above, or set KDTREE_ARG_PREFLIGHT=0 to launch without the preflight",
            "exit_code": EX_SOFTWARE,
            "warnings": [],
        }
    outcome["output"] = output
    return outcome


# The SGLang arguments that decide where the server answers; read by SGLang's own parser in the
# preflight, or by this light scan when the preflight is switched off.
ADDRESS_FLAGS = {"--host": "host", "--port": "port", "--node-rank": "node_rank",
                 "--dist-init-addr": "dist_init_addr", "--ssl-keyfile": "ssl_keyfile"}


def light_address_args(sglang_args: Sequence[str]) -> Dict[str, object]:
    found: Dict[str, object] = {}
    it = list(sglang_args)
    for i, tok in enumerate(it):
        if tok == "--":
            break
        name, eq, val = tok.partition("=")
        key = ADDRESS_FLAGS.get(name)
        if key is None:
            continue
        if not eq:
            if i + 1 >= len(it):
                continue
            val = it[i + 1]
        if key in ("port", "node_rank"):
            try:
                found[key] = int(val)
            except ValueError:
                continue
        else:
            found[key] = val
    return found


def _url_host(host: Optional[str]) -> str:
    host = host or "127.0.0.1"
    if host in ("0.0.0.0", "", "*"):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return host


def health_url_for(host: Optional[str], port: Optional[int], ssl: bool = False) -> str:
    scheme = "https" if ssl else "http"
    return f"{scheme}://{_url_host(host)}:{port or 30000}/health_generate"


def derive_health_url(addr: Mapping[str, object]) -> Tuple[str, Optional[str]]:
    """(URL, note) from SGLang's address arguments. Raises LaunchConfigError when there is none.

    Node rank >= 1 of a multi-node server runs no HTTP server (SGLang's rank 0 does): such a node is
    ready when the whole server answers, on rank 0's host (the host of --dist-init-addr).
    """
    ssl = bool(addr.get("ssl_keyfile"))
    port = addr.get("port")
    node_rank = int(addr.get("node_rank") or 0)
    if node_rank >= 1:
        dist = str(addr.get("dist_init_addr") or "")
        host = dist.rsplit(":", 1)[0].strip("[]") if ":" in dist else dist
        if not host:
            raise LaunchConfigError(
                f"--node-rank {node_rank} runs no HTTP server (only node rank 0 does), and there is no "
                f"--dist-init-addr to find rank 0's host",
                "set KDTREE_HEALTH_URL (or --kdtree-health-url) to rank 0's http://<host>:<port>/health_generate",
            )
        url = health_url_for(host, port, ssl)
        return url, (f"node rank {node_rank} runs no HTTP server: waiting for the whole server on rank 0 "
                     f"({url}; set KDTREE_HEALTH_URL to change)")
    return health_url_for(addr.get("host"), port, ssl), None


def child_command(sglang_args: Sequence[str], environ: Mapping[str, str]) -> List[str]:
    custom = environ.get(ENV_CHILD_CMD, "").strip()
    if custom:
        return shlex.split(custom) + list(sglang_args)
    return [sys.executable, "-m", "sglang.launch_server", *sglang_args]


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before SGLang was started (the supervisor forwards it after)
        say("interrupted before SGLang was started")
        return 130


def _interrupted(signum: int, pid: Optional[int]) -> int:
    code = 128 + signum
    name = signal.Signals(signum).name
    if pid is not None:
        say(f"got {name} during the SGLang argument preflight: stopped it (pid {pid}) and removed its temporary "
            f"directory; SGLang was not started; exiting {code}")
    else:
        say(f"got {name} before SGLang was started; exiting {code}")
    return code


def _help_and_preflight(values: Dict[str, object], sglang_args: List[str], mode: str, environ: Mapping[str, str],
                        guard: StopGuard):
    """Steps 3 and 4: an exit code, or the address arguments SGLang will serve on."""
    from kdtree_backend.errors import KdtreeConfigError

    # 3: help
    if wants_help(sglang_args):
        sys.stdout.write(launcher_help())
        sys.stdout.flush()
        outcome = run_arg_preflight(["--help"], mode, environ, values["preflight_timeout"], guard)
        if outcome.get("status") == "help":
            sys.stdout.write(outcome.get("help_text", ""))
            sys.stdout.flush()
            return 0
        say_error(KdtreeConfigError(outcome.get("cause", "?"), outcome.get("fix", "?")))
        return int(outcome.get("exit_code") or EX_SOFTWARE)

    # 4: SGLang's parser and resolution
    addr = light_address_args(sglang_args)
    if values["arg_preflight"]:
        try:  # before spending 5-15 s importing sglang, and in our words rather than the hub's
            check_local_paths(sglang_args)
        except LaunchConfigError as err:
            say_error(err)
            return EX_CONFIG
        outcome = run_arg_preflight(sglang_args, mode, environ, values["preflight_timeout"], guard)
        for w in outcome.get("warnings", []):
            say(w)
        if outcome.get("status") != "ok":
            if outcome.get("details"):
                sys.stderr.write(outcome["details"])
            say_error(KdtreeConfigError(outcome.get("cause", "?"), outcome.get("fix", "?")))
            return int(outcome.get("exit_code") or EX_SOFTWARE)
        addr = {**addr, **{k: v for k, v in (outcome.get("address") or {}).items() if v is not None}}
        say(f"preflight passed: KDTREE_VERIFY={mode}, SGLang arguments parsed and resolved")
    else:
        say("warning: SGLang argument preflight skipped (KDTREE_ARG_PREFLIGHT=0 / --kdtree-no-arg-preflight); "
            "argument errors will only show up in SGLang's own output")
        if mode == "validate" and not any(t == "--enable-metrics" for t in sglang_args):
            say_error(KdtreeConfigError(
                "KDTREE_VERIFY=validate publishes its comparison through SGLang's /metrics, which exists only with "
                "--enable-metrics, and it is not set",
                "add --enable-metrics to the SGLang arguments (or set KDTREE_VERIFY=off)"))
            return EX_CONFIG
    return addr


def _main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = dict(os.environ)
    from kdtree_backend.errors import KdtreeConfigError

    # 1 + 2: our flags, then mode and library (before anything of SGLang)
    try:
        values, sglang_args = split_args(argv, environ)
        mode = check_mode_and_library(environ)
    except (KdtreeConfigError, LaunchConfigError) as err:
        say_error(err)
        return int(getattr(err, "exit_code", EX_CONFIG))
    except Exception as err:
        say(f"error: the mode/library check failed unexpectedly: {type(err).__name__}: {err}. "
            f"Fix: report this; set KDTREE_VERIFY=off to run without the kernel")
        return EX_SOFTWARE

    # 3 + 4: help, SGLang's parser and resolution; a stop signal meanwhile ends the preflight child too
    with StopGuard() as guard:
        try:
            result = _help_and_preflight(values, sglang_args, mode, environ, guard)
        except PreflightInterrupted as exc:
            return _interrupted(exc.signum, exc.pid)
        if guard.signum is not None:
            return _interrupted(guard.signum, None)
    if isinstance(result, int):
        return result
    addr = result

    # 5: the watched child
    health_url = values["health_url"]
    if not health_url:
        try:
            health_url, note = derive_health_url(addr)
        except LaunchConfigError as err:
            say_error(err)
            return EX_CONFIG
        if note:
            say(note)
    cfg = readiness.WatchConfig(
        health_url=health_url,
        start_timeout=values["start_timeout"],
        probe_interval=values["probe_interval"],
        probe_timeout=values["probe_timeout"],
        stop_timeout=values["stop_timeout"],
        tail_lines=values["tail_lines"],
        serving_probe_interval=values["serving_probe_interval"],
        serving_probe_timeout=values["serving_probe_timeout"],
        exit_on_hang=values["exit_on_hang"],
        mode=mode,
    )
    sup = readiness.Supervisor(child_command(sglang_args, environ), cfg, env=environ, notify_env=environ)
    return sup.run()


if __name__ == "__main__":
    sys.exit(main())
