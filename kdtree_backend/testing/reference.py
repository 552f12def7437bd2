"""Float64 reference of TARGET_VERIFY MLA attention (the batches it is checked on: batches.py).

Semantics: exactly what SGLang 0.5.23's Triton ``extend_attention_fwd`` computes when
``TritonAttnBackend.forward_extend`` calls it in ``ForwardMode.TARGET_VERIFY`` for absorbed MLA
(``../shared/docs/sglang-0.5.23-target-verify.md`` sections 1.5 and 2.3):

* request ``b`` owns the query rows ``qo_indptr[b]:qo_indptr[b+1]`` (``n`` rows) and the prefix
  slots ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` (``P`` tokens) of the latent cache
  (``[N, 1, 576]`` or ``[N, 576]``); K is all 576 dims of a row, V its first 512;
* the draft keys/values are ``k[qo rows]`` (576 dims / first 512);
* ``score = q . K * sm_scale`` (times ``k_scale`` for prefix keys); prefix ``P.V`` times
  ``v_scale``; the draft block uses no scales (SGLang passes bf16 ``k``/``v`` there);
* every row sees its whole prefix: the prefix columns of the mask are never read
  (``skip_prefix_custom_mask=True`` is the backend's default);
* draft column ``c`` is visible to row ``i`` iff
  ``custom_mask[mask_indptr[b] + i*(P+n) + P + c] != 0`` (FULL_MASK layout, any non-zero byte
  allows), or ``c <= i`` when ``custom_mask`` is None;
* a row that sees nothing outputs 0.

One documented difference from Triton, irrelevant for real inputs: with ``is_causal=True`` the
Triton kernel never consults mask bits above the diagonal *tile* (``c >= (i//BLOCK_M+1)*BLOCK_M``,
BLOCK_M = 32 on sm_90 and in the interpreter). SGLang's tree masks are lower-triangular (parents
precede children), so both agree on them; the reference honours every mask bit (the contract of
``docs/interfaces.md``). Only garbage masks (padded requests) can differ, and their outputs are
discarded by SGLang.

Nothing here imports sglang.
"""
from __future__ import annotations

from typing import Optional

import torch

QK_HEAD_DIM = 576
V_HEAD_DIM = 512
# layer.scaling for DeepSeek-V3 / Kimi K2.x without YaRN mscale: qk_head_dim of the model (192),
# NOT the latent width 576.
MLA_SM_SCALE = 192 ** -0.5

__all__ = [
    "QK_HEAD_DIM",
    "V_HEAD_DIM",
    "MLA_SM_SCALE",
    "verify_attention_reference",
    "attention_weights_reference",
    "relative_error",
]


# --------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------
def _as_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """[X, 1, 576] or [X, 576] -> [X, 576] view (no copy)."""
    if t.dim() == 3:
        if t.shape[1] != 1:
            raise ValueError(f"{name}: expected one latent head, got shape {tuple(t.shape)}")
        t = t[:, 0, :]
    if t.dim() != 2 or t.shape[-1] != QK_HEAD_DIM:
        raise ValueError(f"{name}: expected [X, 1, {QK_HEAD_DIM}] or [X, {QK_HEAD_DIM}], got {tuple(t.shape)}")
    return t


def _host_list(t: Optional[torch.Tensor]) -> Optional[list]:
    return None if t is None else [int(x) for x in t.detach().cpu().tolist()]


def _request_scores(qb, kp, kd, allowed, sm_scale, k_scale):
    """Scores [n, h, P+n] in float64 with -inf where a draft column is masked."""
    s_pre = torch.einsum("nhd,pd->nhp", qb, kp) * (sm_scale * k_scale)
    s_dr = torch.einsum("nhd,cd->nhc", qb, kd) * sm_scale
    s_dr = s_dr.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.cat([s_pre, s_dr], dim=-1)


def _draft_allowed(custom_mask, mask_start, n, P, device) -> torch.Tensor:
    """[n, n] bool: row i may see draft column c."""
    if custom_mask is None:
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    block = custom_mask[mask_start: mask_start + n * (P + n)]
    if block.numel() != n * (P + n):
        raise ValueError(
            f"custom_mask too short: request needs bytes [{mask_start}, {mask_start + n * (P + n)}) "
            f"but the buffer has {custom_mask.numel()}"
        )
    return block.view(n, P + n)[:, P:].to(device) != 0


def _iter_requests(qo_indptr, kv_indptr, mask_indptr, custom_mask):
    qo = _host_list(qo_indptr)
    kv = _host_list(kv_indptr)
    if len(qo) != len(kv):
        raise ValueError(f"qo_indptr has {len(qo)} entries but kv_indptr has {len(kv)}")
    mi = None
    if custom_mask is not None:
        if mask_indptr is None:
            raise ValueError("custom_mask given without mask_indptr")
        mi = _host_list(mask_indptr)
        if len(mi) < len(qo) - 1:
            raise ValueError("mask_indptr shorter than the batch")
    for b in range(len(qo) - 1):
        q0, q1 = qo[b], qo[b + 1]
        p0, p1 = kv[b], kv[b + 1]
        if q1 < q0 or p1 < p0:
            raise ValueError(f"request {b}: decreasing indptr ({q0}->{q1}, {p0}->{p1})")
        yield b, q0, q1, p0, p1, (mi[b] if mi is not None else 0)


def verify_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    kv_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: Optional[torch.Tensor],
    mask_indptr: Optional[torch.Tensor],
    sm_scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    max_qo_len: Optional[int] = None,
) -> torch.Tensor:
    """Float64 ``[T, H*512]`` on q's device; see the module docstring for the semantics.

    ``max_qo_len`` is optional and only checked (it must be at least every request's draft
    count), so that the op's keyword arguments can be replayed here verbatim. Rows of ``q`` that
    no ``qo_indptr`` range covers are 0 in the result.
    """
    if q.dim() != 3 or q.shape[-1] != QK_HEAD_DIM:
        raise ValueError(f"q: expected [T, H, {QK_HEAD_DIM}], got {tuple(q.shape)}")
    T, H, _ = q.shape
    dev = q.device
    kd_all = _as_rows(k, "k")
    cache = _as_rows(kv_cache, "kv_cache")
    out = torch.zeros(T, H, V_HEAD_DIM, dtype=torch.float64, device=dev)
    for b, q0, q1, p0, p1, m0 in _iter_requests(qo_indptr, kv_indptr, mask_indptr, custom_mask):
        n, P = q1 - q0, p1 - p0
        if n == 0:
            continue
        if q1 > T or q1 > kd_all.shape[0]:
            raise ValueError(f"request {b}: rows {q0}:{q1} beyond q/k ({T}, {kd_all.shape[0]})")
        if max_qo_len is not None and n > max_qo_len:
            raise ValueError(f"request {b} has {n} draft rows > max_qo_len={max_qo_len}")
        slots = kv_indices[p0:p1].to(device=cache.device, dtype=torch.long)
        if slots.numel() != P:
            raise ValueError(f"request {b}: kv_indices too short for kv_indptr range {p0}:{p1}")
        kp = cache[slots].to(device=dev, dtype=torch.float64)  # [P, 576]
        kd = kd_all[q0:q1].to(device=dev, dtype=torch.float64)  # [n, 576]
        allowed = _draft_allowed(custom_mask, m0, n, P, dev)
        vals = torch.cat([kp[:, :V_HEAD_DIM] * v_scale, kd[:, :V_HEAD_DIM]], dim=0)  # [P+n, 512]
        # Chunk heads so the [n, h, P+n] float64 score block stays under ~256 MB.
        h_chunk = max(1, min(H, (1 << 25) // max(1, n * (P + n))))
        for h0 in range(0, H, h_chunk):
            h1 = min(H, h0 + h_chunk)
            qb = q[q0:q1, h0:h1].to(torch.float64)
            s = _request_scores(qb, kp, kd, allowed, sm_scale, k_scale)
            m = s.amax(dim=-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all-masked rows
            e = torch.exp(s - m)  # exp(-inf) = 0
            den = e.sum(dim=-1, keepdim=True)
            o = torch.einsum("nhj,jd->nhd", e, vals)
            out[q0:q1, h0:h1] = torch.where(den > 0, o / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(o))
    return out.reshape(T, H * V_HEAD_DIM)


def attention_weights_reference(batch, request: int) -> torch.Tensor:
    """Softmax probabilities ``[n, H, P+n]`` (float64) of one request: lets tests check that the
    generated inputs give a spread-out attention, not a one-hot one."""
    for b, q0, q1, p0, p1, m0 in _iter_requests(batch.qo_indptr, batch.kv_indptr, batch.mask_indptr, batch.custom_mask):
        if b != request:
            continue
        n, P = q1 - q0, p1 - p0
        cache = _as_rows(batch.kv_cache, "kv_cache")
        kp = cache[batch.kv_indices[p0:p1].long()].double()
        kd = _as_rows(batch.k, "k")[q0:q1].double()
        allowed = _draft_allowed(batch.custom_mask, m0, n, P, batch.q.device)
        s = _request_scores(batch.q[q0:q1].double(), kp, kd, allowed, batch.sm_scale, batch.k_scale)
        return torch.softmax(s, dim=-1)
    raise IndexError(request)


def relative_error(out: torch.Tensor, ref: torch.Tensor, rows: Optional[torch.Tensor] = None) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 over the selected rows (a bool mask over dim 0).
    NaN/Inf anywhere in the selection gives ``inf``."""
    o = out.reshape(out.shape[0], -1).to(torch.float64)
    r = ref.reshape(ref.shape[0], -1).to(device=o.device, dtype=torch.float64)
    if rows is not None:
        rows = rows.to(o.device)
        o, r = o[rows], r[rows]
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    num = torch.linalg.vector_norm(o - r).item()
    den = torch.linalg.vector_norm(r).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den
