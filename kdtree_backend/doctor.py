"""`kdtree-doctor` / `python -m kdtree_backend doctor`: can the configured mode run here?

Prints the sglang version (and whether it is supported), the mode, the kernel library (where,
whether it loads, its version and archs), the GPUs and their compute capability (or "no GPU"),
and whether the hook would be active. Exit 0 only when the configured mode can run here:
off needs a valid configuration; validate/on need a supported sglang, the installed entry
point, a library that loads, and at least one GPU, every one of them covered by the library.
Imports neither sglang nor torch, so it answers in well under a second.

Every KDTREE_* variable goes through the same validation as the launcher's (config.read_settings
for the plugin's switches, the launcher's own parser for its settings), and unknown KDTREE_* names
are reported (a typo such as KDTREE_VERIFIY leaves the mode off). With SGLang's arguments after
`--` (`kdtree-doctor -- --model-path ... --attention-backend triton ...`), the doctor also runs the
launcher's argument preflight, which applies the same static server check the plugin runs in
every SGLang process (kdtree_backend.sglang.server_check): it then says whether a TARGET_VERIFY
call of that server could reach the kernel, or names the flag that keeps it from running.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List, Mapping, Optional, Tuple

import kdtree_backend
from kdtree_backend.kernel import abi
from kdtree_backend.kernel import loader
from kdtree_backend.sglang import plugin
from kdtree_backend.config import (
    ENV_ALLOW_UNSUPPORTED_SGLANG,
    ENV_FAKE_GPU_CAPABILITY,
    ENV_KERNEL,
    ENV_LIB,
    ENV_MODE,
    SUPPORTED_SGLANG_VERSIONS,
    Mode,
    read_kernel_choice,
    read_mode,
    read_settings,
    resolve_kernel,
    unknown_variables,
)
from kdtree_backend.errors import KdtreeConfigError


def diagnose(environ: Optional[Mapping[str, str]] = None) -> Tuple[List[Tuple[str, str]], List[str], Optional[Mode]]:
    """Returns (rows to print, problems that stop the configured mode, mode or None)."""
    env = os.environ if environ is None else environ
    rows: List[Tuple[str, str]] = []
    problems: List[str] = []

    rows.append(("kdtree-backend", f"{kdtree_backend.__version__} ({Path(kdtree_backend.__file__).parent})"))
    rows.append(("python", f"{sys.version.split()[0]} ({sys.executable})"))

    # mode
    mode: Optional[Mode]
    try:
        mode = read_mode(env)
        rows.append(("mode", f"{ENV_MODE}={mode.value}" + ("" if ENV_MODE in env else " (default: unset)")))
    except KdtreeConfigError as err:
        mode = None
        rows.append(("mode", f"INVALID: {err}"))
        problems.append(str(err))
    active = mode in (Mode.VALIDATE, Mode.ON)
    if active:
        try:
            settings = read_settings(env)
            v = settings.validate
            rows.append(("settings", f"{ENV_KERNEL}={settings.kernel}; validate sample rate {v.sample_rate}, "
                                     f"atol {v.atol}, rtol {v.rtol}"))
        except KdtreeConfigError as err:
            rows.append(("settings", f"INVALID: {err}"))
            problems.append(str(err))
    try:
        from kdtree_backend.launcher.main import LaunchConfigError, split_args

        split_args([], env)
    except LaunchConfigError as err:
        rows.append(("launcher", f"INVALID: {err}"))
        problems.append(str(err))
    for warning in unknown_variables(env):
        rows.append(("variables", warning))

    # sglang
    version = plugin.sglang_version()
    if version is None:
        rows.append(("sglang", "not installed"))
    else:
        ok = version in SUPPORTED_SGLANG_VERSIONS
        rows.append(("sglang", f"{version} ({'supported' if ok else 'NOT supported; supported: ' + ', '.join(SUPPORTED_SGLANG_VERSIONS)})"))
    if active:
        try:
            plugin.check_sglang_version(env)
        except KdtreeConfigError as err:
            problems.append(str(err))
    elif version is not None and version not in SUPPORTED_SGLANG_VERSIONS:
        rows.append(("", f"(would need {ENV_ALLOW_UNSUPPORTED_SGLANG}=1 for validate/on)"))

    # entry point
    try:
        plugin.check_entry_point(env)
        rows.append(("entry point", f"{plugin.ENTRY_POINT_GROUP}: {plugin.ENTRY_POINT_NAME} -> {plugin.ENTRY_POINT_VALUE} (installed)"))
    except KdtreeConfigError as err:
        rows.append(("entry point", f"PROBLEM: {err}"))
        if active:
            problems.append(str(err))

    # library
    path = loader.library_path(env)
    origin = f"from {ENV_LIB}" if env.get(ENV_LIB, "").strip() else "default location"
    rows.append(("kernel library", f"{path} ({origin})"))
    lib = None
    try:
        lib = loader.load_library(check_devices=False, environ=env)
        rows.append(("", f"loads: yes; version {lib.version or '?'}; ABI {lib.abi_version}; built for {lib.archs_text()}"))
        warning = lib.diagnostics_warning()
        if warning:
            rows.append(("", f"WARNING: a {warning}"))
    except KdtreeConfigError as err:
        rows.append(("", f"loads: NO: {err}"))
        if active:
            problems.append(str(err))

    # GPUs
    try:
        probe = loader.probe_gpus(env)
    except KdtreeConfigError as err:
        probe = loader.GpuProbe([], f"GPU query failed: {err}")
        if active:
            problems.append(str(err))
    if probe.fake:
        rows.append(("GPUs", f"TEST MODE: {probe.note}"))
    elif ENV_FAKE_GPU_CAPABILITY in env:
        rows.append(("GPUs", f"note: {ENV_FAKE_GPU_CAPABILITY} is set but ignored (only honoured in tests)"))
    if not probe.gpus:
        rows.append(("GPUs" if not probe.fake else "", probe.note or "no GPU"))
        if active:
            problems.append(f"kdtree-backend: no GPU visible to this process ({probe.note or 'no GPU'}); "
                            f"{ENV_MODE}={mode.value} needs an NVIDIA GPU. Fix: run on a GPU machine "
                            f"(check nvidia-smi and CUDA_VISIBLE_DEVICES), or set {ENV_MODE}=off.")
    try:
        kernel_choice = read_kernel_choice(env)
    except KdtreeConfigError as err:
        kernel_choice = None
        rows.append(("kernel", f"{ENV_KERNEL}: INVALID: {err}"))
        problems.append(str(err))
    has_hopper = lib is not None and abi.library_has_hopper(lib.cdll)
    for index, name, cap in probe.gpus:
        text = f"{index}: {name}, compute capability {cap[0]}.{cap[1]}"
        if lib is not None:
            code = lib.code_for(cap)
            text += f" (supported by the library: {code.describe()})" if code else " (NOT supported by the library)"
            if kernel_choice is not None:
                try:
                    text += f", kernel path: {resolve_kernel(kernel_choice, cap, has_hopper)}"
                except ValueError as err:
                    text += ", kernel path: NONE"
                    if active:
                        problems.append(f"GPU {index}: {err}")
        rows.append(("GPUs" if index == 0 and not probe.fake else "", text))
    if active and lib is not None and probe.gpus:
        try:
            loader.check_library_devices(lib, probe.gpus)
        except KdtreeConfigError as err:
            problems.append(str(err))

    # hook
    if mode is None:
        rows.append(("hook", "no: the configuration is invalid; SGLang would stop at start-up (exit 78)"))
    elif not active:
        rows.append(("hook", f"not installed ({ENV_MODE}=off): SGLang serves stock Triton"))
    elif problems:
        rows.append(("hook", f"NOT active: with {ENV_MODE}={mode.value} SGLang would stop at start-up here (exit 78)"))
    else:
        rows.append(("hook", f"would be active ({mode.value}) on {plugin.TARGET}"))
    return rows, problems, mode


def check_server(sglang_args: List[str], mode: Optional[Mode], environ: Mapping[str, str]) -> Tuple[List[Tuple[str, str]], List[str]]:
    """The launcher's SGLang argument preflight (the same subprocess), for `kdtree-doctor -- <args>`."""
    from kdtree_backend.launcher.main import run_arg_preflight

    if mode is None:
        return [("server", "not checked: the mode is invalid")], []
    try:
        outcome = run_arg_preflight(sglang_args, mode.value, environ, 300.0)
    except Exception as err:  # run_arg_preflight raises the launcher's own errors: report them as problems
        return [("server", f"REFUSED: {err}")], [str(err)]
    rows = [("server", w) for w in outcome.get("warnings", [])]  # the outcome dict the launcher reads
    if outcome.get("status") == "error":
        line = str(KdtreeConfigError(outcome.get("cause", "?"), outcome.get("fix", "?")))
        return rows + [("server", f"REFUSED: {line}")], [line]
    rows.append(("server", f"SGLang arguments parsed and resolved; {'the kdtree kernel can serve target verify' if mode is not Mode.OFF else 'no kernel (off)'}"))
    return rows, []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kdtree-doctor", description=__doc__.split("\n\n")[0],
                                     usage="kdtree-doctor [-- SGLANG_ARGS ...]")
    argv = list(sys.argv[1:] if argv is None else argv)
    sglang_args = None
    if "--" in argv:
        i = argv.index("--")
        argv, sglang_args = argv[:i], argv[i + 1:]
    parser.parse_args(argv)
    rows, problems, mode = diagnose()
    if sglang_args is not None:
        more_rows, more_problems = check_server(sglang_args, mode, os.environ)
        rows += more_rows
        problems += more_problems
    width = max(len(label) for label, _ in rows)
    print("kdtree-backend doctor")
    for label, text in rows:
        print(f"  {label:<{width}}  {text}")
    if problems:
        what = f"{ENV_MODE}={mode.value}" if mode is not None else "this configuration"
        print(f"RESULT: {what} cannot run here:")
        for p in problems:
            print(f"  - {p}")
        return 1
    print(f"RESULT: OK, {ENV_MODE}={mode.value} can run here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
