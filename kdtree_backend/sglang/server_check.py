"""Can a TARGET_VERIFY batch of this server ever reach the kdtree kernel? One static check, three callers.

`check(server_args, mode)` reads SGLang's RESOLVED server arguments (and the model's config, through
SGLang's own `ModelConfig`) and returns every reason why no verify call could ever be eligible:
the backend that runs target verify is not Triton, no speculative algorithm, a dtype or KV-cache
dtype the kernel does not take, deterministic inference, more drafts than the kernel supports, a
KV pool the kernel cannot read, a model that is not 576/512 MLA, ... In `validate`/`on` any such
reason stops the server with exit 78 and one line naming the flag and the fix: "on" means our
kernel runs (docs/architecture.md, "Never silently off").

Callers (they must agree, so they call this function):
* the launcher's argument preflight (`kdtree_backend.launcher.preflight`), before SGLang starts;
* the plugin, in EVERY SGLang process (an AROUND hook on `sglang.srt.runtime_context.publish`, which
  each process calls with the resolved arguments before it builds anything: the HTTP process before
  it spawns schedulers, each scheduler, the detokenizer, the DP controller), so plain
  `python -m sglang.launch_server` is covered too;
* `kdtree-doctor -- <sglang args>`, through the launcher's preflight.

What stays a runtime fallback: reasons that depend on a batch (`eligibility.check`: not a
TARGET_VERIFY pass, the draft model's own passes, one-shot MHA, a forward_batch output buffer of
another layout). docs/operations.md lists every eligibility reason and where it is enforced.

Reads only attributes; never touches the GPU. Imports sglang lazily (the caller has it loaded).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from kdtree_backend.errors import KdtreeConfigError

QK_HEAD_DIM = 576
V_HEAD_DIM = 512
OFF_FIX = "or set KDTREE_VERIFY=off to serve without the kernel"
# KV-cache dtypes (--kv-cache-dtype) the kernel reads: bf16 only ("auto" = the model's dtype).
BF16_KV_NAMES = ("bf16", "bfloat16")


def max_draft_tokens() -> int:
    """The most draft tokens per request the kernel takes: the C plan's limit (abi.MAX_QO_LEN, which
    eligibility.MAX_DRAFT_TOKENS also is)."""
    from kdtree_backend.kernel import abi

    return int(abi.MAX_QO_LEN)


@dataclass(frozen=True)
class Refusal:
    """One reason the kernel could never run, as `reason` (a bounded label), cause and fix."""

    reason: str
    cause: str
    fix: str

    def error(self, mode: str) -> KdtreeConfigError:
        return KdtreeConfigError(f"KDTREE_VERIFY={mode}, but {self.cause}", f"{self.fix}, {OFF_FIX}")


@dataclass
class ServerCheck:
    refusals: List[Refusal] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    facts: Dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.refusals

    def error(self, mode: str) -> Optional[KdtreeConfigError]:
        """The one line every caller stops with: the first refusal, naming the others' reasons."""
        if not self.refusals:
            return None
        first = self.refusals[0].error(mode)
        others = [r.reason for r in self.refusals[1:]]
        return KdtreeConfigError(first.cause + (f" (also refused: {', '.join(others)})" if others else ""),
                                 first.fix)


def _view(server_args):
    """SGLang's resolved view of the record (declarations overlaid), or the record itself."""
    try:
        from sglang.srt.arg_groups.model_override_base import resolved_view

        return resolved_view(server_args)
    except Exception:
        return server_args


def _get(view, record, name, default=None):
    try:
        value = getattr(view, name)
    except Exception:
        value = getattr(record, name, default)
    return default if value is None else value


def speculative_algorithm(server_args) -> Optional[str]:
    """The resolved speculative algorithm's name, or None when there is none."""
    algo = _get(_view(server_args), server_args, "speculative_algorithm")
    name = str(getattr(algo, "name", algo)) if algo else None
    return None if not name or name.upper() == "NONE" else name


def verify_backend(view) -> tuple:
    """(backend that runs TARGET_VERIFY, prefill backend, decode backend, speculative attention mode).

    SGLang (0.5.23, deepseek_v2.py dispatch_attn_forward_method and HybridAttnBackend._select_backend):
    target verify runs on the PREFILL backend unless --speculative-attention-mode decode.
    """
    attn = getattr(view, "attention_backend", None)
    prefill = getattr(view, "prefill_attention_backend", None) or attn
    decode = getattr(view, "decode_attention_backend", None) or attn
    spec_mode = getattr(view, "speculative_attention_mode", None) or "prefill"
    return (decode if spec_mode == "decode" else prefill), prefill, decode, spec_mode


def _model_facts(server_args) -> Dict[str, Any]:
    """What the target model is, from SGLang's own ModelConfig (reads config.json; no weights)."""
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    mc = ModelConfig.from_server_args(server_args)
    arch = getattr(mc, "attention_arch", None)
    dtype = getattr(mc, "dtype", None)
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    try:
        from sglang.srt.configs.model_config import is_deepseek_dsa  # noqa: PLC0415

        dsa = bool(is_deepseek_dsa(getattr(mc, "hf_config", hf)))
    except ImportError:
        dsa = bool(getattr(hf, "index_topk", None))  # DeepSeek V3.2 sparse attention (DSA) configs carry it
    return {
        "mla": arch == AttentionArch.MLA,
        "dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
        "kv_lora_rank": getattr(mc, "kv_lora_rank", None),
        "qk_rope_head_dim": getattr(mc, "qk_rope_head_dim", None),
        "num_attention_heads": getattr(mc, "num_attention_heads", None),
        "dsa": dsa,
        "architectures": list(getattr(hf, "architectures", None) or []),
    }


def check(server_args, mode: str, *, model_facts: Optional[Dict[str, Any]] = None) -> ServerCheck:
    """Every static reason the kernel could never run under `server_args` (resolved) in `mode`.

    `model_facts` (tests) replaces reading the model's config through SGLang's ModelConfig.
    """
    out = ServerCheck()
    view = _view(server_args)

    def get(name, default=None):
        return _get(view, server_args, name, default)

    def refuse(reason, cause, fix):
        out.refusals.append(Refusal(reason, cause, fix))

    # 1. The speculative algorithm: without one there is no TARGET_VERIFY pass at all.
    algo_name = speculative_algorithm(server_args)
    out.facts["speculative_algorithm"] = algo_name
    if algo_name is None:
        refuse("no_speculative_algorithm",
               "no --speculative-algorithm is set: without speculative decoding there is no TARGET_VERIFY "
               "pass, so the kdtree kernel would never run",
               "add --speculative-algorithm (EAGLE with an MTP layer or a draft model, EAGLE3, ...) and its "
               "--speculative-num-steps / --speculative-eagle-topk / --speculative-num-draft-tokens")

    # 2. Which backend runs target verify.
    backend, prefill, decode, spec_mode = verify_backend(view)
    out.facts.update(verify_backend=backend, prefill_backend=prefill, decode_backend=decode,
                     speculative_attention_mode=spec_mode)
    if backend != "triton":
        if prefill != decode:
            where = (f"target verify runs on the {'decode' if spec_mode == 'decode' else 'prefill'} backend "
                     f"(--speculative-attention-mode {spec_mode}), which is {backend!r} "
                     f"(prefill {prefill!r}, decode {decode!r})")
            fix = (f"use --attention-backend triton, or make the backend target verify runs on triton "
                   f"(--{'decode' if spec_mode == 'decode' else 'prefill'}-attention-backend triton)")
        elif backend is None:
            where = ("SGLang left the attention backend to its run-time default (no --attention-backend), which "
                     "for MLA models on NVIDIA GPUs is not triton (fa3 on H100/H200, flashinfer or trtllm_mla elsewhere)")
            fix = "add --attention-backend triton"
        else:
            where = f"SGLang resolved the attention backend to {backend!r}"
            fix = "add --attention-backend triton (the kdtree kernel replaces the Triton backend's verify attention)"
        refuse("verify_backend", f"{where}, so target verify never reaches TritonAttnBackend and the kdtree kernel "
                                 f"would never run", fix)

    # 3. Draft tokens per request (max_extend_len): the kernel's own limit, never a silent fallback.
    drafts = get("speculative_num_draft_tokens")
    out.facts["speculative_num_draft_tokens"] = drafts
    limit = max_draft_tokens()
    if isinstance(drafts, int) and drafts > limit:
        refuse("draft_len", f"--speculative-num-draft-tokens {drafts} is more than the kernel's {limit} draft tokens "
                            f"per request", f"use at most {limit} draft tokens")

    # 4. Backend switches that route verify away from the kernel's path.
    if get("enable_deterministic_inference", False):
        refuse("deterministic", "--enable-deterministic-inference makes TritonAttnBackend use its deterministic "
                                "unified kernel, which the kdtree kernel does not replace",
               "remove --enable-deterministic-inference")
    dcp = get("dcp_size", 1) or 1
    out.facts["dcp_size"] = dcp
    if dcp != 1:
        refuse("dcp", f"--dcp-size {dcp} (decode context parallelism) splits the KV cache across ranks, which the "
                      f"kdtree kernel does not read", "remove --dcp-size (use 1)")
    if get("dllm_algorithm"):
        refuse("dllm", f"--dllm-algorithm {get('dllm_algorithm')} uses a diffusion attention path the kdtree kernel "
                       f"does not replace", "remove --dllm-algorithm")
    if get("enable_kv_cache_sharding", False):
        refuse("pool_type", "--enable-kv-cache-sharding stores the MLA cache in a page-interleaved (sharded) pool, "
                            "which the kdtree kernel does not read", "remove --enable-kv-cache-sharding")

    # 5. KV cache dtype.
    kv = str(get("kv_cache_dtype", "auto") or "auto").lower()
    out.facts["kv_cache_dtype"] = kv
    if kv not in ("auto",) + BF16_KV_NAMES:
        refuse("kv_dtype", f"--kv-cache-dtype {kv}: the kdtree kernel reads a bf16 KV cache only",
               "remove --kv-cache-dtype (or use --kv-cache-dtype bf16) with a bf16 model")

    # 6. The model: MLA with 576-wide latent keys, bf16 activations.
    if model_facts is None:
        try:
            model_facts = _model_facts(server_args)
        except Exception as exc:  # cannot tell: never pretend the kernel will run
            refuse("model_config", f"the model's configuration could not be read to check that the kernel can run "
                                   f"({type(exc).__name__}: {exc})", "check --model-path")
            model_facts = {}
    out.facts.update({f"model_{k}": v for k, v in model_facts.items()})
    if model_facts:
        if not model_facts.get("mla", False):
            refuse("not_mla", f"the model ({', '.join(model_facts.get('architectures') or ['?'])}) does not use MLA "
                              f"attention: the kdtree kernel only computes absorbed-MLA verify attention "
                              f"(DeepSeek-V3, Kimi K2.x)", "serve an MLA model")
        elif (model_facts.get("kv_lora_rank"), model_facts.get("qk_rope_head_dim")) != (V_HEAD_DIM, QK_HEAD_DIM - V_HEAD_DIM):
            refuse("head_dim", f"the model's MLA geometry is kv_lora_rank {model_facts.get('kv_lora_rank')} + rope "
                               f"{model_facts.get('qk_rope_head_dim')}; the kdtree kernel computes 512 + 64 "
                               f"(DeepSeek-V3, Kimi K2.x)", "serve a model with kv_lora_rank 512 and qk_rope_head_dim 64")
        if model_facts.get("dsa"):
            refuse("pool_type", "the model uses DeepSeek sparse attention (DSA/NSA), whose KV pool the kdtree kernel "
                                "does not read", "serve a dense-MLA model")
        dtype = model_facts.get("dtype")
        if dtype is not None and dtype != "bfloat16":
            flag = get("dtype", "auto")
            refuse("q_dtype", f"the model runs in {dtype} (--dtype {flag}; the KV cache follows it): the kdtree "
                              f"kernel computes bf16 only", "use --dtype bfloat16 (or auto with a bf16 checkpoint)")

    # 7. Facts worth a line (no refusal).
    out.facts["page_size"] = get("page_size", 1)
    tp = get("tp_size", 1) or 1
    heads = model_facts.get("num_attention_heads") if model_facts else None
    if heads and not get("enable_dp_attention", False):
        out.facts["heads_per_gpu"] = heads // tp if tp and heads % tp == 0 else None
    return out
