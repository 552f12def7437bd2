"""Environment switches of kdtree-backend (see docs/interfaces.md, "Environment variables")."""
from __future__ import annotations

import os
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
