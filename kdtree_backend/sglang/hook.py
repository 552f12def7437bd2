"""The AROUND hook on `TritonAttnBackend.forward_extend` (issue 4; docs/validate.md).

`plugin.py` registers `forward_extend_hook` through SGLang's HookRegistry when KDTREE_VERIFY is
validate or on. Per call:

1. `eligibility.check(...)`: anything the kernel does not support goes to the original method
   untouched (counted by reason, first occurrence logged).
2. Eligible calls run the ORIGINAL `forward_extend` with one thing swapped: the backend's
   kernel call `self._forward_extend_kernel(layer, q, k, v, o, K_buf, V_buf, qo_indptr,
   kv_indptr, kv_indices, custom_mask, causal, mask_indptr, max_extend_len, k_descale,
   v_descale, sm_scale, ...)` (triton_backend.py:1888-1920) is routed, for this one call, to
   `_KernelShim`. Every side effect before it (output allocation honouring
   `forward_batch._attn_output`, the KV save with `k.clone().div_(layer.k_scale)` and
   `KVWriteLoc.for_batch`, `get_key_buffer`/`get_value_buffer`, the descale choice) is SGLang's
   own code, so it is identical by construction; the shim receives exactly the arguments the
   Triton kernel would have received.
   * on: the shim calls the kdtree kernel into `o`; a kernel exception propagates (fail loudly).
   * validate: the shim calls the original kernel (the control, written into `o` and
     returned), then, if the call is sampled, the kdtree kernel into a scratch copy of `o`, and
     records the comparison on the device (`shadow.py`); a kernel exception is recorded and
     swallowed.

The candidate is injectable (`set_candidate`) so CPU tests can use the float64 reference; the
default is `kdtree_backend.kernel.ops.verify_attention`, imported lazily.
"""
from __future__ import annotations

import collections
import os
import threading
from typing import Callable, Optional

import torch

from kdtree_backend.sglang import eligibility
from kdtree_backend.sglang import logs
from kdtree_backend.sglang import metrics
from kdtree_backend.sglang import shadow

V_HEAD_DIM = eligibility.V_HEAD_DIM


class KdtreeHookError(RuntimeError):
    """The hook could not honour `KDTREE_VERIFY=on` (an eligibility gap; a bug to report)."""


# --- candidate (injectable) -------------------------------------------------------------------
_candidate: Optional[Callable] = None


def _default_candidate(*args, **kwargs):
    from kdtree_backend.kernel.ops import verify_attention

    return verify_attention(*args, **kwargs)


def set_candidate(fn: Optional[Callable]) -> None:
    """Replace the kernel under test (signature of `ops.verify_attention`); None restores it."""
    global _candidate
    _candidate = fn


def get_candidate() -> Callable:
    return _candidate if _candidate is not None else _default_candidate


# --- process state ----------------------------------------------------------------------------
class _State:
    def __init__(self, mode, settings: shadow.Settings):
        self.mode = mode
        self.mode_name = str(getattr(mode, "value", mode))
        self.settings = settings
        self.sampler = shadow.Sampler(settings.sample_rate)
        fallback_watch.enabled = self.mode_name == "on"


_state: Optional[_State] = None
_state_lock = threading.Lock()


def _arch() -> str:
    try:
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
    except Exception:
        pass
    return "cpu"


def _kernel_path() -> str:
    """The kernel path this process's GPU runs (KDTREE_KERNEL resolved), for the start-up event."""
    try:
        if torch.cuda.is_available():
            from kdtree_backend.kernel import ops

            return ops.selected_kernel()
    except Exception as e:  # the first kernel call raises the same error, loudly
        return f"unavailable: {e}"
    return "none (no GPU)"


def _device_code() -> str:
    """What this process's GPU runs from the library: "sm_120 code", or the PTX the driver JIT-compiles
    (loader.code_for), for the start-up event."""
    try:
        if torch.cuda.is_available():
            from kdtree_backend.kernel import loader

            code = loader.get_library().code_for(tuple(torch.cuda.get_device_capability()))
            return code.describe() if code is not None else "none"
    except Exception as e:  # the first kernel call raises the same error, loudly
        return f"unavailable: {e}"
    return "none (no GPU)"


def _library_text() -> str:
    try:
        from kdtree_backend.kernel import loader

        return str(loader.library_path())
    except Exception as exc:
        return f"unavailable ({type(exc).__name__})"


def _startup(state: _State) -> None:
    import kdtree_backend

    version = getattr(kdtree_backend, "__version__", "unknown")
    arch = _arch()
    try:
        import importlib.metadata

        sglang_version = importlib.metadata.version("sglang")
    except Exception:
        sglang_version = "unknown"
    metrics.set_build_info(version=version, mode=state.mode_name, arch=arch)
    logs.startup(
        mode=state.mode_name,
        version=version,
        library=_library_text(),
        arch=arch,
        kernel=_kernel_path(),
        code=_device_code(),
        sglang_version=sglang_version,
        pid=os.getpid(),
        sample_rate=state.settings.sample_rate,
        atol=state.settings.atol,
        rtol=state.settings.rtol,
    )


def get_state() -> _State:
    """The process's mode and validate settings, read once (first hook call, in the scheduler)."""
    global _state
    st = _state
    if st is None:
        with _state_lock:
            if _state is None:
                from kdtree_backend.config import read_mode

                _state = _State(read_mode(), shadow.read_settings())
                _startup(_state)
            st = _state
    return st


def reset_for_tests(mode=None, settings: Optional[shadow.Settings] = None) -> None:
    """Forget the process state; with `mode`, install it directly (no env read)."""
    global _state
    with _state_lock:
        _state = None
        if mode is not None:
            _state = _State(mode, settings or shadow.Settings())
            _startup(_state)


# --- the kernel shim ---------------------------------------------------------------------------
class _KernelShim:
    """Stands in for `backend._forward_extend_kernel` during one eligible forward_extend call.

    Positional order is `extend_attention_fwd`'s (sglang 0.5.23,
    kernels/ops/attention/extend_attention.py:916-947) after the leading `layer`.
    """

    def __init__(self, backend, state: _State, validate: bool, sampled: bool):
        self.backend = backend
        self.state = state
        self.validate = validate
        self.sampled = sampled
        self.called = False

    def __call__(
        self,
        layer,
        q,
        k,
        v,
        o,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        custom_mask,
        is_causal,
        mask_indptr,
        max_len_extend,
        k_scale,
        v_scale,
        sm_scale=None,
        **kw,
    ):
        self.called = True
        if self.validate:
            # The control: exactly what the original would have run.
            type(self.backend)._forward_extend_kernel(
                self.backend, layer, q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr,
                kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale,
                v_scale, sm_scale, **kw,
            )
            if self.sampled:
                self._shadow(layer, q, k, o, k_buffer, qo_indptr, kv_indptr, kv_indices,
                             custom_mask, is_causal, mask_indptr, max_len_extend, k_scale,
                             v_scale, sm_scale, kw)
            return None
        self._check_invariants(is_causal, kw)
        out2d = o.view(o.shape[0], -1)
        res = get_candidate()(
            q, k, k_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
            sm_scale, max_qo_len=max_len_extend, k_scale=k_scale, v_scale=v_scale, out=out2d,
        )
        if res is not None and res is not out2d:
            out2d.copy_(res.reshape(out2d.shape))
        return None

    @staticmethod
    def _check_invariants(is_causal, kw):
        bad = []
        if is_causal is not True:
            bad.append(f"causal={is_causal!r}")
        if (kw.get("logit_cap") or 0) > 0:
            bad.append("logit_cap")
        if kw.get("sliding_window_size", -1) not in (None, -1):
            bad.append("sliding_window_size")
        for name in ("sinks", "window_kv_offsets", "score_mod", "aux_tensors"):
            if kw.get(name) is not None:
                bad.append(name)
        if (kw.get("xai_temperature_len", -1) or -1) > 0:
            bad.append("xai_temperature_len")
        if bad:
            raise KdtreeHookError(
                "the Triton kernel call carries arguments the kdtree kernel does not implement: "
                + ", ".join(bad) + " (eligibility gap; report it)"
            )

    def _shadow(self, layer, q, k, o, k_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
                is_causal, mask_indptr, max_len_extend, k_scale, v_scale, sm_scale, kw):
        st = self.state
        layer_id = getattr(layer, "layer_id", -1)
        store = shadow.store_for(self.backend, st.settings, o.device)
        if store is None:
            _fallback(st, "stats_unavailable", layer_id, self.backend, q)
            return
        ctrl = o.view(o.shape[0], -1)
        try:
            self._check_invariants(is_causal, kw)
            # Rows no qo_indptr range covers are never written: start from the control's bytes.
            cand = ctrl.clone()
            res = get_candidate()(
                q, k, k_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr,
                sm_scale, max_qo_len=max_len_extend, k_scale=k_scale, v_scale=v_scale, out=cand,
            )
            if res is not None and res is not cand:
                cand.copy_(res.reshape(cand.shape))
        except Exception as exc:
            shadow.record_candidate_error(
                exc, layer_id=layer_id, shape=list(q.shape), max_qo_len=max_len_extend,
            )
            return
        store.record(layer_id, cand, ctrl, heads=q.shape[1])


class _override_kernel:
    """Route `backend._forward_extend_kernel` to `shim` for the duration of one call."""

    def __init__(self, backend, shim):
        self.backend = backend
        self.shim = shim

    def __enter__(self):
        if "_forward_extend_kernel" in vars(self.backend):
            raise KdtreeHookError("re-entrant kdtree forward_extend hook on one backend")
        self.backend._forward_extend_kernel = self.shim

    def __exit__(self, *exc):
        self.backend.__dict__.pop("_forward_extend_kernel", None)
        return False


def _fallback(state: _State, reason: str, layer_id, backend=None, q=None, capturing=None) -> None:
    metrics.count_fallback(reason)
    logs.fallback(reason, mode=state.mode_name, layer_id=layer_id)
    if backend is not None:
        _record_capture(backend, q, ("fallback", reason), capturing)


def _count_call(backend, q, mode: str, path: str, capturing=None) -> None:
    metrics.count_call(mode, path)
    _record_capture(backend, q, ("call", mode, path), capturing)


# Reasons that mean "not a TARGET_VERIFY call of the target model": not counted as verify calls.
_NOT_VERIFY = frozenset({"not_target_verify", "draft_runner"})


def _count_verify(backend, q, served_by: str, reason: str = "", capturing=None) -> None:
    metrics.count_verify(served_by, reason)
    fallback_watch.add(1, served_by in ("triton", "error"), reason)
    _record_capture(backend, q, ("verify", served_by, reason), capturing)


class FallbackWatch:
    """In `on`: one ERROR event (`kdtree_fallback_rate_high`) per window in which more than `threshold` of
    the target model's verify calls were not served by our kernel (at least `min_calls` calls seen).

    Counts eager calls and graph replays alike (replays through `_account_replay`). Windows are
    wall-clock (`window_s`), so a burst of fallbacks is reported once, within a window of it.
    """

    def __init__(self, window_s: float = 60.0, threshold: float = 0.01, min_calls: int = 20, clock=None):
        import time

        self.window_s, self.threshold, self.min_calls = window_s, threshold, min_calls
        self._clock = clock or time.monotonic
        self.enabled = False
        self._reset(self._clock())

    def _reset(self, now):
        self._start, self.total, self.fallbacks = now, 0, 0
        self.reasons = collections.Counter()

    def add(self, n: int, fell_back: bool, reason: str = "") -> None:
        if not self.enabled:
            return
        self.total += n
        if fell_back:
            self.fallbacks += n
            self.reasons[reason or "error"] += n
        now = self._clock()
        if now - self._start < self.window_s:
            return
        if self.total >= self.min_calls and self.fallbacks > self.threshold * self.total:
            logs.fallback_rate_high(
                window_s=round(now - self._start, 1), verify_calls=self.total, not_served_by_kdtree=self.fallbacks,
                fraction=round(self.fallbacks / self.total, 4), threshold=self.threshold,
                reasons=dict(self.reasons.most_common(5)),
            )
        self._reset(now)


fallback_watch = FallbackWatch()


# --- accounting of CUDA-graph replays -------------------------------------------------------------
# A replay runs no Python of ours, so calls_total / fallbacks_total would stop at capture. During a
# capture the hook records, per backend and captured batch size (T // max_extend_len), which
# (call, mode, path) / (fallback, reason) events the graph contains; the per-instance wrapper of
# init_forward_metadata_out_graph (SGLang's load_batch calls it before EVERY replay, with the
# graph's padded batch size) adds them once per replay.
def _record_capture(backend, q, key, capturing=None) -> None:
    if q is None or not (shadow.is_capturing() if capturing is None else capturing):
        return
    md = getattr(backend, "forward_metadata", None)
    d = getattr(md, "max_extend_len", None)
    if not isinstance(d, int) or d <= 0:
        return
    table = backend.__dict__.setdefault("_kdtree_graph_events", {})
    table.setdefault(int(q.shape[0]) // d, collections.Counter())[key] += 1


def _account_replay(backend, forward_batch) -> None:
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None or not mode.is_target_verify():
        return
    events = backend.__dict__.get("_kdtree_graph_events", {}).get(getattr(forward_batch, "batch_size", None))
    if not events:
        return
    for key, n in events.items():
        if key[0] == "call":
            metrics.count_call(key[1], key[2], n)
        elif key[0] == "verify":
            metrics.count_verify(key[1], key[2], n)
            fallback_watch.add(n, key[1] in ("triton", "error"), key[2])
        else:
            metrics.count_fallback(key[1], n)


def install_step_wrappers(backend, validate: bool) -> bool:
    """Wrap THIS backend instance's `init_forward_metadata_out_graph` (replay accounting, and in
    validate the host side of the stats ring) and `init_forward_metadata` (validate: host side),
    so that both run once per step OUTSIDE any graph, also when every TARGET_VERIFY forward is a
    CUDA-graph replay. Instance attributes shadow the class's methods; idempotent."""
    if getattr(backend, "_kdtree_poll_installed", False):
        return False

    def _safe(fn, *a):
        try:
            fn(*a)
        except Exception as exc:  # accounting/publishing must never break serving
            logs.candidate_error(exc, mode="validate" if validate else "on", where=getattr(fn, "__name__", "?"))

    out_graph = getattr(backend, "init_forward_metadata_out_graph", None)
    if out_graph is not None:

        def init_forward_metadata_out_graph(forward_batch, in_capture=False, *args, **kwargs):
            result = out_graph(forward_batch, in_capture, *args, **kwargs)
            if not in_capture and not shadow.is_capturing():
                _safe(_account_replay, backend, forward_batch)
                if validate:
                    _safe(shadow.poll_all)
            return result

        init_forward_metadata_out_graph.__wrapped__ = out_graph
        backend.init_forward_metadata_out_graph = init_forward_metadata_out_graph
    eager = getattr(backend, "init_forward_metadata", None)
    if validate and eager is not None:

        def init_forward_metadata(*args, **kwargs):
            result = eager(*args, **kwargs)
            if not shadow.is_capturing():
                _safe(shadow.poll_all)
            return result

        init_forward_metadata.__wrapped__ = eager
        backend.init_forward_metadata = init_forward_metadata
    backend._kdtree_poll_installed = True
    return True


# --- the hook -----------------------------------------------------------------------------------
def _forward_extend_hook(original_fn, self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    st = get_state()
    mode = st.mode_name
    if mode == "off":
        return original_fn(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    capturing = shadow.is_capturing()
    if mode == "validate" and not capturing:
        try:
            shadow.poll_all()
        except Exception as exc:  # publishing must never break serving
            logs.candidate_error(exc, mode=mode, where="poll")

    validate = mode == "validate"
    fm = getattr(forward_batch, "forward_mode", None)
    if fm is not None and fm.is_target_verify() and not getattr(self, "_kdtree_poll_installed", False):
        install_step_wrappers(self, validate)

    reason = eligibility.check(self, layer, forward_batch, q, k, v, kwargs)
    if reason is not None:
        _fallback(st, reason, getattr(layer, "layer_id", -1), self, q, capturing)
        _count_call(self, q, mode, "fallback", capturing)
        if reason not in _NOT_VERIFY:
            _count_verify(self, q, "triton", reason, capturing)
        return original_fn(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    sampled = st.sampler() if validate else False
    shim = _KernelShim(self, st, validate=validate, sampled=sampled)
    try:
        with _override_kernel(self, shim):
            out = original_fn(self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
    except Exception as exc:
        if not validate and shim.called:
            _count_call(self, q, mode, "error")
            _count_verify(self, q, "error")
            logs.candidate_error(exc, mode=mode, layer_id=getattr(layer, "layer_id", -1), shape=list(q.shape))
        raise
    if not shim.called:
        # The original took another branch (an eligibility gap): its output is Triton's.
        _fallback(st, "kernel_not_reached", getattr(layer, "layer_id", -1), self, q)
        _count_verify(self, q, "triton" if validate else "error", "kernel_not_reached")
        if not validate:
            _count_call(self, q, mode, "error")
            raise KdtreeHookError(
                "KDTREE_VERIFY=on but TritonAttnBackend.forward_extend did not reach its kernel call "
                "for an eligible TARGET_VERIFY batch (eligibility gap; report it)"
            )
        _count_call(self, q, mode, "fallback")
        return out
    _count_call(self, q, mode, ("shadow" if sampled else "shadow_unsampled") if validate else "kdtree", capturing)
    _count_verify(self, q, "shadow" if validate else "kdtree", "", capturing)
    return out


# Hidden from Dynamo like the backend's own kernels (triton_backend.py:188-204): with
# --enable-torch-compile the decode-graph capture traces the model; this keeps our Python
# (eligibility, metrics, the shim) out of the trace and runs it eagerly.
_forward_extend_hook_nocompile = torch.compiler.disable(_forward_extend_hook)


def forward_extend_hook(original_fn, self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
    return _forward_extend_hook_nocompile(
        original_fn, self, q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs
    )


forward_extend_hook.__kdtree_hook__ = True


def is_kdtree_hook(fn) -> bool:
    """True when `fn` is (a wrapper around) this package's hook."""
    return getattr(fn, "__kdtree_hook__", False) or getattr(getattr(fn, "__wrapped__", None), "__kdtree_hook__", False)
