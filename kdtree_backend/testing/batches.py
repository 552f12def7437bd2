"""Random TARGET_VERIFY batches for the tests and benchmarks: random trees, ragged prefixes, padded
requests like SGLang's CUDA-graph padding, scattered/contiguous cache slots (``make_verify_batch``).

Checked against the float64 reference of reference.py; called through SGLang's Triton kernel by
``kdtree_backend.testing.sglang_calls``. Nothing here imports sglang.
"""
from __future__ import annotations

import dataclasses
import math
import random
from typing import Optional, Sequence, Union

import torch

from kdtree_backend.testing.reference import MLA_SM_SCALE, QK_HEAD_DIM, V_HEAD_DIM, verify_attention_reference

MASK_KINDS = ("tree", "chain", "none", "random")

__all__ = [
    "MASK_KINDS",
    "VerifyBatch",
    "make_verify_batch",
    "random_tree_parents",
    "ancestor_matrix",
]


# --------------------------------------------------------------------------------------------
# trees
# --------------------------------------------------------------------------------------------
def random_tree_parents(n: int, rng: random.Random) -> list:
    """Token 0 is the root (parent -1); every token c >= 1 gets a random parent < c, so parents
    precede children (SGLang's sorted order) and the ancestor matrix is lower-triangular."""
    return [-1] + [rng.randrange(c) for c in range(1, n)]


def slot_runs(first: int, end: int, rng: random.Random) -> torch.Tensor:
    """The slots [first, end) cut into runs of 1-300 consecutive slots, the runs shuffled: a
    page-size-1 pool after some traffic, where each prefill's prefix is a run or a few (SGLang's
    allocator hands out the head of its sorted free list; journal m22). int64, on the CPU."""
    cuts, at = [], first
    while at < end:
        step = min(end - at, rng.randint(1, 300))
        cuts.append(torch.arange(at, at + step, dtype=torch.long))
        at += step
    rng.shuffle(cuts)
    return torch.cat(cuts)


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
        perm = slot_runs(1, N, rng)[:total_prefix].to(device)
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
