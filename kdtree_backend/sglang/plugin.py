"""SGLang entry point: `sglang.srt.plugins: kdtree = kdtree_backend.sglang.plugin:register`.

SGLang calls `register()` through `load_plugins()` in EVERY process it starts (the main HTTP
process, each spawned scheduler, the DP controller, the detokenizer), before it has parsed its
arguments or chosen a GPU. `register()`:

- KDTREE_VERIFY=off (default): installs nothing. Zero cost on the serving path.
- validate / on: checks the sglang version, loads and checks the kernel library (symbols, ABI,
  the archs of every visible GPU), registers `kdtree_backend.sglang.hook.forward_extend_hook` as an
  AROUND hook on `TritonAttnBackend.forward_extend` through SGLang's own `HookRegistry`, plus a
  guard (AROUND on `TritonAttnBackend.__init__`) that re-checks, whenever a backend is built,
  that the forward_extend of the backend's class is still ours. It then applies the registry's
  hooks right away (idempotent: `apply_hooks()` skips targets already patched, so the call
  `load_plugins()` makes after us is a no-op for ours) and verifies the attribute really is our
  wrapper.

Any failure in validate/on goes through `fail_fast` (SystemExit 78): `load_plugins()` catches
`Exception` and would otherwise leave this process serving stock Triton silently.
"""
from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
from typing import Mapping, NoReturn, Optional

import kdtree_backend
from kdtree_backend.config import (
    ENV_ALLOW_UNSUPPORTED_SGLANG,
    ENV_MODE,
    SUPPORTED_SGLANG_VERSIONS,
    Mode,
    allow_unsupported_sglang,
    read_mode,
    read_settings,
    unknown_variables,
)
from kdtree_backend.errors import KdtreeConfigError, as_config_error, fail_fast

logger = logging.getLogger("kdtree_backend.sglang.plugin")

ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "kdtree"
ENTRY_POINT_VALUE = "kdtree_backend.sglang.plugin:register"
# The value before the package was split by part: kdtree_backend/plugin.py re-exports register, so an
# environment installed then still loads the same function until it is reinstalled.
LEGACY_ENTRY_POINT_VALUES = ("kdtree_backend.plugin:register",)

BACKEND_CLASS = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend"
TARGET = BACKEND_CLASS + ".forward_extend"
GUARD_TARGET = BACKEND_CLASS + ".__init__"
# Every SGLang process calls runtime_context.publish(server_args, role=...) with the RESOLVED
# arguments before it builds anything (the HTTP process before it spawns the schedulers, each
# scheduler, the detokenizer, the DP controller): the static check (server_check) runs there.
PUBLISH_TARGET = "sglang.srt.runtime_context.publish"

_OFF_FIX = f"or set {ENV_MODE}=off to serve without the kernel"

# Process-global state: the mode this process armed, or None.
_armed_mode: Optional[Mode] = None
# How many hooks the registry held for each of our targets when register() applied them. A
# plugin that SGLang runs after ours and that registers on one of these targets is skipped by the
# registry (target already patched): the guard logs that once, loudly.
_applied_counts: dict = {}
_late_hooks_reported = False
# The error register() stopped the process with. Kept so that, should some caller ever swallow
# that SystemExit (a future load_plugins() catching BaseException), the guard re-raises it when
# the first backend is built.
_failure: Optional[KdtreeConfigError] = None
_guard_registered = False


# --- checks shared by register() and the launcher's preflight --------------------------------

def sglang_version() -> Optional[str]:
    """The installed sglang's version from its distribution metadata (no import), or None.

    An sglang run from a source tree without metadata, already imported by the caller, reports
    its own `sglang.__version__`.
    """
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        module = sys.modules.get("sglang")
        return getattr(module, "__version__", None) if module is not None else None


def check_sglang_version(environ: Optional[Mapping[str, str]] = None) -> str:
    version = sglang_version()
    supported = ", ".join(SUPPORTED_SGLANG_VERSIONS)
    if version is None:
        raise KdtreeConfigError(
            "sglang is not installed in this Python environment",
            f"install sglang=={SUPPORTED_SGLANG_VERSIONS[-1]} (pip install 'kdtree-backend[sglang]'), {_OFF_FIX}",
        )
    if version not in SUPPORTED_SGLANG_VERSIONS and not allow_unsupported_sglang(environ):
        raise KdtreeConfigError(
            f"sglang {version} is installed but kdtree-backend supports sglang {supported} only "
            f"(the hook depends on TritonAttnBackend.forward_extend's internals)",
            f"install sglang=={SUPPORTED_SGLANG_VERSIONS[-1]}, or set "
            f"{ENV_ALLOW_UNSUPPORTED_SGLANG}=1 to try this version at your own risk, {_OFF_FIX}",
        )
    return version


def check_entry_point(environ: Optional[Mapping[str, str]] = None) -> None:
    """SGLang will run this plugin in every process: it is installed, and not filtered out."""
    env = os.environ if environ is None else environ
    eps = [ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT_NAME]
    if not eps or eps[0].value.replace(" ", "") not in (ENTRY_POINT_VALUE, *LEGACY_ENTRY_POINT_VALUES):
        raise KdtreeConfigError(
            f"the SGLang entry point {ENTRY_POINT_GROUP}:{ENTRY_POINT_NAME} -> {ENTRY_POINT_VALUE} is not "
            f"installed in this Python environment ({sys.executable}), so SGLang's scheduler "
            f"processes would never load the kdtree hook",
            f"pip install kdtree-backend (or `pip install -e .` in its checkout) into this environment, {_OFF_FIX}",
        )
    allowed = env.get("SGLANG_PLUGINS", "")
    if allowed:
        names = {x.strip() for x in allowed.split(",") if x.strip()}
        if ENTRY_POINT_NAME not in names:
            raise KdtreeConfigError(
                f"SGLANG_PLUGINS={allowed!r} does not list the plugin {ENTRY_POINT_NAME!r}, so SGLang "
                f"would not load the kdtree hook",
                f"add {ENTRY_POINT_NAME} to SGLANG_PLUGINS (or unset it), {_OFF_FIX}",
            )


def preflight_checks(environ: Optional[Mapping[str, str]] = None) -> Mode:
    """Mode, sglang version, entry point and kernel library checks; raises KdtreeConfigError.

    For the launcher, before SGLang loads anything. With off, only the mode is checked.
    """
    from kdtree_backend.kernel import loader

    mode = read_mode(environ)
    if mode is Mode.OFF:
        return mode
    read_settings(environ)
    check_sglang_version(environ)
    check_entry_point(environ)
    loader.load_library(check_devices=True, environ=environ)
    return mode


# --- hook installation -------------------------------------------------------------------------

def _wrapper_chain_holds(fn, predicate) -> bool:
    """Walk `fn`, the functions in its closure and its `__wrapped__` chain for `predicate`."""
    seen = 0
    while fn is not None and seen < 32:
        seen += 1
        if predicate(fn):
            return True
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                content = cell.cell_contents
            except ValueError:  # empty cell
                continue
            if callable(content) and content is not fn and predicate(content):
                return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def wraps_kdtree_hook(fn) -> bool:
    """True when `fn` is our forward_extend hook or a HookRegistry wrapper (chain) around it.

    The registry's AROUND wrapper is `functools.wraps(original)`: it carries the ORIGINAL's
    attributes and `__wrapped__ = original`; the hook itself sits in the wrapper's closure.
    """
    from kdtree_backend.sglang.hook import is_kdtree_hook

    return _wrapper_chain_holds(fn, lambda f: bool(is_kdtree_hook(f)))


def wraps_init_guard(fn) -> bool:
    return _wrapper_chain_holds(fn, lambda f: f is _backend_init_guard)


def _backend_init_guard(original_fn, self, *args, **kwargs):
    """AROUND hook on TritonAttnBackend.__init__: refuse to build a backend that is not ours."""
    if _failure is not None:
        fail_fast(_failure)
    if _armed_mode is not None and not wraps_kdtree_hook(getattr(type(self), "forward_extend", None)):
        fail_fast(KdtreeConfigError(
            f"{ENV_MODE}={_armed_mode.value} but {type(self).__module__}.{type(self).__qualname__}"
            f".forward_extend is not wrapped by the kdtree hook in process {os.getpid()} "
            f"(something replaced it after the plugin loaded); this backend would serve stock Triton",
            f"find the other plugin or code that patches TritonAttnBackend (see SGLang's "
            f"'Applied N hook(s)' log lines), {_OFF_FIX}",
        ))
    _report_late_hooks()
    return original_fn(self, *args, **kwargs)


def _report_late_hooks() -> None:
    global _late_hooks_reported
    if _late_hooks_reported or not _applied_counts:
        return
    _late_hooks_reported = True
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry

        late = [t for t, n in _applied_counts.items() if len(HookRegistry._hooks.get(t, ())) > n]
    except Exception:  # diagnostics only: never break backend construction
        return
    if late:
        logger.error(
            "kdtree-backend applied its hooks on %s before another plugin registered more hooks on "
            "the same target(s); SGLang's HookRegistry does not apply those late hooks (the target is "
            "already patched). The kdtree hook is active; the other plugin's hook is not.",
            ", ".join(late),
        )


class _CaptureErrors(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.ERROR)
        self.messages = []

    def emit(self, record):
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += f": {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        self.messages.append(text)


def _install_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kdtree_backend.sglang.hook import forward_extend_hook

    HookRegistry.register(TARGET, forward_extend_hook, HookType.AROUND)
    HookRegistry.register(PUBLISH_TARGET, _publish_guard, HookType.AROUND)
    _register_guard()

    capture = _CaptureErrors()
    registry_logger = logging.getLogger("sglang.srt.plugins.hook_registry")
    registry_logger.addHandler(capture)
    try:
        HookRegistry.apply_hooks()
    finally:
        registry_logger.removeHandler(capture)
    for target in (TARGET, GUARD_TARGET, PUBLISH_TARGET):
        _applied_counts[target] = len(HookRegistry._hooks.get(target, ()))

    import pkgutil

    cls = pkgutil.resolve_name(BACKEND_CLASS)
    if not wraps_kdtree_hook(cls.forward_extend):
        detail = "; ".join(capture.messages) or "HookRegistry reported no error"
        raise KdtreeConfigError(
            f"{TARGET} is not wrapped by the kdtree hook after applying SGLang's HookRegistry ({detail})",
            f"check that sglang {', '.join(SUPPORTED_SGLANG_VERSIONS)} is installed intact, {_OFF_FIX}",
        )
    publish = pkgutil.resolve_name(PUBLISH_TARGET)
    if not wraps_publish_guard(publish):
        detail = "; ".join(capture.messages) or "HookRegistry reported no error"
        raise KdtreeConfigError(
            f"{PUBLISH_TARGET} did not receive the kdtree server check ({detail}), so a configuration under "
            f"which the kernel never runs would not be refused",
            f"check that sglang {', '.join(SUPPORTED_SGLANG_VERSIONS)} is installed intact, {_OFF_FIX}",
        )
    if not wraps_init_guard(cls.__init__):
        detail = "; ".join(capture.messages) or "HookRegistry reported no error"
        raise KdtreeConfigError(
            f"{GUARD_TARGET} did not receive the kdtree guard hook ({detail})",
            f"check that sglang {', '.join(SUPPORTED_SGLANG_VERSIONS)} is installed intact, {_OFF_FIX}",
        )


_checked_args: set = set()  # id()s of the ServerArgs this process has checked


def _publish_guard(original_fn, server_args, *args, **kwargs):
    """AROUND hook on runtime_context.publish: refuse, in this process, a configuration under which
    no TARGET_VERIFY call could reach the kernel (exit 78, the same line as the launcher's preflight)."""
    if _armed_mode is not None and server_args is not None and id(server_args) not in _checked_args:
        from kdtree_backend.sglang import server_check

        try:
            result = server_check.check(server_args, _armed_mode.value)
        except Exception as err:  # a bug in the check must not pass for "the kernel will run"
            _fail(err)
        err = result.error(_armed_mode.value)
        if err is not None:
            _fail(err)
        _checked_args.add(id(server_args))
        facts = result.facts
        _startup_line(
            f"kdtree-backend: server check passed in pid {os.getpid()} (role {kwargs.get('role', '?')}): target "
            f"verify on {facts.get('verify_backend')}, {facts.get('speculative_algorithm')} with "
            f"{facts.get('speculative_num_draft_tokens')} draft tokens, model dtype {facts.get('model_dtype')}, "
            f"KV cache {facts.get('kv_cache_dtype')}, page size {facts.get('page_size')}"
        )
    return original_fn(server_args, *args, **kwargs)


def wraps_publish_guard(fn) -> bool:
    return _wrapper_chain_holds(fn, lambda f: f is _publish_guard)


def _register_guard() -> None:
    global _guard_registered
    if _guard_registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(GUARD_TARGET, _backend_init_guard, HookType.AROUND)
    _guard_registered = True


def _startup_line(text: str) -> None:
    """One start-up line per process, visible even before SGLang configures logging."""
    if logger.hasHandlers():
        logger.info(text)
    else:
        try:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        except Exception:
            pass


def _fail(err: BaseException) -> NoReturn:
    """Stop the process (fail_fast), remembering why for the guard.

    Under load_plugins() the registry is already imported: the guard is registered too, so that if
    a caller ever swallowed the SystemExit (say a future load_plugins() catching BaseException
    before its own apply_hooks()), the first TritonAttnBackend built re-raises this error instead
    of serving stock Triton.
    """
    global _armed_mode, _failure
    _armed_mode = None
    _failure = as_config_error(err)
    if "sglang.srt.plugins.hook_registry" in sys.modules:
        try:
            _register_guard()
        except Exception:
            pass
    fail_fast(_failure)


def register() -> None:
    """The entry point SGLang's `load_plugins()` runs in every process. See module docstring."""
    global _armed_mode
    try:
        mode = read_mode()
    except KdtreeConfigError as err:
        _fail(err)
    if mode is Mode.OFF:
        for warning in unknown_variables():  # KDTREE_VERIFIY=on leaves the mode off: say so
            _startup_line(f"kdtree-backend: {warning}")
        _startup_line(
            f"kdtree-backend {kdtree_backend.__version__}: {ENV_MODE}=off, hook not installed (pid {os.getpid()})"
        )
        return
    if _armed_mode is not None:
        return  # already armed in this process (register() called twice)
    try:
        from kdtree_backend.kernel import loader

        kernel_choice = read_settings().kernel
        version = check_sglang_version()
        lib = loader.get_library()
        # GPUs that no SASS arch of the library covers run the portable kernel from its PTX: say so.
        jit_gpus = [(i, name, cap, code) for i, name, cap in loader.probe_gpus().gpus
                    for code in [lib.code_for(cap)] if code is not None and code.kind == "ptx"]
        _armed_mode = mode
        _install_hooks()
    except Exception as err:  # anything would be swallowed by load_plugins(): stop here
        _fail(err)
    for warning in unknown_variables():
        _startup_line(f"kdtree-backend: {warning}")
    warning = lib.diagnostics_warning()
    if warning:
        _startup_line(f"kdtree-backend: WARNING: the kernel library {lib.path} is a {warning}")
    for index, name, cap, code in jit_gpus:
        _startup_line(f"kdtree-backend: GPU {index} ({name}, compute capability {cap[0]}.{cap[1]}) has no machine "
                      f"code in the kernel library; it runs {code.describe()}")
    _startup_line(
        f"kdtree-backend {kdtree_backend.__version__}: {ENV_MODE}={mode.value}, hook installed on "
        f"{TARGET} (sglang {version}; KDTREE_KERNEL={kernel_choice}; kernel library {lib.path}, "
        f"version {lib.version or '?'}, "
        f"ABI {lib.abi_version}, {lib.archs_text()}; pid {os.getpid()})"
    )


def armed_mode() -> Optional[Mode]:
    """The mode register() armed in this process, or None (off / not loaded)."""
    return _armed_mode
