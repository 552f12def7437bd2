"""The SGLang scene the GPU tests and benchmarks share: SGLang's real `TritonAttnBackend` over a
real `MLATokenToKVPool` (built with SGLang's own attention test kit), a TARGET_VERIFY batch whose
contents can be reloaded in place (CUDA-graph friendly), the hook installed as HookRegistry's
AROUND wrapper does, and the float64 reference computed independently of the backend's metadata.

Used by tests/sglang/test_backend_gpu.py and bench/bench_modes.py. Imports sglang and torch.
"""
from __future__ import annotations

import contextlib
import functools
import random

import torch


class _TC:
    """The kit's `testcase` argument: skipTest raises (a scene that cannot be built is an error)."""

    def skipTest(self, msg):
        raise RuntimeError(f"SGLang's attention test kit cannot build this scene: {msg}")


@contextlib.contextmanager
def hook_installed():
    """`TritonAttnBackend.forward_extend` wrapped like SGLang's HookRegistry AROUND does
    (wrapper(*a) -> hook(orig, *a)); yields the original; restored afterwards."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from kdtree_backend.sglang import hook

    orig = TritonAttnBackend.forward_extend

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        return hook.forward_extend_hook(orig, *args, **kwargs)

    wrapper.__wrapped__ = orig
    TritonAttnBackend.forward_extend = wrapper
    try:
        yield orig
    finally:
        TritonAttnBackend.forward_extend = orig
        hook.set_candidate(None)
        hook.reset_for_tests()


def set_mode(mode, **settings):
    """Reset the hook's process state to `mode` (off / validate / on) with validate `settings`."""
    from kdtree_backend.sglang import hook
    from kdtree_backend.sglang import logs
    from kdtree_backend.sglang import shadow
    from kdtree_backend.config import Mode

    logs.reset_for_tests()
    shadow.reset_for_tests()
    hook.reset_for_tests(mode=Mode(mode), settings=shadow.Settings(**settings))


def tree_block(kind: str, D: int, seed: int) -> torch.Tensor:
    from kdtree_backend.testing.batches import ancestor_matrix, random_tree_parents

    if kind == "chain":
        return torch.tril(torch.ones(D, D, dtype=torch.bool))
    return ancestor_matrix(random_tree_parents(D, random.Random(seed)))


class Scene:
    """A TARGET_VERIFY batch of `bs` requests over a real backend, with its own slot layout.

    The ForwardBatch tensors (req_pool_indices, seq_lens, out_cache_loc) and q/k/v are STATIC:
    `load()` rewrites them in place (like SGLang's load_batch), so a captured graph sees new
    contents at the same addresses.
    """

    def __init__(self, *, bs, D, kind, heads=8, max_context_len=512, graph=False, seed=0, device="cuda", dtype=None):
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
        self.bs, self.D, self.kind, self.ctx, self.heads = bs, D, kind, max_context_len, heads
        self.dtype = dtype if dtype is not None else torch.bfloat16
        self.dev = torch.device(device)
        self.case = MLAAttentionCase(
            name="kdtree_backend_gpu", backend="triton", forward_mode=ForwardMode.TARGET_VERIFY,
            num_heads=self.heads, page_size=1, prefix_lens=(1,) * bs, extend_lens=(D,) * bs,
        )
        self.fx = build_mla_attention_fixture(
            _TC(), self.case, kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=256,
            max_context_len=max_context_len, dtype=self.dtype, device=str(self.dev),
            disable_cuda_graph=not graph, runner_batch_size=bs, loc_layout="contiguous",
        )
        self.backend = self.fx.backend
        self.runner = self.fx.runner
        self.layer = self.fx.actual_module.attn_mqa
        self.pool = self.runner.token_to_kv_pool
        self.batch = _make_forward_batch(self.case, self.runner, max_context_len=max_context_len, device=str(self.dev))
        self._prepare(self.batch, self.case, str(self.dev))
        self.batch.spec_info = self._make_spec(self.case, self.batch, topk=1, device=str(self.dev), spec_kind="eagle")
        T = bs * D
        self.q = torch.zeros(T, self.heads, 576, dtype=self.dtype, device=self.dev)
        self.k = torch.zeros(T, 1, 576, dtype=self.dtype, device=self.dev)
        self.v = torch.zeros(T, 1, 512, dtype=self.dtype, device=self.dev)
        self.rng = random.Random(seed)
        self.gen = torch.Generator(device=str(self.dev)).manual_seed(seed)
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
            kv = torch.randn(plens[r], 1, 576, generator=self.gen, device=self.dev).mul_(0.5).to(self.dtype)
            self.pool.kv_buffer[0][torch.tensor(slots[: plens[r]], dtype=torch.long, device=self.dev)] = kv
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
        self.blocks = [tree_block(self.kind, D, self.rng.randrange(1 << 30)) for _ in range(bs)]
        flat = []
        for r in range(bs):
            m = torch.ones(D, plens[r] + D, dtype=torch.bool)
            m[:, plens[r]:] = self.blocks[r]
            flat.append(m.reshape(-1))
        case = self.Case(name=self.case.name, backend="triton", forward_mode=self.case.forward_mode,
                         num_heads=self.heads, page_size=1, prefix_lens=tuple(plens), extend_lens=(D,) * bs)
        spec = self._make_spec(case, self.batch, topk=1, device=str(self.dev), spec_kind="eagle")
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
        from kdtree_backend.testing.reference import verify_attention_reference

        bs, D = self.bs, self.D
        r2t = self.runner.req_to_token_pool.req_to_token
        qo = torch.arange(0, (bs + 1) * D, D, dtype=torch.int32, device=self.dev)
        kv_indptr = torch.tensor([0] + list(cumsum(self.prefix_lens)), dtype=torch.int32, device=self.dev)
        kv_indices = torch.cat([r2t[self.rpi[r], : self.prefix_lens[r]].long() for r in range(bs)])
        mask = self.batch.spec_info.custom_mask
        mask_indptr = torch.tensor([0] + list(cumsum([D * (p + D) for p in self.prefix_lens])),
                                   dtype=torch.int64, device=self.dev)
        lay = self.layer
        scaled = lay.k_scale is not None and lay.v_scale is not None
        return verify_attention_reference(self.q, self.k, self.pool.get_key_buffer(0), qo, kv_indptr, kv_indices,
                                          mask, mask_indptr, lay.scaling, max_qo_len=D,
                                          k_scale=lay.k_scale_float if scaled else 1.0,
                                          v_scale=lay.v_scale_float if scaled else 1.0)

    def kdtree_now(self):
        """The kdtree kernel on the backend's current metadata (what the shim passes)."""
        from kdtree_backend.sglang.hook import get_candidate

        md = self.backend.forward_metadata
        out = torch.empty(self.q.shape[0], self.heads * 512, dtype=self.q.dtype, device=self.dev)
        return get_candidate()(self.q, self.k, self.pool.get_key_buffer(0), md.qo_indptr, md.kv_indptr,
                               md.kv_indices, md.custom_mask, md.mask_indptr, self.layer.scaling,
                               max_qo_len=md.max_extend_len, out=out)

    def real_rows(self):
        return self.real_bs * self.D


def cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s
