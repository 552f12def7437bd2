"""SGLang argument preflight: SGLang's own parser and resolution, before any model or GPU work.

Runs in a short-lived subprocess of the launcher (`python -m kdtree_backend.launcher.preflight`):
importing sglang costs seconds and hundreds of MB, `prepare_server_args` calls
`logging.basicConfig(force=True)`, `import sglang` writes cache variables into `os.environ`, and
resolution may touch the GPU; none of that should live on in the unit's main process for the
server's lifetime, nor leak into the SGLang child's environment.

What it does, in order:
1. `load_plugins()` (other plugins may add flags); our own plugin is kept `off` here, the launcher
   has already checked the mode and the kernel library itself.
2. Flag analysis against the real parser: an unknown flag gets the closest real flag (known vLLM
   spellings first); a unique prefix that argparse would silently accept is warned about; an
   ambiguous prefix is an error.
3. `prepare_server_args(argv)`: argparse errors become one line.
4. Our own precondition: `KDTREE_VERIFY=validate` needs `--enable-metrics`.
5. `ServerArgs.resolve_once()`: reads the model's config.json, runs every check; a bare
   `AssertionError` or a `ValueError` becomes one line naming the options and the fix.
6. With validate/on: kdtree_backend.sglang.server_check, the static check the plugin also runs in
   every SGLang process: a configuration under which no verify call could reach the kernel (verify
   backend not triton, no speculative algorithm, fp8 KV cache, fp16, deterministic inference, too
   many drafts, a non-MLA model, ...) is refused. In every mode: speculative flags without
   --speculative-algorithm are warned about (SGLang ignores them).
7. A value given explicitly that resolution replaced (`--speculative-eagle-topk 1` rewrites the
   draft-token count) is warned about.

The outcome is a JSON file the launcher reads (status ok / help / error, the line, warnings, the
host and port to probe). Exit codes: 0 ok or help, 78 configuration error, 70 internal error.
"""
from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import linecache
import os
import re
import sys
import traceback
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from kdtree_backend.errors import EX_CONFIG, KdtreeConfigError

EX_SOFTWARE = 70

# vLLM's (and a few other engines') spellings -> SGLang's. Only entries whose SGLang flag exists in
# the running SGLang's parser are used, and only for flags SGLang does not itself accept.
VLLM_ALIASES: Dict[str, str] = {
    "--num-speculative-tokens": "--speculative-num-draft-tokens",
    "--speculative-model": "--speculative-draft-model-path",
    "--speculative-draft-tensor-parallel-size": "--speculative-draft-model-tp-size",
    "--speculative-method": "--speculative-algorithm",
    "--gpu-memory-utilization": "--mem-fraction-static",
    "--max-model-len": "--context-length",
    "--max-num-seqs": "--max-running-requests",
    "--max-num-batched-tokens": "--chunked-prefill-size",
    "--tokenizer": "--tokenizer-path",
    "--enforce-eager": "--disable-cuda-graph",
    "--block-size": "--page-size",
    "--seed": "--random-seed",
    "--enable-prefix-caching": "--disable-radix-cache (prefix caching is on by default in SGLang; omit the flag)",
    "--no-enable-prefix-caching": "--disable-radix-cache",
    "--tp": "--tp-size",
    "--pp": "--pp-size",
    "--dp": "--dp-size",
    "--ep": "--ep-size",
}

SPEC_TRIPLE = ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")


@dataclass
class Outcome:
    status: str = "ok"  # ok | help | error
    cause: str = ""
    fix: str = ""
    exit_code: int = 0
    warnings: List[str] = field(default_factory=list)
    help_text: str = ""
    address: Dict[str, object] = field(default_factory=dict)  # host, port, node_rank, dist_init_addr, ssl_keyfile
    enable_metrics: Optional[bool] = None
    details: str = ""  # a traceback, only for errors we could not classify

    @property
    def line(self) -> str:
        return str(KdtreeConfigError(self.cause, self.fix))


class PreflightError(KdtreeConfigError):
    """A configuration error found by the preflight: one line with cause and fix, exit code 78."""

    def __init__(self, cause: str, fix: str, details: str = ""):
        super().__init__(cause, fix)
        self.details = details


def one_line(text: str) -> str:
    return re.sub(r"\s+", " ", str(text)).strip()


# ------------------------------------------------------------------------------------------------
# Flag analysis (pure: testable without sglang)
# ------------------------------------------------------------------------------------------------


def suggest_flag(token: str, options: Iterable[str]) -> Tuple[Optional[str], str]:
    """The closest real flag for an unknown `token`, and where the suggestion comes from."""
    options = sorted(set(options))
    alias = VLLM_ALIASES.get(token)
    if alias is not None and alias.split()[0] in options:
        return alias, "vLLM's spelling"
    dashed = token.replace("_", "-")
    if dashed != token and dashed in options:
        return dashed, "underscores instead of dashes"
    long_opts = [o for o in options if o.startswith("--")]
    close = difflib.get_close_matches(token, long_opts, n=1, cutoff=0.6)
    if close:
        return close[0], "closest flag"
    # word overlap: --num-speculative-tokens ~ --speculative-num-draft-tokens
    words = set(token.lstrip("-").split("-"))
    best, score = None, 0.0
    for o in long_opts:
        ow = set(o.lstrip("-").split("-"))
        s = len(words & ow) / max(len(words | ow), 1)
        if s > score:
            best, score = o, s
    if best is not None and score >= 0.5:
        return best, "closest flag"
    return None, ""


def analyze_flags(argv: Sequence[str], options: Iterable[str]) -> Tuple[List[str], List[str]]:
    """(errors, warnings) for the flag tokens in argv, judged against the parser's option strings.

    Only `--long` tokens before a bare `--` are judged; values never start with `--` for argparse.
    """
    options = set(options)
    errors: List[str] = []
    warnings: List[str] = []
    unknown: List[Tuple[str, Optional[str], str]] = []
    for tok in argv:
        if tok == "--":
            break
        if not tok.startswith("--") or len(tok) <= 2:
            continue
        name = tok.split("=", 1)[0]
        if name in options:
            continue
        prefixed = sorted(o for o in options if o.startswith(name))
        if len(prefixed) == 1:
            warnings.append(
                f"warning: {name} is not an SGLang flag; argparse silently reads it as an abbreviation of "
                f"{prefixed[0]}. Fix: spell out {prefixed[0]}."
            )
        elif len(prefixed) > 1:
            shown = ", ".join(prefixed[:6]) + (", ..." if len(prefixed) > 6 else "")
            errors.append(f"{name} is ambiguous: it abbreviates {shown}|spell out the flag you mean")
        else:
            suggestion, why = suggest_flag(name, options)
            unknown.append((name, suggestion, why))
    if unknown:
        causes, fixes = [], []
        for name, suggestion, why in unknown:
            if suggestion is None:
                causes.append(f"{name}")
                fixes.append(f"remove {name} (no similar SGLang flag; see --help)")
            elif why == "vLLM's spelling":
                causes.append(f"{name} ({why})")
                fixes.append(f"use {suggestion} instead of {name}")
            else:
                causes.append(f"{name}")
                fixes.append(f"use {suggestion} (the closest SGLang flag) instead of {name}")
        noun = "argument" if len(unknown) == 1 else "arguments"
        errors.insert(0, f"unknown SGLang {noun} {', '.join(causes)}|{'; '.join(fixes)}")
    return errors, warnings


# ------------------------------------------------------------------------------------------------
# Exceptions from SGLang's checks -> one line
# ------------------------------------------------------------------------------------------------


def _innermost_frame(exc: BaseException):
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return None
    return last.tb_frame.f_code.co_filename, last.tb_lineno, last.tb_frame.f_code.co_name


def _given(value) -> bool:
    return value is not None


def explain_exception(exc: BaseException, sa) -> PreflightError:
    """Turn an exception from `resolve_once()` into a PreflightError with cause and fix."""
    where = _innermost_frame(exc)
    loc = ""
    if where is not None:
        fname, lineno, func = where
        loc = f"{os.path.basename(fname)}:{lineno}"
    msg = one_line(exc)

    if isinstance(exc, AssertionError) and where is not None and where[2] == "_handle_eagle_family" \
            and os.path.basename(where[0]) == "speculative_hook.py":
        steps = getattr(sa, "speculative_num_steps", None)
        topk = getattr(sa, "speculative_eagle_topk", None)
        draft = getattr(sa, "speculative_num_draft_tokens", None)
        if steps is None and (_given(topk) or _given(draft)):
            given = []
            if _given(topk):
                given.append(f"--speculative-eagle-topk {topk}")
            if _given(draft):
                given.append(f"--speculative-num-draft-tokens {draft}")
            verb = "was" if len(given) == 1 else "were"
            return PreflightError(
                f"{' and '.join(given)} {verb} given without --speculative-num-steps "
                f"(SGLang's bare assertion at {loc})",
                "give all three of --speculative-num-steps, --speculative-eagle-topk and "
                "--speculative-num-draft-tokens (e.g. 3, 4, 8), or none of them to let SGLang choose",
            )

    if isinstance(exc, AssertionError):
        source = ""
        if where is not None:
            source = one_line(linecache.getline(where[0], where[1]))
        what = f"`{source}`" if source else "an assertion"
        detail = f": {msg}" if msg else ""
        return PreflightError(
            f"SGLang's argument checks failed: {what} at {loc} in {where[2] if where else '?'}{detail}",
            "the options that check reads conflict; change one of them "
            "(python -m sglang.launch_server with the same arguments shows the full traceback)",
        )

    if isinstance(exc, ValueError):
        return PreflightError(f"SGLang rejected the arguments ({loc}): {msg}",
                              "change the options the message names")

    if isinstance(exc, OSError):
        model = getattr(sa, "model_path", None)
        return PreflightError(
            f"cannot read the model configuration for --model-path {model}: {type(exc).__name__}: {msg}",
            "point --model-path at a local model folder holding config.json, or at a hub id reachable from "
            "here (HF_HUB_OFFLINE=1 forbids downloads)",
        )

    if isinstance(exc, RuntimeError) and "accelerator" in msg.lower():
        return PreflightError(f"SGLang found no usable device: {msg}",
                              "run on a machine with a visible GPU (check CUDA_VISIBLE_DEVICES) or pass --device")

    return PreflightError(
        f"SGLang's argument resolution failed ({loc}): {type(exc).__name__}: {msg}",
        "read the traceback above; the arguments or the model folder are the usual cause",
        details="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


# ------------------------------------------------------------------------------------------------
# The preflight itself (imports sglang)
# ------------------------------------------------------------------------------------------------


def _argparse_error(stderr_text: str) -> str:
    for line in reversed(stderr_text.strip().splitlines()):
        if ": error: " in line:
            return line.split(": error: ", 1)[1]
    return one_line(stderr_text) or "argparse error"


def _maybe_merge_config(parser, argv: List[str]) -> List[str]:
    if "--config" not in argv:
        return argv
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    return ConfigArgumentMerger(parser).merge_config_with_args(argv)


def run_preflight(argv: Sequence[str], mode: str) -> Outcome:
    argv = list(argv)
    out = Outcome()

    from sglang.srt.plugins import load_plugins

    load_plugins()

    from sglang.srt.server_args import ServerArgs, prepare_server_args

    # 1. help: SGLang's own text, as `python -m sglang.launch_server --help` prints it
    probe_parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(probe_parser)
    options = set(probe_parser._option_string_actions)
    help_tokens = {o for o in options if o.startswith("--h") and "--help".startswith(o)} | {"-h", "--help"}

    try:
        merged = _maybe_merge_config(probe_parser, argv)
    except SystemExit as exc:
        raise PreflightError(f"cannot merge --config: exit {exc.code}", "check the --config file")
    except Exception as exc:
        raise PreflightError(f"cannot read the --config file: {type(exc).__name__}: {one_line(exc)}",
                             "check the --config path and its YAML")

    pre_dash = merged[: merged.index("--")] if "--" in merged else merged
    if not any(t in help_tokens for t in pre_dash):
        # 2. flags we can judge before argparse does
        errors, warnings = analyze_flags(merged, options)
        out.warnings.extend(warnings)
        if errors:
            cause, fix = errors[0].split("|", 1)
            raise PreflightError(cause, fix)

    # 3. SGLang's own parser (prints help and exits 0, or exits 2 on an error)
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            sa = prepare_server_args(argv)
    except SystemExit as exc:
        if exc.code in (0, None):
            out.status = "help"
            out.help_text = stdout.getvalue()
            return out
        raise PreflightError(f"SGLang's argument parser rejected the arguments: {_argparse_error(stderr.getvalue())}",
                             "correct that argument (the launcher's --help lists SGLang's flags)")

    out.address = {k: getattr(sa, k, None) for k in ("host", "port", "node_rank", "dist_init_addr", "ssl_keyfile")}
    out.enable_metrics = bool(getattr(sa, "enable_metrics", False))

    # 4. our own preconditions
    if mode == "validate" and not out.enable_metrics:
        raise PreflightError(
            "KDTREE_VERIFY=validate publishes its comparison through SGLang's /metrics, which exists only "
            "with --enable-metrics, and it is not set",
            "add --enable-metrics to the SGLang arguments (or set KDTREE_VERIFY=off)",
        )

    # 5. SGLang's resolution: every check, reads config.json, loads no weights
    try:
        sa.resolve_once()
    except Exception as exc:  # AssertionError, ValueError, OSError, ...
        raise explain_exception(exc, sa) from exc

    # 6. would the kernel ever run? It replaces TritonAttnBackend.forward_extend in TARGET_VERIFY.
    if mode in ("validate", "on"):
        check_kernel_reachable(sa, mode, out)
    warn_spec_flags_without_algorithm(argv, sa, out)
    # 7. values the operator gave that SGLang's resolution silently replaced
    warn_overridden(sa, out)
    return out


# Fields whose explicit value SGLang's resolution may replace with only a log line (e.g.
# `--speculative-eagle-topk 1` forces num-draft-tokens to num-steps + 1).
WATCHED_FIELDS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                  "attention_backend", "prefill_attention_backend", "decode_attention_backend")


def warn_overridden(sa, out: Outcome) -> None:
    try:
        from sglang.srt.arg_groups.model_override_base import resolved_view

        rv = resolved_view(sa)
    except Exception:
        return
    for name in WATCHED_FIELDS:
        given = getattr(sa, name, None)
        if given is None:
            continue
        try:
            resolved = getattr(rv, name)
        except Exception:
            continue
        if resolved != given:
            flag = "--" + name.replace("_", "-")
            out.warnings.append(
                f"warning: SGLang replaced {flag} {given} by {resolved} while resolving the arguments. "
                f"Fix: pass {flag} {resolved} explicitly, or change the options that force it."
            )


def check_kernel_reachable(sa, mode: str, out: Outcome) -> None:
    """Refuse a configuration under which no TARGET_VERIFY call could ever reach the kernel.

    The same static check the plugin runs in every SGLang process (kdtree_backend.sglang.server_check):
    the first refusal is the error line, the others are named in it.
    """
    from kdtree_backend.sglang import server_check

    result = server_check.check(sa, mode)
    out.warnings.extend(result.warnings)
    err = result.error(mode)
    if err is not None:
        raise PreflightError(err.cause, err.fix)


def warn_spec_flags_without_algorithm(argv: Sequence[str], sa, out: Outcome) -> None:
    """--speculative-eagle-topk / -num-draft-tokens / -num-steps without --speculative-algorithm: SGLang
    ignores them silently (the seed incident's mistake). Warned about in every mode."""
    from kdtree_backend.sglang.server_check import speculative_algorithm

    if speculative_algorithm(sa) is not None:
        return
    given = [t.split("=", 1)[0] for t in argv if t.split("=", 1)[0] in SPEC_TRIPLE]
    if given:
        out.warnings.append(
            f"warning: {', '.join(dict.fromkeys(given))} {'is' if len(set(given)) == 1 else 'are'} given without "
            f"--speculative-algorithm, so SGLang ignores {'it' if len(set(given)) == 1 else 'them'} and runs without "
            f"speculative decoding. Fix: add --speculative-algorithm (e.g. EAGLE), or drop the speculative flags."
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kdtree_backend.launcher.preflight",
                                 description="internal: the launcher's SGLang argument preflight")
    ap.add_argument("--result", required=True, help="where to write the JSON outcome")
    ap.add_argument("--mode", default="off", choices=["off", "validate", "on"])
    ap.add_argument("sglang_args", nargs=argparse.REMAINDER)
    ns = ap.parse_args(argv)
    sglang_args = list(ns.sglang_args)
    if sglang_args[:1] == ["--"]:
        sglang_args = sglang_args[1:]

    try:
        out = run_preflight(sglang_args, ns.mode)
    except PreflightError as exc:
        out = Outcome(status="error", cause=exc.cause, fix=exc.fix, exit_code=EX_CONFIG, details=exc.details)
    except BaseException as exc:  # a bug here must not pass for "arguments fine"
        out = Outcome(status="error", cause=f"the argument preflight itself failed: {type(exc).__name__}: {one_line(exc)}",
                      fix="report this; set KDTREE_ARG_PREFLIGHT=0 to launch without the preflight",
                      exit_code=EX_SOFTWARE,
                      details="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    with open(ns.result, "w") as fh:
        json.dump(asdict(out), fh)
    return out.exit_code


if __name__ == "__main__":
    sys.exit(main())
