"""CPU dry run of the real-server release check (bench/e2e/, issues 24 and 27).

What runs here without a GPU: the pure logic of bench/e2e/e2e_lib.py on recorded SGLang /metrics
text and log lines (the pass/fail rules, each shown to fail on a wrong input), the configs and
SGLang arguments (parsed and resolved by the real sglang 0.5.23 preflight), the offline tokenizer,
SGLang's own benchmark client accepting our flags, per-process Prometheus files (TP > 1), and
e2e_server.py end to end: the REAL launcher starting bench/e2e/fake_sglang.py (a stand-in for
`sglang.launch_server`), with injected faults that must turn the verdict to fail.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
E2E = ROOT / "bench" / "e2e"
sys.path.insert(0, str(E2E))

import e2e_lib as L  # noqa: E402

SCRIPT = E2E / "e2e_server.py"
FAKE = E2E / "fake_sglang.py"

# --------------------------------------------------------------------------------------------------
# recorded text (formats of sglang 0.5.23 and of the plugin's metrics in multiprocess mode)
# --------------------------------------------------------------------------------------------------

METRICS_BEFORE = textwrap.dedent("""\
    # HELP kdtree_attention_calls_total forward_extend calls through the hook
    # TYPE kdtree_attention_calls_total counter
    kdtree_attention_calls_total{mode="validate",path="shadow"} 120.0
    kdtree_attention_calls_total{mode="validate",path="fallback"} 27.0
    # TYPE kdtree_attention_fallbacks_total counter
    kdtree_attention_fallbacks_total{reason="not_target_verify"} 27.0
    # TYPE kdtree_attention_validations_total counter
    kdtree_attention_validations_total{outcome="within_tolerance"} 100.0
    kdtree_attention_validation_nonfinite_total 0.0
    # TYPE kdtree_attention_validation_max_abs_diff histogram
    kdtree_attention_validation_max_abs_diff_bucket{le="0.0001"} 0.0
    kdtree_attention_validation_max_abs_diff_bucket{le="0.001"} 40.0
    kdtree_attention_validation_max_abs_diff_bucket{le="0.01"} 100.0
    kdtree_attention_validation_max_abs_diff_bucket{le="0.03"} 100.0
    kdtree_attention_validation_max_abs_diff_bucket{le="+Inf"} 100.0
    kdtree_attention_validation_max_abs_diff_count 100.0
    kdtree_attention_validation_max_abs_diff_sum 0.2
    # TYPE kdtree_attention_build_info gauge
    kdtree_attention_build_info{arch="sm_90",mode="validate",version="0.1.0"} 1.0
    # TYPE sglang:spec_verify_calls_total counter
    sglang:spec_verify_calls_total{engine_type="unified",model_name="/tmp/e2e/model-tiny"} 50.0
    sglang:num_running_reqs{engine_type="unified",model_name="/tmp/e2e/model-tiny",pp_rank="0",tp_rank="0"} 0.0
    """)


def metrics_after(shadow=120 + 2 * 60, fallback_reasons=None, valid=None, hist_top=None) -> str:
    fallback_reasons = fallback_reasons or {"not_target_verify": 27 + 6}
    valid = valid if valid is not None else {"within_tolerance": 100 + 2 * 60 + 20}
    n = sum(valid.values())
    lines = [f'kdtree_attention_calls_total{{mode="validate",path="shadow"}} {float(shadow)}',
             f'kdtree_attention_calls_total{{mode="validate",path="fallback"}} {float(sum(fallback_reasons.values()))}']
    lines += [f'kdtree_attention_fallbacks_total{{reason="{r}"}} {float(v)}' for r, v in fallback_reasons.items()]
    lines += [f'kdtree_attention_validations_total{{outcome="{o}"}} {float(v)}' for o, v in valid.items()]
    lines.append("kdtree_attention_validation_nonfinite_total 0.0")
    top = n if hist_top is None else n - hist_top
    lines += [f'kdtree_attention_validation_max_abs_diff_bucket{{le="{le}"}} {v}' for le, v in
              (("0.0001", 0.0), ("0.001", 40.0), ("0.01", float(top)), ("0.03", float(top)), ("+Inf", float(n)))]
    lines.append('kdtree_attention_build_info{arch="sm_90",mode="validate",version="0.1.0"} 1.0')
    lines.append('sglang:spec_verify_calls_total{engine_type="unified",model_name="/tmp/e2e/model-tiny"} 170.0')
    return "\n".join(lines) + "\n"


DECODE_LOG = [
    "[2026-12-01 10:00:00] Prefill batch, #new-seq: 1, #new-token: 21, #cached-token: 0, token usage: 0.00, "
    "#running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: False, input throughput (token/s): 0.00",
] + [
    "[2026-12-01 10:00:01] Decode batch, #running-req: 1, #token: 30, token usage: 0.00, accept len: 1.00, "
    "accept rate: 0.00, cuda graph: True, gen throughput (token/s): 200.00, #queue-req: 0" for _ in range(40)
] + [
    "[2026-12-01 10:00:02 TP0] Decode batch [17], #running-req: 6, #full token: 300, full token usage: 0.01, "
    "accept len: 1.50, accept rate: 0.25, cuda graph: False, gen throughput (token/s): 900.00, #queue-req: 0"
    for _ in range(20)
] + ['INFO:     127.0.0.1:5000 - "POST /generate HTTP/1.1" 200 OK']

STARTUP_LINE = ('[2026-12-01 10:00:00] {"arch": "sm_90", "event": "kdtree_startup", "kernel": "portable", "level": "info", '
                '"mode": "on", "pid": 4242, "sample_rate": 1.0, "timestamp": "2026-12-01T10:00:00Z", "version": "0.1.0"}')


# --------------------------------------------------------------------------------------------------
# metric parsing and the rules
# --------------------------------------------------------------------------------------------------


def test_parse_prometheus_labels_values_and_sglang_names():
    s = L.parse_prometheus(METRICS_BEFORE + 'weird{a="x\\"y",b="c,d"} 3\nnot a sample line\n')
    assert L.total(s, "kdtree_attention_calls_total", path="shadow") == 120
    assert L.by_label(s, "kdtree_attention_fallbacks_total", "reason") == {"not_target_verify": 27}
    assert L.total(s, "sglang:spec_verify_calls_total") == 50
    assert dict(next(iter(L.select(s, "weird")))) == {"a": 'x"y', "b": "c,d"}
    c = L.KdtreeCounts.from_text(METRICS_BEFORE)
    assert c.present and c.kernel_calls("validate") == 120 and c.kernel_calls("on") == 0
    assert c.diff_buckets[float("inf")] == 100 and c.build_info == [{"arch": "sm_90", "mode": "validate", "version": "0.1.0"}]
    assert not L.KdtreeCounts.from_text("sglang:num_running_reqs 1.0\n").present


def test_decode_steps_from_sglang_log_lines():
    d = L.count_decode_steps(DECODE_LOG)
    assert (d.total, d.graph, d.eager) == (60, 40, 20)
    assert d.by_running == {1: 40, 6: 20}
    # step time from SGLang's own per-step numbers: running x accept len / gen throughput
    assert d.step_ms[0] == (1, pytest.approx(5.0)) and d.step_ms[-1] == (6, pytest.approx(10.0))


def test_startup_events_from_structlog_json_in_sglang_log():
    ev = L.startup_events(["noise", STARTUP_LINE])
    assert ev == [json.loads(STARTUP_LINE.split("] ", 1)[1])]
    assert all(c.ok for c in L.check_startup_events("on", "portable", ev))
    assert not all(c.ok for c in L.check_startup_events("on", "hopper", ev))  # wrong path
    assert not all(c.ok for c in L.check_startup_events("on", "portable", []))  # no event at all
    assert not all(c.ok for c in L.check_startup_events("on", "portable", ev, tp=2))  # one rank silent


def _rules(after_text, steps=None, mode="validate", layers=2):
    d = L.delta(L.KdtreeCounts.from_text(METRICS_BEFORE), L.KdtreeCounts.from_text(after_text))
    steps = steps or L.count_decode_steps(DECODE_LOG[1:41] + DECODE_LOG[41:61][:20])
    return d, steps, {c.name: c for c in L.check_kernel_counts(mode, d, steps, layers, require_eager=True, require_graph=True)}


def test_kernel_count_rules_pass_on_consistent_numbers():
    d, steps, checks = _rules(metrics_after())
    assert steps.total == 60 and d.kernel_calls("validate") == 120
    assert all(c.ok for c in checks.values()), [c for c in checks.values() if not c.ok]


@pytest.mark.parametrize("bad, broken", [
    (dict(shadow=120 + 2 * 60 + 1), "kernel calls == verify steps x 2 layers x 1 rank(s)"),
    (dict(shadow=120 + 2 * 60 - 2), "kernel calls == verify steps x 2 layers x 1 rank(s)"),
    (dict(fallback_reasons={"not_target_verify": 33, "draft_len": 4}), "no fallback other than the draft model's/prefill's (not_target_verify)"),
])
def test_kernel_count_rules_fail(bad, broken):
    _d, _s, checks = _rules(metrics_after(**bad))
    assert not checks[broken].ok
    if "fallback_reasons" in bad:
        assert "draft_len" in checks[broken].detail and "MAX_DRAFT_TOKENS" in checks[broken].detail


def test_kernel_count_rules_need_eager_and_graph_steps_and_scale_with_tp():
    steps = L.count_decode_steps(DECODE_LOG[1:41])  # graph only
    d = L.delta(L.KdtreeCounts.from_text(METRICS_BEFORE), L.KdtreeCounts.from_text(metrics_after(shadow=120 + 2 * 40)))
    checks = {c.name: c for c in L.check_kernel_counts("validate", d, steps, 2, require_eager=True)}
    assert not checks["eager verify steps served (batch above the largest captured size)"].ok
    # TP 2: /metrics sums both ranks, so the same delta is half of what two ranks must show
    checks = {c.name: c for c in L.check_kernel_counts("validate", d, steps, 2, tp=2)}
    assert not checks["kernel calls == verify steps x 2 layers x 2 rank(s)"].ok


def test_off_mode_rule_refuses_kdtree_metrics():
    d = L.delta(L.KdtreeCounts(), L.KdtreeCounts.from_text(METRICS_BEFORE))
    assert not all(c.ok for c in L.check_kernel_counts("off", d, L.count_decode_steps(DECODE_LOG), 2))
    clean = L.delta(L.KdtreeCounts(), L.KdtreeCounts.from_text("sglang:spec_verify_calls_total 3\n"))
    assert all(c.ok for c in L.check_kernel_counts("off", clean, L.count_decode_steps(DECODE_LOG), 2))


def test_validation_rules():
    before = L.KdtreeCounts.from_text(METRICS_BEFORE)
    phase = L.delta(before, L.KdtreeCounts.from_text(metrics_after()))
    ok = L.check_validations(phase, L.delta(before, L.KdtreeCounts.from_text(metrics_after())), atol=2e-2)
    assert all(c.ok for c in ok), [c for c in ok if not c.ok]
    cases = {
        "unpublished": metrics_after(valid={"within_tolerance": 100 + 100}),
        "exceeded": metrics_after(valid={"within_tolerance": 100 + 139, "exceeded": 1}),
        "candidate_error": metrics_after(valid={"within_tolerance": 100 + 139, "candidate_error": 1}),
        "dropped": metrics_after(valid={"within_tolerance": 100 + 139, "dropped": 1}),
        "histogram above atol": metrics_after(hist_top=1),
    }
    for what, text in cases.items():
        checks = L.check_validations(phase, L.delta(before, L.KdtreeCounts.from_text(text)), atol=2e-2)
        assert not all(c.ok for c in checks), what
    # a bad comparison before the window (warm-up, capture) is caught by the lifetime counters
    early = L.KdtreeCounts.from_text(METRICS_BEFORE.replace('outcome="within_tolerance"} 100.0',
                                                            'outcome="within_tolerance"} 99.0\nkdtree_attention_validations_total{outcome="exceeded"} 1.0'))
    checks = {c.name: c for c in L.check_validations(phase, phase, atol=2e-2, lifetime=early)}
    assert not checks["since start: no exceeded / candidate_error / dropped / non-finite"].ok


def test_build_info_and_outputs():
    assert all(c.ok for c in L.check_build_info("on", [{"mode": "on", "arch": "sm_90"}]))
    assert not all(c.ok for c in L.check_build_info("on", [{"mode": "validate", "arch": "sm_90"}]))
    assert not all(c.ok for c in L.check_build_info("off", [{"mode": "on", "arch": "sm_90"}]))
    ref = {"s0": [5, 6, 7], "s1": [1, 2]}
    assert L.compare_outputs(ref, {"s0": [5, 6, 7], "s1": [1, 2]}) == []
    diff = L.compare_outputs(ref, {"s0": [5, 9, 7], "s1": [1, 2]})
    assert diff and "first difference at token 1" in diff[0]
    assert L.compare_outputs(ref, {"s0": [5, 6, 7]}) == ["s1: missing in this mode"]
    assert L.outputs_digest(ref) == L.outputs_digest({"s1": [1, 2], "s0": [5, 6, 7]}) != L.outputs_digest({"s0": [5], "s1": [1, 2]})


def test_histogram_helpers():
    b = {1e-3: 4.0, 1e-2: 10.0, 3e-2: 10.0, float("inf"): 11.0}
    assert L.observations_above(b, 2e-2) == 1.0 and L.max_bucket(b) == float("inf")
    assert L.observations_above({}, 2e-2) is None and L.max_bucket({1e-3: 2.0, 1e-2: 2.0}) == 1e-3


# --------------------------------------------------------------------------------------------------
# configs, SGLang arguments, tokenizer, SGLang's client
# --------------------------------------------------------------------------------------------------


def test_configs():
    tiny = L.tiny_config()
    assert (tiny["num_attention_heads"], tiny["num_hidden_layers"], tiny["num_nextn_predict_layers"]) == (16, 2, 1)
    assert (tiny["kv_lora_rank"] + tiny["qk_rope_head_dim"], tiny["kv_lora_rank"]) == (576, 512)  # the kernel's shape
    assert L.tiny_config(heads=8)["num_attention_heads"] == 8 and L.tiny_config()["num_attention_heads"] == 16
    k = L.kimi_like_config()
    assert {key: k[key] for key in ("num_hidden_layers", "num_attention_heads", "hidden_size", "q_lora_rank", "kv_lora_rank",
                                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_nextn_predict_layers")} == {
        "num_hidden_layers": 61, "num_attention_heads": 8, "hidden_size": 7168, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_nextn_predict_layers": 1}
    a = L.sglang_args("/m", 31000, L.Spec(8, 8, 80), graph_bs=(1, 2), tp=2)
    assert a[a.index("--speculative-num-draft-tokens") + 1] == "80" and a[a.index("--tp-size") + 1] == "2"
    assert a[a.index("--cuda-graph-bs-decode") + 1: a.index("--cuda-graph-bs-decode") + 3] == ["1", "2"]
    assert "--skip-tokenizer-init" in a and "--decode-log-interval" in a and "--enable-metrics" in a
    assert "--skip-tokenizer-init" not in L.sglang_args("/m", 1, L.Spec(), tokenizer=True)
    assert L.parse_mode("on:portable") == ("on", "portable") and L.parse_mode("validate") == ("validate", "auto")
    for bad in ("onn", "off:hopper", "on:fast"):
        with pytest.raises(ValueError):
            L.parse_mode(bad)
    p = L.prompt_ids(3, 50)
    assert p == L.prompt_ids(3, 50) != L.prompt_ids(4, 50) and min(p) >= 3 and max(p) < 32000


@pytest.mark.timeout(240)
def test_real_sglang_accepts_the_server_arguments(tmp_path):
    """SGLang 0.5.23's own parser and resolution (the launcher's preflight, --device cpu) take the
    arguments of the shape suite (H 8, 80 drafts, TP 2) and of the speed suite (tokenizer)."""
    shape, kimi = tmp_path / "shape", tmp_path / "kimi"
    shape.mkdir()
    kimi.mkdir()
    (shape / "config.json").write_text(json.dumps(L.tiny_config(heads=8)))
    (kimi / "config.json").write_text(json.dumps(L.kimi_like_config()))
    subprocess.run([sys.executable, str(E2E / "make_tokenizer.py"), str(kimi)], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDTREE_")}
    env["HF_HUB_OFFLINE"] = "1"
    for args in (L.sglang_args(str(shape), 30000, L.Spec(8, 8, 80), graph_bs=(1, 2), tp=2),
                 L.sglang_args(str(kimi), 30000, L.Spec(3, 4, 16), tokenizer=True, graph_bs=(1, 8), mem_fraction=0.4,
                               context_length=33088)):
        res = tmp_path / "r.json"
        p = subprocess.run([sys.executable, "-m", "kdtree_backend.launcher.preflight", "--result", str(res), "--mode", "off",
                            "--", *args, "--device", "cpu"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=200)
        out = json.loads(res.read_text())
        assert out["status"] == "ok", (out, p.stderr[-2000:])


def test_offline_tokenizer(tmp_path):
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    import make_tokenizer

    make_tokenizer.write_tokenizer(str(tmp_path), 32000)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.vocab_size == 32000 and len(tok) == 32000
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1) and tok.num_special_tokens_to_add() == 0
    assert tok.decode([5, 31999, 1], skip_special_tokens=True) == "w5 w31999"
    assert tok.encode("w5 w31999", add_special_tokens=False) == [5, 31999]


@pytest.mark.timeout(240)
def test_sglang_bench_client_accepts_our_flags(tmp_path):
    """SGLang's own client parses exactly the command e2e_server.py builds (then finds no server)."""
    import e2e_server

    args = e2e_server.build_parser().parse_args(["--out", str(tmp_path)])
    run = e2e_server.Run(args)
    cmd = run.bench_cmd(1, 8, 8192, 64, tmp_path / "r.jsonl")
    assert cmd[1].endswith("bench_client.py") and cmd[cmd.index("--dataset-name") + 1] == "random-ids"
    cmd[cmd.index("--ready-check-timeout-sec") + 1] = "1"
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    out = p.stdout + p.stderr
    assert "unrecognized arguments" not in out and "invalid choice" not in out, out[-2000:]
    assert "tokenize_prompt=True" in out and "dataset_name='random-ids'" in out and "is not ready" in out, out[-2000:]


def test_e2e_server_argument_parsing(tmp_path):
    import e2e_server

    a = e2e_server.build_parser().parse_args([
        "--suite", "serve,faults", "--modes", "off,on:portable", "--speed-cases", "1x8k,8x32768",
        "--stop-with", "serve/on:portable=kill-scheduler", "--shape-spec", "8,8,129", "--tp-size", "2"])
    assert a.suite == ["serve", "faults"] and a.modes == ["off", "on:portable"]
    assert a.speed_cases == [(1, 8192), (8, 32768)] and a.stop_with == [("serve/on:portable", "kill-scheduler")]
    assert a.shape_spec == (8, 8, 129) and a.tp_size == 2
    for bad in (["--suite", "serve,bogus"], ["--modes", "on:fast"], ["--stop-with", "on=kill"], ["--speed-cases", "8by8k"],
                ["--faults", "bad-mode,oops"], ["--shape-spec", "8,8"]):
        with pytest.raises(SystemExit):
            e2e_server.build_parser().parse_args(bad)


# --------------------------------------------------------------------------------------------------
# per-rank metrics (TP > 1): prometheus-client's multiprocess files, one set per process
# --------------------------------------------------------------------------------------------------


def test_per_rank_metrics_from_multiprocess_files(tmp_path):
    pytest.importorskip("prometheus_client")
    code = textwrap.dedent("""
        import os, sys
        from kdtree_backend.sglang import metrics
        n = int(sys.argv[1])
        for _ in range(n):
            metrics.count_call("validate", "shadow")
        metrics.count_validation("within_tolerance", n)
        print(os.getpid())
    """)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    pids = {}
    for rank, n in (("TP0", 10), ("TP1", 10)):
        out = subprocess.run([sys.executable, "-c", code, str(n)], env=env, capture_output=True, text=True, check=True)
        pids[int(out.stdout.split()[-1])] = rank
    per = L.per_pid_samples(str(tmp_path))
    assert set(pids) <= set(per)
    steps = L.count_decode_steps(DECODE_LOG[1:6])  # 5 steps
    ok = L.check_per_rank("validate", {}, per, pids, steps, layers=2, tp=2)
    assert all(c.ok for c in ok), [c for c in ok if not c.ok]
    bad = L.check_per_rank("validate", {}, per, pids, L.count_decode_steps(DECODE_LOG[1:7]), layers=2, tp=2)
    assert not all(c.ok for c in bad)
    missing = L.check_per_rank("validate", {}, per, dict(list(pids.items())[:1]), steps, layers=2, tp=2)
    assert not all(c.ok for c in missing)


# --------------------------------------------------------------------------------------------------
# attention share arithmetic
# --------------------------------------------------------------------------------------------------


def test_attention_share_estimates():
    import e2e_server

    phases = [{"suite": "speed", "name": "speed/off", "mode": "off", "kernel": None,
               "cases": [{"bs": 8, "ctx": 8192, "server_step_ms_median": 100.0}]},
              {"suite": "speed", "name": "speed/on:hopper", "mode": "on", "kernel": "hopper",
               "cases": [{"bs": 8, "ctx": 8192, "server_step_ms_median": 10.0}]}]
    times = {("triton", 8, 8, 16, 8192): 1500.0, ("hopper", 8, 8, 16, 8192): 50.0}
    rows = {r["phase"]: r for r in e2e_server.attention_share(phases, times, layers=61, n_draft=16)}
    assert rows["speed/off"]["share_from_bench"] == pytest.approx(1500 * 61 / 1000 / 100)
    on = rows["speed/on:hopper"]
    assert on["share_from_bench"] == pytest.approx(50 * 61 / 1000 / 10)
    # (100 - 10) ms = 61 x (t_tri - t_ours), t_tri = 30 t_ours  ->  t_ours = 90 / (61 * 29) ms
    assert on["ours_us_from_difference"] == pytest.approx(1000 * 90 / (61 * 29))
    assert on["share_from_difference"] == pytest.approx(90 / 29 / 10)


def test_kernel_times_reads_the_benchmark_json(tmp_path):
    import e2e_server

    f = tmp_path / "2026-11-30-h200-abc-portable.json"
    f.write_text(json.dumps({"rows": [{"shape": {"B": 1, "H": 8, "n": 16, "L": 8192},
                                       "times_us": {"ours": 20.0, "triton": 1500.0, "flashmla": None}}]}))
    t = e2e_server.kernel_times([str(f)])
    assert t == {("portable", 1, 8, 16, 8192): 20.0, ("triton", 1, 8, 16, 8192): 1500.0}


# --------------------------------------------------------------------------------------------------
# end to end: the real launcher, a fake SGLang
# --------------------------------------------------------------------------------------------------


def run_e2e(tmp_path, fake_libs, *args, bug: str = "", timeout: float = 240):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KDTREE_", "FAKE_", "NOTIFY_SOCKET", "WATCHDOG_"))}
    env.update(KDTREE_LAUNCH_CHILD_CMD=f"{sys.executable} {FAKE}", KDTREE_TESTING="1", KDTREE_FAKE_GPU_CAPABILITY="9.0",
               KDTREE_LIB=str(fake_libs.good), FAKE_E2E_BUG=bug, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--workdir", str(tmp_path / "work"), "--commit", "cafe123",
           "--preflight", "never", "--start-timeout", "40", "--stop-timeout", "15", *args]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    files = list(out.glob("*-e2e-*.json"))
    assert len(files) == 1, (p.returncode, p.stderr[-3000:])
    return p, json.loads(files[0].read_text())


def checks_of(result, phase):
    ph = next(p for p in result["phases"] if p["name"] == phase)
    return ph, {c["name"]: c for c in ph["checks"]}


@pytest.mark.timeout(300)
def test_dry_run_serve_and_faults_pass(tmp_path, fake_libs):
    p, r = run_e2e(tmp_path, fake_libs, "--suite", "serve,faults", "--modes", "off,validate:hopper,on:portable",
                   "--faults", "bad-mode,missing-lib,wrong-arch,kill-scheduler,hang", "--lib120", str(fake_libs.sm120_only),
                   "--stop-with", "serve/on:portable=kill-scheduler",
                   "--hang-exit-s", "4", "--hang-probe-interval", "0.5", "--hang-probe-timeout", "2", "--watchdog-usec", "4000000")
    assert p.returncode == 0, p.stderr[-3000:]
    assert r["verdict"] == "pass" and r["commit"] == "cafe123" and r["date"] and "gpu" in r and r["command"]
    names = [ph["name"] for ph in r["phases"]]
    assert names == ["serve/off", "serve/validate:hopper", "serve/on:portable", "faults/bad-mode", "faults/missing-lib",
                     "faults/wrong-arch", "faults/hang"]
    digests = {ph["outputs_digest"] for ph in r["phases"] if ph["name"].startswith("serve/")}
    assert len(digests) == 1
    ph, c = checks_of(r, "serve/validate:hopper")
    assert ph["start"]["ready_s"] > 0 and ph["start"]["probe_after_ready"]["code"] == 200
    assert ph["steps"]["graph"] > 0 and ph["steps"]["eager"] > 0
    assert ph["delta"]["calls"]["validate/shadow"] == 2 * ph["steps"]["total"]
    assert c["validations published on /metrics for every compared call"]["ok"]
    assert ph["stop"]["rc"] == 0 and ph["stop"]["leftovers"] == []
    ph, c = checks_of(r, "serve/on:portable")
    assert ph["stop"]["action"] == "kill-scheduler" and ph["stop"]["rc"] not in (0, None)
    assert c["kill-scheduler: the launcher names the cause (SGLang died while serving)"]["ok"]
    ph, c = checks_of(r, "faults/wrong-arch")
    assert ph["rc"] == 78 and "sm_120" in ph["line"]
    ph, c = checks_of(r, "faults/hang")
    assert ph["stop"]["rc"] == 124 and ph["stop"]["keepalives_before_hang"] >= 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("bug, mode, broken", [
    ("extra_call", "on:hopper", "kernel calls == verify steps x 2 layers x 1 rank(s)"),
    ("draft_len", "on:hopper", "no fallback other than the draft model's/prefill's (not_target_verify)"),
    ("exceeded", "validate:portable", "since start: no exceeded / candidate_error / dropped / non-finite"),
    ("no_publish", "validate:portable", "validations published on /metrics for every compared call"),
    ("no_startup_event", "on:portable", "kdtree_startup logged by every scheduler (1)"),
    ("term_exit1", "on:hopper", "SIGTERM: launcher exits 0 (or 143) in time"),
    ("leftover", "off", "SIGTERM: no leftover process of the server's tree"),
])
def test_dry_run_catches_injected_faults(tmp_path, fake_libs, bug, mode, broken):
    p, r = run_e2e(tmp_path, fake_libs, "--suite", "serve", "--modes", mode, bug=bug)
    assert p.returncode == 1 and r["verdict"] == "fail", p.stderr[-2000:]
    _ph, c = checks_of(r, f"serve/{mode}")
    assert broken in c and not c[broken]["ok"], {k: v for k, v in c.items() if not v["ok"]}


@pytest.mark.timeout(300)
def test_dry_run_outputs_must_match_across_modes(tmp_path, fake_libs):
    p, r = run_e2e(tmp_path, fake_libs, "--suite", "serve", "--modes", "off,on:hopper", bug="diverge")
    assert p.returncode == 1
    _ph, c = checks_of(r, "serve/on:hopper")
    bad = c["greedy outputs token-identical to serve/off"]
    assert not bad["ok"] and "first difference at token 5" in bad["detail"]


def test_dry_run_skips_what_the_budget_cannot_hold(tmp_path, fake_libs):
    p, r = run_e2e(tmp_path, fake_libs, "--suite", "serve,faults", "--modes", "off", "--faults", "bad-mode", "--budget-s", "5")
    assert p.returncode == 2 and r["verdict"] == "incomplete" and r["skipped"] == ["serve/off"]
    assert next(ph for ph in r["phases"] if ph["name"] == "faults/bad-mode")["ok"]


@pytest.mark.timeout(300)
def test_dry_run_speed_suite_with_sglangs_own_client(tmp_path, fake_libs):
    pytest.importorskip("matplotlib")
    p, r = run_e2e(tmp_path, fake_libs, "--suite", "speed", "--speed-modes", "off,on:hopper", "--speed-cases", "2x64",
                   "--speed-output-len", "8", "--speed-start-timeout", "40", timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    for name in ("speed/off", "speed/on:hopper"):
        ph, c = checks_of(r, name)
        case = ph["cases"][0]
        assert case["client"]["completed"] == 2 and case["client"]["output_throughput"] > 0, case
        assert "bench_client.py" in case["client_command"] and "--tokenize-prompt" in case["client_command"]
    assert {row["phase"] for row in r["attention_share"]["rows"]} == {"speed/off", "speed/on:hopper"}
    assert r["plot"] and Path(r["plot"]).exists()
