"""The hook on a REAL sglang 0.5.23 `TritonAttnBackend`, on CPU (issue 4, item 6).

Runs only inside the subprocess that `tests/sglang/test_hook_modes.py` starts with `TRITON_INTERPRET=1`
set before triton/sglang are imported (SGLang's Triton kernel then runs on CPU) and
`KDTREE_HOOK_BACKEND_CPU=1`; collected in any other process, it skips, so the interpreter
setting never leaks into other test modules.

The backend is built with SGLang's own test kit (`sglang.test.kits.attention_unittest`):
`MockMLAModelRunner` works with `device="cpu"` (its `TritonAttnBackend.__init__` path needs no
CUDA there), with MLA 576/512 shapes (kv_lora_rank=512, qk_rope_head_dim=64).

Dtype: the Triton interpreter (triton 3.8) mis-computes bf16 on CPU (garbage of ~1e9 against
the float64 reference, while fp16 matches to 1e-3), so these tests run the backend in fp16 and
widen `eligibility.SUPPORTED_DTYPES` to fp16 for the duration. The GPU tests
(tests/sglang/test_backend_gpu.py) run bf16.

The candidate is the float64 reference cast to the output dtype (`hook.set_candidate`).
"""
from __future__ import annotations

import json
import logging
import os

import pytest
from conftest import kit_prefix_slot_collisions

pytestmark = pytest.mark.skipif(
    os.environ.get("KDTREE_HOOK_BACKEND_CPU") != "1" or os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs in the TRITON_INTERPRET=1 subprocess started by tests/sglang/test_hook_modes.py",
)

TARGET = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend"
H = 4


class _TC:
    def skipTest(self, msg):  # the kit calls testcase.skipTest when a backend is unavailable
        pytest.skip(msg)


@pytest.fixture(scope="module")
def env():
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from prometheus_client import CollectorRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kdtree_backend.sglang import eligibility
    from kdtree_backend.sglang import hook
    from kdtree_backend.sglang import metrics

    HookRegistry.register(TARGET, hook.forward_extend_hook, HookType.AROUND)
    HookRegistry.apply_hooks()
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    assert hook.is_kdtree_hook(TritonAttnBackend.forward_extend) or hasattr(
        TritonAttnBackend.forward_extend, "__wrapped__"
    )
    original = TritonAttnBackend.forward_extend.__wrapped__
    old = eligibility.SUPPORTED_DTYPES
    eligibility.SUPPORTED_DTYPES = frozenset({torch.bfloat16, torch.float16})
    reg = CollectorRegistry()
    metrics.init(reg)
    yield {"original": original, "registry": reg}
    eligibility.SUPPORTED_DTYPES = old


def _reference_candidate(q, k, kv_cache, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
                         sm_scale, *, max_qo_len, k_scale=1.0, v_scale=1.0, out=None):
    from kdtree_backend.testing.reference import verify_attention_reference

    ref = verify_attention_reference(q, k, kv_cache, qo_indptr, kv_indptr, kv_indices, custom_mask,
                                     mask_indptr, sm_scale, k_scale=k_scale, v_scale=v_scale,
                                     max_qo_len=max_qo_len)
    out.copy_(ref.to(out.dtype))
    return out


class Fx:
    """A TARGET_VERIFY batch on a real TritonAttnBackend, plus production-shaped q/k/v."""

    def __init__(self, topk=1, prefix_lens=(4, 7), draft=3, page_size=1, seed=0):
        import torch
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.test.kits.attention_unittest.attention_methods.mla_attention import (
            MLAAttentionCase,
            build_mla_attention_fixture,
        )
        from sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner import (
            _make_spec_verify_input,
            _prepare_target_verify_batch,
        )

        case = MLAAttentionCase(
            name="kdtree_hook_cpu", backend="triton", forward_mode=ForwardMode.TARGET_VERIFY,
            num_heads=H, page_size=page_size, prefix_lens=tuple(prefix_lens),
            extend_lens=(draft,) * len(prefix_lens),
        )
        self.fixture = build_mla_attention_fixture(
            _TC(), case, kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=256,
            dtype=torch.float16, device="cpu",
        )
        self.backend = self.fixture.backend
        self.batch = self.fixture.forward_batch
        _prepare_target_verify_batch(self.batch, case, "cpu")
        self.batch.spec_info = _make_spec_verify_input(case, self.batch, topk=topk, device="cpu", spec_kind="eagle")
        self.layer = self.fixture.actual_module.attn_mqa
        self.pool = self.fixture.runner.token_to_kv_pool
        g = torch.Generator().manual_seed(seed)
        T = case.num_input_tokens
        self.q = (torch.randn(T, H, 576, generator=g) * 0.5).half()
        self.k = (torch.randn(T, 1, 576, generator=g) * 0.5).half()
        self.v = self.k[..., :512].contiguous()
        self.init_metadata()

    def ctx(self):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        return forward_context(ForwardContext(attn_backend=self.backend))

    def init_metadata(self):
        with self.ctx():
            self.backend.init_forward_metadata(self.batch)

    def kv(self):
        return self.pool.kv_buffer[0].clone()

    def set_kv(self, t):
        self.pool.kv_buffer[0].copy_(t)

    def call(self, fn=None, **kw):
        import torch
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        with torch.no_grad(), forward_context(ForwardContext(attn_backend=self.backend)):
            if fn is None:
                return self.backend.forward_extend(self.q, self.k, self.v, self.layer, self.batch,
                                                   save_kv_cache=True, **kw)
            return fn(self.backend, self.q, self.k, self.v, self.layer, self.batch, save_kv_cache=True, **kw)

    def reference(self):
        """The float64 reference on the pool AFTER the KV save (what both kernels read)."""
        from kdtree_backend.testing.reference import verify_attention_reference

        md = self.backend.forward_metadata
        k_scale = self.layer.k_scale_float if self.layer.k_scale is not None and self.layer.v_scale is not None else 1.0
        v_scale = self.layer.v_scale_float if self.layer.k_scale is not None and self.layer.v_scale is not None else 1.0
        return verify_attention_reference(
            self.q, self.k, self.pool.get_key_buffer(0), md.qo_indptr, md.kv_indptr, md.kv_indices,
            md.custom_mask, md.mask_indptr, self.layer.scaling, k_scale=k_scale, v_scale=v_scale,
        )


def _set_mode(mode, **settings):
    from kdtree_backend.sglang import hook
    from kdtree_backend.sglang import logs
    from kdtree_backend.sglang import shadow
    from kdtree_backend.config import Mode

    logs.reset_for_tests()
    shadow.reset_for_tests()
    hook.reset_for_tests(mode=Mode(mode), settings=shadow.Settings(**settings))


def _sample(env, name, **labels):
    return env["registry"].get_sample_value(name, labels) or 0.0


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.events = []

    def emit(self, record):
        try:
            self.events.append(json.loads(record.getMessage()))
        except ValueError:
            pass


@pytest.fixture
def records():
    lg = logging.getLogger("kdtree_backend")
    h = _Records()
    old = lg.level
    lg.setLevel(logging.DEBUG)
    lg.addHandler(h)
    yield h
    lg.removeHandler(h)
    lg.setLevel(old)


@pytest.fixture
def cand():
    from kdtree_backend.sglang import hook

    hook.set_candidate(_reference_candidate)
    yield
    hook.set_candidate(None)


# --- eligibility matrix ---------------------------------------------------------------------
def test_eligibility_matrix(env):
    import copy

    import torch
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from kdtree_backend.sglang import eligibility
    from kdtree_backend.sglang.eligibility import REASONS, check

    fx = Fx()
    b, layer, batch, q, k, v = fx.backend, fx.layer, fx.batch, fx.q, fx.k, fx.v
    assert check(b, layer, batch, q, k, v, {}) is None

    def with_attr(obj, name, value):
        sentinel = object()
        old = obj.__dict__.get(name, sentinel)
        setattr(obj, name, value)
        return lambda: (delattr(obj, name) if old is sentinel else setattr(obj, name, old))

    cases = [
        ("not_target_verify", batch, "forward_mode", ForwardMode.EXTEND),
        ("not_target_verify", batch, "forward_mode", ForwardMode.DECODE),
        ("draft_runner", b, "is_draft_runner", True),
        ("not_mla", b, "use_mla", False),
        ("head_dim", layer, "qk_head_dim", 192),
        ("head_dim", layer, "v_head_dim", 128),
        ("kv_heads", layer, "tp_k_head_num", 2),
        ("cross_attention", layer, "is_cross_attention", True),
        ("attn_type", layer, "attn_type", AttentionType.ENCODER_ONLY),
        ("sliding_window", layer, "sliding_window_size", 128),
        ("logit_cap", layer, "logit_cap", 30.0),
        ("xai_temperature", layer, "xai_temperature_len", 8),
        ("dcp", b, "dcp_size", 2),
        ("deterministic", b, "enable_deterministic", True),
        ("dllm", b, "dllm_attention", object()),
        ("verify_shared_kv", b, "use_verify_shared_kv", True),
        ("verify_shared_kv", b, "use_verify_splitkv", True),
        ("dense_fp8", b, "use_dense_fp8_chunked_prefill", True),
        ("one_shot", batch, "mha_one_shot", True),
        ("no_metadata", b, "forward_metadata", None),
    ]
    for reason, obj, name, value in cases:
        assert reason in REASONS
        undo = with_attr(obj, name, value)
        try:
            assert check(b, layer, batch, q, k, v, {}) == reason, (reason, name)
        finally:
            undo()
        assert check(b, layer, batch, q, k, v, {}) is None, f"undo of {name} failed"

    # kwargs, tensors and metadata
    assert check(b, layer, batch, q, k, v, {"sinks": torch.zeros(4)}) == "sinks"
    assert check(b, layer, batch, q, k, v, {"score_mod": lambda *a: a}) == "score_mod"
    assert check(b, layer, batch, q, k, v, {"aux_tensors": [q]}) == "aux_tensors"
    assert check(b, layer, batch, q, None, None, {}) == "no_kv"
    assert check(b, layer, batch, q.float(), k.float(), v.float(), {}) == "q_dtype"
    assert check(b, layer, batch, q[:, :2], k, v, {}) == "q_shape"
    md = b.forward_metadata
    old = md.max_extend_len
    md.max_extend_len = 65  # DDTree's budget + 1: eligible (no 64-draft cap any more)
    assert check(b, layer, batch, q, k, v, {}) is None
    md.max_extend_len = eligibility.MAX_DRAFT_TOKENS + 1  # past the kernel's own limit (abi.MAX_QO_LEN)
    assert check(b, layer, batch, q, k, v, {}) == "draft_len"
    md.max_extend_len = old
    old_mask = md.custom_mask
    md.custom_mask = old_mask.to(torch.int32)
    assert check(b, layer, batch, q, k, v, {}) == "mask_dtype"
    md.custom_mask = None  # causal (DFLASH): eligible
    assert check(b, layer, batch, q, k, v, {}) is None
    md.custom_mask = old_mask.to(torch.uint8)  # the CUDA-graph buffer's dtype: eligible
    assert check(b, layer, batch, q, k, v, {}) is None
    md.custom_mask = old_mask
    batch._attn_output = torch.empty(q.shape[0], H * 512, dtype=torch.float32)
    assert check(b, layer, batch, q, k, v, {}) == "attn_output"
    batch._attn_output = torch.empty(q.shape[0], H * 512, dtype=q.dtype)
    assert check(b, layer, batch, q, k, v, {}) is None
    batch._attn_output = None

    # pool: exact MLATokenToKVPool only; dtype bf16 (fp8 falls back); no translating pool
    pool = b.token_to_kv_pool

    class SubPool(type(pool)):
        pass

    sub = copy.copy(pool)
    sub.__class__ = SubPool
    undo = with_attr(b, "token_to_kv_pool", sub)
    assert check(b, layer, batch, q, k, v, {}) == "pool_type"
    undo()
    undo = with_attr(pool, "dtype", torch.float8_e4m3fn)
    assert check(b, layer, batch, q, k, v, {}) == "kv_dtype"
    undo()
    undo = with_attr(b.kv_index_translator, "is_translating", True)
    assert check(b, layer, batch, q, k, v, {}) == "translating_pool"
    undo()
    assert check(b, layer, batch, q, k, v, {}) is None


def test_dflash_draft_runner_passes_through(env, cand, records):
    """is_draft_runner (DFLASH's draft model): the original runs untouched, fallback counted."""
    import torch

    _set_mode("on")
    fx = Fx()
    kv0 = fx.kv()
    expected = fx.call(env["original"])
    kv_off = fx.kv()
    fx.set_kv(kv0)
    before = _sample(env, "kdtree_attention_fallbacks_total", reason="draft_runner")
    fx.backend.is_draft_runner = True
    try:
        out = fx.call()
    finally:
        fx.backend.is_draft_runner = False
    assert torch.equal(out, expected)
    assert torch.equal(fx.kv(), kv_off)
    assert _sample(env, "kdtree_attention_fallbacks_total", reason="draft_runner") == before + 1
    assert _sample(env, "kdtree_attention_calls_total", mode="on", path="fallback") >= 1
    ev = [e for e in records.events if e.get("event") == "kdtree_fallback"]
    assert ev and ev[0]["reason"] == "draft_runner" and ev[0]["first_occurrence"] is True
    # second occurrence: counted, not logged again
    fx.backend.is_draft_runner = True
    try:
        fx.call()
    finally:
        fx.backend.is_draft_runner = False
    assert len([e for e in records.events if e.get("event") == "kdtree_fallback" and e["reason"] == "draft_runner"]) == 1


# --- on ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("topk,k_scale", [(1, None), (2, None), (1, 2.0)])
def test_on_matches_triton_and_preserves_side_effects(env, cand, topk, k_scale):
    import torch

    _set_mode("on")
    fx = Fx(topk=topk, prefix_lens=(4, 7) if topk == 1 else (5, 9, 2))
    if k_scale is not None:
        fx.layer.k_scale = torch.tensor(k_scale)
        fx.layer.v_scale = torch.tensor(k_scale)
        fx.layer.k_scale_float = k_scale
        fx.layer.v_scale_float = k_scale
    kv0 = fx.kv()
    triton = fx.call(env["original"])
    kv_off = fx.kv()
    ref = fx.reference()
    fx.set_kv(kv0)
    n0 = _sample(env, "kdtree_attention_calls_total", mode="on", path="kdtree")
    out = fx.call()
    assert _sample(env, "kdtree_attention_calls_total", mode="on", path="kdtree") == n0 + 1
    # the KV save happened exactly as in the original (incl. k / k_scale)
    assert torch.equal(fx.kv(), kv_off)
    if k_scale is not None:
        loc = fx.batch.out_cache_loc
        assert torch.equal(fx.kv()[loc], (fx.k.clone().div_(fx.layer.k_scale)).to(fx.kv().dtype))
    assert out.shape == (fx.q.shape[0], H * 512) and out.dtype == fx.q.dtype
    assert torch.equal(out, ref.to(out.dtype))  # the candidate's result is what is returned
    torch.testing.assert_close(out.float(), triton.float(), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(triton.double(), ref, atol=2e-3, rtol=2e-3)
    # the shim is gone after the call
    assert "_forward_extend_kernel" not in vars(fx.backend)


def test_on_honours_attn_output(env, cand):
    import torch

    _set_mode("on")
    fx = Fx()
    buf = torch.full((fx.q.shape[0], H * 512), 7.0, dtype=fx.q.dtype)
    fx.batch._attn_output = buf
    try:
        out = fx.call()
    finally:
        fx.batch._attn_output = None
    assert out is buf
    assert torch.equal(out, fx.reference().to(out.dtype))


def test_on_candidate_error_raises(env, records):
    from kdtree_backend.sglang import hook

    _set_mode("on")
    fx = Fx()

    def boom(*a, **k):
        raise ValueError("kernel says no")

    hook.set_candidate(boom)
    try:
        with pytest.raises(ValueError, match="kernel says no"):
            fx.call()
    finally:
        hook.set_candidate(None)
    assert "_forward_extend_kernel" not in vars(fx.backend)
    assert _sample(env, "kdtree_attention_calls_total", mode="on", path="error") >= 1
    assert any(e.get("event") == "kdtree_candidate_error" and e["mode"] == "on" for e in records.events)


# --- validate --------------------------------------------------------------------------------------
@pytest.mark.parametrize("topk", [1, 2])
def test_validate_returns_control_bit_for_bit(env, cand, topk):
    import torch

    from kdtree_backend.sglang import shadow

    _set_mode("validate")
    fx = Fx(topk=topk, prefix_lens=(4, 7) if topk == 1 else (5, 9, 2))
    kv0 = fx.kv()
    off = fx.call(env["original"])
    kv_off = fx.kv()
    fx.set_kv(kv0)
    w0 = _sample(env, "kdtree_attention_validations_total", outcome="within_tolerance")
    out = fx.call()
    assert torch.equal(out, off), "validate must return the Triton control unchanged"
    assert torch.equal(fx.kv(), kv_off), "validate must save the KV exactly once, like off"
    shadow.flush_all()
    assert _sample(env, "kdtree_attention_validations_total", outcome="within_tolerance") == w0 + 1
    assert _sample(env, "kdtree_attention_validation_max_abs_diff_count") >= 1
    st = shadow.stores()[0]
    assert st.totals["within_tolerance"] == 1


def test_validate_exceeded_publishes_worst_element(env, records):
    import torch

    from kdtree_backend.sglang import hook
    from kdtree_backend.sglang import shadow

    _set_mode("validate", atol=1e-2, rtol=1e-2)
    fx = Fx()
    T = fx.q.shape[0]
    bad_row, bad_head, bad_dim = T - 1, 2, 100

    def skewed(*a, out=None, **k):
        _reference_candidate(*a, out=out, **k)
        out[bad_row, bad_head * 512 + bad_dim] += 3.0
        return out

    hook.set_candidate(skewed)
    try:
        e0 = _sample(env, "kdtree_attention_validations_total", outcome="exceeded")
        out = fx.call()
        shadow.flush_all()
    finally:
        hook.set_candidate(None)
    assert out is not None
    assert _sample(env, "kdtree_attention_validations_total", outcome="exceeded") == e0 + 1
    ev = [e for e in records.events if e.get("event") == "kdtree_validation_exceeded"]
    assert len(ev) == 1, records.events
    e = ev[0]
    assert e["layer_id"] == 0 and e["shape"] == [T, H * 512] and e["heads"] == H
    assert (e["worst_row"], e["worst_head"], e["worst_dim"]) == (bad_row, bad_head, bad_dim)
    assert abs(e["max_abs_diff"] - 3.0) < 0.05
    assert e["level"] == "warning"


def test_validate_nonfinite_candidate_is_exceeded(env):
    from kdtree_backend.sglang import hook
    from kdtree_backend.sglang import shadow

    _set_mode("validate")
    fx = Fx()

    def nan(*a, out=None, **k):
        _reference_candidate(*a, out=out, **k)
        out[0, 0] = float("nan")
        return out

    hook.set_candidate(nan)
    try:
        n0 = _sample(env, "kdtree_attention_validation_nonfinite_total")
        e0 = _sample(env, "kdtree_attention_validations_total", outcome="exceeded")
        fx.call()
        shadow.flush_all()
    finally:
        hook.set_candidate(None)
    assert _sample(env, "kdtree_attention_validation_nonfinite_total") == n0 + 1
    assert _sample(env, "kdtree_attention_validations_total", outcome="exceeded") == e0 + 1


def test_validate_candidate_error_is_recorded_not_raised(env, records):
    import torch

    from kdtree_backend.sglang import hook

    _set_mode("validate")
    fx = Fx()
    kv0 = fx.kv()
    off = fx.call(env["original"])
    fx.set_kv(kv0)

    def boom(*a, **k):
        from kdtree_backend.kernel.ops import KernelInputError

        raise KernelInputError("q must be a CUDA tensor")

    hook.set_candidate(boom)
    try:
        c0 = _sample(env, "kdtree_attention_validations_total", outcome="candidate_error")
        out = fx.call()
    finally:
        hook.set_candidate(None)
    assert torch.equal(out, off)
    assert _sample(env, "kdtree_attention_validations_total", outcome="candidate_error") == c0 + 1
    ev = [e for e in records.events if e.get("event") == "kdtree_candidate_error"]
    assert ev and ev[0]["error_type"] == "KernelInputError" and ev[0]["mode"] == "validate"


def test_validate_sampling_and_poll_wrapper(env, cand):
    from kdtree_backend.sglang import shadow

    _set_mode("validate", sample_rate=0.5)
    fx = Fx()
    s0 = _sample(env, "kdtree_attention_calls_total", mode="validate", path="shadow")
    u0 = _sample(env, "kdtree_attention_calls_total", mode="validate", path="shadow_unsampled")
    for _ in range(4):
        fx.call()
    assert _sample(env, "kdtree_attention_calls_total", mode="validate", path="shadow") == s0 + 2
    assert _sample(env, "kdtree_attention_calls_total", mode="validate", path="shadow_unsampled") == u0 + 2
    # the host side runs from the per-instance wrapper of init_forward_metadata (as it would
    # between CUDA-graph replays), not only from flush()
    assert getattr(fx.backend, "_kdtree_poll_installed", False)
    st = shadow.stores()[0]
    shadow.POLL_INTERVAL_S, old = 0.0, shadow.POLL_INTERVAL_S
    try:
        fx.init_metadata()
    finally:
        shadow.POLL_INTERVAL_S = old
    assert st.totals["within_tolerance"] == 2


def test_startup_event_and_build_info(env, records):
    from kdtree_backend.sglang import hook
    from kdtree_backend.sglang import logs
    from kdtree_backend.config import Mode

    logs.reset_for_tests()
    hook.reset_for_tests(mode=Mode.VALIDATE)
    ev = [e for e in records.events if e.get("event") == "kdtree_startup"]
    assert len(ev) == 1
    e = ev[0]
    assert e["mode"] == "validate" and e["arch"] == "cpu" and e["sglang_version"] == "0.5.23"
    assert e["kernel"] == "none (no GPU)"  # on a GPU: "hopper" or "portable" (KDTREE_KERNEL resolved)
    assert e["code"] == "none (no GPU)"  # on a GPU: "sm_90 code", or the PTX the driver JIT-compiles
    assert "library" in e and e["pid"] == os.getpid()
    import kdtree_backend

    assert _sample(env, "kdtree_attention_build_info", version=kdtree_backend.__version__, mode="validate", arch="cpu") == 1


def test_kit_page_size_1_cuda_graph_case_is_a_kit_bug(env):
    """Item 7, reproduced on CPU (fp16): the kit's `run_mla_eagle_verify_cuda_graph_case` fails
    at its GRAPH-EAGER leg (before any capture) for page_size=1 when the case name's seed makes
    the kit's prefix re-write (`prepare_mla_runner_inputs` -> `_populate_prefix_kv` with the
    contiguous `_token_loc` layout) land on slots that the fixture's shuffled layout
    (`loc_layout="shuffled_pages"`, per token at page_size=1) gives to other prefix tokens.
    Forcing the fixture onto the contiguous layout makes the same case pass. docs/validate.md."""
    import unittest

    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention
    from sglang.test.kits.attention_unittest.attention_methods.mla_attention import MLAAttentionCase
    from sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner import (
        run_mla_eagle_verify_cuda_graph_case,
    )

    from kdtree_backend.sglang import hook

    hook.reset_for_tests(mode=None)  # the hook reads KDTREE_VERIFY (unset: off -> passthrough)

    name = "tv_1"  # seed 3094: one prefix slot of request 0 is overwritten at page_size=1
    assert kit_prefix_slot_collisions(name, 1) > 0 and kit_prefix_slot_collisions(name, 16) == 0

    def run(ps):
        case = MLAAttentionCase(name=name, backend="triton", forward_mode=ForwardMode.TARGET_VERIFY,
                                num_heads=4, page_size=ps, prefix_lens=(4, 7), extend_lens=(3, 3))
        run_mla_eagle_verify_cuda_graph_case(unittest.TestCase(), case, topk=1, device="cpu",
                                             dtype=torch.float16, kv_lora_rank=512, qk_rope_head_dim=64,
                                             hidden_size=256)

    run(16)
    with pytest.raises(AssertionError, match="not close"):
        run(1)
    orig = dense_attention.make_loc_fn
    dense_attention.make_loc_fn = lambda layout, **kw: orig("contiguous", **kw)
    try:
        run(1)  # same case, fixture on the layout the kit's prefix re-write uses: passes
    finally:
        dense_attention.make_loc_fn = orig


def test_graph_replays_are_counted(env, cand):
    """calls_total under CUDA graphs: events recorded while capturing are added once per replay by
    the wrapper of init_forward_metadata_out_graph (SGLang's load_batch calls it per replay)."""
    from kdtree_backend.sglang import shadow

    _set_mode("on")
    fx = Fx()
    bs, D = 2, 3
    fx.backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs * D)
    with fx.ctx():
        fx.backend.init_forward_metadata_out_graph(fx.batch, in_capture=True)
    real = shadow.is_capturing
    shadow.is_capturing = lambda: True  # what the hook sees inside torch.cuda.graph(...)
    try:
        fx.call()  # "capture": one eligible call recorded for batch size 2
        fx.backend.is_draft_runner = True
        fx.call()  # and one fallback
        fx.backend.is_draft_runner = False
    finally:
        shadow.is_capturing = real
    c0 = _sample(env, "kdtree_attention_calls_total", mode="on", path="kdtree")
    f0 = _sample(env, "kdtree_attention_fallbacks_total", reason="draft_runner")
    v0 = _sample(env, "kdtree_attention_verify_calls_total", served_by="kdtree", reason="")
    for _ in range(3):
        with fx.ctx():
            fx.backend.init_forward_metadata_out_graph(fx.batch)  # before each replay
    assert _sample(env, "kdtree_attention_calls_total", mode="on", path="kdtree") == c0 + 3
    assert _sample(env, "kdtree_attention_fallbacks_total", reason="draft_runner") == f0 + 3
    # the kernel's share: the draft runner's pass is not a verify call of the target model
    assert _sample(env, "kdtree_attention_verify_calls_total", served_by="kdtree", reason="") == v0 + 3
    assert _sample(env, "kdtree_attention_verify_calls_total", served_by="triton", reason="draft_runner") == 0
    with fx.ctx():
        fx.backend.init_forward_metadata_out_graph(fx.batch, in_capture=True)  # a capture: not a replay
    assert _sample(env, "kdtree_attention_calls_total", mode="on", path="kdtree") == c0 + 3


def test_verify_share_and_the_fallback_rate_alarm(env, cand, records):
    """kdtree_attention_verify_calls_total counts the target model's TARGET_VERIFY calls by who served
    them; in `on`, a window in which Triton served more than 1% of them logs one ERROR event."""
    from kdtree_backend.sglang import hook

    _set_mode("on")
    now = [0.0]
    hook.fallback_watch.__init__(window_s=60.0, threshold=0.01, min_calls=4, clock=lambda: now[0])
    hook.fallback_watch.enabled = True
    fx = Fx()
    k0 = _sample(env, "kdtree_attention_verify_calls_total", served_by="kdtree", reason="")
    t0 = _sample(env, "kdtree_attention_verify_calls_total", served_by="triton", reason="logit_cap")
    for _ in range(4):
        fx.call()
    assert _sample(env, "kdtree_attention_verify_calls_total", served_by="kdtree", reason="") == k0 + 4
    fx.layer.logit_cap = 30.0  # a verify call the kernel cannot take: Triton serves it
    fx.call()
    fx.layer.logit_cap = 0.0
    assert _sample(env, "kdtree_attention_verify_calls_total", served_by="triton", reason="logit_cap") == t0 + 1
    assert not [e for e in records.events if e.get("event") == "kdtree_fallback_rate_high"]
    now[0] = 61.0
    fx.call()  # closes the window: 1 of 6 calls fell back
    ev = [e for e in records.events if e.get("event") == "kdtree_fallback_rate_high"]
    assert len(ev) == 1 and ev[0]["level"] == "error", records.events
    assert ev[0]["verify_calls"] == 6 and ev[0]["not_served_by_kdtree"] == 1 and ev[0]["reasons"] == {"logit_cap": 1}
    now[0] = 125.0
    fx.call()  # a clean window: nothing more
    assert len([e for e in records.events if e.get("event") == "kdtree_fallback_rate_high"]) == 1
    hook.fallback_watch.__init__()
