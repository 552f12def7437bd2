"""Validate (shadow) mode: compare the kdtree kernel with Triton on the device, publish on the host.

Design (docs/validate.md has the full argument):

* Per call, `StatsStore.record()` computes on the device, with tensor ops only (no `.item()`,
  no `.cpu()`, no host sync, so it is legal inside a CUDA-graph capture), one row of float64
  statistics: max |cand - ctrl|, ||cand - ctrl|| / ||ctrl||, the tolerance excess
  max(|cand - ctrl| - rtol*|ctrl|), non-finite counts of candidate and control, the flat index
  of the worst element and both values there, and the output shape. The row goes into a per
  layer ring `ring[layer, seq % R]` at a device-side sequence number `counters[layer]`, which
  the same captured kernels increment. Both tensors are allocated once per backend (eagerly,
  before any capture), so their addresses are stable across capture and replay.
* Under CUDA-graph replay the Python hook does not run; the captured kernels still write the
  ring. The host side is `StatsStore.poll()`, called OUTSIDE the graph: from the hook's eager
  calls and from a per-instance wrapper of `init_forward_metadata_out_graph` /
  `init_forward_metadata` (`hook.install_step_wrappers`), which SGLang calls before every
  replay / eager step. `poll()`
  (1) publishes the snapshots whose CUDA event has completed (`event.query()`, never a wait),
  then (2) at most every `POLL_INTERVAL_S` enqueues on the current stream a non-blocking copy of
  ring + counters into one of a few pinned host buffers and records an event. Stream order puts
  that copy after every replay enqueued before it, so a snapshot is never torn.
* Publishing walks the sequence numbers a snapshot holds that were not seen yet; one that was
  overwritten before the host saw it (more than R validations of one layer between two
  snapshots) is counted as `dropped`. Classification (within_tolerance / exceeded) uses the
  host-side atol on the device-computed excess, so it is exact per element:
  within tolerance iff every element satisfies |cand - ctrl| <= atol + rtol*|ctrl| and the
  candidate is finite.
"""
from __future__ import annotations

import collections
import math
import os
import threading
import time
from typing import Deque, Dict, List, Mapping, Optional

import torch

from kdtree_backend.sglang import logs
from kdtree_backend.sglang import metrics

# The settings live in config.py (no torch import) so the plugin and the launcher can check them
# before any model loading; these names are the ones this module has always exported.
from kdtree_backend.config import (  # noqa: E402
    DEFAULT_VALIDATE_ATOL as DEFAULT_ATOL,
    DEFAULT_VALIDATE_RTOL as DEFAULT_RTOL,
    ENV_VALIDATE_ATOL as ENV_ATOL,
    ENV_VALIDATE_RTOL as ENV_RTOL,
    ENV_VALIDATE_SAMPLE_RATE as ENV_SAMPLE_RATE,
    ValidateSettings as Settings,
    read_validate_settings as read_settings,
)

# Ring entries per layer, pinned snapshot buffers, minimum seconds between two snapshots.
RING = 64
SNAPSHOTS = 3
POLL_INTERVAL_S = 0.1

# Row layout (float64).
F_SEQ, F_MAX_ABS, F_REL, F_EXCESS, F_CAND_NF, F_CTRL_NF, F_ARGMAX, F_CAND_AT, F_CTRL_AT, F_ROWS, F_COLS, F_HEADS = range(12)
NFIELDS = 12


class Sampler:
    """Deterministic Bernoulli-free sampler: exactly round(n*rate) of n calls are chosen.

    Under CUDA graphs the choice is made at capture and frozen into each captured graph (which
    layers of that batch size are compared at every replay); docs/validate.md.
    """

    def __init__(self, rate: float):
        self.rate = float(rate)
        self._acc = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> bool:
        if self.rate >= 1.0:
            return True
        with self._lock:
            self._acc += self.rate
            if self._acc >= 1.0 - 1e-12:
                self._acc -= 1.0
                return True
            return False


def is_capturing() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:
        return False


@torch.no_grad()
def compare_row(cand: torch.Tensor, ctrl: torch.Tensor, rtol: float, heads: int) -> torch.Tensor:
    """The float64 statistics row (F_SEQ left 0) of `cand` vs `ctrl` (both `[T, H*512]`).

    Pure device ops: capturable, no host sync. Three float32 temporaries of the output's size.
    """
    dev = cand.device
    f64 = torch.float64

    def const(x):
        return torch.full((), float(x), device=dev, dtype=f64)

    rows, cols = cand.shape[0], (cand.shape[1] if cand.dim() > 1 else 1)
    if cand.numel() == 0:
        return torch.stack([const(0)] * 9 + [const(rows), const(cols), const(heads)])
    cand_nf = (~torch.isfinite(cand)).sum()
    ctrl_nf = (~torch.isfinite(ctrl)).sum()
    r = ctrl.float().reshape(-1)
    d = cand.float().reshape(-1).sub_(r).abs_()  # |cand - ctrl|, in float32
    nonfinite = ~torch.isfinite(d)
    d.masked_fill_(nonfinite, 0.0)
    err2 = torch.dot(d, d)  # ||cand - ctrl||^2 over the finite differences
    ref2 = torch.dot(r, r)
    rel = err2.to(f64).sqrt() / ref2.to(f64).sqrt().clamp_min(1e-300)
    d.masked_fill_(nonfinite, float("inf"))  # a non-finite difference is the worst one
    max_abs, argmax = torch.max(d, dim=0)
    excess = r.abs().mul_(-float(rtol)).add_(d).amax()  # max(|cand - ctrl| - rtol*|ctrl|)
    idx = argmax.reshape(1)
    cand_at = torch.index_select(cand.reshape(-1), 0, idx).reshape(())
    ctrl_at = torch.index_select(ctrl.reshape(-1), 0, idx).reshape(())
    return torch.stack(
        [
            const(0),
            max_abs.to(f64),
            rel.to(f64),
            excess.to(f64),
            cand_nf.to(f64),
            ctrl_nf.to(f64),
            argmax.to(f64),
            cand_at.to(f64),
            ctrl_at.to(f64),
            const(rows),
            const(cols),
            const(heads),
        ]
    )


class _Snapshot:
    def __init__(self, ring: torch.Tensor, counters: torch.Tensor):
        pin = ring.device.type == "cuda"
        self.ring = torch.empty(ring.shape, dtype=ring.dtype, pin_memory=pin)
        self.counters = torch.empty(counters.shape, dtype=counters.dtype, pin_memory=pin)
        self.event = torch.cuda.Event() if pin else None
        self.busy = False


class StatsStore:
    """Device rings of one backend's layers (`layer_num` layers from `start_layer`)."""

    def __init__(self, device, start_layer: int, layer_num: int, settings: Settings, ring: int = RING):
        self.device = torch.device(device)
        self.start_layer = int(start_layer)
        self.layer_num = int(layer_num)
        self.settings = settings
        self.R = int(ring)
        self.ring = torch.zeros((self.layer_num, self.R, NFIELDS), dtype=torch.float64, device=self.device)
        self.counters = torch.zeros((self.layer_num,), dtype=torch.int64, device=self.device)
        self._seen = [0] * self.layer_num
        self._snapshots = [_Snapshot(self.ring, self.counters) for _ in range(SNAPSHOTS)]
        self._pending: Deque[_Snapshot] = collections.deque()
        self._last_enqueue = -1e30
        self._lock = threading.RLock()
        # Host-side publication results, for tests and the bench.
        self.published: List[dict] = []
        self.keep_published = 0  # keep the last N published samples (0: none)
        self.totals = collections.Counter()

    def slot(self, layer_id: int) -> Optional[int]:
        i = int(layer_id) - self.start_layer
        return i if 0 <= i < self.layer_num else None

    @torch.no_grad()
    def record(self, layer_id: int, cand: torch.Tensor, ctrl: torch.Tensor, heads: int) -> bool:
        """Enqueue the device comparison of one call into its layer's ring. No host sync."""
        i = self.slot(layer_id)
        if i is None:
            return False
        row = compare_row(cand, ctrl, self.settings.rtol, heads)
        cnt = self.counters[i : i + 1]
        cnt.add_(1)
        row = torch.cat([cnt.to(torch.float64), row[1:]])
        pos = torch.remainder(cnt - 1, self.R)
        self.ring[i].index_copy_(0, pos, row.reshape(1, NFIELDS))
        return True

    # --- host side -------------------------------------------------------------------------
    def poll(self, force: bool = False) -> int:
        """Publish completed snapshots and maybe enqueue a new one. Never waits on the device.

        Must not be called during a CUDA-graph capture (callers check). Returns the number of
        samples published.
        """
        with self._lock:
            n = self._drain(wait=False)
            now = time.monotonic()
            if force or now - self._last_enqueue >= POLL_INTERVAL_S:
                self._enqueue()
                self._last_enqueue = now
                if self.device.type != "cuda":
                    n += self._drain(wait=False)
            return n

    def flush(self) -> int:
        """Snapshot now and WAIT for it (tests, bench, shutdown): publishes everything recorded."""
        with self._lock:
            n = self._drain(wait=True)
            self._enqueue()
            n += self._drain(wait=True)
            return n

    def _enqueue(self) -> None:
        snap = next((s for s in self._snapshots if not s.busy), None)
        if snap is None:
            return  # all snapshots in flight: the next poll retries
        snap.ring.copy_(self.ring, non_blocking=snap.event is not None)
        snap.counters.copy_(self.counters, non_blocking=snap.event is not None)
        if snap.event is not None:
            snap.event.record()
        snap.busy = True
        self._pending.append(snap)

    def _drain(self, wait: bool) -> int:
        n = 0
        while self._pending:
            snap = self._pending[0]
            if snap.event is not None:
                if wait:
                    snap.event.synchronize()
                elif not snap.event.query():
                    break
            self._pending.popleft()
            try:
                n += self._publish(snap)
            finally:
                snap.busy = False
        return n

    def _publish(self, snap: _Snapshot) -> int:
        counters = snap.counters.tolist()  # host memory: no device sync
        ring = snap.ring
        published = 0
        for i, c in enumerate(counters):
            last = self._seen[i]
            if c <= last:
                continue
            first = max(last + 1, c - self.R + 1)
            dropped = first - (last + 1)
            self._seen[i] = c
            for seq in range(first, c + 1):
                row = ring[i, (seq - 1) % self.R].tolist()
                if int(row[F_SEQ]) != seq:
                    dropped += 1  # overwritten after the counter was read (cannot happen in-stream)
                    continue
                self._publish_row(self.start_layer + i, row)
                published += 1
            if dropped:
                metrics.count_validation("dropped", dropped)
                self.totals["dropped"] += dropped
        return published

    def _publish_row(self, layer_id: int, row: List[float]) -> None:
        s = self.settings
        max_abs, rel, excess = row[F_MAX_ABS], row[F_REL], row[F_EXCESS]
        cand_nf, ctrl_nf = int(row[F_CAND_NF]), int(row[F_CTRL_NF])
        finite = cand_nf == 0 and math.isfinite(max_abs)
        within = finite and excess <= s.atol
        outcome = "within_tolerance" if within else "exceeded"
        metrics.count_validation(outcome)
        self.totals[outcome] += 1
        if finite:
            metrics.observe_diff(max_abs, rel if math.isfinite(rel) else float("inf"))
        if cand_nf:
            metrics.count_nonfinite()
        sample = {
            "layer_id": layer_id,
            "seq": int(row[F_SEQ]),
            "outcome": outcome,
            "max_abs_diff": max_abs,
            "rel_err": rel,
            "tol_excess": excess,
            "cand_nonfinite": cand_nf,
            "ctrl_nonfinite": ctrl_nf,
            "rows": int(row[F_ROWS]),
            "cols": int(row[F_COLS]),
            "heads": int(row[F_HEADS]),
            "worst_index": int(row[F_ARGMAX]),
            "worst_kdtree": row[F_CAND_AT],
            "worst_triton": row[F_CTRL_AT],
        }
        if self.keep_published:
            self.published.append(sample)
            del self.published[: -self.keep_published]
        if not within:
            worst = logs.fields_of_worst(sample["worst_index"], sample["cols"], sample["heads"])
            logs.validation_exceeded(
                layer_id=layer_id,
                shape=[sample["rows"], sample["cols"]],
                heads=sample["heads"],
                max_abs_diff=max_abs,
                rel_err=rel,
                tol_excess=excess,
                atol=s.atol,
                rtol=s.rtol,
                cand_nonfinite=cand_nf,
                ctrl_nonfinite=ctrl_nf,
                worst_row=worst["row"],
                worst_head=worst["head"],
                worst_dim=worst["dim"],
                worst_kdtree=sample["worst_kdtree"],
                worst_triton=sample["worst_triton"],
            )


# --- per-backend registry ----------------------------------------------------------------------
_stores_lock = threading.Lock()
_stores: Dict[int, StatsStore] = {}


def store_for(backend, settings: Settings, device) -> Optional[StatsStore]:
    """The backend's store, allocated on first use. Returns None if that first use is inside a
    CUDA-graph capture (allocating and zeroing there would be captured into the graph)."""
    key = id(backend)
    st = _stores.get(key)
    if st is not None:
        return st
    if is_capturing():
        return None
    pool = backend.token_to_kv_pool
    start = int(getattr(pool, "start_layer", 0) or 0)
    num = int(getattr(pool, "layer_num", 0) or 0) or 1
    with _stores_lock:
        st = _stores.get(key)
        if st is None:
            st = StatsStore(device, start, num, settings)
            _stores[key] = st
            # keep the backend alive-key mapping valid: drop the store if the backend dies
            try:
                import weakref

                weakref.finalize(backend, _stores.pop, key, None)
            except TypeError:
                pass
    return st


def stores() -> List[StatsStore]:
    return list(_stores.values())


def poll_all(force: bool = False) -> int:
    """Host side of every store (outside any capture)."""
    if is_capturing():
        return 0
    return sum(st.poll(force=force) for st in stores())


def flush_all() -> int:
    return sum(st.flush() for st in stores())


def reset_for_tests() -> None:
    with _stores_lock:
        _stores.clear()


def record_candidate_error(exc: BaseException, **fields) -> None:
    """validate: the candidate raised in Python. Counted now (host), logged rate-limited."""
    metrics.count_validation("candidate_error")
    logs.candidate_error(exc, mode="validate", **fields)
