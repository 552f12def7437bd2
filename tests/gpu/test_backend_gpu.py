"""The hook inside SGLang's real `TritonAttnBackend.forward_extend`, on the GPU (issue 4).

Built with SGLang's own attention test kit (`sglang.test.kits.attention_unittest`: a real
`TritonAttnBackend` over a real `MLATokenToKVPool`, MLA 576/512, bf16). Covers:

* eager TARGET_VERIFY, chain and tree masks, modes off / validate / on, against the float64
  reference built INDEPENDENTLY of the backend's metadata (from req_to_token, seq_lens, mask);
* a real `torch.cuda.graph` capture of `forward_extend` (after two eager warm-ups, as SGLang's
  FullCudaGraphBackend does), then replays with changed prefix lengths, KV slots, draft slots,
  masks and a production-style padded request, in all three modes; validate returns Triton
  bit-for-bit and publishes, from the graph, the diff the test measures itself;
* item 7: the kit's `run_mla_eagle_verify_cuda_graph_case` at page_size 1 and 16, stock Triton
  and with the kdtree kernel, plus the layout fix that confirms the hypothesis of
  docs/validate.md. Prints what it sees (run pytest with -s).

Run (see docs/validate.md, "GPU runs"):
    pytest -q -s -m gpu tests/gpu/test_backend_gpu.py
"""
from __future__ import annotations

import functools
import os
import random

import pytest
from conftest import kit_prefix_slot_collisions

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

H = 8  # Kimi K2.5 heads per GPU at TP8
# Module constants so the non-graph parts can be dry-run elsewhere (fp16 on CPU under
# TRITON_INTERPRET=1, with the reference as candidate); the lead's run uses these defaults.
DEVICE = "cuda"
DTYPE = torch.bfloat16
MODES = ("off", "validate", "on")


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


class _TC:
    def skipTest(self, msg):
        pytest.skip(msg)


@pytest.fixture(scope="module")
def hooked():
    """Install the hook like SGLang's HookRegistry AROUND does (wrapper(*a) -> hook(orig, *a));
    restored afterwards so other test modules see stock Triton."""
    _cuda()
    import warnings

    warnings.filterwarnings("ignore")
    from prometheus_client import CollectorRegistry
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from kdtree_backend import hook, metrics

    orig = TritonAttnBackend.forward_extend

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        return hook.forward_extend_hook(orig, *args, **kwargs)

    wrapper.__wrapped__ = orig
    TritonAttnBackend.forward_extend = wrapper
    reg = CollectorRegistry()
    metrics.init(reg)
    try:
        yield {"original": orig, "registry": reg}
    finally:
        TritonAttnBackend.forward_extend = orig
        hook.set_candidate(None)
        hook.reset_for_tests()


def _set_mode(mode, **settings):
    from kdtree_backend import hook, logs, shadow
    from kdtree_backend.config import Mode

    logs.reset_for_tests()
    shadow.reset_for_tests()
    hook.reset_for_tests(mode=Mode(mode), settings=shadow.Settings(**settings))


def _tree_block(kind: str, D: int, seed: int) -> torch.Tensor:
    from kdtree_backend.reference import ancestor_matrix, random_tree_parents

    if kind == "chain":
        return torch.tril(torch.ones(D, D, dtype=torch.bool))
    return ancestor_matrix(random_tree_parents(D, random.Random(seed)))


class Scene:
    """A TARGET_VERIFY batch of `bs` requests over a real backend, with its own slot layout.

    The ForwardBatch tensors (req_pool_indices, seq_lens, out_cache_loc) and q/k/v are STATIC:
    `load()` rewrites them in place (like SGLang's load_batch), so a captured graph sees new
    contents at the same addresses.
    """

    def __init__(self, *, bs, D, kind, max_context_len=512, graph=False, seed=0):
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.test.kits.attention_unittest.attention_methods.mla_attention import (
            MLAAttentionCase,
            _make_forward_batch,
            build_mla_attention_fixture,
        )
        from sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner import (
            _make_spec_verify_input,
            _prepare_target_verify_batch,
        )

        self._make_spec = _make_spec_verify_input
        self._prepare = _prepare_target_verify_batch
        self.Case = MLAAttentionCase
        self.bs, self.D, self.kind, self.ctx = bs, D, kind, max_context_len
        self.dev = torch.device(DEVICE)
        self.case = MLAAttentionCase(
            name="kdtree_backend_gpu", backend="triton", forward_mode=ForwardMode.TARGET_VERIFY,
            num_heads=H, page_size=1, prefix_lens=(1,) * bs, extend_lens=(D,) * bs,
        )
        self.fx = build_mla_attention_fixture(
            _TC(), self.case, kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=256,
            max_context_len=max_context_len, dtype=DTYPE, device=DEVICE,
            disable_cuda_graph=not graph, runner_batch_size=bs, loc_layout="contiguous",
        )
        self.backend = self.fx.backend
        self.runner = self.fx.runner
        self.layer = self.fx.actual_module.attn_mqa
        self.pool = self.runner.token_to_kv_pool
        self.batch = _make_forward_batch(self.case, self.runner, max_context_len=max_context_len, device=DEVICE)
        self._prepare(self.batch, self.case, DEVICE)
        self.batch.spec_info = self._make_spec(self.case, self.batch, topk=1, device=DEVICE, spec_kind="eagle")
        T = bs * D
        self.q = torch.zeros(T, H, 576, dtype=DTYPE, device=self.dev)
        self.k = torch.zeros(T, 1, 576, dtype=DTYPE, device=self.dev)
        self.v = torch.zeros(T, 1, 512, dtype=DTYPE, device=self.dev)
        self.rng = random.Random(seed)
        self.gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.real_bs = bs

    # --- contents ---------------------------------------------------------------------------
    def load(self, prefix_lens, *, padded=0):
        """New contents: prefix lengths, shuffled KV slots, prefix KV, draft slots, q/k/v, mask.
        The last `padded` requests are production CUDA-graph padding (seq_len 1, req 0, slot 0)."""
        bs, D, ctx = self.bs, self.D, self.ctx
        assert len(prefix_lens) == bs and max(prefix_lens) + D <= ctx
        self.real_bs = bs - padded
        plens = list(prefix_lens)
        rpi = list(range(bs))
        for r in range(self.real_bs, bs):
            plens[r], rpi[r] = 1, 0
        self.prefix_lens, self.rpi = plens, rpi
        req_to_token = self.runner.req_to_token_pool.req_to_token
        out_cache = []
        for r in range(self.real_bs):
            slots = [1 + r * ctx + s for s in self.rng.sample(range(ctx), plens[r] + D)]
            req_to_token[r, : plens[r] + D] = torch.tensor(slots, dtype=req_to_token.dtype, device=self.dev)
            out_cache += slots[plens[r]:]
            kv = torch.randn(plens[r], 1, 576, generator=self.gen, device=self.dev).mul_(0.5).to(DTYPE)
            self.pool.kv_buffer[0][torch.tensor(slots[: plens[r]], device=self.dev)] = kv
        out_cache += [0] * (D * padded)
        self.batch.seq_lens.copy_(torch.tensor(plens, dtype=self.batch.seq_lens.dtype, device=self.dev))
        self.batch.req_pool_indices.copy_(torch.tensor(rpi, dtype=self.batch.req_pool_indices.dtype, device=self.dev))
        self.batch.out_cache_loc.copy_(torch.tensor(out_cache, dtype=self.batch.out_cache_loc.dtype, device=self.dev))
        self.batch.seq_lens_cpu = torch.tensor(plens, dtype=torch.int32)
        self.batch.seq_lens_sum = sum(plens)
        self.q.copy_(torch.randn(self.q.shape, generator=self.gen, device=self.dev).mul_(0.5))
        self.k.copy_(torch.randn(self.k.shape, generator=self.gen, device=self.dev).mul_(0.5))
        self.v.copy_(self.k[..., :512])
        # the FULL_MASK tree mask, as EAGLE's builder lays it out (prefix columns 1)
        self.blocks = [_tree_block(self.kind, D, self.rng.randrange(1 << 30)) for _ in range(bs)]
        flat = []
        for r in range(bs):
            m = torch.ones(D, plens[r] + D, dtype=torch.bool)
            m[:, plens[r]:] = self.blocks[r]
            flat.append(m.reshape(-1))
        case = self.Case(name=self.case.name, backend="triton", forward_mode=self.case.forward_mode,
                         num_heads=H, page_size=1, prefix_lens=tuple(plens), extend_lens=(D,) * bs)
        spec = self._make_spec(case, self.batch, topk=1, device=DEVICE, spec_kind="eagle")
        spec.custom_mask = torch.cat(flat).to(self.dev)
        self.batch.spec_info = spec

    # --- metadata / calls ----------------------------------------------------------------------
    def ctx_(self):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        return forward_context(ForwardContext(attn_backend=self.backend))

    def init_eager(self):
        with self.ctx_():
            self.backend.init_forward_metadata(self.batch)

    def forward(self, fn=None):
        with torch.no_grad(), self.ctx_():
            if fn is None:
                return self.backend.forward_extend(self.q, self.k, self.v, self.layer, self.batch, save_kv_cache=True)
            return fn(self.backend, self.q, self.k, self.v, self.layer, self.batch, save_kv_cache=True)

    def reference(self):
        """float64, from req_to_token/seq_lens/mask (not from the backend's metadata), on the pool
        as it is after the call's KV save."""
        from kdtree_backend.reference import verify_attention_reference

        bs, D = self.bs, self.D
        r2t = self.runner.req_to_token_pool.req_to_token
        qo = torch.arange(0, (bs + 1) * D, D, dtype=torch.int32, device=self.dev)
        kv_indptr = torch.tensor([0] + list(_cumsum(self.prefix_lens)), dtype=torch.int32, device=self.dev)
        kv_indices = torch.cat([r2t[self.rpi[r], : self.prefix_lens[r]].long() for r in range(bs)])
        mask = self.batch.spec_info.custom_mask
        mask_indptr = torch.tensor([0] + list(_cumsum([D * (p + D) for p in self.prefix_lens])),
                                   dtype=torch.int64, device=self.dev)
        lay = self.layer
        scaled = lay.k_scale is not None and lay.v_scale is not None
        return verify_attention_reference(self.q, self.k, self.pool.get_key_buffer(0), qo, kv_indptr, kv_indices,
                                          mask, mask_indptr, lay.scaling, max_qo_len=D,
                                          k_scale=lay.k_scale_float if scaled else 1.0,
                                          v_scale=lay.v_scale_float if scaled else 1.0)

    def kdtree_now(self):
        """The kdtree kernel on the backend's current metadata (what the shim passes)."""
        from kdtree_backend.hook import get_candidate

        md = self.backend.forward_metadata
        out = torch.empty(self.q.shape[0], H * 512, dtype=self.q.dtype, device=self.dev)
        return get_candidate()(self.q, self.k, self.pool.get_key_buffer(0), md.qo_indptr, md.kv_indptr,
                               md.kv_indices, md.custom_mask, md.mask_indptr, self.layer.scaling,
                               max_qo_len=md.max_extend_len, out=out)

    def real_rows(self):
        return self.real_bs * self.D


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def _close(out, ref, rows, what):
    err = (out[:rows].double() - ref[:rows]).abs().max().item()
    print(f"  {what}: max|out-ref| = {err:.3e}")
    torch.testing.assert_close(out[:rows].double(), ref[:rows], atol=1.5e-2, rtol=1.5e-2, msg=what)


# --- eager ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_eager_target_verify_all_modes(hooked, kind):
    from kdtree_backend import shadow

    D = 4 if kind == "chain" else 6
    sc = Scene(bs=3, D=D, kind=kind, seed=11)
    sc.load([37, 5, 300])
    sc.init_eager()
    kv0 = sc.pool.kv_buffer[0].clone()
    outs = {}
    for mode in MODES:
        _set_mode(mode)
        sc.pool.kv_buffer[0].copy_(kv0)
        outs[mode] = sc.forward().clone()
        ref = sc.reference()
        _close(outs[mode], ref, sc.real_rows(), f"eager {kind} {mode}")
        if mode == "validate":
            st = shadow.stores()[0]
            st.keep_published = 10
            assert shadow.flush_all() == 1
            assert st.totals["within_tolerance"] == 1, dict(st.totals)
            measured = (sc.kdtree_now().float() - outs[mode].float()).abs().max().item()
            p = st.published[-1]
            print(f"  published max_abs_diff {p['max_abs_diff']:.4e}, measured {measured:.4e}")
            assert p["max_abs_diff"] == pytest.approx(measured, rel=1e-5, abs=1e-6)
    assert torch.equal(outs["validate"], outs["off"]), "validate must return Triton's output bit-for-bit"


def test_eager_k_scale_all_modes(hooked):
    """layer.k_scale set (FP8-quantized checkpoints attach one even with a bf16 cache): the KV save
    stores k / k_scale and the kernel descales the prefix by k_scale_float (SGLang's own code
    path in all modes; the kdtree kernel receives the descales)."""
    sc = Scene(bs=2, D=4, kind="tree", seed=3)
    lay = sc.layer
    lay.k_scale = torch.tensor(2.0, device=DEVICE)
    lay.v_scale = torch.tensor(2.0, device=DEVICE)
    lay.k_scale_float = 2.0
    lay.v_scale_float = 2.0
    try:
        sc.load([40, 9])
        sc.init_eager()
        kv0 = sc.pool.kv_buffer[0].clone()
        outs, kvs = {}, {}
        for mode in MODES:
            _set_mode(mode)
            sc.pool.kv_buffer[0].copy_(kv0)
            outs[mode] = sc.forward().clone()
            kvs[mode] = sc.pool.kv_buffer[0].clone()
            _close(outs[mode], sc.reference(), sc.real_rows(), f"eager k_scale=2 {mode}")
        loc = sc.batch.out_cache_loc
        assert torch.equal(kvs["off"][loc], (sc.k / lay.k_scale).to(kvs["off"].dtype))
        assert torch.equal(kvs["on"], kvs["off"]) and torch.equal(kvs["validate"], kvs["off"])
        assert torch.equal(outs["validate"], outs["off"])
    finally:
        lay.k_scale = lay.v_scale = None
        lay.k_scale_float = lay.v_scale_float = None


# --- CUDA graph ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_cuda_graph_capture_and_replay(hooked, mode, kind):
    from kdtree_backend import shadow

    _set_mode(mode)
    D = 4 if kind == "chain" else 6
    bs = 4
    sc = Scene(bs=bs, D=D, kind=kind, graph=True, seed=5)
    sc.backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs * D)
    # capture-time batch: SGLang fills seq_lens with get_cuda_graph_seq_len_fill_value() (1)
    sc.load([1] * bs)
    with sc.ctx_():
        sc.backend.init_forward_metadata_out_graph(sc.batch, in_capture=True)
    st_store = None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # eager warm-ups (FullCudaGraphBackend.capture_one does 2)
            sc.forward()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    if mode == "validate":
        st_store = shadow.stores()[0]
        st_store.keep_published = 100
        shadow.flush_all()
        warm = sum(st_store.totals.values())
        assert warm == 2, dict(st_store.totals)
    g = torch.cuda.CUDAGraph()
    # warm-ups and capture on the same stream, as SGLang's capture does
    with torch.cuda.graph(g, stream=stream):
        o_static = sc.forward()
    torch.cuda.synchronize()

    path = {"validate": "shadow", "on": "kdtree"}.get(mode)
    reg = hooked["registry"]
    calls0 = reg.get_sample_value("kdtree_attention_calls_total", {"mode": mode, "path": path}) or 0.0 if path else 0.0
    shadow.POLL_INTERVAL_S, old_interval = 0.0, shadow.POLL_INTERVAL_S
    try:
        replays = [([37, 5, 300, 64], 0), ([3, 128, 17, 1], 1), ([250, 1, 90, 9], 2)]
        measured = []
        for i, (plens, padded) in enumerate(replays):
            sc.load(plens, padded=padded)
            with sc.ctx_():
                # what load_batch does before every replay (in_capture=False); in validate this
                # also runs the host side of the stats ring (per-instance poll wrapper)
                sc.backend.init_forward_metadata_out_graph(sc.batch)
            g.replay()
            torch.cuda.synchronize()
            out = o_static.clone()
            ref = sc.reference()
            _close(out, ref, sc.real_rows(), f"graph {kind} {mode} replay {i} (padded {padded})")
            if mode in ("off", "validate"):
                # Triton on the same buffers, eagerly: validate must return exactly this
                triton = sc.forward(hooked["original"]).clone()
                assert torch.equal(out, triton), f"replay {i}: validate/off output is not Triton's"
            if mode == "validate":
                cand = sc.kdtree_now()
                d = (cand.float() - out.float()).abs()
                measured.append(d.max().item())
        if path:  # graph replays are counted (per replay, from the out-of-graph metadata wrapper)
            calls1 = reg.get_sample_value("kdtree_attention_calls_total", {"mode": mode, "path": path}) or 0.0
            assert calls1 - calls0 == len(replays), (calls0, calls1)
        if mode == "validate":
            shadow.flush_all()
            pub = [p for p in st_store.published if p["layer_id"] == 0][-len(replays):]
            assert [p["seq"] for p in pub] == [3, 4, 5], pub
            for p, m in zip(pub, measured):
                print(f"  published max_abs_diff {p['max_abs_diff']:.4e}, measured {m:.4e}, rel_err {p['rel_err']:.3e}, outcome {p['outcome']}")
                assert p["max_abs_diff"] == pytest.approx(m, rel=1e-5, abs=1e-6)
                assert p["rows"] == bs * D and p["heads"] == H
            assert st_store.totals["within_tolerance"] == 5, dict(st_store.totals)
            assert st_store.totals["dropped"] == 0
    finally:
        shadow.POLL_INTERVAL_S = old_interval
        del g


# --- item 7: the kit's CUDA-graph target-verify case at page_size 1 ----------------------------------
def _kit_case(name, page_size):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods.mla_attention import MLAAttentionCase

    return MLAAttentionCase(name=name, backend="triton", forward_mode=ForwardMode.TARGET_VERIFY, num_heads=4,
                            page_size=page_size, prefix_lens=(4, 7), extend_lens=(3, 3))


def _run_kit(name, page_size, *, contiguous=False, topk=1):
    import traceback
    import unittest

    from sglang.test.kits.attention_unittest.attention_methods import dense_attention
    from sglang.test.kits.attention_unittest.runner_modes.speculative_target_verify_runner import (
        run_mla_eagle_verify_cuda_graph_case,
    )

    orig = dense_attention.make_loc_fn
    if contiguous:
        dense_attention.make_loc_fn = lambda layout, **kw: orig("contiguous", **kw)
    try:
        run_mla_eagle_verify_cuda_graph_case(unittest.TestCase(), _kit_case(name, page_size), topk=topk,
                                             dtype=DTYPE, device=DEVICE, kv_lora_rank=512,
                                             qk_rope_head_dim=64, hidden_size=1024)
        return "PASS"
    except AssertionError as e:
        where = [f"{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno}" for fr in traceback.extract_tb(e.__traceback__)][-2]
        first = [ln for ln in str(e).splitlines() if "Mismatched" in ln or "Greatest absolute" in ln]
        return f"FAIL at {where}: {' | '.join(first)}"
    finally:
        dense_attention.make_loc_fn = orig


@pytest.mark.parametrize("mode", ["off", "on"])
def test_item7_kit_cuda_graph_case_page_size(hooked, mode):
    """Hypothesis (docs/validate.md): the kit, not SGLang's Triton backend, is wrong. Its
    graph-eager leg re-writes the prefix KV with the contiguous `_token_loc` layout
    (`prepare_mla_runner_inputs`) over a fixture laid out with `shuffled_pages`; at page_size=1
    the shuffle is per token, so for some seeds (the seed is 3090 + len(case name)) it overwrites
    other prefix tokens' slots. Expected: page_size=1 FAILS for a colliding name with stock Triton
    AND with the kdtree kernel (same failure: the inputs are wrong, not the kernel), passes for a
    non-colliding name, and passes for every name once the fixture uses the contiguous layout."""
    from kdtree_backend import eligibility

    _set_mode(mode)
    reg = hooked["registry"]
    kd0 = reg.get_sample_value("kdtree_attention_calls_total", {"mode": "on", "path": "kdtree"}) or 0.0
    old = eligibility.ALLOW_KV_READBACK
    # the kit's module writes the cache itself and calls attn_mqa(q, None, None): the read-back path
    eligibility.ALLOW_KV_READBACK = True
    try:
        names = {"tv1": None, "tv_1": None, "eagle_topk1_p1": None}
        results = {}
        for name in names:
            for ps in (1, 16):
                results[(name, ps)] = _run_kit(name, ps)
                results[(name, ps, "contiguous")] = _run_kit(name, ps, contiguous=True)
        print(f"\n  item 7, mode={mode} (kdtree kernel {'ON' if mode == 'on' else 'not used'}):")
        for key, res in results.items():
            name, ps = key[0], key[1]
            layout = key[2] if len(key) > 2 else "shuffled_pages"
            print(f"    name={name!r:28} page_size={ps:2} layout={layout:14} collisions={kit_prefix_slot_collisions(name, ps)}: {res}")
    finally:
        eligibility.ALLOW_KV_READBACK = old
    kd1 = reg.get_sample_value("kdtree_attention_calls_total", {"mode": "on", "path": "kdtree"}) or 0.0
    if mode == "on":
        assert kd1 > kd0, "the kit's forward never reached the kdtree kernel"
    for key, res in results.items():
        name, ps = key[0], key[1]
        if len(key) > 2 or ps == 16 or kit_prefix_slot_collisions(name, ps) == 0:
            assert res == "PASS", (key, res)
        else:
            assert res.startswith("FAIL at speculative_cuda_graph_runner.py"), (key, res)
