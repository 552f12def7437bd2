"""Never silently off (issue 23): every configuration under which no TARGET_VERIFY call could reach the
kernel is refused at start with exit 78 and one line naming the flag and the fix, by the SAME check
(kdtree_backend.sglang.server_check) in its three callers:

* the launcher (`launch_with_kdtree.py`: its argument preflight);
* the plugin inside a real spawned SGLang scheduler process (`run_scheduler_process`), and inside the
  main process of a plain `python -m sglang.launch_server`;
* `kdtree-doctor -- <sglang args>`, which must print the launcher's line.

Real sglang 0.5.23 on the CPU (`--device cpu`, the tiny DeepSeek-V3 config of tests/fixtures_ops), a
fake kernel library and a fake Hopper GPU (KDTREE_TESTING=1). Every subprocess imports sglang (~5-10 s).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from conftest import clean_env, run_python
from kdtree_backend.sglang import server_check

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "tests" / "fixtures_ops" / "dsv3_tiny"
LAUNCHER = ROOT / "launch_with_kdtree.py"
BASE = ["--model-path", str(MODEL), "--device", "cpu"]
SPEC = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
        "--speculative-num-draft-tokens", "8"]
GOOD = [*BASE, "--attention-backend", "triton", *SPEC]

# (id, SGLang arguments, the reason label, a piece of the one line that must name the flag)
REFUSED = [
    ("fp8_e4m3", [*GOOD, "--kv-cache-dtype", "fp8_e4m3"], "kv_dtype", "--kv-cache-dtype fp8_e4m3"),
    ("fp8_e5m2", [*GOOD, "--kv-cache-dtype", "fp8_e5m2"], "kv_dtype", "--kv-cache-dtype fp8_e5m2"),
    ("fp16", [*GOOD, "--dtype", "float16"], "q_dtype", "--dtype float16"),
    ("deterministic", [*GOOD, "--enable-deterministic-inference"], "deterministic", "--enable-deterministic-inference"),
    ("split_prefill_fa3", [*BASE, *SPEC, "--prefill-attention-backend", "fa3", "--decode-attention-backend", "triton"],
     "verify_backend", "prefill backend (--speculative-attention-mode prefill), which is 'fa3'"),
    ("split_decode_mode", [*BASE, *SPEC, "--prefill-attention-backend", "triton", "--decode-attention-backend", "fa3",
                           "--speculative-attention-mode", "decode"],
     "verify_backend", "decode backend (--speculative-attention-mode decode), which is 'fa3'"),
    ("no_attention_backend", [*BASE, *SPEC], "verify_backend", "Fix: add --attention-backend triton"),
    ("no_speculation", [*BASE, "--attention-backend", "triton"], "no_speculative_algorithm", "no --speculative-algorithm"),
]


def _env(**kw):
    return clean_env(KDTREE_TESTING="1", KDTREE_FAKE_GPU_CAPABILITY="9.0", **kw)


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.startswith("kdtree-backend:")]
    assert lines, stderr[-3000:]
    return lines[-1]


# --- the check itself, on plain attribute records (no sglang resolution) --------------------------

def _record(**kw):
    base = dict(speculative_algorithm="EAGLE", attention_backend="triton", prefill_attention_backend=None,
                decode_attention_backend=None, speculative_attention_mode="prefill", speculative_num_draft_tokens=8,
                enable_deterministic_inference=False, dcp_size=1, dllm_algorithm=None,
                enable_kv_cache_sharding=False, kv_cache_dtype="auto", dtype="auto", page_size=1, tp_size=8,
                enable_dp_attention=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


MLA = dict(mla=True, dtype="bfloat16", kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=64, dsa=False,
           architectures=["DeepseekV3ForCausalLM"])


@pytest.mark.parametrize("fields, facts, reason", [
    ({}, {}, None),
    ({"speculative_num_draft_tokens": 129}, {}, None),  # DDTree's budget + 1: no 64 cap any more
    ({"page_size": 64}, {}, None),  # kv_indices are flat slot ids for any page size
    ({"speculative_algorithm": None}, {}, "no_speculative_algorithm"),
    ({"attention_backend": "fa3"}, {}, "verify_backend"),
    ({"attention_backend": None}, {}, "verify_backend"),
    ({"prefill_attention_backend": "fa3", "decode_attention_backend": "triton"}, {}, "verify_backend"),
    ({"prefill_attention_backend": "fa3", "decode_attention_backend": "triton", "speculative_attention_mode": "decode"}, {}, None),
    ({"prefill_attention_backend": "triton", "decode_attention_backend": "fa3", "speculative_attention_mode": "decode"}, {}, "verify_backend"),
    ({"speculative_num_draft_tokens": 10 ** 6}, {}, "draft_len"),
    ({"enable_deterministic_inference": True}, {}, "deterministic"),
    ({"dcp_size": 2}, {}, "dcp"),
    ({"dllm_algorithm": "LowConfidence"}, {}, "dllm"),
    ({"enable_kv_cache_sharding": True}, {}, "pool_type"),
    ({"kv_cache_dtype": "fp8_e4m3"}, {}, "kv_dtype"),
    ({"kv_cache_dtype": "fp4_e2m1"}, {}, "kv_dtype"),
    ({"kv_cache_dtype": "bf16"}, {}, None),
    ({}, {"mla": False, "architectures": ["LlamaForCausalLM"]}, "not_mla"),
    ({}, {"kv_lora_rank": 256}, "head_dim"),
    ({}, {"dsa": True}, "pool_type"),
    ({"dtype": "float16"}, {"dtype": "float16"}, "q_dtype"),
])
def test_every_static_reason(fields, facts, reason):
    result = server_check.check(_record(**fields), "on", model_facts={**MLA, **facts})
    got = [r.reason for r in result.refusals]
    assert got == ([] if reason is None else [reason]), got
    for r in result.refusals:  # one line, the mode, a fix
        line = str(r.error("on"))
        assert "\n" not in line and line.startswith("kdtree-backend: KDTREE_VERIFY=on, but ") and ". Fix: " in line
        assert line.endswith("or set KDTREE_VERIFY=off to serve without the kernel.")


def test_draft_limit_is_the_kernels_own():
    limit = server_check.max_draft_tokens()
    assert limit >= 257  # DDTree verifies 65, 129 and 257-node trees
    from kdtree_backend.sglang import eligibility

    assert eligibility.MAX_DRAFT_TOKENS == limit
    assert server_check.check(_record(speculative_num_draft_tokens=limit), "on", model_facts=MLA).ok
    assert not server_check.check(_record(speculative_num_draft_tokens=limit + 1), "on", model_facts=MLA).ok


def test_unreadable_model_config_is_refused_not_ignored():
    rec = _record(model_path="/nonexistent/model")
    result = server_check.check(rec, "validate")
    assert [r.reason for r in result.refusals] == ["model_config"]


# --- the launcher --------------------------------------------------------------------------------

def _launch(args, fake_libs, mode="on", extra=()):
    env = _env(KDTREE_VERIFY=mode, KDTREE_LIB=str(fake_libs.good), KDTREE_LAUNCH_CHILD_CMD=f"{sys.executable} -c pass")
    return subprocess.run([sys.executable, str(LAUNCHER), *extra, *args], env=env, capture_output=True, text=True,
                          timeout=240, cwd=ROOT)


_LAUNCHER_LINES: dict = {}  # case id -> the launcher's line (the doctor must print the same)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_launcher_refuses(case, fake_libs):
    name, args, reason, needle = case
    proc = _launch(args, fake_libs)
    assert proc.returncode == 78, (proc.stdout, proc.stderr[-3000:])
    line = _one_line(proc.stderr)
    _LAUNCHER_LINES[name] = line
    assert line.startswith("kdtree-backend: KDTREE_VERIFY=on, but ") and needle in line, line
    assert "Fix: " in line and "SGLang serving" not in proc.stdout


@pytest.mark.timeout(300)
def test_launcher_accepts_the_good_configuration_and_more_than_64_drafts(fake_libs, tmp_path):
    args = [*BASE, "--attention-backend", "triton", "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "8",
            "--speculative-eagle-topk", "8", "--speculative-num-draft-tokens", "80"]
    result = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "kdtree_backend.launcher.preflight", "--result", str(result),
                           "--mode", "on", "--", *args], env=_env(), capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(result.read_text())["status"] == "ok"


@pytest.mark.timeout(300)
def test_spec_flags_without_algorithm_are_warned_about_in_every_mode(tmp_path):
    result = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "kdtree_backend.launcher.preflight", "--result", str(result),
                           "--mode", "off", "--", *BASE, "--speculative-eagle-topk", "4",
                           "--speculative-num-draft-tokens", "8", "--speculative-num-steps", "3"],
                          env=_env(), capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = json.loads(result.read_text())["warnings"]
    assert any("without --speculative-algorithm, so SGLang ignores them" in w for w in warnings), warnings


# --- the plugin in real SGLang processes ------------------------------------------------------------

_SCHEDULERS = textwrap.dedent(
    """
    import json, sys, logging
    import multiprocessing as mp
    logging.disable(logging.WARNING)
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.managers.scheduler import run_scheduler_process
    cases = json.loads(sys.argv[1])
    ctx = mp.get_context("spawn")  # what SGLang uses
    out = {}
    for name, args in cases.items():
        sa = prepare_server_args(args)
        sa.resolve_once()
        reader, writer = ctx.Pipe(duplex=False)
        # two ranks, as with --tp-size 2: each scheduler process loads the plugin and checks on its own
        procs = [ctx.Process(target=run_scheduler_process, args=(sa, None, 0, rank, 0, None, writer)) for rank in (0, 1)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(240)
        out[name] = [p.exitcode for p in procs]
    print("RESULT " + json.dumps(out), flush=True)
    """
)


@pytest.mark.timeout(900)
def test_plugin_refuses_in_every_spawned_scheduler(fake_libs):
    cases = {name: args for name, args, _, _ in REFUSED[:4]} | {"split_prefill_fa3": REFUSED[4][1]}
    env = _env(KDTREE_VERIFY="on", KDTREE_LIB=str(fake_libs.good))
    proc = run_python(_SCHEDULERS, env, timeout=880, args=[json.dumps(cases)])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, (proc.stdout, proc.stderr[-4000:])
    exits = json.loads(lines[-1][len("RESULT "):])
    assert exits == {name: [78, 78] for name in cases}, (exits, proc.stderr[-4000:])
    for name, (_, args, reason, needle) in {c[0]: c for c in REFUSED}.items():
        if name in cases:
            assert needle in proc.stderr, (name, proc.stderr[-4000:])
    assert proc.stderr.count("kdtree-backend: KDTREE_VERIFY=on, but --kv-cache-dtype fp8_e4m3") == 2  # both ranks


@pytest.mark.timeout(600)
def test_broken_library_stops_both_spawned_schedulers(fake_libs):
    """Issue 27's CPU part: with --tp-size 2 each rank's scheduler loads the plugin on its own."""
    env = _env(KDTREE_VERIFY="on", KDTREE_LIB=str(fake_libs.missing_symbol))
    proc = run_python(_SCHEDULERS, env, timeout=580, args=[json.dumps({"good": GOOD})])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines and json.loads(lines[-1][len("RESULT "):]) == {"good": [78, 78]}, (proc.stdout, proc.stderr[-3000:])
    assert proc.stderr.count("lacks the symbol(s) kdtree_verify_run") == 2, proc.stderr[-3000:]


@pytest.mark.timeout(300)
def test_plain_launch_server_without_triton_backend_stops_in_the_main_process(fake_libs):
    env = _env(KDTREE_VERIFY="on", KDTREE_LIB=str(fake_libs.good))
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", *BASE, *SPEC, "--port", "1", "--skip-tokenizer-init"],
                          env=env, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 78, proc.stderr[-3000:]
    line = _one_line(proc.stderr)
    assert "so target verify never reaches TritonAttnBackend" in line and "Fix: add --attention-backend triton" in line
    assert "Load weight" not in proc.stderr and "scheduler" not in line.lower()


# --- the doctor agrees with the launcher -------------------------------------------------------------

@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_doctor_prints_the_launchers_line(case, fake_libs):
    name, args, _, needle = case
    launcher_line = _LAUNCHER_LINES.get(name) or _one_line(_launch(args, fake_libs).stderr)
    env = _env(KDTREE_VERIFY="on", KDTREE_LIB=str(fake_libs.good))
    proc = subprocess.run([sys.executable, "-m", "kdtree_backend", "doctor", "--", *args], env=env,
                          capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout
    assert f"REFUSED: {launcher_line}" in proc.stdout, (launcher_line, proc.stdout)
