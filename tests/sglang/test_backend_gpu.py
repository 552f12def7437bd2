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
    pytest -q -s -m gpu tests/sglang/test_backend_gpu.py
"""
from __future__ import annotations

import pytest
from conftest import kit_prefix_slot_collisions

torch = pytest.importorskip("torch")

from kdtree_backend.testing.scene import Scene, hook_installed, set_mode  # noqa: E402

pytestmark = pytest.mark.gpu

H = 8  # Kimi K2.5 heads per GPU at TP8 (the scene's default)
MODES = ("off", "validate", "on")


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.fixture(scope="module")
def hooked():
    """The hook installed as HookRegistry's AROUND wrapper does; restored afterwards so other test
    modules see stock Triton."""
    _cuda()
    import warnings

    warnings.filterwarnings("ignore")
    from prometheus_client import CollectorRegistry

    from kdtree_backend.sglang import metrics

    reg = CollectorRegistry()
    metrics.init(reg)
    with hook_installed() as orig:
        yield {"original": orig, "registry": reg}


def _close(out, ref, rows, what):
    err = (out[:rows].double() - ref[:rows]).abs().max().item()
    print(f"  {what}: max|out-ref| = {err:.3e}")
    torch.testing.assert_close(out[:rows].double(), ref[:rows], atol=1.5e-2, rtol=1.5e-2, msg=what)


# --- eager ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["chain", "tree"])
def test_eager_target_verify_all_modes(hooked, kind):
    from kdtree_backend.sglang import shadow

    D = 4 if kind == "chain" else 6
    sc = Scene(bs=3, D=D, kind=kind, seed=11)
    sc.load([37, 5, 300])
    sc.init_eager()
    kv0 = sc.pool.kv_buffer[0].clone()
    outs = {}
    for mode in MODES:
        set_mode(mode)
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
    lay.k_scale = torch.tensor(2.0, device="cuda")
    lay.v_scale = torch.tensor(2.0, device="cuda")
    lay.k_scale_float = 2.0
    lay.v_scale_float = 2.0
    try:
        sc.load([40, 9])
        sc.init_eager()
        kv0 = sc.pool.kv_buffer[0].clone()
        outs, kvs = {}, {}
        for mode in MODES:
            set_mode(mode)
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
    from kdtree_backend.sglang import shadow

    set_mode(mode)
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
                                             dtype=torch.bfloat16, device="cuda", kv_lora_rank=512,
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
    from kdtree_backend.sglang import eligibility

    set_mode(mode)
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


# --- issue 23: no 64-draft cap, empty prefixes, the legal corners ----------------------------------
def _verify_served(reg, before):
    now = reg.get_sample_value("kdtree_attention_verify_calls_total", {"served_by": "kdtree", "reason": ""}) or 0.0
    return now - before


def _graph_capture(sc, bs):
    sc.backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs * sc.D)
    sc.load([1] * bs)
    with sc.ctx_():
        sc.backend.init_forward_metadata_out_graph(sc.batch, in_capture=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            sc.forward()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        o_static = sc.forward()
    torch.cuda.synchronize()
    return g, o_static


@pytest.mark.parametrize("D", [65, 129, 257])
def test_ddtree_sized_trees_are_served_by_the_kernel_eager_and_replayed(hooked, D):
    """DDTree verifies budget + 1 = 65, 129 (and 257) nodes: `on` serves them with our kernel (no
    draft_len fallback any more), eager and from a CUDA graph, against float64."""
    reg = hooked["registry"]
    set_mode("on")
    bs = 2
    sc = Scene(bs=bs, D=D, kind="tree", max_context_len=1100 + D, seed=D)
    sc.load([1000, 37])
    sc.init_eager()
    before = _verify_served(reg, 0.0)
    out = sc.forward().clone()
    _close(out, sc.reference(), sc.real_rows(), f"eager D={D}")
    assert _verify_served(reg, before) == 1, "the eager call was not served by the kdtree kernel"
    sc = Scene(bs=bs, D=D, kind="tree", graph=True, max_context_len=1100 + D, seed=D + 1)
    g, o_static = _graph_capture(sc, bs)
    for plens, padded in [([1000, 37], 0), ([3, 901], 1)]:
        sc.load(plens, padded=padded)
        before = _verify_served(reg, 0.0)
        with sc.ctx_():
            sc.backend.init_forward_metadata_out_graph(sc.batch)
        g.replay()
        torch.cuda.synchronize()
        _close(o_static.clone(), sc.reference(), sc.real_rows(), f"graph D={D} prefixes {plens} padded {padded}")
        assert _verify_served(reg, before) == 1, "the replay was not served by the kdtree kernel"
    del g


def test_empty_prefix_batch_is_computed(hooked):
    """Every request without a committed prefix: the op gets an empty kv_indices (a NULL data pointer)
    and must compute what Triton computes (it raised 'a required pointer is NULL')."""
    from kdtree_backend.kernel import ops
    from kdtree_backend.testing.reference import verify_attention_reference

    set_mode("on")
    sc = Scene(bs=3, D=6, kind="tree", seed=21)
    sc.load([0, 0, 0])
    sc.init_eager()
    out = sc.forward().clone()
    _close(out, sc.reference(), sc.real_rows(), "forward_extend, empty prefixes")
    md = sc.backend.forward_metadata
    empty = torch.empty(0, dtype=torch.int64, device="cuda")
    direct = ops.verify_attention(sc.q, sc.k, sc.pool.get_key_buffer(0), md.qo_indptr, md.kv_indptr, empty,
                                  md.custom_mask, md.mask_indptr, sc.layer.scaling, max_qo_len=sc.D)
    ref = verify_attention_reference(sc.q, sc.k, sc.pool.get_key_buffer(0), md.qo_indptr, md.kv_indptr, empty,
                                     md.custom_mask, md.mask_indptr, sc.layer.scaling)
    _close(direct, ref, sc.real_rows(), "op, empty kv_indices")


@pytest.mark.parametrize("heads, bs, D, prefixes, padded, mask", [
    (1, 1, 1, [5], 0, "bool"),          # H = 1, n = 1, one request
    (8, 1, 4, [0], 0, "bool"),          # one request, empty prefix
    (16, 4, 7, [300, 0, 17, 1], 1, "uint8"),  # a padded request, the backend's uint8 mask buffer
    (128, 2, 3, [64, 65], 0, "uint8"),  # DeepSeek-V3 with DP attention: 128 heads
    (8, 5, 33, [1, 2, 3, 4, 1000], 0, "bool"),
])
def test_legal_corners_through_the_hook_in_on(hooked, heads, bs, D, prefixes, padded, mask):
    """What SGLang's Triton kernel accepts, `on` computes with our kernel (never an exception, never
    a fallback): one request, H = 1, n = 1, empty prefixes, padded rows, bool and uint8 masks, int32
    (eager) and int64 (graph) index tensors."""
    reg = hooked["registry"]
    set_mode("on")
    sc = Scene(bs=bs, D=D, kind="tree", heads=heads, max_context_len=max(prefixes) + D + 8, seed=heads + D)
    sc.load(prefixes, padded=padded)
    if mask == "uint8":
        sc.batch.spec_info.custom_mask = sc.batch.spec_info.custom_mask.to(torch.uint8)
    sc.init_eager()
    before = _verify_served(reg, 0.0)
    out = sc.forward().clone()
    _close(out, sc.reference(), sc.real_rows(), f"H{heads} bs{bs} D{D} {mask}")
    assert _verify_served(reg, before) == 1
    md = sc.backend.forward_metadata
    assert md.qo_indptr.dtype == torch.int32 and md.kv_indptr.dtype == torch.int32  # eager: int32 indptrs
