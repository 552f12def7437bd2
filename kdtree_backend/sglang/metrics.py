"""Prometheus metrics of the forward_extend hook (issue 4, item 4). See docs/metrics.md.

Created lazily, on first use, in the process that runs attention (SGLang's scheduler). Never at
import: importing `prometheus_client` in SGLang's main process before SGLang sets
`PROMETHEUS_MULTIPROC_DIR` (plugins load before argument parsing) would drop SGLang's own
main-process metrics (docs/operations-notes.md). With `--enable-metrics` SGLang runs
prometheus-client in multiprocess mode; metrics created here are then written to the shared
directory and appear on SGLang's own `/metrics` with no extra wiring.

Every label value is bounded: `mode` in {off, validate, on}; `path` in PATHS; `outcome` in
OUTCOMES; `reason` in `eligibility.REASONS`; build-info labels are process constants.
If prometheus_client is not installed, every metric is a no-op (the hook must never fail
because of metrics).
"""
from __future__ import annotations

import threading
from typing import Optional

PREFIX = "kdtree_attention_"

# calls_total{path}: kdtree = our kernel's result returned (on); shadow = validate, compared;
# shadow_unsampled = validate, eligible but not sampled (control only); fallback = not
# eligible, original called untouched; error = our kernel raised in `on` (re-raised).
PATHS = ("kdtree", "shadow", "shadow_unsampled", "fallback", "error")
# verify_calls_total{served_by, reason}: the TARGET_VERIFY calls of the target model only (not the
# draft model's passes, not prefill/decode): kdtree = our kernel's output served (on); shadow = our
# kernel ran beside Triton, Triton served (validate, sampled or not); triton = Triton ran alone (reason:
# the eligibility label); error = our kernel raised (on; the exception propagates). The kernel's share
# is (kdtree + shadow) / all: docs/operations.md has the PromQL and the alert.
SERVED_BY = ("kdtree", "shadow", "triton", "error")
# validations_total{outcome}
OUTCOMES = ("within_tolerance", "exceeded", "candidate_error", "dropped")

MAX_ABS_DIFF_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0, 3.0, 10.0, float("inf"))
REL_ERR_BUCKETS = (1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 1.0, float("inf"))


class _Noop:
    def labels(self, *a, **k):
        return self

    def inc(self, *a, **k):
        pass

    def observe(self, *a, **k):
        pass

    def set(self, *a, **k):
        pass


class Metrics:
    """The hook's metrics. Build with `get()`; tests may pass their own registry to `init()`."""

    def child(self, metric, *labels):
        """`metric.labels(*labels)`, cached: labels() takes a lock and hashes every call, and the hook
        counts two or three series per forward_extend call on the serving path."""
        key = (id(metric), labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def __init__(self, registry=None):
        self._children = {}
        try:
            import prometheus_client as pc
        except Exception:  # pragma: no cover - prometheus_client ships with sglang
            noop = _Noop()
            self.available = False
            self.max_abs_diff = self.rel_err = self.validations = self.nonfinite = noop
            self.fallbacks = self.calls = self.build_info = self.verify_calls = noop
            return
        self.available = True
        kw = {} if registry is None else {"registry": registry}
        self.max_abs_diff = pc.Histogram(
            PREFIX + "validation_max_abs_diff",
            "validate mode: per-call max |kdtree - triton| over the output (finite calls only)",
            buckets=MAX_ABS_DIFF_BUCKETS,
            **kw,
        )
        self.rel_err = pc.Histogram(
            PREFIX + "validation_relative_error",
            "validate mode: per-call ||kdtree - triton||_2 / ||triton||_2 (finite calls only)",
            buckets=REL_ERR_BUCKETS,
            **kw,
        )
        self.validations = pc.Counter(
            PREFIX + "validations_total",
            "validate mode: compared calls by outcome (within_tolerance, exceeded, candidate_error, dropped)",
            ["outcome"],
            **kw,
        )
        self.nonfinite = pc.Counter(
            PREFIX + "validation_nonfinite_total",
            "validate mode: compared calls whose kdtree output held a NaN or Inf",
            **kw,
        )
        self.fallbacks = pc.Counter(
            PREFIX + "fallbacks_total",
            "forward_extend calls passed to the original Triton path, by bounded reason",
            ["reason"],
            **kw,
        )
        self.calls = pc.Counter(
            PREFIX + "calls_total",
            "forward_extend calls through the hook (eager calls, plus the calls a captured CUDA graph "
            "holds, added once per replay), by mode and path",
            ["mode", "path"],
            **kw,
        )
        self.verify_calls = pc.Counter(
            PREFIX + "verify_calls_total",
            "TARGET_VERIFY calls of the target model, by who computed the served output (kdtree, shadow = "
            "validate, triton = fallback with its reason, error) (graph replays included)",
            ["served_by", "reason"],
            **kw,
        )
        self.build_info = pc.Gauge(
            PREFIX + "build_info",
            "1, labelled with the kdtree-backend version, the mode and the GPU arch of this process",
            ["version", "mode", "arch"],
            multiprocess_mode="livemax",
            **kw,
        )


_lock = threading.Lock()
_metrics: Optional[Metrics] = None


def get() -> Metrics:
    """The process's metrics, created on first call (in the scheduler, never at import)."""
    global _metrics
    m = _metrics
    if m is None:
        with _lock:
            if _metrics is None:
                _metrics = Metrics()
            m = _metrics
    return m


def init(registry=None) -> Metrics:
    """(Re)create the metrics in `registry` (tests). Replaces the process's metrics object."""
    global _metrics
    with _lock:
        _metrics = Metrics(registry)
        return _metrics


def set_build_info(version: str, mode: str, arch: str) -> None:
    get().build_info.labels(version=version, mode=mode, arch=arch).set(1)


def count_call(mode: str, path: str, n: int = 1) -> None:
    m = get()
    m.child(m.calls, mode, path).inc(n)


def count_verify(served_by: str, reason: str = "", n: int = 1) -> None:
    m = get()
    m.child(m.verify_calls, served_by, reason).inc(n)


def count_fallback(reason: str, n: int = 1) -> None:
    m = get()
    m.child(m.fallbacks, reason).inc(n)


def count_validation(outcome: str, n: int = 1) -> None:
    if n:
        get().validations.labels(outcome=outcome).inc(n)


def observe_diff(max_abs_diff: float, rel_err: float) -> None:
    m = get()
    m.max_abs_diff.observe(max_abs_diff)
    m.rel_err.observe(rel_err)


def count_nonfinite() -> None:
    get().nonfinite.inc()
