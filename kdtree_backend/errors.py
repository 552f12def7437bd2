"""Configuration errors and the one way this package stops a process because of them.

Every error that means "the configured mode cannot run here" is a `KdtreeConfigError`: it knows
its cause and its fix, prints as ONE line, and carries exit code 78 (EX_CONFIG, which the
systemd drop-in lists in `RestartPreventExitStatus`, so a broken configuration is not restarted
in a loop).

`fail_fast(err)` prints that line to stderr and raises `SystemExit(78)`. Why SystemExit and not
`os._exit`: see docs/architecture.md ("Fail-fast"). In short: SGLang's `load_plugins()` wraps our
entry point in `except Exception` and would otherwise serve stock Triton silently; SystemExit is
a BaseException and passes through those handlers (every SGLang call site of `load_plugins()` in
0.5.23 either has no handler or re-raises BaseException), while still running `finally` blocks,
so SGLang's own cleanup (kill_process_tree, multiprocessing's exit-code propagation) happens.
"""
from __future__ import annotations

import re
import sys
from typing import NoReturn, Optional

EX_CONFIG = 78

VALID_MODES_TEXT = "off, validate, on"


def _one_line(text: str) -> str:
    """Join the lines of `text` into one (a dlerror() text may span lines)."""
    return re.sub(r"\s*[\r\n]+\s*", " ", str(text)).strip()


class KdtreeConfigError(Exception):
    """A configuration the process must not run with. `str(err)` is one readable line."""

    exit_code = EX_CONFIG

    def __init__(self, cause: str, fix: str):
        self.cause = _one_line(cause).rstrip(".")
        self.fix = _one_line(fix).rstrip(".")
        super().__init__(self.cause, self.fix)

    def __str__(self) -> str:
        return f"kdtree-backend: {self.cause}. Fix: {self.fix}."


class KdtreeModeError(KdtreeConfigError):
    """`KDTREE_VERIFY` (or another kdtree switch) holds a value outside its valid set."""

    def __init__(self, variable: str, value: str, valid: str = VALID_MODES_TEXT, fix: Optional[str] = None):
        self.variable = variable
        self.value = value
        self.valid = valid
        cause = f"{variable}={value!r} is not a valid value; valid values are: {valid}"
        super().__init__(cause, fix or f"set {variable} to one of: {valid} (or unset it for the default)")


class KdtreeLibraryError(KdtreeConfigError, RuntimeError):
    """The compiled kernel library cannot be used: missing, not loadable, wrong symbols/ABI/arch,
    no kernel image for this GPU, or a launch it refused. The one library-error class: the loader
    raises it at start-up, the op (kernel.ops) at the first call on a GPU; a RuntimeError too."""

    def __init__(self, cause: str, fix: str, *, path=None):
        self.path = path
        super().__init__(cause, fix)


def as_config_error(err: BaseException) -> KdtreeConfigError:
    """`err` itself when it is a KdtreeConfigError, else one that names it (an unexpected bug)."""
    if isinstance(err, KdtreeConfigError):
        return err
    return KdtreeConfigError(
        f"unexpected {type(err).__name__} while setting up the kdtree verify kernel: {err}",
        "report this as a bug with the full log; set KDTREE_VERIFY=off to serve without the kernel",
    )


def fail_fast(err: BaseException) -> NoReturn:
    """Print one line naming cause and fix to stderr, then stop the process with `err.exit_code`.

    Raises SystemExit (a BaseException), so `except Exception` blocks — SGLang's plugin loader,
    its scheduler's main loop — cannot swallow it.
    """
    err = as_config_error(err)
    try:
        sys.stderr.write(str(err) + "\n")
        sys.stderr.flush()
    except Exception:  # a closed stderr must not turn the exit into something catchable
        pass
    raise SystemExit(err.exit_code)
