"""Structured (JSON) log events of the forward_extend hook (issue 4, item 5).

structlog renders each event to one JSON line and hands it to the stdlib logger
`kdtree_backend` through `structlog.wrap_logger`: no global `structlog.configure()`, so nothing
fights SGLang, which owns stdlib logging (`logging.basicConfig(force=True)`); the lines go out
through SGLang's handlers at SGLang's level. Events:

* `kdtree_startup`: once per process, at the hook's first call (mode, library, arch, kernel path,
  the library's code the GPU runs (`code`: "sm_120 code", or PTX the driver JIT-compiles), versions).
* `kdtree_fallback`: the first occurrence of each fallback reason in the process.
* `kdtree_validation_exceeded`: a validation outside tolerance, with layer, shapes and the worst
  element; rate-limited (`suppressed` counts the events dropped since the previous one).
* `kdtree_candidate_error`: the kdtree kernel raised (validate: recorded; on: re-raised);
  rate-limited.
* `kdtree_fallback_rate_high` (ERROR, `on` only): over the last window, more than the threshold of
  the target model's TARGET_VERIFY calls were served by Triton; at most one per window
  (hook.FallbackWatch).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, Optional

LOGGER_NAME = "kdtree_backend"

_lock = threading.Lock()
_log = None
_fallbacks_seen: set = set()
_startup_done = False


def _processors():
    import structlog

    return [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer(sort_keys=True),
    ]


def get_logger():
    """The structlog logger bound to stdlib `kdtree_backend` (created lazily)."""
    global _log
    if _log is None:
        with _lock:
            if _log is None:
                try:
                    import structlog

                    _log = structlog.wrap_logger(
                        logging.getLogger(LOGGER_NAME),
                        processors=_processors(),
                        wrapper_class=structlog.stdlib.BoundLogger,
                    )
                except Exception:  # pragma: no cover - structlog missing: plain stdlib lines
                    _log = _PlainLogger(logging.getLogger(LOGGER_NAME))
    return _log


class _PlainLogger:
    def __init__(self, logger):
        self._logger = logger

    def _emit(self, level, event, **kw):
        import json

        self._logger.log(level, json.dumps({"event": event, **kw}, default=str, sort_keys=True))

    def info(self, event, **kw):
        self._emit(logging.INFO, event, **kw)

    def warning(self, event, **kw):
        self._emit(logging.WARNING, event, **kw)

    def error(self, event, **kw):
        self._emit(logging.ERROR, event, **kw)


class RateLimiter:
    """Token bucket: `burst` events at once, then one per `interval_s`. Counts what it drops."""

    def __init__(self, interval_s: float = 10.0, burst: int = 5, clock=time.monotonic):
        self.interval_s = float(interval_s)
        self.burst = int(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        self.suppressed = 0
        self._lock = threading.Lock()

    def allow(self) -> Optional[int]:
        """None when the event must be dropped; else the number dropped since the last one."""
        with self._lock:
            now = self._clock()
            if self.interval_s > 0:
                self._tokens = min(self.burst, self._tokens + (now - self._last) / self.interval_s)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                n, self.suppressed = self.suppressed, 0
                return n
            self.suppressed += 1
            return None


exceeded_limiter = RateLimiter()
error_limiter = RateLimiter()


def startup(**fields: Any) -> bool:
    """Log `kdtree_startup` once per process. Returns True if it logged now."""
    global _startup_done
    with _lock:
        if _startup_done:
            return False
        _startup_done = True
    get_logger().info("kdtree_startup", **fields)
    return True


def fallback(reason: str, **fields: Any) -> bool:
    """Log `kdtree_fallback` at the first occurrence of `reason` in this process."""
    with _lock:
        if reason in _fallbacks_seen:
            return False
        _fallbacks_seen.add(reason)
    get_logger().info("kdtree_fallback", reason=reason, first_occurrence=True, **fields)
    return True


def validation_exceeded(**fields: Any) -> bool:
    n = exceeded_limiter.allow()
    if n is None:
        return False
    get_logger().warning("kdtree_validation_exceeded", suppressed=n, **fields)
    return True


def candidate_error(exc: BaseException, **fields: Any) -> bool:
    n = error_limiter.allow()
    if n is None:
        return False
    get_logger().error(
        "kdtree_candidate_error",
        error_type=type(exc).__name__,
        error=str(exc)[:500],
        suppressed=n,
        **fields,
    )
    return True


def fallback_rate_high(**fields: Any) -> None:
    get_logger().error("kdtree_fallback_rate_high", **fields)


def reset_for_tests() -> None:
    """Forget what was logged (first-occurrence and start-up state, rate limiters)."""
    global _startup_done, exceeded_limiter, error_limiter
    with _lock:
        _fallbacks_seen.clear()
        _startup_done = False
    exceeded_limiter = RateLimiter()
    error_limiter = RateLimiter()


def fields_of_worst(flat_index: int, cols: int, heads: int) -> Dict[str, int]:
    """Decompose a flat index into the `[T, H*512]` output: row, head, dim."""
    row, col = divmod(int(flat_index), max(1, int(cols)))
    d = max(1, int(cols) // max(1, int(heads)))
    head, dim = divmod(col, d)
    return {"row": row, "head": head, "dim": dim}
