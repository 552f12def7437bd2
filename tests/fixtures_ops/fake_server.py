"""A stand-in for `python -m sglang.launch_server` in launcher and kdtree-wait tests (stdlib only).

Takes SGLang-style arguments (only --host/--port are read; the rest is ignored) and behaves as
FAKE_MODE says, after FAKE_AFTER seconds (default 1):
  crash    raise RuntimeError (a traceback on stderr, exit 1) while "loading"
  healthy  serve /health_generate: 503 until FAKE_AFTER, then 200; runs until signalled
  hang     serve 503 forever (never healthy)
  hang_after  like healthy, but FAKE_HANG_AFTER seconds (default 2) after becoming healthy it hangs:
           it still accepts connections but never answers a request that arrives during the hang,
           which lasts FAKE_HANG_FOR seconds (default: forever); requests after it get 200 again.
           The record holds hang_starts_at and hang_ends_at (wall clock, time.time()).
  exit0    exit 0 while loading (an engine death that reports success)
  sigkill  kill itself with SIGKILL
  configerror  print the plugin's one-line configuration error (as a scheduler's fail_fast does),
           then 60 lines of other output, then exit 1
FAKE_RECORD=<file>: a JSON record of argv, whether NOTIFY_SOCKET (or WATCHDOG_USEC/WATCHDOG_PID) was
visible, and the signal that stopped it (written at start and again on SIGTERM/SIGINT).
FAKE_PIDFILE=<file>: the pid, written at start.
FAKE_IGNORE_TERM=1: ignore SIGTERM (tests the stop timeout / SIGKILL escalation).
FAKE_GRANDCHILD=1: start a long-sleeping grandchild that inherits stdout/stderr (like SGLang's
scheduler processes, it keeps the pipes open after the fake dies); its pid goes in the record.
"""
import argparse
import http.server
import json
import os
import signal
import sys
import threading
import time

START = time.monotonic()
MODE = os.environ.get("FAKE_MODE", "healthy")
AFTER = float(os.environ.get("FAKE_AFTER", "1"))
RECORD = os.environ.get("FAKE_RECORD")
HANG_AFTER = float(os.environ.get("FAKE_HANG_AFTER", "2"))
HANG_FOR = float(os.environ["FAKE_HANG_FOR"]) if os.environ.get("FAKE_HANG_FOR") else None
HANG_START = START + AFTER + HANG_AFTER  # monotonic

ap = argparse.ArgumentParser(add_help=False)
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--port", type=int, default=30000)
args, _unknown = ap.parse_known_args()

state = {"argv": sys.argv[1:], "notify_socket_visible": "NOTIFY_SOCKET" in os.environ,
         "watchdog_visible": any(v in os.environ for v in ("WATCHDOG_USEC", "WATCHDOG_PID")), "signal": None,
         "pid": os.getpid(), "pythonunbuffered": os.environ.get("PYTHONUNBUFFERED")}
if MODE == "hang_after":
    _wall = time.time() - (time.monotonic() - START)  # wall clock of START
    state["hang_starts_at"] = _wall + AFTER + HANG_AFTER
    state["hang_ends_at"] = None if HANG_FOR is None else state["hang_starts_at"] + HANG_FOR


def write_record():
    if RECORD:
        tmp = RECORD + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(state, fh)
        os.replace(tmp, RECORD)


def on_signal(signum, _frame):
    state["signal"] = signal.Signals(signum).name
    write_record()
    print(f"fake server: got {state['signal']}, shutting down", flush=True)
    os._exit(0)


if os.environ.get("FAKE_GRANDCHILD") == "1":
    import subprocess

    gc = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                                 "print('grandchild up', flush=True); time.sleep(600)"])
    state["grandchild"] = gc.pid

if os.environ.get("FAKE_PIDFILE"):
    with open(os.environ["FAKE_PIDFILE"], "w") as fh:
        fh.write(str(os.getpid()))
write_record()
signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, signal.SIG_IGN if os.environ.get("FAKE_IGNORE_TERM") == "1" else on_signal)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        now = time.monotonic()
        if MODE == "hang_after" and now >= HANG_START and (HANG_FOR is None or now < HANG_START + HANG_FOR):
            while True:  # hung: the connection is open, no answer ever comes
                time.sleep(3600)
        ready = MODE in ("healthy", "hang_after") and now - START >= AFTER
        code = 200 if ready and self.path in ("/health_generate", "/health") else 503
        body = b"ok" if code == 200 else b"starting"
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt, *a):
        pass


print(f"fake server: pid {os.getpid()} mode={MODE} after={AFTER} port={args.port}", flush=True)
print("fake server: loading weights ...", file=sys.stderr, flush=True)

if MODE in ("healthy", "hang", "hang_after"):
    srv = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    while True:
        time.sleep(0.1)

time.sleep(AFTER)
if MODE == "crash":
    state["crash_at"] = time.time()  # wall clock: the test measures detection from here
    write_record()

    def load_weights():
        raise RuntimeError("fake crash during load: CUDA error: out of memory (layer 17)")

    load_weights()
elif MODE == "exit0":
    print("fake server: engine core exited cleanly (but nobody asked)", flush=True)
    sys.exit(0)
elif MODE == "configerror":
    print("kdtree-backend: the kernel library was not built for GPU 0 (sm_80); it holds sm_90. "
          "Fix: rebuild with `python -m kdtree_backend.build` on this machine, or set KDTREE_VERIFY=off.",
          file=sys.stderr, flush=True)
    for i in range(60):
        print(f"fake server: Scheduler hit an exception ... line {i}", file=sys.stderr, flush=True)
    sys.exit(1)
elif MODE == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
else:
    sys.exit(f"unknown FAKE_MODE {MODE!r}")
