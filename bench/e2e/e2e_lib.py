"""Pure logic of the real-server release check (bench/e2e/e2e_server.py): model configs, SGLang
arguments, Prometheus text parsing, log parsing and the pass/fail rules. No sglang, torch or GPU:
tests/test_e2e_cpu.py runs all of it on recorded text.

How a phase is judged (one server start = one phase):

* verify steps: SGLang runs with `--decode-log-interval 1`, so its scheduler logs one
  `Decode batch, #running-req: N, ..., cuda graph: True|False, ...` line per decode forward (the
  metrics reporter runs once per processed decode batch; with speculative decoding each decode
  batch is exactly one TARGET_VERIFY forward of the target model, after the draft). Counting those
  lines between two quiet points gives the number of verify steps, split into graph-replayed and
  eager ones. Every request counts, ours and SGLang's own (warm-up, health probes: max_new_tokens 1,
  no decode), so the count and the kernel counter always see the same traffic. SGLang's own
  counter `sglang:spec_verify_calls_total` counts per REQUEST (a batch of 6 adds 6 per step), so
  it equals the step count only for requests run one at a time; it is recorded as a cross-check.
* our kernel: `kdtree_attention_calls_total{mode, path}` (path `kdtree` in on, `shadow` in
  validate) must grow by exactly steps x target layers (x TP ranks: each rank counts its own calls
  and /metrics sums them). The draft model never runs TARGET_VERIFY, so its layers do not count;
  its extend calls (and the target's prefill) are `fallbacks_total{reason="not_target_verify"}`.
* fallbacks: only `not_target_verify` / `draft_runner`; anything else fails the phase (e.g.
  `draft_len` while the 64-draft cap is still in eligibility.py).
* validate: every compared call published (`validations_total` grows by at least the shadow calls
  of the phase after the flush requests), `exceeded`, `candidate_error`, `dropped` and
  `validation_nonfinite_total` stay 0, the max-abs-diff histogram has nothing above the tolerance.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

# ------------------------------------------------------------------------------------------------
# model configs
# ------------------------------------------------------------------------------------------------

# The tiny DeepSeek-V3 of ../shared/gpu/e2e/tiny-deepseek-v3.json (verified on the H200 on
# 2026-12-01): 2 layers + 1 MTP layer, MLA with kv_lora_rank 512 and rope 64 (576-wide keys).
TINY_DSV3: Dict[str, object] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 384,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "use_cache": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def tiny_config(heads: int = 16) -> dict:
    """The verified tiny DeepSeek-V3; `heads` = query heads per rank (Kimi K2 at TP8: 64/8 = 8)."""
    cfg = copy.deepcopy(TINY_DSV3)
    cfg["num_attention_heads"] = heads
    cfg["num_key_value_heads"] = heads
    return cfg


def kimi_like_config(layers: int = 61, heads: int = 8, max_positions: int = 40960) -> dict:
    """Kimi K2's attention at TP8 (61 layers, 8 query heads, its MLA dims) with a small MoE.

    Attention is Kimi K2's per-rank share: hidden 7168, q_lora_rank 1536, kv_lora_rank 512,
    qk_nope 128, qk_rope 64, v_head 128, H = 8 (64 heads / TP 8). The MLP is small on purpose
    (16 experts of width 128, one dense layer of width 2048) so that weights (~10 GB bf16, dummy
    init; Kimi K2's own MoE would be ~2 TB) and load time stay small; the MoE routing is the tiny config's, which is verified to run
    (Kimi's n_group 1 / 384 experts is not what is measured here). One MTP layer for EAGLE.
    """
    cfg = copy.deepcopy(TINY_DSV3)
    cfg.update({
        "hidden_size": 7168,
        "intermediate_size": 2048,
        "moe_intermediate_size": 128,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "max_position_embeddings": max_positions,
        "rope_theta": 50000,
    })
    return cfg


def target_layers(cfg: Mapping[str, object]) -> int:
    return int(cfg["num_hidden_layers"])


# ------------------------------------------------------------------------------------------------
# SGLang arguments
# ------------------------------------------------------------------------------------------------


@dataclass
class Spec:
    steps: int = 2
    topk: int = 2
    draft_tokens: int = 4

    def args(self) -> List[str]:
        return ["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", str(self.topk),
                "--speculative-num-steps", str(self.steps),
                "--speculative-num-draft-tokens", str(self.draft_tokens)]


def sglang_args(model_dir: str, port: int, spec: Spec, *, tokenizer: bool = False, tp: int = 1,
                graph_bs: Sequence[int] = (1, 2, 3, 4), mem_fraction: float = 0.3,
                max_running: int = 8, context_length: Optional[int] = None,
                extra: Sequence[str] = ()) -> List[str]:
    """The server's arguments: those of ../shared/gpu/e2e/README.md (verified there), plus
    `--decode-log-interval 1` (one log line per verify step: the step count), an explicit list
    of captured decode batch sizes (a batch above the largest runs eagerly), and `--tp-size`."""
    a = ["--model-path", model_dir, "--load-format", "dummy"]
    if not tokenizer:
        a += ["--skip-tokenizer-init"]
    a += ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
          "--moe-runner-backend", "triton", *spec.args(), "--disable-radix-cache",
          "--cuda-graph-backend-prefill", "disabled",
          "--cuda-graph-bs-decode", *[str(b) for b in graph_bs],
          "--mem-fraction-static", str(mem_fraction), "--max-running-requests", str(max_running),
          "--enable-metrics", "--decode-log-interval", "1", "--host", "127.0.0.1", "--port", str(port)]
    if context_length:
        a += ["--context-length", str(context_length)]
    if tp != 1:
        a += ["--tp-size", str(tp)]
    return a + list(extra)


def parse_mode(text: str) -> Tuple[str, Optional[str]]:
    """'off' | 'validate:hopper' | 'on:portable' | 'on' (= on:auto) -> (mode, kernel or None)."""
    mode, _, kernel = text.strip().partition(":")
    mode = mode.lower()
    if mode not in ("off", "validate", "on"):
        raise ValueError(f"unknown mode {text!r} (off, validate[:KERNEL], on[:KERNEL])")
    if mode == "off":
        if kernel:
            raise ValueError(f"{text!r}: off runs no kernel, give no path")
        return mode, None
    kernel = (kernel or "auto").lower()
    if kernel not in ("auto", "hopper", "portable"):
        raise ValueError(f"unknown kernel path in {text!r} (auto, hopper, portable)")
    return mode, kernel


# ------------------------------------------------------------------------------------------------
# requests
# ------------------------------------------------------------------------------------------------


def prompt_ids(index: int, length: int, vocab: int = 32000) -> List[int]:
    """Deterministic prompt token ids (no tokenizer needed: /generate takes input_ids)."""
    out, x = [], 1000003 * (index + 1)
    for _ in range(length):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append(3 + (x >> 33) % (vocab - 3))  # never 0/1/2 (BOS/EOS/UNK)
    return out


def outputs_digest(outputs: Mapping[str, Sequence[int]]) -> str:
    canon = json.dumps({k: list(map(int, v)) for k, v in sorted(outputs.items())}, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()


def compare_outputs(ref: Mapping[str, Sequence[int]], got: Mapping[str, Sequence[int]]) -> List[str]:
    """Human-readable differences (empty when token-identical)."""
    diffs = []
    for key in sorted(set(ref) | set(got)):
        a, b = ref.get(key), got.get(key)
        if a is None or b is None:
            diffs.append(f"{key}: missing in {'reference' if a is None else 'this mode'}")
            continue
        a, b = list(a), list(b)
        if a == b:
            continue
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        diffs.append(f"{key}: first difference at token {first} of {len(a)}/{len(b)} "
                     f"(reference {a[first:first + 4]}, this mode {b[first:first + 4]})")
    return diffs


# ------------------------------------------------------------------------------------------------
# Prometheus text
# ------------------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')

Labels = Tuple[Tuple[str, str], ...]


def _unescape(v: str) -> str:
    return v.replace(r"\\", "\0").replace(r"\"", '"').replace(r"\n", "\n").replace("\0", "\\")


def parse_prometheus(text: str) -> Dict[Tuple[str, Labels], float]:
    """{(sample name, sorted label pairs): value} for every sample line of a text exposition."""
    out: Dict[Tuple[str, Labels], float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels: List[Tuple[str, str]] = []
        body = m.group(3) or ""
        pos = 0
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            if not lm:
                break
            labels.append((lm.group(1), _unescape(lm.group(2))))
            pos = lm.end()
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        key = (m.group(1), tuple(sorted(labels)))
        out[key] = out.get(key, 0.0) + value
    return out


Samples = Mapping[Tuple[str, Labels], float]


def select(samples: Samples, name: str, **match: str) -> Dict[Labels, float]:
    return {labels: v for (n, labels), v in samples.items()
            if n == name and all(dict(labels).get(k) == val for k, val in match.items())}


def total(samples: Samples, name: str, **match: str) -> float:
    return float(sum(select(samples, name, **match).values()))


def by_label(samples: Samples, name: str, label: str, **match: str) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for labels, v in select(samples, name, **match).items():
        key = dict(labels).get(label, "")
        out[key] = out.get(key, 0.0) + v
    return out


K = "kdtree_attention_"


@dataclass
class KdtreeCounts:
    """The kdtree metrics of one /metrics scrape (summed over processes, as /metrics shows them)."""

    present: bool = False
    calls: Dict[str, float] = field(default_factory=dict)  # "mode/path" -> n
    fallbacks: Dict[str, float] = field(default_factory=dict)  # reason -> n
    validations: Dict[str, float] = field(default_factory=dict)  # outcome -> n
    nonfinite: float = 0.0
    diff_buckets: Dict[float, float] = field(default_factory=dict)  # le -> cumulative count
    diff_count: float = 0.0
    rel_buckets: Dict[float, float] = field(default_factory=dict)
    build_info: List[Dict[str, str]] = field(default_factory=list)
    spec_verify_calls: float = 0.0  # sglang:spec_verify_calls_total (per request)
    generation_tokens: float = 0.0  # sglang:generation_tokens_total

    @classmethod
    def from_samples(cls, s: Samples) -> "KdtreeCounts":
        c = cls()
        c.present = any(n.startswith(K) for n, _ in s)
        for labels, v in select(s, K + "calls_total").items():
            d = dict(labels)
            c.calls[f"{d.get('mode', '?')}/{d.get('path', '?')}"] = c.calls.get(f"{d.get('mode', '?')}/{d.get('path', '?')}", 0.0) + v
        c.fallbacks = by_label(s, K + "fallbacks_total", "reason")
        c.validations = by_label(s, K + "validations_total", "outcome")
        c.nonfinite = total(s, K + "validation_nonfinite_total")
        for labels, v in select(s, K + "validation_max_abs_diff_bucket").items():
            le = float(dict(labels).get("le", "nan").replace("+Inf", "inf"))
            c.diff_buckets[le] = c.diff_buckets.get(le, 0.0) + v
        c.diff_count = total(s, K + "validation_max_abs_diff_count")
        for labels, v in select(s, K + "validation_relative_error_bucket").items():
            le = float(dict(labels).get("le", "nan").replace("+Inf", "inf"))
            c.rel_buckets[le] = c.rel_buckets.get(le, 0.0) + v
        c.build_info = [dict(labels) for labels, v in select(s, K + "build_info").items() if v >= 1]
        c.spec_verify_calls = total(s, "sglang:spec_verify_calls_total")
        c.generation_tokens = total(s, "sglang:generation_tokens_total")
        return c

    @classmethod
    def from_text(cls, text: str) -> "KdtreeCounts":
        return cls.from_samples(parse_prometheus(text))

    def kernel_calls(self, mode: str) -> float:
        """Calls our kernel served (on) or compared (validate)."""
        if mode == "on":
            return self.calls.get("on/kdtree", 0.0)
        if mode == "validate":
            return self.calls.get("validate/shadow", 0.0) + self.calls.get("validate/shadow_unsampled", 0.0)
        return 0.0

    def validations_total(self) -> float:
        return float(sum(self.validations.values()))

    def to_json(self) -> dict:
        return {
            "present": self.present,
            "calls": self.calls,
            "fallbacks": self.fallbacks,
            "validations": self.validations,
            "nonfinite": self.nonfinite,
            "max_abs_diff_buckets": {("+Inf" if math.isinf(k) else repr(k)): v for k, v in sorted(self.diff_buckets.items())},
            "build_info": self.build_info,
            "sglang_spec_verify_calls_total": self.spec_verify_calls,
            "sglang_generation_tokens_total": self.generation_tokens,
        }


def _delta_map(a: Mapping[str, float], b: Mapping[str, float]) -> Dict[str, float]:
    return {k: b.get(k, 0.0) - a.get(k, 0.0) for k in sorted(set(a) | set(b)) if b.get(k, 0.0) - a.get(k, 0.0)}


def delta(before: KdtreeCounts, after: KdtreeCounts) -> KdtreeCounts:
    d = KdtreeCounts(present=after.present)
    d.calls = _delta_map(before.calls, after.calls)
    d.fallbacks = _delta_map(before.fallbacks, after.fallbacks)
    d.validations = _delta_map(before.validations, after.validations)
    d.nonfinite = after.nonfinite - before.nonfinite
    d.diff_buckets = {k: after.diff_buckets.get(k, 0.0) - before.diff_buckets.get(k, 0.0)
                      for k in set(after.diff_buckets) | set(before.diff_buckets)}
    d.diff_count = after.diff_count - before.diff_count
    d.rel_buckets = {k: after.rel_buckets.get(k, 0.0) - before.rel_buckets.get(k, 0.0)
                     for k in set(after.rel_buckets) | set(before.rel_buckets)}
    d.build_info = after.build_info
    d.spec_verify_calls = after.spec_verify_calls - before.spec_verify_calls
    d.generation_tokens = after.generation_tokens - before.generation_tokens
    return d


def observations_above(buckets: Mapping[float, float], threshold: float) -> Optional[float]:
    """Histogram observations certainly above `threshold`: count(+Inf) - count(le = smallest bucket
    edge >= threshold). None when the histogram is empty or has no such edge."""
    if not buckets:
        return None
    inf = buckets.get(float("inf"))
    edges = sorted(k for k in buckets if not math.isinf(k) and k >= threshold)
    if inf is None or not edges:
        return None
    return inf - buckets[edges[0]]


def max_bucket(buckets: Mapping[float, float]) -> Optional[float]:
    """Upper edge of the highest non-empty bucket (the largest value is <= it); None when empty."""
    prev = 0.0
    top = None
    for le in sorted(buckets):
        if buckets[le] > prev:
            top = le
        prev = max(prev, buckets[le])
    return top


# ------------------------------------------------------------------------------------------------
# log lines
# ------------------------------------------------------------------------------------------------

DECODE_RE = re.compile(r"Decode batch(?: \[\d+\])?, #running-req: (\d+),.*?(?:cuda|cpu|npu|musa) graph: (True|False)")
ACCEPT_RE = re.compile(r"accept len: ([0-9.]+)")
GEN_TPUT_RE = re.compile(r"gen throughput \(token/s\): ([0-9.]+)")
READY_LINE_RE = re.compile(r"kdtree launcher: SGLang is serving: (\S+) answered (HTTP \d+) after ([0-9.]+) s; sent READY=1")
STARTUP_EVENT_RE = re.compile(r"(\{[^{}]*\"event\": \"kdtree_startup\"[^{}]*\})")
FIRED_UP = "The server is fired up and ready to roll"
# SGLang's own model-loading lines: none of them may appear when the launcher refuses to start.
MODEL_LOADING_MARKERS = ("Load weight begin", "Loading safetensors", "Load weight end", "Init torch distributed",
                         "Capture cuda graph", "KV Cache is allocated", "Memory pool end")


@dataclass
class DecodeSteps:
    graph: int = 0
    eager: int = 0
    by_running: Dict[int, int] = field(default_factory=dict)
    accept_lens: List[float] = field(default_factory=list)
    step_ms: List[Tuple[int, float]] = field(default_factory=list)  # (running reqs, ms per step)

    @property
    def total(self) -> int:
        return self.graph + self.eager

    def to_json(self) -> dict:
        return {"total": self.total, "graph": self.graph, "eager": self.eager,
                "by_running_reqs": {str(k): v for k, v in sorted(self.by_running.items())}}


def count_decode_steps(lines: Iterable[str]) -> DecodeSteps:
    """One `Decode batch` line per verify step (SGLang with --decode-log-interval 1)."""
    d = DecodeSteps()
    for line in lines:
        m = DECODE_RE.search(line)
        if not m:
            continue
        n = int(m.group(1))
        if m.group(2) == "True":
            d.graph += 1
        else:
            d.eager += 1
        d.by_running[n] = d.by_running.get(n, 0) + 1
        a = ACCEPT_RE.search(line)
        acc = float(a.group(1)) if a else None
        if acc is not None:
            d.accept_lens.append(acc)
        g = GEN_TPUT_RE.search(line)
        if g and float(g.group(1)) > 0 and acc is not None:
            # gen throughput = tokens generated in this one step / the step's wall time
            d.step_ms.append((n, 1000.0 * n * acc / float(g.group(1))))
    return d


def startup_events(lines: Iterable[str]) -> List[dict]:
    out = []
    for line in lines:
        m = STARTUP_EVENT_RE.search(line)
        if m:
            try:
                out.append(json.loads(m.group(1)))
            except ValueError:
                pass
    return out


# ------------------------------------------------------------------------------------------------
# checks
# ------------------------------------------------------------------------------------------------

ALLOWED_FALLBACKS = ("not_target_verify", "draft_runner")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""

    def to_json(self) -> dict:
        return {"name": self.name, "ok": bool(self.ok), "detail": self.detail}


def check_kernel_counts(mode: str, d: KdtreeCounts, steps: DecodeSteps, layers: int, tp: int = 1,
                        require_eager: bool = False, require_graph: bool = False) -> List[Check]:
    """The kernel/fallback rules of one traffic window (`d` = after - before)."""
    checks: List[Check] = []
    if mode == "off":
        checks.append(Check("off: no kdtree metrics (hook not installed)", not d.present and not d.calls,
                            f"kdtree series present={d.present}, calls delta={d.calls}"))
        checks.append(Check("verify steps ran", steps.total > 0, f"{steps.total} decode steps"))
        return checks
    expected = steps.total * layers * tp
    got = d.kernel_calls(mode)
    path = "kdtree" if mode == "on" else "shadow"
    checks.append(Check("verify steps ran", steps.total > 0, f"{steps.total} decode steps "
                        f"({steps.graph} graph, {steps.eager} eager)"))
    checks.append(Check(f"kernel calls == verify steps x {layers} layers x {tp} rank(s)", got == expected,
                        f"calls_total{{mode={mode},path={path}}} grew by {got:g}; expected {steps.total} x {layers} x {tp} = {expected}"))
    if require_graph:
        checks.append(Check("graph-replayed verify steps served", steps.graph > 0, f"{steps.graph} graph steps"))
    if require_eager:
        checks.append(Check("eager verify steps served (batch above the largest captured size)", steps.eager > 0,
                            f"{steps.eager} eager steps"))
    bad = {r: n for r, n in d.fallbacks.items() if r not in ALLOWED_FALLBACKS and n}
    hint = ""
    if "draft_len" in bad:
        hint = " (draft_len: more draft tokens than eligibility.MAX_DRAFT_TOKENS allows)"
    checks.append(Check("no fallback other than the draft model's/prefill's (not_target_verify)", not bad,
                        f"fallbacks delta {d.fallbacks}{hint}"))
    fb_calls = d.calls.get(f"{mode}/fallback", 0.0)
    fb_sum = float(sum(d.fallbacks.values()))
    checks.append(Check("fallback calls == fallbacks by reason", fb_calls == fb_sum,
                        f"calls_total{{path=fallback}} +{fb_calls:g}, fallbacks_total +{fb_sum:g}"))
    err = d.calls.get(f"{mode}/error", 0.0)
    checks.append(Check("no kernel error calls", err == 0, f"calls_total{{path=error}} +{err:g}"))
    other = {k: v for k, v in d.calls.items() if not k.startswith(mode + "/")}
    checks.append(Check("every call in the configured mode", not other, f"calls in other modes: {other}"))
    return checks


def check_build_info(mode: str, info: Sequence[Mapping[str, str]], tp: int = 1) -> List[Check]:
    if mode == "off":
        return [Check("off: no build_info", not info, f"{info}")]
    modes = sorted({i.get("mode", "?") for i in info})
    return [Check(f"build_info mode={mode}", modes == [mode], f"build_info series: {info}"),
            Check("build_info arch is a GPU", bool(info) and all(i.get("arch", "").startswith("sm_") for i in info),
                  f"{[i.get('arch') for i in info]}")]


def check_startup_events(mode: str, kernel: Optional[str], events: Sequence[Mapping[str, object]], tp: int = 1) -> List[Check]:
    if mode == "off":
        return [Check("off: no kdtree_startup event", not events, f"{len(events)} events")]
    checks = [Check(f"kdtree_startup logged by every scheduler ({tp})", len({e.get('pid') for e in events}) >= tp,
                    f"{len(events)} events from pids {sorted({str(e.get('pid')) for e in events})}")]
    if kernel and kernel != "auto":
        paths = sorted({str(e.get("kernel")) for e in events})
        checks.append(Check(f"kernel path {kernel} (KDTREE_KERNEL)", paths == [kernel], f"startup events name {paths}"))
    bad_mode = [e for e in events if e.get("mode") != mode]
    checks.append(Check("startup events name the mode", not bad_mode, f"{[e.get('mode') for e in events]}"))
    return checks


def check_validations(d_phase: KdtreeCounts, d_flushed: KdtreeCounts, atol: float,
                      lifetime: Optional[KdtreeCounts] = None) -> List[Check]:
    """validate mode. `d_phase`: delta over the traffic window; `d_flushed`: delta from the same
    start to after the flush requests (validations are published asynchronously, outside graphs,
    at the next forward; the flush requests provide those forwards). `lifetime`: the counters
    since the server started (warm-up, graph capture, health probes included): nothing bad there
    either."""
    shadow = d_phase.calls.get("validate/shadow", 0.0)
    v = d_flushed.validations
    published = float(sum(v.values()))
    checks = [
        Check("validations published on /metrics for every compared call", published >= shadow > 0,
              f"validations_total grew by {published:g} (outcomes {v}) for {shadow:g} shadow calls"),
        Check("validations all within tolerance", v.get("within_tolerance", 0.0) == published,
              f"outcomes {v}"),
        Check("no exceeded / candidate_error / dropped", all(v.get(k, 0.0) == 0 for k in ("exceeded", "candidate_error", "dropped")),
              f"outcomes {v}"),
        Check("no non-finite kernel output", d_flushed.nonfinite == 0, f"validation_nonfinite_total +{d_flushed.nonfinite:g}"),
    ]
    if lifetime is not None:
        lv = lifetime.validations
        checks.append(Check("since start: no exceeded / candidate_error / dropped / non-finite",
                            all(lv.get(k, 0.0) == 0 for k in ("exceeded", "candidate_error", "dropped")) and lifetime.nonfinite == 0,
                            f"outcomes {lv}, nonfinite {lifetime.nonfinite:g}"))
    above = observations_above(d_flushed.diff_buckets, atol)
    top = max_bucket(d_flushed.diff_buckets)
    checks.append(Check(f"max |kdtree - triton| histogram: nothing above atol {atol:g}", above == 0,
                        f"observations above: {above}, largest bucket edge reached: {top}"))
    return checks


def summarize(checks: Sequence[Check]) -> Tuple[bool, List[str]]:
    failed = [f"{c.name}: {c.detail}" for c in checks if not c.ok]
    return (not failed, failed)


# ------------------------------------------------------------------------------------------------
# per-rank metrics (TP > 1): read the multiprocess directory, one file set per process
# ------------------------------------------------------------------------------------------------


def per_pid_samples(multiproc_dir: str) -> Dict[int, Dict[Tuple[str, Labels], float]]:
    """{pid: samples} from prometheus-client's multiprocess files (`counter_<pid>.db`, ...).

    /metrics sums counters over processes (no pid label), so per-rank numbers come from the files
    themselves, each merged on its own with prometheus-client's own reader."""
    import glob
    import os

    from prometheus_client.multiprocess import MultiProcessCollector

    pids: Dict[int, List[str]] = {}
    for path in glob.glob(os.path.join(multiproc_dir, "*.db")):
        m = re.search(r"_(\d+)\.db$", os.path.basename(path))
        if m:
            pids.setdefault(int(m.group(1)), []).append(path)
    out: Dict[int, Dict[Tuple[str, Labels], float]] = {}
    for pid, files in pids.items():
        samples: Dict[Tuple[str, Labels], float] = {}
        for metric in MultiProcessCollector.merge(files, accumulate=True):
            for s in metric.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "pid"))
                samples[(s.name, labels)] = samples.get((s.name, labels), 0.0) + float(s.value)
        out[pid] = samples
    return out


def check_per_rank(mode: str, before: Mapping[int, Samples], after: Mapping[int, Samples], rank_of: Mapping[int, str],
                   steps: DecodeSteps, layers: int, tp: int) -> List[Check]:
    """Each scheduler (TP rank) ran our kernel steps x layers times; in validate each published its
    own comparisons. `rank_of`: scheduler pid -> rank name (from the process title)."""
    checks: List[Check] = []
    if mode == "off":
        return checks
    per = {}
    for pid, rank in sorted(rank_of.items(), key=lambda kv: kv[1]):
        a = KdtreeCounts.from_samples(after.get(pid, {}))
        b = KdtreeCounts.from_samples(before.get(pid, {}))
        per[rank] = (pid, b, a)
    checks.append(Check(f"{tp} scheduler processes with kdtree metrics", len(per) == tp and all(a.present for _, _, a in per.values()),
                        f"ranks {sorted(per)}"))
    for rank, (pid, b, a) in per.items():
        got = a.kernel_calls(mode) - b.kernel_calls(mode)
        checks.append(Check(f"{rank} (pid {pid}): kernel calls == steps x {layers}", got == steps.total * layers,
                            f"+{got:g}, expected {steps.total * layers}"))
        if mode == "validate":
            checks.append(Check(f"{rank} (pid {pid}): validations published", a.validations_total() - b.validations_total() > 0,
                                f"+{a.validations_total() - b.validations_total():g} ({a.validations})"))
    return checks
