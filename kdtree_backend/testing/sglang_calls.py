"""SGLang's own Triton kernel called on a ``VerifyBatch``, exactly as ``TritonAttnBackend.forward_extend``
calls it: the control the tests and benchmarks compare the kdtree kernel with. Imports sglang lazily.
"""
from __future__ import annotations

from typing import Optional

import torch

from kdtree_backend.testing.reference import QK_HEAD_DIM, V_HEAD_DIM

__all__ = ["call_sglang_triton"]


def call_sglang_triton(batch, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """SGLang 0.5.23's Triton ``extend_attention_fwd`` called exactly as
    ``TritonAttnBackend.forward_extend`` does (doc section 1.5 step 7). Returns ``[T, H*512]``."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    T, H = batch.q.shape[0], batch.q.shape[1]
    o = out if out is not None else batch.q.new_empty((T, H * V_HEAD_DIM))
    k_buf = batch.kv_cache.view(batch.kv_cache.shape[0], 1, QK_HEAD_DIM)  # get_key_buffer
    v_buf = k_buf[..., :V_HEAD_DIM]  # get_value_buffer: a strided view of the same rows
    extend_attention_fwd(
        batch.q.view(-1, H, QK_HEAD_DIM),
        batch.k.view(-1, 1, QK_HEAD_DIM).contiguous(),
        batch.v.contiguous(),
        o.view(-1, H, V_HEAD_DIM),
        k_buf,
        v_buf,
        batch.qo_indptr,
        batch.kv_indptr,
        batch.kv_indices,
        batch.custom_mask,
        True,  # causal: attn_type DECODER
        batch.mask_indptr,
        batch.max_qo_len,
        batch.k_scale,
        batch.v_scale,
        batch.sm_scale,
        logit_cap=0.0,
        sliding_window_size=-1,
        sinks=None,
        window_kv_offsets=None,
        xai_temperature_len=-1,
        page_size=1,
        score_mod=None,
        aux_tensors=None,
        extend_seq_lens_cpu=None,
    )
    return o
