"""Which `TritonAttnBackend.forward_extend` calls the kdtree kernel may take (issue 4, item 1).

`check(backend, layer, forward_batch, q, k, v, kwargs)` is a pure function (it reads attributes,
never tensor values, never the device) that returns None when the call is eligible, or one
reason label from `REASONS` otherwise. The label is a bounded Prometheus label value
(`kdtree_attention_fallbacks_total{reason=...}`), so every return value must be in `REASONS`.

Every attribute below was checked against the sglang 0.5.23 source (paths relative to the
`sglang` package):

* `srt/layers/attention/triton_backend.py` `TritonAttnBackend.__init__` (l.159-428):
  `is_draft_runner`, `use_mla`, `dcp_size`, `enable_deterministic`, `use_verify_shared_kv`,
  `use_verify_splitkv`, `use_dense_fp8_chunked_prefill`, `token_to_kv_pool`,
  `kv_index_translator`, `forward_metadata`; `dllm_attention` is a class attribute of
  `AttentionBackend` (`base_attn_backend.py:193`), set only with dllm_fa4.
* `forward_extend` (l.1669-1915): the branch order the eligible path must fall through (dense
  FP8 MHA shortcut, `k is None` read-back, `mha_one_shot`, DCP, deterministic, sliding window,
  ROCm verify kernels) and the kernel call `_forward_extend_kernel` (l.1917-1920) that the hook
  intercepts.
* `srt/layers/radix_attention.py`: `qk_head_dim`, `v_head_dim`, `tp_q_head_num`,
  `tp_k_head_num`, `tp_v_head_num`, `sliding_window_size`, `logit_cap`, `xai_temperature_len`,
  `is_cross_attention`, `attn_type` (`AttentionType.DECODER` gives `causal=True`).
* `srt/mem_cache/memory_pool.py`: `MLATokenToKVPool` (l.4754) and its subclasses
  `MLATokenToKVPoolFP4`, `DSATokenToKVPool` (excluded by the exact-type test); `dtype` is the
  logical KV dtype (`store_dtype` is uint8 for FP8).
* `srt/mem_cache/kv_index_translator.py:147`: `is_translating`.
* `srt/model_executor/forward_batch_info.py`: `forward_mode.is_target_verify()`,
  `mha_one_shot`, `_attn_output`.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from kdtree_backend.kernel import abi as _abi

QK_HEAD_DIM = 576
V_HEAD_DIM = 512
# Largest draft count per request (`max_extend_len`) the kernel takes: the C plan's own limit
# (kdtree_api.h KDTREE_MAX_QO_LEN, mirrored in abi.MAX_QO_LEN). A server configured for more drafts is
# refused at start (server_check), so this label only fires for a batch SGLang builds beyond its own
# --speculative-num-draft-tokens.
MAX_DRAFT_TOKENS = _abi.MAX_QO_LEN

# KV-cache / activation dtypes the kernel takes. FP8 caches fall back for now. Tests on CPU widen
# this (the Triton interpreter mis-computes bf16 there, see tests/sglang/test_hook_modes.py).
SUPPORTED_DTYPES = frozenset({torch.bfloat16})
MASK_DTYPES = frozenset({torch.bool, torch.uint8})
# TEST-ONLY: let `k is None and v is None` (forward_extend's read-back path, l.1700-1712: draft
# K/V read from the cache at out_cache_loc; used by SGLang's test kit, never by the MLA model)
# take the kdtree kernel. The kernel then receives the read-back K exactly as Triton does.
ALLOW_KV_READBACK = False

# Every label `check` can return, in checking order. Bounded: no value is derived from data.
REASONS = (
    "not_target_verify",
    "draft_runner",
    "not_mla",
    "sinks",
    "score_mod",
    "aux_tensors",
    "no_kv",
    "head_dim",
    "kv_heads",
    "cross_attention",
    "attn_type",
    "sliding_window",
    "logit_cap",
    "xai_temperature",
    "dcp",
    "deterministic",
    "dllm",
    "verify_shared_kv",
    "dense_fp8",
    "one_shot",
    "pool_type",
    "translating_pool",
    "kv_dtype",
    "q_dtype",
    "q_shape",
    "no_metadata",
    "draft_len",
    "mask_dtype",
    "attn_output",
    "sglang_internals",
    # Not returned by check(): recorded by the hook when the original forward_extend did not
    # reach its kernel call although check() said eligible (an eligibility gap, a bug).
    "kernel_not_reached",
    # Not returned by check(): validate mode could not allocate its stats buffer because the
    # first call for a backend happened inside a CUDA-graph capture (no eager warm-up).
    "stats_unavailable",
)


_sglang_types: Optional[tuple] = None


def _sglang_type_refs() -> tuple:
    """(MLATokenToKVPool, AttentionType.DECODER), imported once: check() runs on every call."""
    global _sglang_types
    if _sglang_types is None:
        from sglang.srt.layers.radix_attention import AttentionType
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

        _sglang_types = (MLATokenToKVPool, AttentionType.DECODER)
    return _sglang_types


def _mla_pool_class():
    return _sglang_type_refs()[0]


def _decoder_attn_type():
    return _sglang_type_refs()[1]


def _dtype_ok(dtype) -> bool:
    return dtype in SUPPORTED_DTYPES


def check(backend, layer, forward_batch, q, k, v, kwargs: Optional[Mapping[str, Any]] = None) -> Optional[str]:
    """None when the kdtree kernel may replace this call's attention, else a label of REASONS."""
    kwargs = kwargs or {}
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or not mode.is_target_verify():
        return "not_target_verify"
    if getattr(backend, "is_draft_runner", False):
        return "draft_runner"  # DFLASH's draft model runs TARGET_VERIFY through this backend too
    if not getattr(backend, "use_mla", False):
        return "not_mla"
    if kwargs.get("sinks") is not None:
        return "sinks"
    if kwargs.get("score_mod") is not None:
        return "score_mod"
    if kwargs.get("aux_tensors") is not None:
        return "aux_tensors"
    readback = k is None and v is None
    if (k is None or v is None) and not (readback and ALLOW_KV_READBACK):
        return "no_kv"
    if getattr(layer, "qk_head_dim", None) != QK_HEAD_DIM or getattr(layer, "v_head_dim", None) != V_HEAD_DIM:
        return "head_dim"
    if getattr(layer, "tp_k_head_num", None) != 1 or getattr(layer, "tp_v_head_num", None) != 1:
        return "kv_heads"
    if getattr(layer, "is_cross_attention", False):
        return "cross_attention"
    if getattr(layer, "attn_type", None) != _decoder_attn_type():
        return "attn_type"  # ENCODER_ONLY / bidirectional: causal=False in the original
    sw = getattr(layer, "sliding_window_size", None)
    if sw is not None and sw > -1:
        return "sliding_window"
    if (getattr(layer, "logit_cap", 0) or 0) > 0:
        return "logit_cap"
    if (getattr(layer, "xai_temperature_len", -1) or -1) > 0:
        return "xai_temperature"
    if getattr(backend, "dcp_size", 1) != 1:
        return "dcp"
    if getattr(backend, "enable_deterministic", False):
        return "deterministic"
    if getattr(backend, "dllm_attention", None) is not None:
        return "dllm"
    if getattr(backend, "use_verify_shared_kv", False) or getattr(backend, "use_verify_splitkv", False):
        return "verify_shared_kv"
    if getattr(backend, "use_dense_fp8_chunked_prefill", False):
        return "dense_fp8"
    if getattr(forward_batch, "mha_one_shot", False):
        return "one_shot"
    pool = getattr(backend, "token_to_kv_pool", None)
    if pool is None or type(pool) is not _mla_pool_class():
        return "pool_type"  # FP4, DSA, page-interleave (sharded), SWA, unified pools
    if getattr(getattr(backend, "kv_index_translator", None), "is_translating", False):
        return "translating_pool"
    if not _dtype_ok(getattr(pool, "dtype", None)):
        return "kv_dtype"
    if not (_dtype_ok(q.dtype) and (readback or k.dtype == q.dtype)):
        return "q_dtype"
    tq = getattr(layer, "tp_q_head_num", None)
    if readback:
        q = q.view(q.shape[0], -1, QK_HEAD_DIM) if q.dim() == 2 and q.shape[1] % QK_HEAD_DIM == 0 else q
    elif k.shape[0] != q.shape[0]:
        return "q_shape"
    if q.dim() != 3 or q.shape[1] != tq or q.shape[2] != QK_HEAD_DIM or q.stride(2) != 1:
        return "q_shape"
    md = getattr(backend, "forward_metadata", None)
    if md is None or getattr(md, "qo_indptr", None) is None or getattr(md, "kv_indptr", None) is None:
        return "no_metadata"
    d = getattr(md, "max_extend_len", None)
    if not isinstance(d, int) or d < 1 or d > MAX_DRAFT_TOKENS:
        return "draft_len"
    mask = getattr(md, "custom_mask", None)
    if mask is not None and (mask.dtype not in MASK_DTYPES or getattr(md, "mask_indptr", None) is None):
        return "mask_dtype"
    out = getattr(forward_batch, "_attn_output", None)
    if out is not None and (
        out.dtype != q.dtype or tuple(out.shape) != (q.shape[0], tq * V_HEAD_DIM) or not out.is_contiguous()
    ):
        return "attn_output"
    if not callable(getattr(type(backend), "_forward_extend_kernel", None)):
        return "sglang_internals"  # the hook intercepts this method (see docs/validate.md)
    return None
