"""CPU tests of the float64 reference and the batch generator (kdtree_backend/reference.py),
including a comparison with SGLang 0.5.23's REAL Triton `extend_attention_fwd` run by Triton's
interpreter, plus the GPU-independent parts of bench/bench_verify.py.

The Triton comparison runs in ONE subprocess with TRITON_INTERPRET=1 (it must be set before
triton/sglang are imported, and must not leak into other test modules); it prints a JSON result.

Triton's interpreter does not support bfloat16 (it multiplies the raw bit patterns in tl.dot:
triton-lang/triton#4972, #11584), so the subprocess hands the kernel float32 copies of the bf16
inputs. The values are exactly the bf16 values, so this checks the semantics (indexing through
kv_indices, FULL_MASK offsets, prefix columns ignored, scales, causal/None, empty rows) to float32
precision; bf16 rounding inside the kernel is covered by the GPU tests.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from kdtree_backend.testing.reference import MLA_SM_SCALE, V_HEAD_DIM, attention_weights_reference, relative_error, verify_attention_reference
from kdtree_backend.testing.batches import ancestor_matrix, make_verify_batch, random_tree_parents

ROOT = pathlib.Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------
# an independent, deliberately naive implementation (per row, per head, explicit key lists)
# ------------------------------------------------------------------------------------------
def _naive(batch, visible_draft):
    """visible_draft(b, i) -> list of draft columns request b's row i may see."""
    q, k, cache = batch.q.double(), batch.k.reshape(-1, 576).double(), batch.kv_cache.reshape(-1, 576).double()
    H = batch.num_heads
    out = torch.zeros(batch.num_rows, H, V_HEAD_DIM, dtype=torch.float64)
    qo, kv = batch.qo_indptr.tolist(), batch.kv_indptr.tolist()
    for b in range(batch.batch_size):
        slots = batch.kv_indices[kv[b]:kv[b + 1]].tolist()
        for i in range(qo[b + 1] - qo[b]):
            row = qo[b] + i
            keys = [(cache[s], batch.k_scale, batch.v_scale) for s in slots]
            keys += [(k[qo[b] + c], 1.0, 1.0) for c in visible_draft(b, i)]
            if not keys:
                continue
            for h in range(H):
                scores = torch.stack([torch.dot(q[row, h], kk) * batch.sm_scale * ks for kk, ks, _ in keys])
                p = torch.softmax(scores, 0)
                out[row, h] = sum(p[j] * keys[j][0][:V_HEAD_DIM] * keys[j][2] for j in range(len(keys)))
    return out.reshape(batch.num_rows, -1)


def _ancestors_by_walking(parents, i):
    seen, c = [], i
    while c >= 0:
        seen.append(c)
        c = parents[c]
    return sorted(seen)


def test_reference_tree_equals_hand_built():
    b = make_verify_batch((0, 7, 23), num_heads=2, draft_lens=5, mask="tree", seed=11,
                          k_scale=0.75, v_scale=1.25, mask_dtype=torch.uint8)
    ref = verify_attention_reference(*b.args(), **b.kwargs())
    exp = _naive(b, lambda rb, i: _ancestors_by_walking(b.parents[rb], i))
    assert torch.allclose(ref, exp, rtol=1e-12, atol=1e-12), (ref - exp).abs().max()


def test_reference_none_mask_is_causal_and_equals_chain():
    b = make_verify_batch((3, 0, 40), num_heads=3, draft_lens=4, mask="none", seed=5)
    ref = b.reference()
    exp = _naive(b, lambda rb, i: list(range(i + 1)))
    assert torch.allclose(ref, exp, rtol=1e-12, atol=1e-12)
    chain = make_verify_batch((3, 0, 40), num_heads=3, draft_lens=4, mask="chain", seed=5)
    assert torch.equal(chain.q, b.q) and torch.equal(chain.kv_cache, b.kv_cache)
    assert torch.allclose(chain.reference(), ref, rtol=0, atol=1e-13)


def test_prefix_mask_columns_are_ignored():
    b = make_verify_batch((0, 9, 31), num_heads=2, draft_lens=4, mask="tree", seed=3)
    ref = b.reference()
    mask = b.custom_mask.clone()
    mi, kv = b.mask_indptr.tolist(), b.kv_indptr.tolist()
    for fill in (0, 1):
        for r in range(b.batch_size):
            P, n = kv[r + 1] - kv[r], b.draft_lens[r]
            blk = mask[mi[r]:mi[r] + n * (P + n)].view(n, P + n)
            blk[:, :P] = fill
        b2 = dataclasses.replace(b, custom_mask=mask)
        assert torch.equal(b2.reference(), ref)
    # ... but the draft columns are read: clearing one non-diagonal ancestor bit changes a row.
    r = 2
    P, n = b.prefix_lens[r], b.draft_lens[r]
    blk = mask[mi[r]:mi[r] + n * (P + n)].view(n, P + n)
    assert blk[n - 1, P] != 0  # the root is an ancestor of every row
    blk[n - 1, P] = 0
    changed = dataclasses.replace(b, custom_mask=mask).reference()
    row = b.qo_indptr[r].item() + n - 1
    assert not torch.allclose(changed[row], ref[row])
    assert torch.equal(changed[:row], ref[:row])


def test_mask_dtypes_and_index_dtypes_and_layouts_agree():
    kw = dict(prefix_lens=(5, 0, 66), num_heads=2, draft_lens=3, mask="tree", seed=21)
    base = make_verify_batch(**kw, mask_dtype=torch.uint8)
    ref = base.reference()
    assert base.custom_mask.dtype == torch.uint8
    nonzero = base.custom_mask[base.custom_mask != 0]
    assert nonzero.numel() and int(nonzero.max()) > 1  # "non-zero means allowed", not just 1
    as_bool = dataclasses.replace(base, custom_mask=base.custom_mask != 0)
    assert torch.equal(as_bool.reference(), ref)
    b64 = dataclasses.replace(base, qo_indptr=base.qo_indptr.long(), kv_indptr=base.kv_indptr.long())
    assert torch.equal(b64.reference(), ref)
    flat = make_verify_batch(**kw, mask_dtype=torch.uint8, k_3d=False, cache_3d=False)
    assert flat.k.dim() == 2 and flat.kv_cache.dim() == 2
    assert torch.equal(flat.reference(), ref)
    gen_bool = make_verify_batch(**kw, mask_dtype=torch.bool)
    assert gen_bool.custom_mask.dtype == torch.bool
    assert torch.equal(gen_bool.reference(), ref)


def test_scales():
    """k_scale multiplies prefix scores only, v_scale prefix values only: a cache stored as
    2*K read with k_scale = v_scale = 0.5 is the same function (powers of two are exact)."""
    b = make_verify_batch((4, 37), num_heads=2, draft_lens=3, seed=8)
    ref = b.reference()
    b2 = dataclasses.replace(b, kv_cache=b.kv_cache * 2, k_scale=0.5, v_scale=0.5)
    assert torch.allclose(b2.reference(), ref, rtol=1e-12, atol=1e-12)
    # and they matter: the same cache with v_scale = 2 changes the output
    b3 = dataclasses.replace(b, v_scale=2.0)
    assert relative_error(b3.reference(), ref) > 0.1


def test_shapes_dtypes_uncovered_rows_and_padding():
    b = make_verify_batch((0, 13), num_heads=4, draft_lens=[1, 5], num_padded=2, extra_rows=3,
                          qo_indptr_dtype=torch.int64, seed=2)
    T = b.num_rows
    assert T == 1 + 5 + 2 * 5 + 3
    assert b.q.shape == (T, 4, 576) and b.q.dtype == torch.bfloat16
    assert b.k.shape == (T, 1, 576) and b.v.shape == (T, 1, 512) and b.v.is_contiguous()
    assert torch.equal(b.v, b.k[..., :512])
    assert b.qo_indptr.dtype == torch.int64 and b.kv_indptr.dtype == torch.int32
    assert b.mask_indptr.dtype == torch.int64 and b.kv_indices.dtype == torch.int64
    assert b.max_qo_len == 5
    ref = b.reference()
    assert ref.shape == (T, 4 * 512) and ref.dtype == torch.float64 and ref.device == b.q.device
    cov = b.covered_rows()
    assert int(cov.sum()) == T - 3 and bool((ref[~cov] == 0).all())
    assert bool(torch.isfinite(ref).all())
    assert int(b.real_rows().sum()) == 6 and int(b.padded_rows().sum()) == 10
    # SGLang's CUDA-graph padding: prefix 1 at slot 0, n = D draft rows
    assert b.prefix_lens[-2:] == [1, 1] and b.padded == [False, False, True, True]
    kv = b.kv_indptr.tolist()
    assert b.kv_indices[kv[2]:kv[4]].tolist() == [0, 0]
    with pytest.raises(ValueError, match="max_qo_len"):
        verify_attention_reference(*b.args(), **{**b.kwargs(), "max_qo_len": 4})


def test_generator_layout():
    b = make_verify_batch((0, 17, 64, 100), num_heads=1, draft_lens=6, mask="tree", seed=4,
                          extra_indices=37, extra_mask_bytes=29)
    P, n = b.prefix_lens, b.draft_lens
    real = b.kv_indices[: sum(P)]
    assert real.unique().numel() == real.numel()  # unique slots
    assert int(real.min()) >= 1 and int(real.max()) < b.kv_cache.shape[0]  # slot 0 reserved
    assert b.kv_cache.shape[0] > sum(P)  # pool larger than needed
    assert not bool((real[1:] - real[:-1] == 1).all())  # scattered, not contiguous
    assert b.kv_indices.numel() == sum(P) + 37  # over-allocated like SGLang's
    assert b.mask_indptr.tolist() == [0] + list(torch.cumsum(torch.tensor([6 * (p + 6) for p in P]), 0).tolist())
    assert b.custom_mask.numel() == b.mask_indptr[-1].item() + 29
    mi = b.mask_indptr.tolist()
    saw_zero_prefix_bit = False
    for r in range(4):
        blk = b.custom_mask[mi[r]:mi[r + 1]].view(n[r], P[r] + n[r]) != 0
        draft = blk[:, P[r]:]
        assert torch.equal(draft, ancestor_matrix(b.parents[r]))
        assert bool(draft[:, 0].all()) and bool(draft.diagonal().all())
        assert torch.equal(draft, draft.tril())  # parents precede children
        saw_zero_prefix_bit |= bool((~blk[:, :P[r]]).any())
    assert saw_zero_prefix_bit  # the never-read prefix columns hold garbage, not all-ones
    for t in (b.q, b.k, b.kv_cache):
        assert bool((t != 0).float().mean() > 0.99)  # never zeros
    # deterministic for a seed; different seeds differ
    again = make_verify_batch((0, 17, 64, 100), num_heads=1, draft_lens=6, mask="tree", seed=4,
                              extra_indices=37, extra_mask_bytes=29)
    assert torch.equal(again.q, b.q) and torch.equal(again.custom_mask, b.custom_mask)
    assert torch.equal(again.kv_indices, b.kv_indices)
    other = make_verify_batch((0, 17, 64, 100), num_heads=1, draft_lens=6, seed=5)
    assert not torch.equal(other.q, b.q)


def test_random_trees_are_varied():
    import random
    rng = random.Random(0)
    shapes = {tuple(random_tree_parents(6, rng)) for _ in range(50)}
    assert len(shapes) > 20
    for par in shapes:
        assert par[0] == -1 and all(0 <= p < c for c, p in enumerate(par) if c)


def test_attention_is_spread_not_one_hot():
    b = make_verify_batch((300, 1000), num_heads=4, draft_lens=8, mask="tree", seed=1)
    for r in range(2):
        w = attention_weights_reference(b, r)
        peak = w.max(dim=-1).values
        assert float(peak.mean()) < 0.2, float(peak.mean())  # not one-hot
        ent = -(w.clamp_min(1e-300).log() * w).sum(-1)
        assert float(ent.mean()) > 2.0  # many keys carry weight
        uniform = math.log(w.shape[-1])
        assert float(ent.mean()) < uniform - 0.05  # but not uniform either


def test_row_that_sees_nothing_is_zero():
    b = make_verify_batch((0, 4), num_heads=2, draft_lens=3, mask="tree", seed=9)
    mask = b.custom_mask.clone()
    n = 3
    mask[0:n] = 0  # request 0 (prefix 0), row 0 sees nothing
    b2 = dataclasses.replace(b, custom_mask=mask)
    out = b2.reference()
    assert bool((out[0] == 0).all()) and bool(torch.isfinite(out).all())
    assert bool((out[1] != 0).any())


def test_relative_error_helper():
    a = torch.randn(4, 8, dtype=torch.float64)
    assert relative_error(a, a) == 0.0
    bad = a.clone()
    bad[1, 2] = float("nan")
    assert relative_error(bad, a) == float("inf")
    rows = torch.tensor([True, False, True, True])
    assert relative_error(bad, a, rows) == 0.0
    assert abs(relative_error(a * 1.01, a) - 0.01) < 1e-12


def test_default_scale_is_layer_scaling_not_latent_width():
    b = make_verify_batch((2,), num_heads=1, draft_lens=1)
    assert b.sm_scale == MLA_SM_SCALE == 192 ** -0.5


# ------------------------------------------------------------------------------------------
# the real Triton kernel, interpreted, in one subprocess
# ------------------------------------------------------------------------------------------
TRITON_CASES = {
    # name: (make_verify_batch kwargs, post-processing)
    "tree_u8_ragged_prefix_h2": (dict(prefix_lens=(0, 5, 37), num_heads=2, draft_lens=4, mask="tree"), None),
    "tree_bool_i64_scales_h1": (dict(prefix_lens=(70, 1), num_heads=1, draft_lens=5, mask="tree",
                                     mask_dtype="bool", qo_indptr_dtype="int64", k_scale=0.7, v_scale=1.3), None),
    "chain_u8_h3": (dict(prefix_lens=(33, 64), num_heads=3, draft_lens=3, mask="chain"), None),
    "none_causal_h4": (dict(prefix_lens=(0, 31, 65), num_heads=4, draft_lens=2, mask="none"), None),
    "none_causal_no_mask_indptr_n1": (dict(prefix_lens=(10, 0), num_heads=4, draft_lens=1, mask="none"), "no_mask_indptr"),
    "random_bits_bool_h2": (dict(prefix_lens=(3, 40), num_heads=2, draft_lens=5, mask="random", mask_dtype="bool"), None),
    "random_bits_u8_empty_row": (dict(prefix_lens=(0, 6), num_heads=2, draft_lens=4, mask="random"), "empty_row"),
    "ragged_draft_tree_i64": (dict(prefix_lens=(4, 0, 50), num_heads=2, draft_lens=(1, 3, 5), mask="tree",
                                   qo_indptr_dtype="int64", kv_indptr_dtype="int64"), None),
    "padded_tree_extra_rows_flat": (dict(prefix_lens=(9, 20), num_heads=3, draft_lens=3, mask="tree", num_padded=2,
                                         extra_rows=3, k_3d=False, cache_3d=False, k_scale=1.5, v_scale=0.8), None),
    "prefix_zero_tree_u8_h4_n5": (dict(prefix_lens=(0, 0), num_heads=4, draft_lens=5, mask="tree"), None),
}

_SUBPROCESS = r"""
import dataclasses, json, sys, time
import torch
from kdtree_backend.testing.reference import relative_error
from kdtree_backend.testing.batches import make_verify_batch
from kdtree_backend.testing.sglang_calls import call_sglang_triton
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd  # noqa: F401 (interpreted)
cases = json.loads(sys.argv[1])
DT = {"bool": torch.bool, "uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64}
res = {}
for i, (name, (kw, post)) in enumerate(sorted(cases.items())):
    kw = {k: (DT[v] if isinstance(v, str) and v in DT else v) for k, v in kw.items()}
    for key in ("prefix_lens", "draft_lens"):
        if isinstance(kw.get(key), list):
            kw[key] = tuple(kw[key])
    b = make_verify_batch(seed=100 + i, **kw)
    if post == "empty_row":  # request 0 has prefix 0: clear draft row 1 -> it sees nothing
        m = b.custom_mask.clone(); n = b.draft_lens[0]; m[n:2 * n] = 0
        b = dataclasses.replace(b, custom_mask=m)
    if post == "no_mask_indptr":  # the op accepts None with no mask; so must Triton and the reference
        b = dataclasses.replace(b, mask_indptr=None)
    ref = b.reference()
    # The interpreter cannot compute in bf16: exact float32 copies of the bf16 values.
    f = dataclasses.replace(b, q=b.q.float(), k=b.k.float(), v=b.v.float(), kv_cache=b.kv_cache.float())
    out = torch.full((b.num_rows, b.num_heads * 512), float("nan"), dtype=torch.float32)
    t = time.time()
    call_sglang_triton(f, out)
    cov, real = b.covered_rows(), b.real_rows()
    zero_rows = [int(r) for r in torch.nonzero((ref == 0).all(1) & cov).flatten()]
    res[name] = dict(
        rel_covered=relative_error(out, ref, cov), rel_real=relative_error(out, ref, real),
        max_abs=float((out[cov].double() - ref[cov]).abs().max()),
        uncovered_untouched=bool(torch.isnan(out[~cov]).all()) if bool((~cov).any()) else True,
        zero_rows=zero_rows, zero_rows_out_zero=bool((out[zero_rows] == 0).all()) if zero_rows else True,
        seconds=time.time() - t, describe=b.describe())
# the benchmark's call of SGLang's verify_shared_kv_fwd (chain), same argument layout
import importlib.util, pathlib
spec = importlib.util.spec_from_file_location("bv", str(pathlib.Path("bench/bench_verify.py").resolve()))
bv = importlib.util.module_from_spec(spec); spec.loader.exec_module(bv)
from sglang.kernels.ops.attention.verify_mla import verify_shared_kv_fwd
b = make_verify_batch([40, 70, 3], num_heads=4, draft_lens=3, mask="none", qo_indptr_dtype=torch.int64, seed=7)
ref = b.reference()
f = dataclasses.replace(b, q=b.q.float(), k=b.k.float(), v=b.v.float(), kv_cache=b.kv_cache.float())
out = torch.full((b.num_rows, b.num_heads * 512), float("nan"), dtype=torch.float32)
bv.call_verify_mla(verify_shared_kv_fwd, f, out)
res["bench_verify_mla_chain"] = dict(rel_covered=relative_error(out, ref, b.covered_rows()), describe=b.describe())
print("KDTREE_JSON:" + json.dumps(res))
"""


@pytest.fixture(scope="module")
def triton_results():
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    proc = subprocess.run([sys.executable, "-c", _SUBPROCESS, json.dumps(TRITON_CASES)], env=env, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("KDTREE_JSON:")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"interpreted Triton subprocess failed (rc {proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1][len("KDTREE_JSON:"):])


@pytest.mark.parametrize("name", sorted(TRITON_CASES))
def test_reference_matches_sglang_triton_interpreted(triton_results, name):
    r = triton_results[name]
    # float32 arithmetic on exact bf16 values: agreement to ~1e-7 relative.
    assert r["rel_covered"] < 2e-6, r
    assert r["uncovered_untouched"], r
    assert r["zero_rows_out_zero"], r
    if name == "random_bits_u8_empty_row":
        assert r["zero_rows"], r  # the empty row really was exercised


def test_bench_verify_mla_call_matches_chain_reference(triton_results):
    """bench_verify.call_verify_mla drives SGLang's verify_shared_kv_fwd with the right argument
    layout: it reproduces the chain reference (its partials are stored in bf16, hence ~3e-3)."""
    r = triton_results["bench_verify_mla_chain"]
    assert r["rel_covered"] < 1e-2, r


def test_triton_interpret_did_not_leak():
    assert "TRITON_INTERPRET" not in os.environ


# ------------------------------------------------------------------------------------------
# bench/bench_verify.py: the parts that need no GPU
# ------------------------------------------------------------------------------------------
def _load_bench(name):
    path = ROOT / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_kdtree_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_grid_and_args():
    bv = _load_bench("bench_verify")
    full = bv.build_grid()
    assert full == bv.build_grid("main") == bv.build_grid(quick=False)
    assert len(full) == 45 and len(set(full)) == 45
    assert {(s.H, s.n) for s in full} == {(8, 16), (8, 64), (16, 16), (16, 64), (8, 8)}
    assert {s.L for s in full} == {1024, 8192, 32768} and {s.B for s in full} == {1, 8, 32}
    quick = bv.build_grid(quick=True)
    assert 3 <= len(quick) <= 8 and set(quick) <= set(full) and bv.build_grid("quick") == quick
    a = bv.parse_args(["--quick", "--skip-triton", "--out", "/tmp/x.json"])
    assert a.quick and a.grid == "quick" and a.skip_triton and a.out == "/tmp/x.json" and a.only is None
    a = bv.parse_args(["--only", "ours"])
    assert a.only == "ours" and a.grid == "main" and a.paths == []
    assert bv.selected_impls(a) == ["ours"] and bv.ours_keys(a) == ["ours"]
    assert bv.selected_impls(bv.parse_args([])) == ["ours", "triton", "verify_mla", "flashmla"]
    assert "triton" not in bv.selected_impls(bv.parse_args(["--skip-triton"]))
    assert bv.parse_shapes("8,16,64,0; 8,16,64,1024;") == [bv.Shape(8, 16, 64, 0), bv.Shape(8, 16, 64, 1024)]
    for bad in ("8,16,64", "0,16,64,1024", "8,16,64,-1", "", "a,b,c,d"):
        with pytest.raises(ValueError):
            bv.parse_shapes(bad)
    with pytest.raises(SystemExit):
        bv.parse_args(["--shapes", "8,16,64"])
    assert bv.parse_args(["--shapes", "1,8,16,64"]).shapes == [bv.Shape(1, 8, 16, 64)]
    # kernel paths, timed in one run
    assert bv.ours_keys(bv.parse_args(["--paths", "hopper,portable"])) == ["hopper", "portable"]
    assert bv.parse_args(["--paths", "portable"]).paths == ["portable"]
    for bad in ("ampere", "hopper,hopper", ",", "rows32"):
        with pytest.raises(SystemExit):
            bv.parse_args(["--paths", bad])
    with pytest.raises(SystemExit):
        bv.parse_args(["--grid", "huge"])


def test_bench_ddtree_and_customer_grids():
    """--grid ddtree: n in {33, 65, 129, 257} x H in {8, 16} x B in {1, 8, 32} x L in {8k, 32k} (48),
    grouped by (H, n) so SGLang's Triton kernels compile once per group; --grid customer: its H = 8,
    n >= 65 shapes (18); grids combine without repeats and each shape knows its grids."""
    bv = _load_bench("bench_verify")
    dd = bv.build_grid("ddtree")
    assert len(dd) == len(set(dd)) == 48
    assert {s.n for s in dd} == {33, 65, 129, 257} and {s.H for s in dd} == {8, 16}
    assert {s.B for s in dd} == {1, 8, 32} and {s.L for s in dd} == {8192, 32768}
    groups = [(s.H, s.n) for s in dd]
    assert sum(1 for a, b in zip(groups, groups[1:]) if a != b) == 7  # 8 contiguous (H, n) groups
    cu = bv.build_grid("customer")
    assert len(cu) == 18 and set(cu) <= set(dd) and {s.H for s in cu} == {8} and {s.n for s in cu} == {65, 129, 257}
    both = bv.build_grid("main,ddtree")
    assert len(both) == 93 and both[:45] == bv.build_grid("main") and both[45:] == dd
    assert bv.build_grid("ddtree,customer") == dd
    assert bv.grids_of(bv.Shape(8, 8, 129, 8192)) == ["ddtree", "customer"]
    assert bv.grids_of(bv.Shape(8, 16, 33, 32768)) == ["ddtree"] and bv.grids_of(bv.Shape(1, 8, 16, 1024)) == ["main"]
    assert bv.parse_args(["--grid", "main,ddtree"]).grid == "main,ddtree"
    with pytest.raises(ValueError):
        bv.build_grid("main,nope")


def test_bench_contiguous_slots_keep_the_batch_valid():
    """--slots contiguous (docs/kernel/journal.md h41: separating slot order from the kernel on the HBM-bound
    shapes) is make_verify_batch's "contiguous" layout: prefix slots 1, 2, ... in request order (the
    slot ids of every earlier contiguous-slot result), the garbage tail still there, and a finite
    reference that follows the indices."""
    bv = _load_bench("bench_verify")
    assert bv.parse_args([]).slots == "random" and bv.parse_args(["--slots", "contiguous"]).slots == "contiguous"
    kw = bv.slot_layout_kwargs("contiguous")
    assert kw == {"slot_layout": "contiguous"}
    b = make_verify_batch([40, 70, 3], num_heads=4, draft_lens=3, extra_indices=5, seed=11, **kw)
    total = int(b.kv_indptr[-1])
    assert torch.equal(b.kv_indices[:total], torch.arange(1, total + 1, dtype=b.kv_indices.dtype))
    assert b.kv_indices.numel() == total + 5
    ref = b.reference()
    assert bool(torch.isfinite(ref).all())
    moved = dataclasses.replace(b, kv_indices=torch.cat([b.kv_indices[:total].flip(0), b.kv_indices[total:]]))
    assert not torch.equal(moved.reference(), ref)  # the reference reads the rows the indices name


@pytest.mark.parametrize("layout", ["scattered", "runs", "contiguous"])
def test_batch_slot_layouts(layout):
    """make_verify_batch's slot layouts (the consecutive-slot GPU tests rely on them, docs/kernel/journal.md h41):
    unique slots, never slot 0 for a real request, inside the pool; "contiguous" gives every request
    one run, "runs" a mix of whole consecutive 64-key tiles and broken ones, "scattered" (the default,
    unchanged stream of random numbers) practically none."""
    b = make_verify_batch([700, 130, 64, 0], num_heads=4, draft_lens=3, slot_layout=layout, seed=5)
    if layout == "scattered":
        assert torch.equal(b.kv_indices, make_verify_batch([700, 130, 64, 0], num_heads=4, draft_lens=3, seed=5).kv_indices)
    ip = b.kv_indptr.tolist()
    live = b.kv_indices[: ip[-1]]
    N = b.kv_cache.shape[0]
    assert len(set(live.tolist())) == ip[-1] and int(live.min()) >= 1 and int(live.max()) < N
    whole = broken = 0
    for r in range(len(ip) - 1):
        seg = b.kv_indices[ip[r]:ip[r + 1]]
        if layout == "contiguous" and len(seg):
            assert torch.equal(seg, torch.arange(int(seg[0]), int(seg[0]) + len(seg)))
        for t in range(len(seg) // 64):
            tile = seg[t * 64:(t + 1) * 64]
            if torch.equal(tile - tile[0], torch.arange(64)):
                whole += 1
            else:
                broken += 1
    assert {"scattered": whole == 0, "runs": whole > 0 and broken > 0, "contiguous": broken == 0}[layout], (whole, broken)
    assert bool(torch.isfinite(b.reference()).all())
    with pytest.raises(ValueError, match="slot_layout"):
        make_verify_batch([5], num_heads=1, draft_lens=1, slot_layout="paged")


def test_bench_slot_orders_reach_the_batch():
    """--slots runs (shuffled runs of consecutive slots) is make_verify_batch's "runs" layout; random
    keeps its default stream; anything else is refused before a GPU is touched."""
    bv = _load_bench("bench_verify")
    assert bv.parse_args(["--slots", "runs"]).slots == "runs"
    with pytest.raises(SystemExit):
        bv.parse_args(["--slots", "paged"])
    assert bv.slot_layout_kwargs("random") == {} and bv.slot_layout_kwargs("contiguous") == {"slot_layout": "contiguous"}
    kw = bv.slot_layout_kwargs("runs")
    b = make_verify_batch([700, 300], num_heads=4, draft_lens=3, seed=3, **kw)
    seg = b.kv_indices[: int(b.kv_indptr[-1])]
    assert bool((seg[1:] - seg[:-1] == 1).float().mean() > 0.9)  # mostly consecutive, unlike random
    with pytest.raises(ValueError):
        bv.slot_layout_kwargs("paged")


def test_bench_roofline_arithmetic():
    bv = _load_bench("bench_verify")
    s = bv.Shape(B=8, H=16, n=64, L=8192)
    byts = 8 * (8192 + 64) * 576 * 2 + 8 * 64 * 16 * 576 * 2 + 8 * 64 * 16 * 512 * 2
    flops = 2 * 8 * 64 * 16 * (8192 + 64) * (576 + 512)
    assert bv.shape_bytes(s) == byts and bv.shape_flops(s) == flops
    ceil = {"copy_tbps": 4.25, "matmul_tflops": 716.0}
    roof_us = max(byts / 4.25e12, flops / 716e12) * 1e6
    assert abs(bv.roofline_us(s, ceil) - roof_us) < 1e-9
    # perf-anchors.md: B=8 H=16 n=64 L=8192 roofline 205.5 us
    assert abs(roof_us - 205.5) < 0.5
    m = bv.metrics(s, 250.0, ceil)
    assert abs(m["tbps"] - byts / 250e-6 / 1e12) < 1e-9
    assert abs(m["tflops"] - flops / 250e-6 / 1e12) < 1e-9
    assert abs(m["pct_roofline"] - 100 * roof_us / 250.0) < 1e-9
    assert abs(m["pct_copy"] - 100 * m["tbps"] / 4.25) < 1e-9
    assert abs(m["pct_matmul"] - 100 * m["tflops"] / 716.0) < 1e-9
    assert m["pct_mma_sync"] is None  # no mma.sync ceiling measured
    m2 = bv.metrics(s, 250.0, {**ceil, "mma_sync_tflops": 645.0})
    assert abs(m2["pct_mma_sync"] - 100 * m["tflops"] / 645.0) < 1e-9
    assert {k: v for k, v in m2.items() if k != "pct_mma_sync"} == {k: v for k, v in m.items() if k != "pct_mma_sync"}


def _fake_rows(bv, with_flashmla=True, grid="main", paths=("ours",)):
    """Rows with times: path k of ours takes (k + 1) x (10 + i) us, Triton 12x the first path's,
    FlashMLA the first path's / 1.25."""
    rows = []
    for i, s in enumerate(bv.build_grid(grid)):
        ours = 10.0 + i
        times = {p: ours * (k + 1) for k, p in enumerate(paths)}
        times["triton"] = ours * 12.0
        row = {"shape": s._asdict(), "label": bv.shape_label(s), "times_us": times}
        if with_flashmla:
            row["times_us"]["flashmla"] = ours / 1.25
        rows.append(row)
    return rows


def test_bench_summary_and_json(tmp_path):
    bv = _load_bench("bench_verify")
    ceil = {"copy_tbps": 4.25, "matmul_tflops": 716.0}
    rows = [bv.finish_row(r, ceil) for r in _fake_rows(bv)]
    summ = bv.summarize(rows, ceil)
    assert abs(summ["geomean_speedup_vs_triton"] - 12.0) < 1e-9
    assert abs(summ["min_speedup_vs_triton"] - 12.0) < 1e-9
    assert abs(summ["geomean_ratio_vs_flashmla"] - 1.25) < 1e-9
    assert summ["shapes"] == 45
    assert set(summ["done_when"]) >= {"speedup_geomean_ge_10", "speedup_min_ge_3", "flashmla_ratio_le_1_6",
                                      "large_shapes_matmul_pct_ge_55", "n8_h8_copy_pct_ge_60"}
    assert summ["done_when"]["speedup_geomean_ge_10"] is True
    big = [r for r in rows if r["shape"]["B"] * r["shape"]["L"] >= 256 * 1024 and r["shape"]["n"] != 8]
    assert summ["large_shapes"] == len(big) == 12  # main grid only; the n=8 shapes are judged on copy %
    assert len(summ["n8_h8_pct_copy"]) == 9
    assert summ["large_shapes_min_pct_mma_sync"] is None  # no mma.sync ceiling in this run
    assert summ["paths"]["ours"]["geomean_ratio_vs_flashmla"] == summ["geomean_ratio_vs_flashmla"]
    assert set(summ["grids"]) == {"main"} and summ["grids"]["main"]["shapes_run"] == 45
    doc = bv.make_document(rows, ceil, summ, argv=["bench/bench_verify.py", "--quick"], env={"gpu": "fake"})
    out = tmp_path / "r.json"
    out.write_text(json.dumps(doc))
    back = json.loads(out.read_text())
    for key in ("date", "commit", "gpu", "torch", "triton", "command", "ceilings", "rows", "summary", "paths"):
        assert key in back, key
    assert back["command"].endswith("--quick") and back["paths"] == ["ours"] and bv.doc_paths(back) == ["ours"]
    assert bv.doc_paths({"rows": []}) == ["ours"]  # results written before "paths" existed
    r0 = back["rows"][0]
    for key in ("shape", "times_us", "speedup_vs_triton", "ratio_vs_flashmla", "roofline_us", "metrics", "paths"):
        assert key in r0, key
    assert bv.default_out_path("2026-11-30", "NVIDIA H200", "abc1234").endswith(
        "bench/results/2026-11-30-NVIDIA-H200-abc1234.json")
    table = bv.format_table(rows)
    assert table.splitlines()[0].split()[:4] == ["shape", "ours", "us", "triton"]
    assert "speedup" in table and "%mma" in table and len(table.splitlines()) == 46
    text = bv.format_summary(summ)
    assert "speedup vs Triton: geomean 12.00x" in text and "mma.sync unmeasured" in text


def test_bench_per_path_and_per_grid_summaries():
    """--paths hopper,portable: every row holds both paths' comparisons (row["paths"]), the summary
    one block per path (the top level is the first path's), one line per grid and path, and the
    time ratio between the paths; % of the mma.sync peak per row and for the large shapes."""
    bv = _load_bench("bench_verify")
    ceil = {"copy_tbps": 4.25, "matmul_tflops": 790.0, "mma_sync_tflops": 645.0}
    paths = ["hopper", "portable"]
    rows = [bv.finish_row(r, ceil, paths) for r in _fake_rows(bv, grid="main,ddtree", paths=paths)]
    r = rows[0]
    assert r["paths"]["hopper"]["speedup_vs_triton"] == pytest.approx(12.0)
    assert r["paths"]["portable"]["speedup_vs_triton"] == pytest.approx(6.0)
    assert r["paths"]["portable"]["ratio_vs_flashmla"] == pytest.approx(2.5)
    assert r["paths"]["portable"]["time_vs_first_path"] == pytest.approx(2.0)
    assert r["speedup_vs_triton"] == r["paths"]["hopper"]["speedup_vs_triton"]  # the row level: the first path
    assert r["paths"]["hopper"]["pct_mma_sync"] == pytest.approx(r["metrics"]["hopper"]["tflops"] / 645.0 * 100)
    summ = bv.summarize(rows, ceil, paths)
    assert summ["geomean_speedup_vs_triton"] == pytest.approx(12.0)
    assert summ["paths"]["portable"]["geomean_speedup_vs_triton"] == pytest.approx(6.0)
    assert summ["paths"]["portable"]["geomean_ratio_vs_flashmla"] == pytest.approx(2.5)
    large = [x for x in rows if (x["shape"]["H"], x["shape"]["n"]) in bv.MAIN_HN and x["shape"]["B"] * x["shape"]["L"] >= 256 * 1024]
    assert summ["paths"]["portable"]["large_shapes_min_pct_mma_sync"] == pytest.approx(
        min(x["metrics"]["portable"]["pct_mma_sync"] for x in large))
    assert summ["path_time_ratios"] == {"portable/hopper": pytest.approx(2.0)}
    assert set(summ["grids"]) == {"main", "ddtree", "customer"}
    dd = summ["grids"]["ddtree"]
    assert dd["shapes"] == dd["shapes_run"] == 48 and summ["grids"]["customer"]["shapes_run"] == 18
    assert dd["portable"]["shapes_measured"] == 48
    assert dd["portable"]["geomean_ratio_vs_flashmla"] == pytest.approx(2.5)
    assert dd["hopper"]["max_ratio_vs_flashmla"] == pytest.approx(1.25)
    assert dd["hopper"]["min_speedup_vs_triton"] == pytest.approx(12.0)
    dd_large = [x for x in rows[45:] if x["shape"]["B"] * x["shape"]["L"] >= 256 * 1024]
    assert dd["hopper"]["large_shapes_min_pct_mma_sync"] == pytest.approx(
        min(x["metrics"]["hopper"]["pct_mma_sync"] for x in dd_large))
    table = bv.format_table(rows, paths)
    head = table.splitlines()[0]
    for col in ("hopper us", "portable us", "H speedup", "P /fmla", "P/H", "H %mma", "P %mma", "err portable"):
        assert col in head, col
    assert "H = hopper path, P = portable path" in table.splitlines()[-1]
    text = bv.format_summary(summ, paths)
    assert "[portable] speedup vs Triton: geomean 6.00x" in text
    assert "ddtree [portable] grid (48/48 shapes): time/FlashMLA geomean 2.50" in text
    assert "time portable/hopper: geomean 2.000" in text and "mma.sync 645 TFLOP/s" in text
    doc = bv.make_document(rows, ceil, summ, argv=["x"], env={"gpu": "fake"}, paths=paths)
    assert bv.doc_paths(doc) == paths


def test_bench_emulated_pipe_of_a_pipe_factor_library():
    """Under a `--pipe-factor F` library (journal m27; the loader reads F from its version, test_loader) the
    benchmark reports the portable path's busy share of the slowed pipe, F x its % of the mma.sync peak."""
    bv = _load_bench("bench_verify")
    ceil = {"copy_tbps": 4.25, "matmul_tflops": 790.0, "mma_sync_tflops": 645.0}
    paths = ["hopper", "portable"]
    rows = [bv.finish_row(r, ceil, paths) for r in _fake_rows(bv, grid="main", paths=paths)]
    em = bv.emulated_pipe_summary(rows, "portable", 3)
    assert em["factor"] == 3 and len(em["pct_by_shape"]) == len(rows)
    r = rows[0]
    assert em["pct_by_shape"][r["label"]] == pytest.approx(3 * r["paths"]["portable"]["pct_mma_sync"])
    large = [3 * x["paths"]["portable"]["pct_mma_sync"] for x in rows if x["shape"]["B"] * x["shape"]["L"] >= 256 * 1024]
    assert em["large_shapes_min_pct"] == pytest.approx(min(large)) and em["large_shapes_max_pct"] == pytest.approx(max(large))


def test_bench_issue_targets():
    """The open issues' bars per path, judged on one run: issue 25's for the portable path, 26's for
    the Hopper path; a grid not run leaves its bars unjudged (None), not failed; the summary carries
    them and format_summary prints one line a path."""
    bv = _load_bench("bench_verify")
    ceil = {"copy_tbps": 4.25, "matmul_tflops": 790.0, "mma_sync_tflops": 645.0}
    paths = ["hopper", "portable"]
    rows = [bv.finish_row(r, ceil, paths) for r in _fake_rows(bv, grid="main,ddtree", paths=paths)]
    # hopper: 1.25x FlashMLA on every shape; portable 2.5x; Triton 12x / 6x
    h = bv.issue_targets(rows, "hopper")
    assert h["issue"] == "issue 26" and h["met"] == [0, 5]
    assert h["ddtree_geomean_vs_flashmla"]["value"] == pytest.approx(1.25) and h["ddtree_max_vs_flashmla"]["met"] is False
    # hopper's % of matmul is FlashMLA's / 1.25: the gap on a large shape is -20% of FlashMLA's own %
    large = [r for r in rows[:45] if (r["shape"]["H"], r["shape"]["n"]) in bv.MAIN_HN
             and r["shape"]["B"] * r["shape"]["L"] >= 256 * 1024]
    assert len(large) == 12
    assert h["large_min_pct_matmul_minus_flashmla"]["value"] == pytest.approx(
        min(r["metrics"]["hopper"]["pct_matmul"] - r["metrics"]["flashmla"]["pct_matmul"] for r in large))
    p = bv.issue_targets(rows, "portable")
    assert p["issue"] == "issue 25"
    assert p["main_geomean_vs_flashmla"]["value"] == pytest.approx(2.5) and p["max_vs_flashmla"]["met"] is False
    assert p["geomean_speedup_vs_triton"]["met"] is False and p["min_speedup_vs_triton"]["met"] is True  # 6x
    assert p["large_min_pct_mma_sync"]["value"] == pytest.approx(min(r["metrics"]["portable"]["pct_mma_sync"] for r in large))
    # the fake times are small: every % bar holds (the mma.sync and the copy one)
    assert p["large_min_pct_mma_sync"]["met"] is True and p["n8_h8_large_min_pct_copy"]["met"] is True
    assert p["met"] == [3, 7]
    # a run of the main grid alone: the DDTree bars are not judged
    main_only = [bv.finish_row(r, ceil, paths) for r in _fake_rows(bv, grid="main", paths=paths)]
    h = bv.issue_targets(main_only, "hopper")
    assert h["ddtree_geomean_vs_flashmla"]["value"] is None and h["ddtree_geomean_vs_flashmla"]["met"] is None
    assert h["met"] == [0, 3]
    # a bar that holds: FlashMLA slower than ours everywhere
    fast = _fake_rows(bv, grid="main,ddtree", paths=paths)
    for r in fast:
        r["times_us"]["flashmla"] = r["times_us"]["hopper"] * 1.2
    h = bv.issue_targets([bv.finish_row(r, ceil, paths) for r in fast], "hopper")
    assert h["met"] == [5, 5] and h["main_max_vs_flashmla"]["value"] == pytest.approx(1 / 1.2)
    assert bv.issue_targets(rows, "ours") == {}
    summ = bv.summarize(rows, ceil, paths)
    assert summ["paths"]["portable"]["targets"]["met"] == [3, 7]
    text = bv.format_summary(summ, paths)
    assert "[hopper] issue 26 targets met 0 of 5: time / FlashMLA, DDTree grid geomean 1.25 (<=1: no)" in text
    assert "[portable] issue 25 targets met 3 of 7" in text and "worst shape 6.00 (>=3: yes)" in text


def test_bench_plot_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    bv = _load_bench("bench_verify")
    plot = _load_bench("plot")
    ceil = {"copy_tbps": 4.25, "matmul_tflops": 716.0}
    rows = [bv.finish_row(r, ceil) for r in _fake_rows(bv)]
    rows[3]["times_us"].pop("flashmla")  # a missing competitor must not break the plot
    rows[3] = bv.finish_row(rows[3], ceil)
    doc = bv.make_document(rows, ceil, bv.summarize(rows, ceil), argv=["x"], env={"gpu": "fake"})
    j = tmp_path / "r.json"
    j.write_text(json.dumps(doc))
    png = plot.plot(str(j), str(tmp_path / "r.png"))
    assert pathlib.Path(png).stat().st_size > 10_000
    if os.environ.get("KDTREE_KEEP_PLOT"):
        import shutil
        shutil.copy(png, os.environ["KDTREE_KEEP_PLOT"])
    # two paths side by side; an old single-path result (no "paths", no per-row "paths") reads too
    paths = ["hopper", "portable"]
    rows2 = [bv.finish_row(r, ceil, paths) for r in _fake_rows(bv, grid="customer", paths=paths)]
    doc2 = bv.make_document(rows2, ceil, bv.summarize(rows2, ceil, paths), argv=["x"], env={"gpu": "fake"}, paths=paths)
    assert plot.path_series(doc2, "ratio_vs_flashmla")["portable"][0] == pytest.approx(2.5)
    j2 = tmp_path / "r2.json"
    j2.write_text(json.dumps(doc2))
    assert pathlib.Path(plot.plot(str(j2))).stat().st_size > 10_000
    old = {"rows": [{"label": "B1", "speedup_vs_triton": 3.0}], "ceilings": ceil}
    assert plot.path_series(old, "speedup_vs_triton") == {"ours": [3.0]}


def test_bench_request0_reference_is_request_0_of_the_full_reference():
    """The benchmark's float64 check computes request 0 alone (its n rows; cheap at n = 257, L = 32k):
    the same numbers as the full reference's first n rows, tree and chain."""
    bv = _load_bench("bench_verify")
    b = make_verify_batch([40, 70, 9], num_heads=3, draft_lens=5, mask="tree", qo_indptr_dtype=torch.int64, seed=2)
    tree = bv.request0_reference(b, 5, chain=False)
    assert tree.shape == (5, 3 * 512) and torch.equal(tree, b.reference()[:5])
    chain = bv.request0_reference(b, 5, chain=True)
    none = dataclasses.replace(b, custom_mask=None)
    assert torch.allclose(chain, none.reference()[:5], rtol=0, atol=1e-13)
    assert not torch.allclose(chain, tree)


def test_bench_mma_sync_peak_plumbing(tmp_path, monkeypatch):
    """measure_mma_sync_peak loads the compiled peak library with ctypes and records what it returns
    (a stand-in library built with gcc here); an error code or a library that cannot be built is
    recorded as mma_sync_error with a null peak, and the run goes on."""
    import shutil
    import types

    if shutil.which("gcc") is None:
        pytest.skip("gcc not found")
    bv = _load_bench("bench_verify")
    src = tmp_path / "fake_peak.c"
    src.write_text(
        "int mma_peak(double min_ms, int repeats, double* tflops, double* ms, long long* iters, int* blocks) {\n"
        "  if (min_ms < 0) return 2;\n"
        "  *tflops = 600.0 + repeats; *ms = min_ms + 1.0; *iters = 123456789012LL; *blocks = 264; return 0;\n}\n"
        "const char* mma_peak_error_string(int rc) { return rc == 2 ? \"out of memory\" : \"?\"; }\n")
    lib = tmp_path / "fake_peak.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True, timeout=120)
    seen = []
    monkeypatch.setattr(bv, "mma_peak_library", lambda cap: seen.append(cap) or lib)
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(get_device_capability=lambda i=0: (12, 0),
                                                                   synchronize=lambda: None))
    res = bv.measure_mma_sync_peak(fake_torch, 50.0, 5)
    assert seen == [(12, 0)]
    assert res["mma_sync_tflops"] == 605.0 and res["mma_sync_launch_ms"] == 51.0
    assert res["mma_sync_iters"] == 123456789012 and res["mma_sync_blocks"] == 264
    assert res["mma_sync_instruction"] == "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    bad = bv.measure_mma_sync_peak(fake_torch, -1.0, 5)
    assert bad["mma_sync_tflops"] is None and "out of memory" in bad["mma_sync_error"]

    def no_nvcc(cap):
        raise RuntimeError("nvcc not found (needed to build bench/diag/mma_peak.cu)")

    monkeypatch.setattr(bv, "mma_peak_library", no_nvcc)
    assert "nvcc not found" in bv.measure_mma_sync_peak(fake_torch)["mma_sync_error"]
    cmd = bv.mma_peak_compile_command("/usr/bin/nvcc", "90", tmp_path / "x.so")
    assert "-gencode=arch=compute_90,code=sm_90" in cmd and "-shared" in cmd and str(bv.MMA_PEAK_SOURCE) in cmd


def test_bench_mma_peak_source_compiles(tmp_path, monkeypatch):
    """bench/diag/mma_peak.cu builds as the benchmark builds it (a shared library for sm_90, cached
    per source digest) and exports the symbols measure_mma_sync_peak looks up; the loop is the
    mma.sync instruction the portable path uses."""
    import tempfile

    from kdtree_backend.kernel.build import find_nvcc

    if find_nvcc() is None:
        pytest.skip("nvcc not found")
    bv = _load_bench("bench_verify")
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in bv.MMA_PEAK_SOURCE.read_text()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    lib = bv.mma_peak_library((9, 0))
    assert lib.parent == tmp_path and lib.name.endswith("-sm90.so") and lib.stat().st_size > 0
    assert bv.mma_peak_library((9, 0)) == lib  # cached
    r = subprocess.run(["nm", "-D", str(lib)], capture_output=True, text=True)
    if r.returncode == 0:
        assert " T mma_peak" in r.stdout and " T mma_peak_error_string" in r.stdout


def test_bench_flashmla_inputs_hold_the_same_rows():
    """FlashMLA's paged cache built by the benchmark holds, for every request, its prefix rows
    then its draft rows, so FlashMLA's causal rule is the chain mask on the same data."""
    bv = _load_bench("bench_verify")
    s = bv.Shape(B=3, H=2, n=5, L=70)
    b = make_verify_batch([s.L] * s.B, num_heads=s.H, draft_lens=s.n, mask="none", seed=3)
    gen = torch.Generator().manual_seed(0)
    cache, bt, sl = bv.flashmla_inputs(torch, b, s, gen)
    assert cache.shape[1:] == (64, 1, 576) and cache.dtype == torch.bfloat16
    assert bt.dtype == torch.int32 and bt.shape == (3, 2) and sl.tolist() == [75, 75, 75]
    assert bt.unique().numel() == bt.numel()
    flat = cache.view(-1, 576)
    kv = b.kv_indptr.tolist()
    for r in range(s.B):
        toks = torch.arange(s.L + s.n)
        rows = flat[bt[r, toks // 64].long() * 64 + toks % 64]
        expect = torch.cat([b.kv_cache.view(-1, 576)[b.kv_indices[kv[r]:kv[r + 1]]], b.k.view(-1, 576)[r * s.n:(r + 1) * s.n]])
        assert torch.equal(rows, expect)
    # causal over [prefix | drafts] with query i at position L+i == the chain reference
    q = b.q.double()
    ref = b.reference()
    for r in range(s.B):
        toks = torch.arange(s.L + s.n)
        kvr = flat[bt[r, toks // 64].long() * 64 + toks % 64].double()
        sc = torch.einsum("nhd,td->nht", q[r * s.n:(r + 1) * s.n], kvr) * b.sm_scale
        allowed = toks[None, :] <= (s.L + torch.arange(s.n))[:, None]
        p = torch.softmax(sc.masked_fill(~allowed[:, None, :], float("-inf")), -1)
        o = torch.einsum("nht,td->nhd", p, kvr[:, :512]).reshape(s.n, -1)
        assert torch.allclose(o, ref[r * s.n:(r + 1) * s.n], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("case", ["all-ok", "verify_mla-raises", "both-paths"])
def test_bench_pipeline_dry_run_with_fake_gpu(tmp_path, monkeypatch, capsys, case):
    """Runs bench_verify.main end to end on the CPU: fake CUDA timers/graphs and fake kernels
    (float64 reference semantics) stand in for the GPU, to prove the plumbing: K rotated input
    sets, the four competitors' calls and argument layouts, the per-shape float64 checks (tree
    for ours/Triton, chain for verify_mla/FlashMLA), JSON and table; verify_mla left out past 64
    drafts; with --paths, each kernel path run under its own KDTREE_KERNEL in the same process."""
    vmla_fails = case == "verify_mla-raises"
    paths = ["hopper", "portable"] if case == "both-paths" else ["ours"]
    import contextlib
    import time as _time
    import types

    from kdtree_backend.testing import sglang_calls

    bv = _load_bench("bench_verify")
    monkeypatch.setattr(bv, "DEVICE", "cpu")

    class Ev:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            self.t = _time.perf_counter()

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3 + 1e-3

    class St:
        cuda_stream = 0

        def wait_stream(self, other):
            pass

    class G:
        def replay(self):
            pass

    @contextlib.contextmanager
    def _ctx(*a, **k):
        yield

    props = types.SimpleNamespace(name="Fake GPU", multi_processor_count=132, L2_cache_size=60 << 20, major=9, minor=0)
    for name, val in dict(Event=Ev, Stream=St, CUDAGraph=G, graph=_ctx, stream=_ctx, synchronize=lambda *a: None,
                          empty_cache=lambda: None, is_available=lambda: True,
                          get_device_properties=lambda i=0: props, current_stream=lambda *a: St()).items():
        monkeypatch.setattr(torch.cuda, name, val)
    ceil = {"copy_tbps": 4.25, "matmul_tflops": 716.0, "mma_sync_tflops": 600.0}
    monkeypatch.setattr(bv, "measure_ceilings", lambda torch, mma_peak_ms: dict(ceil, mma_peak_ms=mma_peak_ms))
    grid = [bv.Shape(2, 2, 3, 40), bv.Shape(1, 3, 8, 64), bv.Shape(1, 2, 65, 30)]
    grid += [bv.Shape(1, 2, 3, 17)] if vmla_fails else []
    monkeypatch.setattr(bv, "build_grid", lambda grid_name="main", quick=False: grid)
    monkeypatch.delenv("KDTREE_KERNEL", raising=False)
    calls = {"ours": 0, "triton": 0, "verify_mla": 0, "flashmla": 0}
    path_calls = {}

    def fake_op(q, k, kv_cache, qo, kvp, kvi, mask, mi, sm, *, max_qo_len, k_scale=1.0, v_scale=1.0, out=None):
        calls["ours"] += 1
        p = os.environ.get("KDTREE_KERNEL", "unset")
        path_calls[p] = path_calls.get(p, 0) + 1
        assert mask is not None and mask.dtype == torch.uint8 and qo.dtype == torch.int64
        r = verify_attention_reference(q, k, kv_cache, qo, kvp, kvi, mask, mi, sm, k_scale=k_scale, v_scale=v_scale,
                                       max_qo_len=max_qo_len)
        out.copy_(r.to(out.dtype))
        return out

    def fake_triton(self, out=None):
        calls["triton"] += 1
        out.copy_(self.reference().to(out.dtype))
        return out

    def fake_vmla(q, k, v, o, kb, vb, qo, kvp, kvi, mask, causal, mi, max_len, ks, vs, sm, **kw):
        calls["verify_mla"] += 1
        if vmla_fails:
            raise RuntimeError("out of resources: shared memory")
        assert mask is None and causal is True and kb.dim() == 3 and vb.shape[-1] == 512 and kw["max_bs"] >= 1
        r = verify_attention_reference(q, k, kb, qo, kvp, kvi, None, None, sm)
        o.view(q.shape[0], -1).copy_(r.to(o.dtype))
        return True

    def fake_flash(q4, cache, bt, sl, dv, meta, softmax_scale=None, causal=False, use_legacy=False):
        calls["flashmla"] += 1
        assert causal and use_legacy and dv == 512 and cache.shape[1:] == (64, 1, 576)
        B, n, H, _ = q4.shape
        flat = cache.view(-1, 576).double()
        o = torch.empty(B, n, H, 512, dtype=torch.bfloat16)
        for r in range(B):
            S = int(sl[r])
            toks = torch.arange(S)
            kvr = flat[bt[r, toks // 64].long() * 64 + toks % 64]
            sc = torch.einsum("nhd,td->nht", q4[r].double(), kvr) * softmax_scale
            allowed = toks[None, :] <= (S - n + torch.arange(n))[:, None]
            p = torch.softmax(sc.masked_fill(~allowed[:, None, :], float("-inf")), -1)
            o[r] = torch.einsum("nht,td->nhd", p, kvr[:, :512]).to(torch.bfloat16)
        return o, None

    flash = types.SimpleNamespace(get_mla_metadata=lambda *a, **k: (types.SimpleNamespace(), None),
                                  flash_mla_with_kvcache=fake_flash)
    mods = {"ours": fake_op, "triton_ok": True, "verify_mla": fake_vmla, "flashmla": flash}
    monkeypatch.setattr(bv, "_load_impls", lambda impls: mods)
    monkeypatch.setattr(sglang_calls, "call_sglang_triton", fake_triton)
    out = tmp_path / "res.json"
    argv = ["--out", str(out), "--no-plot", "--max-sets", "3", "--commit", "test123", "--min-replays", "3"]
    rc = bv.main(argv + (["--paths", "hopper,portable"] if case == "both-paths" else []))
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["commit"] == "test123" and doc["gpu"] == "Fake GPU" and len(doc["rows"]) == len(grid)
    assert doc["impls"] == ["ours", "triton", "verify_mla", "flashmla"] and doc["paths"] == paths
    assert doc["ceilings"]["mma_sync_tflops"] == 600.0 and doc["ceilings"]["mma_peak_ms"] == 50.0
    assert "KDTREE_KERNEL" not in os.environ  # each path's setting is undone after its capture
    wide = doc["rows"][2]  # n = 65: verify_mla is not run, the others are
    assert wide["errors"] == {"verify_mla": bv.VERIFY_MLA_SKIP} and "verify_mla" not in wide["times_us"]
    assert wide["errors"]["verify_mla"].startswith("skipped: n > 64 drafts")
    if vmla_fails:
        errs = [r["errors"].get("verify_mla", "") for r in doc["rows"]]
        assert "out of resources" in errs[0] and errs[3].startswith("skipped: failed earlier at H=2 n=3")
        assert calls["verify_mla"] == 2  # first call of each (H, n), never retried
        assert all(set(r["times_us"]) == {"ours", "triton", "flashmla"} for r in doc["rows"])
        assert all(r["check"]["ours"] < 1e-2 for r in doc["rows"])
        return
    for row in doc["rows"]:
        expected = {*paths, "triton", "flashmla"} | ({"verify_mla"} if row["shape"]["n"] <= 64 else set())
        assert set(row["times_us"]) == expected, row["errors"]
        assert row["input_sets"] == 3
        for impl in expected:
            assert row["check"][impl] < 1e-2, (impl, row["check"])
        for p in paths:
            assert row["paths"][p]["speedup_vs_triton"] and row["paths"][p]["ratio_vs_flashmla"]
            assert row["metrics"][p]["pct_mma_sync"] > 0
    assert all(v > 0 for v in calls.values()), calls
    if case == "both-paths":
        assert set(path_calls) == {"hopper", "portable"} and path_calls["hopper"] == path_calls["portable"]
        assert set(doc["summary"]["paths"]) == {"hopper", "portable"} and "portable/hopper" in doc["summary"]["path_time_ratios"]
    else:
        assert set(path_calls) == {"unset"}  # without --paths the environment is left alone
    text = capsys.readouterr().out
    assert "speedup vs Triton" in text and "JSON:" in text and "mma.sync 600 TFLOP/s" in text


def test_flashmla_inputs_hold_each_ragged_request_rows():
    """bench/diag/ragged.py compares our kernel with FlashMLA on ragged batches: FlashMLA's paged cache
    must hold request b's prefix rows then its draft rows at its own block table, cache_seqlens L_b + n."""
    bv = _load_bench("bench_verify")
    prefixes, n, H = [70, 0, 129, 5], 3, 2
    b = make_verify_batch(prefixes, num_heads=H, draft_lens=n, mask="tree", pool_factor=1.25, extra_indices=64, seed=11)
    cache, bt, seqlens = bv.flashmla_inputs_for(torch, b, prefixes, n, torch.Generator().manual_seed(1))
    assert seqlens.tolist() == [L + n for L in prefixes] and bt.shape == (4, -(-(129 + n) // bv.PAGE_FLASHMLA))
    flat, src = cache.view(-1, bv.QK), b.kv_cache.reshape(-1, bv.QK)
    kvp = b.kv_indptr.tolist()
    for r, L in enumerate(prefixes):
        for t in range(L + n):
            row = flat[int(bt[r, t // bv.PAGE_FLASHMLA]) * bv.PAGE_FLASHMLA + t % bv.PAGE_FLASHMLA]
            want = src[int(b.kv_indices[kvp[r] + t])] if t < L else b.k.reshape(-1, bv.QK)[r * n + t - L]
            assert torch.equal(row, want), (r, t)
    assert len(set(bt.flatten().tolist())) == bt.numel()  # no page shared between requests


def test_ragged_batches_are_named_and_valid():
    mod = _load_bench("diag/ragged")
    assert len(mod.RAGGED) >= 6
    for name, (H, n, prefixes) in mod.RAGGED.items():
        assert name.startswith(f"B{len(prefixes)} H{H} n{n} "), name
        assert all(isinstance(L, int) and 0 < L <= 32768 for L in prefixes) and len(set(prefixes)) > 1, name
    H, n, pre = mod.RAGGED["B8 H8 n65 [32k, 1k x7]"]
    assert mod.batch_flops(H, n, pre) == pytest.approx(sum(2 * n * H * (L + n) * (576 + 512) for L in pre))
    with pytest.raises(SystemExit):
        mod.main(["--batches", "no such batch"])
