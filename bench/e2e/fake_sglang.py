"""A stand-in for `python -m sglang.launch_server` in the CPU dry run of bench/e2e/e2e_server.py.

Stdlib only. Started by the REAL launcher (KDTREE_LAUNCH_CHILD_CMD, argument preflight off), it
imitates what e2e_server.py reads from a real SGLang 0.5.23 with speculative decoding:

* processes: a "scheduler" child per TP rank whose command line carries the process title
  (`sglang::scheduler`, `sglang::scheduler_TP1`, ...) and a detokenizer; if a scheduler dies, the
  server reports it and exits 1 (SGLang's SubprocessWatchdog); SIGTERM stops everything, exit 0;
* HTTP: /health_generate (prefill only, like SGLang's max_new_tokens=1 probe), /generate
  (input_ids, one list or a batch; `stream` gives SSE chunks with cumulative text), /metrics,
  /model_info, /v1/models, /server_info (what `sglang.bench_serving` asks for);
* logs: one `Decode batch, #running-req: N, ..., cuda graph: True|False, gen throughput ...` line
  per decode step (as with --decode-log-interval 1), the plugin's `kdtree_startup` JSON event,
  SGLang's warm-up request and "The server is fired up and ready to roll!";
* metrics: the plugin's kdtree_attention_* series as the real hook counts them (per step: one call
  per target layer and rank; per prefill: target layers + the MTP layer as not_target_verify
  fallbacks), validations published one request late (asynchronous, like the real ring readout),
  and sglang:spec_verify_calls_total per request.

Greedy "model": token i of a request depends only on its prompt, never on batching.
A SIGSTOPped scheduler makes /health_generate hang (503 after 20 s, as SGLang answers).
FAKE_E2E_BUG (comma list) injects the faults the checks must catch: extra_call, draft_len,
exceeded, no_publish, diverge (on: tokens differ), term_exit1, leftover (a process that survives
SIGTERM in its own session), no_startup_event.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser(add_help=False)
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--port", type=int, default=30000)
ap.add_argument("--model-path", default="")
ap.add_argument("--tp-size", type=int, default=1)
ap.add_argument("--speculative-num-draft-tokens", type=int, default=4)
ap.add_argument("--cuda-graph-bs-decode", type=int, nargs="+", default=[1, 2, 4])
ap.add_argument("--skip-tokenizer-init", action="store_true")
args, _unknown = ap.parse_known_args()

MODE = os.environ.get("KDTREE_VERIFY", "off").strip().lower()
KERNEL = os.environ.get("KDTREE_KERNEL", "auto").strip().lower()
KERNEL = "hopper" if KERNEL == "auto" else KERNEL
BUGS = {b.strip() for b in os.environ.get("FAKE_E2E_BUG", "").split(",") if b.strip()}
try:
    with open(os.path.join(args.model_path, "config.json")) as fh:
        CFG = json.load(fh)
except OSError:
    CFG = {"num_hidden_layers": 2, "vocab_size": 32000}
LAYERS = int(CFG.get("num_hidden_layers", 2))
VOCAB = int(CFG.get("vocab_size", 32000))
TP = args.tp_size
MAX_GRAPH_BS = max(args.cuda_graph_bs_decode)
PATH = {"on": "kdtree", "validate": "shadow"}.get(MODE)

lock = threading.Lock()  # one batch at a time, like one scheduler loop
state = {
    "calls": {}, "fallbacks": {}, "validations": {}, "pending": 0, "nonfinite": 0,
    "hist": 0, "spec_verify": 0, "gen_tokens": 0, "exceeded_done": False, "ready": False,
}


def say(line: str) -> None:
    sys.stdout.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}\n")
    sys.stdout.flush()


def bump(d: str, key, n=1) -> None:
    state[d][key] = state[d].get(key, 0) + n


# --- processes ------------------------------------------------------------------------------
children = []
titles = ["sglang::scheduler" if TP == 1 else f"sglang::scheduler_TP{r}" for r in range(TP)]
for title in titles + ["sglang::detokenizer"]:
    children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", title]))
schedulers = children[:TP]
if "leftover" in BUGS:
    children.append(subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                      "signal.SIG_IGN); time.sleep(3600)", "fake-leftover"], start_new_session=True))


def scheduler_stopped() -> bool:
    """A scheduler is SIGSTOPped (state T in /proc/PID/stat): generation would hang."""
    for c in schedulers:
        try:
            with open(f"/proc/{c.pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return True
        except (OSError, IndexError):
            pass
    return False


def stop_children() -> None:
    for c in children:
        if "leftover" in BUGS and c is children[-1]:
            continue
        try:
            c.kill()
        except OSError:
            pass


def on_term(signum, _frame):
    say(f"fake server: got {signal.Signals(signum).name}, shutting down")
    stop_children()
    os._exit(1 if "term_exit1" in BUGS else 0)


signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGINT, on_term)


def watch_children() -> None:  # SGLang's SubprocessWatchdog
    while True:
        for i, c in enumerate(schedulers):
            if c.poll() is not None:
                say(f"ERROR Subprocess scheduler_{i} (pid {c.pid}) crashed with exit code {c.returncode}; "
                    f"shutting down the server")
                stop_children()
                os._exit(1)
        time.sleep(0.2)


threading.Thread(target=watch_children, daemon=True).start()

# --- the engine --------------------------------------------------------------------------------


def publish() -> None:  # the hook publishes compared calls at the next forward, outside graphs
    if MODE == "validate" and "no_publish" not in BUGS and state["pending"]:
        n = state["pending"]
        state["pending"] = 0
        if "exceeded" in BUGS and not state["exceeded_done"]:
            state["exceeded_done"] = True
            bump("validations", "exceeded")
            n -= 1
        bump("validations", "within_tolerance", n)
        state["hist"] += n


def prefill(bs: int) -> None:
    publish()
    if MODE != "off":
        n = (LAYERS + 1) * TP  # one extend batch: the target's layers + the MTP layer, per rank
        bump("fallbacks", "not_target_verify", n)
        bump("calls", (MODE, "fallback"), n)


def decode_step(bs: int, step_ms: float = 2.0) -> None:
    t = time.monotonic()
    publish()
    graph = bs <= MAX_GRAPH_BS
    if MODE != "off":
        if "draft_len" in BUGS:
            bump("fallbacks", "draft_len", LAYERS * TP)
            bump("calls", (MODE, "fallback"), LAYERS * TP)
        else:
            bump("calls", (MODE, PATH), LAYERS * TP)
            if MODE == "validate":
                state["pending"] += LAYERS * TP
    time.sleep(step_ms / 1000.0)
    dt = max(1e-6, time.monotonic() - t)
    say(f"Decode batch, #running-req: {bs}, #token: {100 * bs}, token usage: 0.01, accept len: 1.00, "
        f"accept rate: 0.00, cuda graph: {graph}, gen throughput (token/s): {bs / dt:.2f}, #queue-req: 0")


def token(prompt, i: int) -> int:
    t = (sum(prompt) * 31 + 7 * i + 11) % (VOCAB - 3) + 3
    if "diverge" in BUGS and MODE == "on" and i == 5:
        t = (t + 1) % (VOCAB - 3) + 3
    return t


def run_batch(prompts, n_new: int):
    """Prefill, then n_new - 1 decode steps for the whole batch (all requests equally long)."""
    with lock:
        prefill(len(prompts))
        outs = [[token(p, 0)] for p in prompts]
        for i in range(1, n_new):
            decode_step(len(prompts))
            for p, o in zip(prompts, outs):
                o.append(token(p, i))
        state["spec_verify"] += (n_new - 1) * len(prompts)
        state["gen_tokens"] += n_new * len(prompts)
        if "extra_call" in BUGS and MODE != "off":
            bump("calls", (MODE, PATH), 1)
    return outs


def metrics_text() -> str:
    lines = []
    with lock:
        if MODE != "off":
            lines.append("# TYPE kdtree_attention_build_info gauge")
            lines.append(f'kdtree_attention_build_info{{arch="sm_90",mode="{MODE}",version="0.1.0"}} 1.0')
            lines.append("# TYPE kdtree_attention_calls_total counter")
            for (mode, path), n in sorted(state["calls"].items()):
                lines.append(f'kdtree_attention_calls_total{{mode="{mode}",path="{path}"}} {float(n)}')
            for reason, n in sorted(state["fallbacks"].items()):
                lines.append(f'kdtree_attention_fallbacks_total{{reason="{reason}"}} {float(n)}')
            if MODE == "validate":
                for outcome, n in sorted(state["validations"].items()):
                    lines.append(f'kdtree_attention_validations_total{{outcome="{outcome}"}} {float(n)}')
                lines.append(f"kdtree_attention_validation_nonfinite_total {float(state['nonfinite'])}")
                h = state["hist"]
                for le in ("0.0001", "0.0003", "0.001", "0.003"):
                    lines.append(f'kdtree_attention_validation_max_abs_diff_bucket{{le="{le}"}} 0.0')
                for le in ("0.01", "0.03", "0.1", "0.3", "1.0", "3.0", "10.0", "+Inf"):
                    lines.append(f'kdtree_attention_validation_max_abs_diff_bucket{{le="{le}"}} {float(h)}')
                lines.append(f"kdtree_attention_validation_max_abs_diff_count {float(h)}")
                lines.append(f"kdtree_attention_validation_max_abs_diff_sum {0.004 * h}")
        lines.append("# TYPE sglang:spec_verify_calls_total counter")
        lines.append(f'sglang:spec_verify_calls_total{{engine_type="unified",model_name="fake"}} {float(state["spec_verify"])}')
        lines.append(f'sglang:generation_tokens_total{{engine_type="unified",is_streaming="false",model_name="fake"}} {float(state["gen_tokens"])}')
        lines.append('sglang:num_running_reqs{engine_type="unified",model_name="fake",tp_rank="0"} 0.0')
    return "\n".join(lines) + "\n"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, fmt, *a):  # uvicorn-like access lines
        say(f'INFO:     {self.client_address[0]}:{self.client_address[1]} - "{self.requestline}" {a[1] if len(a) > 1 else ""}')

    def reply(self, code: int, body, ctype="application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        p = self.path.split("?")[0]
        if p == "/health_generate":
            if not state["ready"]:
                return self.reply(503, {"status": "starting"})
            if scheduler_stopped():  # SGLang: no scheduler output for 20 s -> 503
                t = time.monotonic()
                while scheduler_stopped() and time.monotonic() - t < 20:
                    time.sleep(0.1)
                if scheduler_stopped():
                    return self.reply(503, {"status": "no scheduler output"})
            with lock:
                prefill(1)
            return self.reply(200, b"", "text/plain")
        if p == "/health":
            return self.reply(200 if state["ready"] else 503, b"", "text/plain")
        if p == "/metrics":
            return self.reply(200, metrics_text().encode(), "text/plain; version=0.0.4")
        if p == "/model_info":
            return self.reply(200, {"model_path": args.model_path, "tokenizer_path": args.model_path, "is_generation": True})
        if p == "/v1/models":
            return self.reply(200, {"object": "list", "data": [{"id": args.model_path, "object": "model"}]})
        if p == "/server_info":
            return self.reply(200, {"internal_states": [{"avg_spec_accept_length": 1.0}]})
        return self.reply(404, {"error": p})

    def do_POST(self):
        if self.path.split("?")[0] != "/generate":
            return self.reply(404, {"error": self.path})
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0") or 0)) or b"{}")
        ids = body.get("input_ids")
        if ids is None:
            text = body.get("text", "")
            texts = text if isinstance(text, list) else [text]
            ids = [[3 + (hash(w) % (VOCAB - 3)) for w in t.split()] or [2] for t in texts]
            batched = isinstance(text, list)
        else:
            batched = bool(ids) and isinstance(ids[0], list)
            ids = ids if batched else [ids]
        n_new = int((body.get("sampling_params") or {}).get("max_new_tokens", 16))
        outs = run_batch(ids, n_new)

        def result(p, o, k):
            r = {"output_ids": o[:k], "meta_info": {"prompt_tokens": len(p), "completion_tokens": k,
                                                    "spec_verify_ct": max(0, k - 1), "spec_accept_length": 1.0}}
            if not args.skip_tokenizer_init:
                r["text"] = " ".join(f"w{t}" for t in o[:k])
            return r

        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for k in range(1, n_new + 1):
                self.wfile.write(f"data: {json.dumps(result(ids[0], outs[0], k))}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            return None
        res = [result(p, o, n_new) for p, o in zip(ids, outs)]
        return self.reply(200, res if batched else res[0])


def main() -> None:
    say("Init torch distributed begin. (fake)")
    say("Load weight begin. (fake)")
    httpd = ThreadingHTTPServer((args.host, args.port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    time.sleep(0.3)
    if MODE != "off" and "no_startup_event" not in BUGS:
        for c in schedulers:
            ev = {"event": "kdtree_startup", "mode": MODE, "kernel": KERNEL, "arch": "sm_90", "pid": c.pid,
                  "level": "info", "version": "0.1.0"}
            say(f"INFO kdtree_backend: {json.dumps(ev, sort_keys=True)}")
    state["ready"] = True
    run_batch([[10, 11, 12]], 8)  # SGLang's warm-up request (max_new_tokens 8)
    say("The server is fired up and ready to roll!")
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
