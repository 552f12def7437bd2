"""`verify_attention`: the Python face of the CUDA kernel (checks inputs, plans once, launches).

The op never synchronises with the host and launches on the current torch stream, so SGLang can
capture it in a CUDA graph: everything it reads from the host (batch size, heads, the largest
draft count, pointers, scales) is fixed at capture, and the per-request lengths, indices and mask
bits are read on the device at replay. The split-KV workspace is allocated once per
(device, stream, batch, heads, max draft count) and reused, which keeps its address stable.
"""
from __future__ import annotations

import ctypes
import math
import os
import threading

import torch

from kdtree_backend.kernel import abi
from kdtree_backend.config import read_kernel_choice, resolve_kernel
from kdtree_backend.errors import KdtreeLibraryError, KdtreeModeError

_OFF_FIX = "set KDTREE_VERIFY=off to serve without the kernel"

__all__ = [
    "KernelInputError",
    "KdtreeLibraryError",
    "verify_attention",
    "kernel_available",
    "library_info",
    "selected_kernel",
]


class KernelInputError(ValueError):
    """An argument the kernel cannot take (type, shape, dtype, device, layout)."""


_lock = threading.Lock()
_probed_devices: set[int] = set()
_plans: dict[tuple, "_Plan"] = {}
_index_stubs: dict[int, torch.Tensor] = {}


def _nonempty_indices(kv_indices: torch.Tensor, index: int) -> torch.Tensor:
    """kv_indices, or a one-entry stand-in when it is empty (every request has an empty prefix: SGLang
    then passes a 0-element tensor whose data pointer may be NULL). The kernel reads kv_indices only
    inside kv_indptr ranges, which are all empty then, so the stand-in is never read; it is cached per
    device so a CUDA graph captured on such a batch keeps a valid address."""
    if kv_indices.numel() > 0:
        return kv_indices
    stub = _index_stubs.get(index)
    if stub is None:
        with _lock:
            stub = _index_stubs.get(index)
            if stub is None:
                stub = torch.zeros(1, dtype=torch.int64, device=torch.device("cuda", index))
                _index_stubs[index] = stub
    return stub
_num_sms: dict[int, int] = {}


class _Plan:
    __slots__ = ("c_plan", "workspace", "workspace_ptr")

    def __init__(self, c_plan: abi.VerifyPlan, workspace: torch.Tensor | None):
        self.c_plan = c_plan
        self.workspace = workspace
        self.workspace_ptr = workspace.data_ptr() if workspace is not None else None


def _cdll():
    """The loaded, checked library; KdtreeLibraryError (naming cause and fix) otherwise."""
    from kdtree_backend.kernel.loader import get_library  # noqa: PLC0415

    return get_library().cdll


def kernel_available() -> bool:
    try:
        _cdll()
        return True
    except KdtreeLibraryError:
        return False


def library_info() -> dict:
    from kdtree_backend.kernel.loader import get_library  # noqa: PLC0415

    lib = get_library()  # what the loader read and checked
    return {
        "abi_version": lib.abi_version,
        "built_archs": ",".join(str(a) for a in lib.built_archs),
        "ptx_arch": lib.ptx_arch,
        "version": lib.version,
        "pipe_factor": lib.pipe_factor(),  # > 1: a --pipe-factor diagnostics build (bench_verify.py reads it)
    }


def _device_index(device: torch.device | int | None) -> int:
    """The CUDA device index of `device` (an int, a torch.device, or None: the current device)."""
    if isinstance(device, int):
        return device
    return device.index if device is not None and device.index is not None else torch.cuda.current_device()


def probe_device(device: torch.device | int) -> str:
    """Check once per device that the library has a kernel image for it; returns the report."""
    index = _device_index(device)
    lib = _cdll()
    buf = ctypes.create_string_buffer(1024)
    rc = lib.kdtree_probe_device(index, buf, len(buf))
    if rc != 0:
        from kdtree_backend.kernel.loader import rebuild_fix  # noqa: PLC0415

        cap = torch.cuda.get_device_capability(index)
        raise KdtreeLibraryError(
            f"the kernel library cannot run on GPU {index} (compute capability {cap[0]}.{cap[1]}): "
            f"{buf.value.decode(errors='replace')}",
            rebuild_fix(tuple(cap)),
        )
    return buf.value.decode(errors="replace")


def _check(cond: bool, msg) -> None:
    """`msg` is a string or a callable returning one: the messages name shapes and dtypes, and building
    them on every call (this runs per layer per step on the serving path) cost more than the checks."""
    if not cond:
        raise KernelInputError(f"verify_attention: {msg() if callable(msg) else msg}")


def _rows(name: str, t, width: int, device: torch.device) -> torch.Tensor:
    """A [N, width] or [N, 1, width] bf16 CUDA tensor with a contiguous last dim."""
    _check(isinstance(t, torch.Tensor), lambda: f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check(t.dim() in (2, 3) and t.shape[-1] == width and (t.dim() == 2 or t.shape[1] == 1),
           lambda: f"{name} must have shape [N, {width}] or [N, 1, {width}], got {list(t.shape)}")
    _check(t.dtype == torch.bfloat16, lambda: f"{name} must be bfloat16, got {t.dtype} (only bf16 KV caches are supported)")
    _check(t.device == device, lambda: f"{name} is on {t.device}, q is on {device}")
    _check(t.stride(-1) == 1, lambda: f"{name}'s last dimension must be contiguous (stride 1), got stride {t.stride(-1)}")
    return t


def _index(name: str, t, dtypes, device: torch.device, min_len: int | None = None) -> torch.Tensor:
    _check(isinstance(t, torch.Tensor), lambda: f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check(t.dim() == 1, lambda: f"{name} must be 1-D, got shape {list(t.shape)}")
    _check(t.dtype in dtypes, lambda: f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    _check(t.device == device, lambda: f"{name} is on {t.device}, q is on {device}")
    _check(t.is_contiguous(), lambda: f"{name} must be contiguous")
    if min_len is not None:
        _check(t.numel() >= min_len, lambda: f"{name} has {t.numel()} entries, needs at least {min_len}")
    return t


def _device_sms(index: int) -> int:
    n = _num_sms.get(index)
    if n is None:
        n = torch.cuda.get_device_properties(index).multi_processor_count
        _num_sms[index] = n
    return n


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        v = int(raw)
    except ValueError:
        raise KernelInputError(f"{name}={raw!r} is not an integer") from None
    if v < 1:
        raise KernelInputError(f"{name}={raw!r} must be >= 1")
    return v


_resolved: dict[tuple[int, str], int] = {}


def selected_kernel(device_index: int | None = None) -> str:
    """The kernel path verify_attention runs on this GPU: "hopper", "portable" or "portable-tiled"."""
    return abi.CONFIG_NAMES[_kernel_config(_cdll(), _device_index(device_index))]


def _kernel_config(lib, device_index: int) -> int:
    """KDTREE_KERNEL (auto | portable | hopper | portable-tiled) resolved for one GPU, cached."""
    try:
        choice = read_kernel_choice()
    except KdtreeModeError as e:
        raise KernelInputError(str(e)) from None
    key = (device_index, choice)
    config = _resolved.get(key)
    if config is not None:
        return config
    cap = torch.cuda.get_device_capability(device_index)
    try:
        name = resolve_kernel(choice, cap, abi.library_has_hopper(lib))
    except ValueError as e:
        cause, _, fix = str(e).partition(" Fix: ")
        raise KdtreeLibraryError(f"GPU {device_index}: {cause}", fix or _OFF_FIX) from None
    config = abi.CONFIG_IDS[name]
    _resolved[key] = config
    return config


def _get_plan(lib, device_index: int, stream_ptr: int, batch: int, heads: int, max_qo_len: int, config: int) -> _Plan:
    key = (device_index, stream_ptr, batch, heads, max_qo_len, config)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    with _lock:
        plan = _plans.get(key)
        if plan is not None:
            return plan
        c_plan = abi.VerifyPlan()
        # Tuning knobs for benchmarks (docs/kernel/semantics.md): inputs of the C plan, which sizes the
        # workspace for them (0 = the library chooses).
        c_plan.requested_splits = _env_int("KDTREE_NUM_SPLITS") or 0
        c_plan.requested_min_keys_per_split = _env_int("KDTREE_MIN_KEYS_PER_SPLIT") or 0
        num_sms = _device_sms(device_index)
        rc = lib.kdtree_verify_plan(batch, heads, max_qo_len, num_sms, config, ctypes.byref(c_plan))
        if rc != 0:
            raise KernelInputError(f"verify_attention: {lib.kdtree_error_string(rc).decode(errors='replace')}")
        ws_bytes = c_plan.workspace_bytes
        # Zeroed, once per plan (cheap, and a slot no piece wrote holds zeros rather than old memory;
        # the kernels never need it: the merge discards what a request's pieces did not write).
        workspace = (
            torch.zeros(ws_bytes, dtype=torch.uint8, device=torch.device("cuda", device_index)) if ws_bytes else None
        )
        plan = _Plan(c_plan, workspace)
        _plans[key] = plan
        return plan


@torch.compiler.disable
def verify_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    kv_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: torch.Tensor | None,
    mask_indptr: torch.Tensor | None,
    sm_scale: float,
    *,
    max_qo_len: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLA tree-verify attention (SGLang TARGET_VERIFY semantics). See docs/interfaces.md."""
    _check(isinstance(q, torch.Tensor), lambda: f"q must be a torch.Tensor, got {type(q).__name__}")
    _check(q.dim() == 3 and q.shape[2] == abi.QK_HEAD_DIM,
           lambda: f"q must have shape [T, H, {abi.QK_HEAD_DIM}], got {list(q.shape)}")
    _check(q.dtype == torch.bfloat16, lambda: f"q must be bfloat16, got {q.dtype}")
    _check(q.is_cuda, lambda: f"q must be a CUDA tensor, got device {q.device}")
    _check(q.stride(2) == 1, "q's last dimension must be contiguous")
    device = q.device
    T, H = q.shape[0], q.shape[1]
    _check(H >= 1, "q has no heads")
    _rows("k", k, abi.QK_HEAD_DIM, device)
    _check(k.shape[0] == T, lambda: f"k has {k.shape[0]} rows, q has {T} tokens")
    _rows("kv_cache", kv_cache, abi.QK_HEAD_DIM, device)
    _index("qo_indptr", qo_indptr, (torch.int32, torch.int64), device, 1)
    batch = qo_indptr.numel() - 1
    _index("kv_indptr", kv_indptr, (torch.int32, torch.int64), device, batch + 1)
    _index("kv_indices", kv_indices, (torch.int64,), device)
    if custom_mask is not None:
        _index("custom_mask", custom_mask, (torch.bool, torch.uint8), device)
        _check(mask_indptr is not None, "custom_mask is given but mask_indptr is None")
        _index("mask_indptr", mask_indptr, (torch.int64,), device, batch + 1)
    _check(isinstance(max_qo_len, int) and not isinstance(max_qo_len, bool) and max_qo_len >= 1,
           lambda: f"max_qo_len must be a positive Python int (the draft count D), got {max_qo_len!r}")
    for name, val in (("sm_scale", sm_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        _check(isinstance(val, (int, float)) and math.isfinite(val), lambda: f"{name} must be a finite float, got {val!r}")
    if out is None:
        out = torch.empty((T, H * abi.V_HEAD_DIM), dtype=q.dtype, device=device)
    else:
        _check(isinstance(out, torch.Tensor), lambda: f"out must be a torch.Tensor, got {type(out).__name__}")
        _check(out.dim() == 2 and tuple(out.shape) == (T, H * abi.V_HEAD_DIM),
               lambda: f"out must have shape [{T}, {H * abi.V_HEAD_DIM}], got {list(out.shape)}")
        _check(out.dtype == q.dtype, lambda: f"out must be {q.dtype}, got {out.dtype}")
        _check(out.device == device, lambda: f"out is on {out.device}, q is on {device}")
        _check(out.stride(1) == 1, "out's last dimension must be contiguous")
    for name, t in (("q", q), ("k", k), ("kv_cache", kv_cache)):
        _check(t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1]),
               lambda: f"{name}'s rows must start on 16-byte boundaries (data_ptr {t.data_ptr():#x}, strides {t.stride()})")
    _check(out.data_ptr() % 8 == 0 and out.stride(0) % 4 == 0, "out's rows must start on 8-byte boundaries")
    if batch == 0 or T == 0:
        return out

    lib = _cdll()
    index = _device_index(device)
    if index not in _probed_devices:
        probe_device(index)
        _probed_devices.add(index)
    with torch.cuda.device(index):
        stream = torch.cuda.current_stream(device)
        config = _kernel_config(lib, index)
        plan = _get_plan(lib, index, stream.cuda_stream, batch, H, max_qo_len, config)
        p = abi.VerifyParams()
        p.q = q.data_ptr()
        p.q_stride_tok = q.stride(0)
        p.q_stride_head = q.stride(1)
        p.k = k.data_ptr()
        p.k_stride_tok = k.stride(0)
        p.kv_cache = kv_cache.data_ptr()
        p.kv_stride_slot = kv_cache.stride(0)
        p.kv_num_slots = kv_cache.shape[0]
        p.qo_indptr = qo_indptr.data_ptr()
        p.kv_indptr = kv_indptr.data_ptr()
        p.kv_indices = _nonempty_indices(kv_indices, index).data_ptr()
        p.custom_mask = custom_mask.data_ptr() if custom_mask is not None else None
        p.mask_indptr = mask_indptr.data_ptr() if custom_mask is not None else None
        p.out = out.data_ptr()
        p.out_stride_tok = out.stride(0)
        p.workspace = plan.workspace_ptr
        p.workspace_bytes = plan.c_plan.workspace_bytes
        p.batch = batch
        p.num_heads = H
        p.max_qo_len = max_qo_len
        p.num_splits = plan.c_plan.num_splits
        p.qo_indptr_is_int64 = int(qo_indptr.dtype == torch.int64)
        p.kv_indptr_is_int64 = int(kv_indptr.dtype == torch.int64)
        p.min_keys_per_split = plan.c_plan.min_keys_per_split
        p.config = config
        p.sm_scale = float(sm_scale)
        p.k_scale = float(k_scale)
        p.v_scale = float(v_scale)
        rc = lib.kdtree_verify_run(ctypes.byref(p), ctypes.c_void_p(stream.cuda_stream))
    if rc != 0:
        raise KdtreeLibraryError(
            f"verify_attention: the kernel library refused the launch: {lib.kdtree_error_string(rc).decode(errors='replace')}",
            f"report this with the shapes above; {_OFF_FIX}",
        )
    return out
