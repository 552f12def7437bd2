"""Environment switches of kdtree-backend (see docs/interfaces.md, "Environment variables")."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from enum import Enum
from typing import Mapping, Optional

from kdtree_backend.errors import KdtreeModeError, VALID_MODES_TEXT

ENV_MODE = "KDTREE_VERIFY"
ENV_LIB = "KDTREE_LIB"
# Allows an sglang other than the supported one (at the operator's risk). Exactly "1" enables.
ENV_ALLOW_UNSUPPORTED_SGLANG = "KDTREE_ALLOW_UNSUPPORTED_SGLANG"
# Test-only GPU injection for the loader's compute-capability check: a comma-separated list of
# capabilities ("9.0", "9.0,12.0") or "none". Honoured ONLY when KDTREE_TESTING=1 is also set,
# so a stray value in a production unit cannot hide the real GPUs.
ENV_FAKE_GPU_CAPABILITY = "KDTREE_FAKE_GPU_CAPABILITY"
ENV_TESTING = "KDTREE_TESTING"

SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)


class Mode(str, Enum):
    OFF = "off"
    VALIDATE = "validate"
    ON = "on"

    def __str__(self) -> str:
        return self.value


def _env(environ: Optional[Mapping[str, str]]) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def read_mode(environ: Optional[Mapping[str, str]] = None) -> Mode:
    """The mode from `KDTREE_VERIFY`: off (default when unset), validate or on.

    Case-insensitive and whitespace-trimmed. Any other value, the empty string included, raises
    `KdtreeModeError`: an unknown value is never treated as off.
    """
    env = _env(environ)
    if ENV_MODE not in env:
        return Mode.OFF
    raw = env[ENV_MODE]
    try:
        return Mode(raw.strip().lower())
    except ValueError:
        raise KdtreeModeError(ENV_MODE, raw, VALID_MODES_TEXT) from None


def allow_unsupported_sglang(environ: Optional[Mapping[str, str]] = None) -> bool:
    raw = _env(environ).get(ENV_ALLOW_UNSUPPORTED_SGLANG)
    if raw is None or raw.strip() in ("", "0"):
        return False
    if raw.strip() == "1":
        return True
    raise KdtreeModeError(ENV_ALLOW_UNSUPPORTED_SGLANG, raw, "1, 0 (or unset)")


def testing_enabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    return _env(environ).get(ENV_TESTING, "").strip() == "1"


# --- kernel selection ---------------------------------------------------------------------------
# auto: the Hopper (wgmma) kernel on compute capability 9.0 when the library has it, else the
# portable one. portable / hopper force a path (hopper on another GPU is an error, not a
# fallback). portable-tiled: the portable kernel's tiled form even where its warp-specialised form
# runs (compute capability 9.0, 10.0, 12.0): the rollback to the pre-p16 kernel without a rebuild, and
# how the H200 tests the tiling other GPUs fall back to (docs/kernel/portable.md).
ENV_KERNEL = "KDTREE_KERNEL"
KERNEL_CHOICES = ("auto", "portable", "hopper", "portable-tiled")


def read_kernel_choice(environ: Optional[Mapping[str, str]] = None) -> str:
    """`KDTREE_KERNEL` (default auto); raises `KdtreeModeError` naming the variable on a bad value."""
    raw = _env(environ).get(ENV_KERNEL)
    if raw is None or raw.strip() == "":
        return "auto"
    value = raw.strip().lower()
    if value not in KERNEL_CHOICES:
        raise KdtreeModeError(ENV_KERNEL, raw, ", ".join(KERNEL_CHOICES) + " (or unset = auto)")
    return value


HOPPER_CAPABILITY = (9, 0)


def resolve_kernel(choice: str, capability: tuple, library_has_hopper: bool) -> str:
    """The kernel path `choice` selects on a GPU of `capability`; ValueError names the fix.

    auto -> "hopper" on compute capability 9.0 when the library has the sm_90a kernel, else
    "portable". An explicit "hopper" never degrades to the portable path.
    """
    cap = tuple(capability)
    if choice == "auto":
        return "hopper" if cap == HOPPER_CAPABILITY and library_has_hopper else "portable"
    if choice == "hopper":
        if cap != HOPPER_CAPABILITY:
            raise ValueError(
                f"{ENV_KERNEL}=hopper, but the GPU has compute capability {cap[0]}.{cap[1]}: the Hopper kernel "
                f"(wgmma, sm_90a) runs on 9.0 (H100/H200) only. Fix: unset {ENV_KERNEL} (auto) or set "
                f"{ENV_KERNEL}=portable")
        if not library_has_hopper:
            raise ValueError(
                f"{ENV_KERNEL}=hopper, but the kernel library was built without the Hopper kernel. Fix: rebuild "
                f"with `python -m kdtree_backend.build --arch 90` (sm_90 builds include sm_90a), or unset {ENV_KERNEL}")
        return "hopper"
    return choice


# --- validate (shadow) mode settings --------------------------------------------------------
ENV_VALIDATE_SAMPLE_RATE = "KDTREE_VALIDATE_SAMPLE_RATE"
ENV_VALIDATE_ATOL = "KDTREE_VALIDATE_ATOL"
ENV_VALIDATE_RTOL = "KDTREE_VALIDATE_RTOL"
DEFAULT_VALIDATE_ATOL = 2e-2
DEFAULT_VALIDATE_RTOL = 2e-2


@dataclass(frozen=True)
class ValidateSettings:
    sample_rate: float = 1.0
    atol: float = DEFAULT_VALIDATE_ATOL
    rtol: float = DEFAULT_VALIDATE_RTOL


def read_validate_settings(environ: Optional[Mapping[str, str]] = None) -> ValidateSettings:
    """Validate-mode settings; raises `KdtreeModeError` naming the variable on a bad value.

    Read at plugin load and in the launcher's preflight (not at the first forward pass), so a
    typo stops the server before it loads a model.
    """
    env = _env(environ)

    def _float(name, default, ok, valid):
        raw = env.get(name)
        if raw is None or raw.strip() == "":
            return default
        try:
            val = float(raw.strip())
        except ValueError:
            raise KdtreeModeError(name, raw, valid) from None
        if not ok(val):
            raise KdtreeModeError(name, raw, valid)
        return val

    rate = _float(ENV_VALIDATE_SAMPLE_RATE, 1.0, lambda x: 0.0 < x <= 1.0, "a float in (0, 1]")
    atol = _float(ENV_VALIDATE_ATOL, DEFAULT_VALIDATE_ATOL, lambda x: math.isfinite(x) and x >= 0.0, "a float >= 0")
    rtol = _float(ENV_VALIDATE_RTOL, DEFAULT_VALIDATE_RTOL, lambda x: math.isfinite(x) and x >= 0.0, "a float >= 0")
    return ValidateSettings(rate, atol, rtol)


# --- every variable, checked together ----------------------------------------------------------
# Every KDTREE_* variable this package reads (tests/test_config.py checks the package's sources name
# no other). A KDTREE_* name outside this list is almost certainly a typo (KDTREE_VERIFIY=on leaves
# the mode off): the launcher, the plugin's start-up line and the doctor warn about it.
KNOWN_VARIABLES = (
    ENV_MODE, ENV_LIB, ENV_ALLOW_UNSUPPORTED_SGLANG, ENV_FAKE_GPU_CAPABILITY, ENV_TESTING, ENV_KERNEL,
    ENV_VALIDATE_SAMPLE_RATE, ENV_VALIDATE_ATOL, ENV_VALIDATE_RTOL,
    # benchmark-only kernel tuning (kernel/ops.py)
    "KDTREE_NUM_SPLITS", "KDTREE_MIN_KEYS_PER_SPLIT",
    # the launcher's own settings (launcher/main.py OPTIONS)
    "KDTREE_START_TIMEOUT", "KDTREE_HEALTH_URL", "KDTREE_PROBE_INTERVAL", "KDTREE_PROBE_TIMEOUT",
    "KDTREE_SERVING_PROBE_INTERVAL", "KDTREE_SERVING_PROBE_TIMEOUT", "KDTREE_EXIT_ON_HANG",
    "KDTREE_STOP_TIMEOUT", "KDTREE_LOG_TAIL_LINES", "KDTREE_ARG_PREFLIGHT", "KDTREE_PREFLIGHT_TIMEOUT",
    "KDTREE_LAUNCH_CHILD_CMD",
    # tests / the CPU test kit
    "KDTREE_HOOK_BACKEND_CPU", "KDTREE_REQUIRE_SYSTEMD_ANALYZE", "KDTREE_VENV", "KDTREE_COMMIT",
)


def unknown_variables(environ: Optional[Mapping[str, str]] = None) -> list:
    """Warnings for KDTREE_* variables this package does not read, each with the closest known name."""
    import difflib

    out = []
    for name in sorted(_env(environ)):
        if name.startswith("KDTREE_") and name not in KNOWN_VARIABLES:
            close = difflib.get_close_matches(name, KNOWN_VARIABLES, n=1, cutoff=0.75)
            hint = f" (did you mean {close[0]}?)" if close else ""
            out.append(f"warning: {name} is not a kdtree-backend variable and is ignored{hint}")
    return out


@dataclass(frozen=True)
class Settings:
    """Every KDTREE_* switch of the plugin, read and validated together."""

    mode: Mode
    validate: ValidateSettings
    kernel: str
    allow_unsupported_sglang: bool


def read_settings(environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Read and validate KDTREE_VERIFY, the KDTREE_VALIDATE_* settings, KDTREE_KERNEL and
    KDTREE_ALLOW_UNSUPPORTED_SGLANG; the first bad value raises `KdtreeModeError` naming it.

    One function for every caller: the plugin's register(), the launcher's preflight and the doctor
    refuse exactly the same values. With KDTREE_VERIFY=off nothing but the mode is used, and the
    callers read the mode alone (`read_mode`): an unused setting never stops a server that does not
    run the kernel.
    """
    return Settings(
        mode=read_mode(environ),
        validate=read_validate_settings(environ),
        kernel=read_kernel_choice(environ),
        allow_unsupported_sglang=allow_unsupported_sglang(environ),
    )
