"""Float64 reference of TARGET_VERIFY MLA attention, and a random batch generator.

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

Nothing here imports sglang at import time; ``VerifyBatch.call_sglang_triton`` imports the
Triton kernel lazily.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Optional, Sequence, Union

import torch

QK_HEAD_DIM = 576
V_HEAD_DIM = 512
# layer.scaling for DeepSeek-V3 / Kimi K2.x without YaRN mscale: qk_head_dim of the model (192),
# NOT the latent width 576.
MLA_SM_SCALE = 192 ** -0.5

MASK_KINDS = ("tree", "chain", "none", "random")

__all__ = [
    "QK_HEAD_DIM",
    "V_HEAD_DIM",
    "MLA_SM_SCALE",
    "MASK_KINDS",
    "VerifyBatch",
    "make_verify_batch",
    "verify_attention_reference",
    "attention_weights_reference",
    "relative_error",
    "random_tree_parents",
    "ancestor_matrix",
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


def attention_weights_reference(batch: "VerifyBatch", request: int) -> torch.Tensor:
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


# --------------------------------------------------------------------------------------------
# trees
# --------------------------------------------------------------------------------------------
def random_tree_parents(n: int, rng: random.Random) -> list:
    """Token 0 is the root (parent -1); every token c >= 1 gets a random parent < c, so parents
    precede children (SGLang's sorted order) and the ancestor matrix is lower-triangular."""
    return [-1] + [rng.randrange(c) for c in range(1, n)]


def ancestor_matrix(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool: A[i, c] iff c is i or an ancestor of i (one row of the FULL_MASK draft block)."""
    n = len(parents)
    a = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):  # generator side: n <= a few hundred, fine
        if p >= 0:
            a[i] = a[p]
        a[i, i] = True
    return a


# --------------------------------------------------------------------------------------------
# batches
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class VerifyBatch:
    """Every argument of ``verify_attention`` plus what the tests need around it."""

    q: torch.Tensor  # [T, H, 576] bf16
    k: torch.Tensor  # [T, 1, 576] (or [T, 576]) bf16: draft K; draft V = k[..., :512]
    v: torch.Tensor  # [T, 1, 512] bf16, contiguous copy of k[..., :512] (SGLang's v argument)
    kv_cache: torch.Tensor  # [N, 1, 576] (or [N, 576]) bf16 latent pool
    qo_indptr: torch.Tensor  # [B+1] int32/int64
    kv_indptr: torch.Tensor  # [B+1] int32/int64 (prefix only)
    kv_indices: torch.Tensor  # int64, over-allocated (trailing garbage)
    custom_mask: Optional[torch.Tensor]  # 1-D bool/uint8 FULL_MASK (trailing garbage) or None
    mask_indptr: torch.Tensor  # [B+1] int64 (computed even when custom_mask is None)
    sm_scale: float
    k_scale: float
    v_scale: float
    max_qo_len: int
    prefix_lens: list
    draft_lens: list
    padded: list  # per request: True for SGLang CUDA-graph padding requests
    parents: Optional[list]  # per request parent lists (trees/chains), None for "none"/"random"
    mask_kind: str
    seed: int

    # -- calling ---------------------------------------------------------------------------
    def args(self, *, mask_indptr_when_no_mask: bool = True) -> tuple:
        """Positional arguments of ``verify_attention`` and ``verify_attention_reference``.
        With no mask, SGLang's backend still passes its mask_indptr buffer; pass
        ``mask_indptr_when_no_mask=False`` to give None instead."""
        mi = self.mask_indptr
        if self.custom_mask is None and not mask_indptr_when_no_mask:
            mi = None
        return (self.q, self.k, self.kv_cache, self.qo_indptr, self.kv_indptr, self.kv_indices,
                self.custom_mask, mi, self.sm_scale)

    def kwargs(self) -> dict:
        """Keyword arguments shared by the op and the reference."""
        return {"max_qo_len": self.max_qo_len, "k_scale": self.k_scale, "v_scale": self.v_scale}

    def reference(self) -> torch.Tensor:
        return verify_attention_reference(*self.args(), **self.kwargs())

    def call_sglang_triton(self, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """SGLang 0.5.23's Triton ``extend_attention_fwd`` called exactly as
        ``TritonAttnBackend.forward_extend`` does (doc section 1.5 step 7). Returns ``[T, H*512]``."""
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

        T, H = self.q.shape[0], self.q.shape[1]
        o = out if out is not None else self.q.new_empty((T, H * V_HEAD_DIM))
        k_buf = self.kv_cache.view(self.kv_cache.shape[0], 1, QK_HEAD_DIM)  # get_key_buffer
        v_buf = k_buf[..., :V_HEAD_DIM]  # get_value_buffer: a strided view of the same rows
        extend_attention_fwd(
            self.q.view(-1, H, QK_HEAD_DIM),
            self.k.view(-1, 1, QK_HEAD_DIM).contiguous(),
            self.v.contiguous(),
            o.view(-1, H, V_HEAD_DIM),
            k_buf,
            v_buf,
            self.qo_indptr,
            self.kv_indptr,
            self.kv_indices,
            self.custom_mask,
            True,  # causal: attn_type DECODER
            self.mask_indptr,
            self.max_qo_len,
            self.k_scale,
            self.v_scale,
            self.sm_scale,
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

    # -- rows ------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.prefix_lens)

    @property
    def num_heads(self) -> int:
        return int(self.q.shape[1])

    @property
    def num_rows(self) -> int:
        return int(self.q.shape[0])

    def _row_mask(self, want_padded: Optional[bool]) -> torch.Tensor:
        m = torch.zeros(self.num_rows, dtype=torch.bool)
        start = 0
        for n, pad in zip(self.draft_lens, self.padded):
            if want_padded is None or pad == want_padded:
                m[start:start + n] = True
            start += n
        return m.to(self.q.device)

    def covered_rows(self) -> torch.Tensor:
        """Rows some qo_indptr range covers (the op must write them)."""
        return self._row_mask(None)

    def real_rows(self) -> torch.Tensor:
        """Covered rows of real (non-padding) requests: the rows whose values are compared."""
        return self._row_mask(False)

    def padded_rows(self) -> torch.Tensor:
        return self._row_mask(True)

    def to(self, device) -> "VerifyBatch":
        def mv(t):
            return None if t is None else t.to(device)

        return dataclasses.replace(
            self, q=mv(self.q), k=mv(self.k), v=mv(self.v), kv_cache=mv(self.kv_cache),
            qo_indptr=mv(self.qo_indptr), kv_indptr=mv(self.kv_indptr), kv_indices=mv(self.kv_indices),
            custom_mask=mv(self.custom_mask), mask_indptr=mv(self.mask_indptr),
        )

    def describe(self) -> str:
        md = "none" if self.custom_mask is None else str(self.custom_mask.dtype).replace("torch.", "")
        return (f"B={self.batch_size} (pad {sum(self.padded)}) H={self.num_heads} n={self.draft_lens} "
                f"P={self.prefix_lens} mask={self.mask_kind}/{md} qo={str(self.qo_indptr.dtype)[6:]} "
                f"ks={self.k_scale} vs={self.v_scale} seed={self.seed}")


def _per_request(value, count: int, name: str) -> list:
    if isinstance(value, int):
        return [value] * count
    vals = [int(x) for x in value]
    if len(vals) != count:
        raise ValueError(f"{name}: expected {count} values, got {len(vals)}")
    return vals


def make_verify_batch(
    prefix_lens: Union[int, Sequence[int]] = (0, 17, 100),
    num_heads: int = 8,
    draft_lens: Union[int, Sequence[int]] = 4,
    *,
    mask: str = "tree",
    mask_dtype: torch.dtype = torch.uint8,
    num_padded: int = 0,
    qo_indptr_dtype: torch.dtype = torch.int32,
    kv_indptr_dtype: torch.dtype = torch.int32,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sm_scale: float = MLA_SM_SCALE,
    prefix_mask_fill: str = "garbage",
    pool_factor: float = 1.5,
    min_pool_slots: int = 64,
    extra_indices: int = 37,
    index_garbage: str = "valid",
    extra_mask_bytes: int = 29,
    extra_rows: int = 0,
    k_3d: bool = True,
    cache_3d: bool = True,
    slot_layout: str = "scattered",
    q_std: float = 1.0,
    k_std: float = 1.0,
    seed: int = 0,
    device: Union[str, torch.device] = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> VerifyBatch:
    """A random TARGET_VERIFY batch shaped like SGLang's.

    ``prefix_lens`` (committed lengths, one per real request, or an int with ``draft_lens`` a
    sequence) and ``draft_lens`` (int: the same n for every request, SGLang's case; or one per
    request: ragged). ``mask``: ``"tree"`` (random ancestor trees), ``"chain"`` (causal written
    into the mask), ``"none"`` (``custom_mask=None``; causal), ``"random"`` (arbitrary bits, not
    lower-triangular: only for n <= 32, where Triton consults every bit). FULL_MASK layout with
    ``prefix_mask_fill`` (``garbage``/``zeros``/``ones``) in the never-read prefix columns; uint8
    masks store random non-zero bytes (1..255) for "allowed". ``num_padded`` requests are appended
    like SGLang's CUDA-graph padding: prefix 1 at slot 0, n draft rows, stale garbage mask.
    Prefix slots are unique slots of a pool larger than needed (slot 0 is reserved for padding, as
    in SGLang), laid out by ``slot_layout``: ``"scattered"`` (a random permutation: a fragmented
    page-size-1 pool), ``"runs"`` (the pool cut into consecutive runs of 1-300 slots, the runs
    shuffled: contiguous stretches at every alignment, some ending at the pool's last slot) or
    ``"contiguous"`` (slots 1, 2, ... in request order, so each request's prefix is one run:
    SGLang's --page-size 64 or a fresh pool); ``kv_indices`` has ``extra_indices`` trailing garbage entries
    (``index_garbage="valid"``: random in-pool slots, ``"wild"``: huge values that fault if read);
    the mask has ``extra_mask_bytes`` trailing garbage bytes; q/k get ``extra_rows`` trailing
    rows that no request covers. Random N(0, std) inputs (never zeros). Deterministic for a seed
    on a given device.
    """
    if mask not in MASK_KINDS:
        raise ValueError(f"mask must be one of {MASK_KINDS}, got {mask!r}")
    if mask_dtype not in (torch.bool, torch.uint8):
        raise ValueError(f"mask_dtype must be torch.bool or torch.uint8, got {mask_dtype}")
    rng = random.Random(seed)
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    cpu_gen = torch.Generator()
    cpu_gen.manual_seed(seed + 1)

    if isinstance(prefix_lens, int):
        if isinstance(draft_lens, int):
            raise ValueError("give prefix_lens or draft_lens as a sequence (batch size)")
        prefix_lens = [prefix_lens] * len(draft_lens)
    prefix_real = [int(p) for p in prefix_lens]
    n_real = len(prefix_real)
    drafts_real = _per_request(draft_lens, n_real, "draft_lens")
    if any(p < 0 for p in prefix_real) or any(n < 1 for n in drafts_real):
        raise ValueError("prefix lengths must be >= 0 and draft counts >= 1")
    pad_n = max(drafts_real) if drafts_real else 1
    prefix = prefix_real + [1] * num_padded
    drafts = drafts_real + [pad_n] * num_padded
    padded = [False] * n_real + [True] * num_padded
    B = len(prefix)
    H = num_heads
    T_cov = sum(drafts)
    T = T_cov + extra_rows

    # --- dense inputs (random, never zeros) ---
    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    q = randn(T, H, QK_HEAD_DIM, std=q_std)
    k3 = randn(T, 1, QK_HEAD_DIM, std=k_std)
    total_prefix = sum(prefix_real)
    N = max(min_pool_slots, 1 + int(math.ceil(total_prefix * pool_factor)) + 1)
    cache3 = randn(N, 1, QK_HEAD_DIM, std=k_std)
    if num_padded:
        # SGLang writes the padded requests' draft K into the dummy slot 0 before the kernel.
        cache3[0] = k3[T_cov - 1]

    # --- prefix slots: unique, never slot 0 for real requests ---
    if slot_layout == "scattered":
        perm = torch.randperm(N - 1, generator=gen, device=device)[:total_prefix] + 1
    elif slot_layout == "runs":  # the pool [1, N) cut into runs of 1-300 slots, the runs shuffled
        cuts, at = [], 1
        while at < N:
            step = min(N - at, rng.randint(1, 300))
            cuts.append(torch.arange(at, at + step, dtype=torch.long))
            at += step
        rng.shuffle(cuts)
        perm = torch.cat(cuts)[:total_prefix].to(device)
    elif slot_layout == "contiguous":  # each request's prefix in one run: slots 1, 2, ... in request order
        perm = torch.arange(1, total_prefix + 1, dtype=torch.long, device=device)
    else:
        raise ValueError(f"slot_layout must be 'scattered', 'runs' or 'contiguous', got {slot_layout!r}")
    pieces, off = [], 0
    for p, pad in zip(prefix, padded):
        if pad:
            pieces.append(torch.zeros(1, dtype=torch.long, device=device))
        else:
            pieces.append(perm[off:off + p])
            off += p
    if index_garbage == "valid":
        garbage = torch.randint(0, N, (extra_indices,), generator=gen, device=device)
    elif index_garbage == "wild":
        garbage = torch.full((extra_indices,), 1 << 40, dtype=torch.long, device=device)
    else:
        raise ValueError(f"index_garbage must be 'valid' or 'wild', got {index_garbage!r}")
    kv_indices = torch.cat(pieces + [garbage]).to(torch.long)

    def indptr(lens, dt):
        t = torch.zeros(len(lens) + 1, dtype=torch.long)
        t[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.long), 0)
        return t.to(dtype=dt, device=device)

    qo_indptr = indptr(drafts, qo_indptr_dtype)
    kv_indptr = indptr(prefix, kv_indptr_dtype)
    mask_indptr = indptr([n * (p + n) for n, p in zip(drafts, prefix)], torch.int64)

    # --- masks (built on the host: they are small next to the KV) ---
    parents = None
    custom_mask = None
    if mask in ("tree", "chain"):
        parents = []
    if mask != "none":
        blocks = []
        for b in range(B):
            n, p = drafts[b], prefix[b]
            if padded[b]:
                bits = torch.randint(0, 2, (n, p + n), generator=cpu_gen, dtype=torch.bool)  # stale garbage
                if parents is not None:
                    parents.append(None)
            else:
                if prefix_mask_fill == "garbage":
                    pre = torch.randint(0, 2, (n, p), generator=cpu_gen, dtype=torch.bool)
                elif prefix_mask_fill == "zeros":
                    pre = torch.zeros(n, p, dtype=torch.bool)
                elif prefix_mask_fill == "ones":
                    pre = torch.ones(n, p, dtype=torch.bool)
                else:
                    raise ValueError(f"prefix_mask_fill: {prefix_mask_fill!r}")
                if mask == "tree":
                    par = random_tree_parents(n, rng)
                    parents.append(par)
                    draft = ancestor_matrix(par)
                elif mask == "chain":
                    parents.append([-1] + list(range(n - 1)))
                    draft = torch.ones(n, n, dtype=torch.bool).tril()
                else:  # random, arbitrary (not triangular)
                    draft = torch.randint(0, 2, (n, n), generator=cpu_gen, dtype=torch.bool)
                bits = torch.cat([pre, draft], dim=1)
            blocks.append(bits.reshape(-1))
        blocks.append(torch.randint(0, 2, (extra_mask_bytes,), generator=cpu_gen, dtype=torch.bool))
        flat = torch.cat(blocks)
        if mask_dtype == torch.uint8:
            # "non-zero means allowed": store random bytes 1..255, not just 1.
            vals = torch.randint(1, 256, flat.shape, generator=cpu_gen, dtype=torch.uint8)
            flat = torch.where(flat, vals, torch.zeros_like(vals))
        custom_mask = flat.to(device)

    k = k3 if k_3d else k3.view(T, QK_HEAD_DIM)
    kv_cache = cache3 if cache_3d else cache3.view(N, QK_HEAD_DIM)
    v = k3[..., :V_HEAD_DIM].contiguous()
    return VerifyBatch(
        q=q, k=k, v=v, kv_cache=kv_cache, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
        kv_indices=kv_indices, custom_mask=custom_mask, mask_indptr=mask_indptr,
        sm_scale=float(sm_scale), k_scale=float(k_scale), v_scale=float(v_scale),
        max_qo_len=max(drafts), prefix_lens=prefix, draft_lens=drafts, padded=padded,
        parents=parents, mask_kind=mask, seed=seed,
    )
