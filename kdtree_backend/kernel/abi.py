"""The binary interface between the Python package and the compiled kernel library.

One place holds what both sides must agree on: the ABI version, the library's file name, the
symbols the loader insists on, and the ctypes mirrors of the C structs declared in
`kernel/csrc/kdtree_api.h`. Bump ABI_VERSION together with KDTREE_ABI_VERSION in that header whenever
a struct or a signature changes; the loader refuses a library whose version differs.
"""
from __future__ import annotations

import ctypes

ABI_VERSION = 2

# The largest draft count (max_qo_len) the kernels take: KDTREE_MAX_QO_LEN in kdtree_api.h, which
# kdtree_verify_plan enforces (tests/kernel/test_kernel_build.py checks the two agree).
MAX_QO_LEN = 4096

LIB_FILENAME = "libkdtree_verify.so"

# Every symbol the Python side calls. A library missing one is refused at load time, by name.
REQUIRED_SYMBOLS = (
    "kdtree_abi_version",
    "kdtree_built_archs",
    "kdtree_library_version",
    "kdtree_error_string",
    "kdtree_probe_device",
    "kdtree_verify_plan",
    "kdtree_verify_run",
)

# Kernel configurations (`config` in the structs below). PORTABLE is what sm_120 runs and what the
# H200 tests select, so the path the first customer runs is the path we test.
# Id 1 (KDTREE_CONFIG_RESERVED_1) was the rejected rows32 variant: reserved so that ids never move.
# PORTABLE runs the warp-specialised tiling where the library has its arch-specific code, the tiled one
# elsewhere; PORTABLE_TILED (added within ABI 2) always the tiled one.
CONFIG_PORTABLE = 0
CONFIG_HOPPER = 2  # wgmma, sm_90a only (H100/H200)
CONFIG_PORTABLE_TILED = 3
CONFIG_NAMES = {CONFIG_PORTABLE: "portable", CONFIG_HOPPER: "hopper", CONFIG_PORTABLE_TILED: "portable-tiled"}
CONFIG_IDS = {name: cid for cid, name in CONFIG_NAMES.items()}

# Head geometry of absorbed MLA: K row = 512 latent + 64 rope; V = the first 512 columns.
QK_HEAD_DIM = 576
V_HEAD_DIM = 512


class VerifyParams(ctypes.Structure):
    """Mirror of `KdtreeVerifyParams` (kernel/csrc/kdtree_api.h). Pointers are device addresses."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_stride_tok", ctypes.c_int64),
        ("q_stride_head", ctypes.c_int64),
        ("k", ctypes.c_void_p),
        ("k_stride_tok", ctypes.c_int64),
        ("kv_cache", ctypes.c_void_p),
        ("kv_stride_slot", ctypes.c_int64),
        ("kv_num_slots", ctypes.c_int64),
        ("qo_indptr", ctypes.c_void_p),
        ("kv_indptr", ctypes.c_void_p),
        ("kv_indices", ctypes.c_void_p),
        ("custom_mask", ctypes.c_void_p),
        ("mask_indptr", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("out_stride_tok", ctypes.c_int64),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_int64),
        ("batch", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("max_qo_len", ctypes.c_int32),
        ("num_splits", ctypes.c_int32),
        ("qo_indptr_is_int64", ctypes.c_int32),
        ("kv_indptr_is_int64", ctypes.c_int32),
        ("min_keys_per_split", ctypes.c_int32),
        ("config", ctypes.c_int32),
        ("sm_scale", ctypes.c_float),
        ("k_scale", ctypes.c_float),
        ("v_scale", ctypes.c_float),
        ("reserved", ctypes.c_float),
    ]


class VerifyPlan(ctypes.Structure):
    """Mirror of `KdtreePlan`: the launch shape fixed once per (batch, heads, draft count).

    The two `requested_*` fields are inputs (0 = the library chooses); kdtree_verify_plan fills the
    rest, the workspace size included."""

    _fields_ = [
        ("requested_splits", ctypes.c_int32),
        ("requested_min_keys_per_split", ctypes.c_int32),
        ("num_splits", ctypes.c_int32),
        ("row_tiles", ctypes.c_int32),
        ("rows_per_tile", ctypes.c_int32),
        ("min_keys_per_split", ctypes.c_int32),
        ("workspace_bytes", ctypes.c_int64),
    ]


def declare_signatures(cdll: ctypes.CDLL) -> None:
    """Give each exported function its C signature (ctypes otherwise assumes int everywhere)."""
    cdll.kdtree_abi_version.restype = ctypes.c_int
    cdll.kdtree_abi_version.argtypes = []
    cdll.kdtree_built_archs.restype = ctypes.c_char_p
    cdll.kdtree_built_archs.argtypes = []
    # Added within ABI 2: a library built before it lacks it, and the loader reads that as no PTX.
    if hasattr(cdll, "kdtree_ptx_arch"):
        cdll.kdtree_ptx_arch.restype = ctypes.c_int
        cdll.kdtree_ptx_arch.argtypes = []
    cdll.kdtree_library_version.restype = ctypes.c_char_p
    cdll.kdtree_library_version.argtypes = []
    cdll.kdtree_error_string.restype = ctypes.c_char_p
    cdll.kdtree_error_string.argtypes = [ctypes.c_int]
    cdll.kdtree_probe_device.restype = ctypes.c_int
    cdll.kdtree_probe_device.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    cdll.kdtree_verify_plan.restype = ctypes.c_int
    cdll.kdtree_verify_plan.argtypes = [
        ctypes.c_int,  # batch
        ctypes.c_int,  # num_heads
        ctypes.c_int,  # max_qo_len
        ctypes.c_int,  # num_sms
        ctypes.c_int,  # config
        ctypes.POINTER(VerifyPlan),
    ]
    cdll.kdtree_verify_run.restype = ctypes.c_int
    cdll.kdtree_verify_run.argtypes = [ctypes.POINTER(VerifyParams), ctypes.c_void_p]


def archs_text(built_archs, ptx_arch: int) -> str:
    """What a library holds, for people: "sm_90, sm_100, sm_120 + compute_120 PTX"."""
    text = ", ".join(f"sm_{a}" for a in built_archs) or "(none)"
    return text + (f" + compute_{ptx_arch} PTX" if ptx_arch else "")


def library_has_hopper(cdll) -> bool:
    """Whether the library was built with the Hopper (sm_90a) kernel: a host-only plan query,
    no CUDA context."""
    plan = VerifyPlan()
    return cdll.kdtree_verify_plan(1, 1, 1, 1, CONFIG_HOPPER, ctypes.byref(plan)) == 0
