"""KDTREE_VERIFY parsing and the fail-fast error type."""
from __future__ import annotations

import pytest

from conftest import clean_env, run_python
from kdtree_backend.config import ENV_MODE, Mode, allow_unsupported_sglang, read_mode
from kdtree_backend.errors import (
    KdtreeConfigError,
    KdtreeLibraryError,
    KdtreeModeError,
    fail_fast,
)

BAD_VALUES = ["vaildate", "1", "true", "", "  ", "offf", "on,validate", "0", "yes", "enable"]


def test_unset_means_off():
    assert read_mode({}) is Mode.OFF


@pytest.mark.parametrize(
    "raw, mode",
    [("off", Mode.OFF), ("OFF", Mode.OFF), (" Validate\n", Mode.VALIDATE), ("validate", Mode.VALIDATE),
     ("on", Mode.ON), ("\tON ", Mode.ON)],
)
def test_valid_values(raw, mode):
    assert read_mode({ENV_MODE: raw}) is mode


def test_mode_is_a_str_enum():
    assert Mode.VALIDATE == "validate" and str(Mode.ON) == "on"


@pytest.mark.parametrize("raw", BAD_VALUES)
def test_bad_values_raise_naming_variable_value_and_valid_values(raw):
    with pytest.raises(KdtreeModeError) as info:
        read_mode({ENV_MODE: raw})
    err = info.value
    text = str(err)
    assert isinstance(err, KdtreeConfigError)
    assert "KDTREE_VERIFY" in text and repr(raw) in text
    assert "off, validate, on" in text
    assert "\n" not in text and text.startswith("kdtree-backend: ")
    assert err.exit_code == 78 and err.variable == ENV_MODE and err.value == raw


def test_error_format_and_attributes():
    err = KdtreeLibraryError("the library is gone.", "build it\n again", path="/x")
    assert str(err) == "kdtree-backend: the library is gone. Fix: build it again."
    assert err.cause == "the library is gone" and err.fix == "build it again" and err.path == "/x"
    assert KdtreeConfigError.exit_code == 78


def test_fail_fast_prints_one_line_and_escapes_except_exception(capsys):
    err = KdtreeConfigError("something is wrong", "do the right thing")
    with pytest.raises(SystemExit) as info:
        try:
            fail_fast(err)
        except Exception:  # what SGLang's load_plugins() does around a plugin
            pytest.fail("fail_fast was swallowed by `except Exception`")
    assert info.value.code == 78
    assert capsys.readouterr().err == "kdtree-backend: something is wrong. Fix: do the right thing.\n"


def test_fail_fast_wraps_unexpected_exceptions(capsys):
    with pytest.raises(SystemExit) as info:
        fail_fast(RuntimeError("boom"))
    assert info.value.code == 78
    assert "unexpected RuntimeError" in capsys.readouterr().err


@pytest.mark.parametrize("raw, expected", [(None, False), ("", False), ("0", False), ("1", True)])
def test_allow_unsupported_sglang(raw, expected):
    env = {} if raw is None else {"KDTREE_ALLOW_UNSUPPORTED_SGLANG": raw}
    assert allow_unsupported_sglang(env) is expected


def test_allow_unsupported_sglang_rejects_other_values():
    with pytest.raises(KdtreeModeError, match="KDTREE_ALLOW_UNSUPPORTED_SGLANG"):
        allow_unsupported_sglang({"KDTREE_ALLOW_UNSUPPORTED_SGLANG": "yes"})


# The entry point itself, in a fresh process, for every bad value: the process must stop with 78
# and one line naming variable, value and valid values (no sglang import happens on this path).
_REGISTER = "from kdtree_backend.sglang import plugin; plugin.register(); print('REGISTER RETURNED')"


@pytest.mark.parametrize("raw", ["vaildate", "1", "true", ""])
def test_register_with_bad_mode_exits_78(raw):
    proc = run_python(_REGISTER, clean_env(KDTREE_VERIFY=raw))
    assert proc.returncode == 78, proc.stderr
    assert "REGISTER RETURNED" not in proc.stdout
    line = proc.stderr.strip().splitlines()[-1]
    assert "KDTREE_VERIFY" in line and repr(raw) in line and "off, validate, on" in line


def test_register_off_installs_nothing_and_does_not_import_sglang():
    code = _REGISTER + "; import sys; print('sglang' in sys.modules, 'torch' in sys.modules)"
    proc = run_python(code, clean_env(KDTREE_VERIFY=" OFF "))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["REGISTER", "RETURNED", "False", "False"]
    assert "KDTREE_VERIFY=off" in proc.stderr


# --- validate settings: checked at plugin load and in the launcher's preflight ------------------

@pytest.mark.parametrize(
    "name, raw",
    [("KDTREE_VALIDATE_SAMPLE_RATE", "0"), ("KDTREE_VALIDATE_SAMPLE_RATE", "1.5"), ("KDTREE_VALIDATE_SAMPLE_RATE", "all"),
     ("KDTREE_VALIDATE_ATOL", "-1"), ("KDTREE_VALIDATE_RTOL", "nan")],
)
def test_bad_validate_settings_fail_preflight(name, raw):
    from kdtree_backend.sglang import plugin
    from kdtree_backend.errors import KdtreeModeError

    with pytest.raises(KdtreeModeError) as info:
        plugin.preflight_checks({"KDTREE_VERIFY": "validate", name: raw})
    assert name in str(info.value) and repr(raw) in str(info.value) or raw in str(info.value)


def test_validate_settings_defaults_and_values():
    from kdtree_backend.config import read_validate_settings

    assert read_validate_settings({}) == read_validate_settings({"KDTREE_VALIDATE_ATOL": " "})
    s = read_validate_settings({"KDTREE_VALIDATE_SAMPLE_RATE": "0.25", "KDTREE_VALIDATE_RTOL": "1e-3"})
    assert (s.sample_rate, s.rtol) == (0.25, 1e-3)


# --- kernel selection: KDTREE_KERNEL ------------------------------------------------------------

@pytest.mark.parametrize("raw, choice", [(None, "auto"), ("", "auto"), (" Hopper ", "hopper"), ("portable", "portable"),
                                         ("auto", "auto")])
def test_kernel_choice_values(raw, choice):
    from kdtree_backend.config import read_kernel_choice

    assert read_kernel_choice({} if raw is None else {"KDTREE_KERNEL": raw}) == choice


@pytest.mark.parametrize("raw", ["wgmma", "1", "sm90", "portable,hopper", "rows32"])
def test_bad_kernel_choice_fails_preflight_naming_valid_values(raw):
    from kdtree_backend.sglang import plugin
    from kdtree_backend.errors import KdtreeModeError

    with pytest.raises(KdtreeModeError) as info:
        plugin.preflight_checks({"KDTREE_VERIFY": "on", "KDTREE_KERNEL": raw})
    text = str(info.value)
    assert "KDTREE_KERNEL" in text and raw in text and "auto, portable, hopper" in text


def test_bad_kernel_choice_stops_the_plugin_at_load():
    proc = run_python(_REGISTER, clean_env(KDTREE_VERIFY="on", KDTREE_KERNEL="fast"))
    assert proc.returncode == 78, proc.stderr
    assert "REGISTER RETURNED" not in proc.stdout
    assert "KDTREE_KERNEL" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("choice, cap, has_hopper, path", [
    ("auto", (9, 0), True, "hopper"), ("auto", (9, 0), False, "portable"), ("auto", (12, 0), True, "portable"),
    ("auto", (8, 0), True, "portable"), ("portable", (9, 0), True, "portable"), ("hopper", (9, 0), True, "hopper"),
])
def test_resolve_kernel(choice, cap, has_hopper, path):
    from kdtree_backend.config import resolve_kernel

    assert resolve_kernel(choice, cap, has_hopper) == path


@pytest.mark.parametrize("cap, has_hopper, needle", [((12, 0), True, "compute capability 12.0"),
                                                     ((9, 0), False, "built without the Hopper kernel")])
def test_forced_hopper_never_degrades_to_portable(cap, has_hopper, needle):
    from kdtree_backend.config import resolve_kernel

    with pytest.raises(ValueError, match=needle) as info:
        resolve_kernel("hopper", cap, has_hopper)
    assert "Fix:" in str(info.value)


def test_every_kdtree_variable_the_package_reads_is_known():
    """A KDTREE_* name outside config.KNOWN_VARIABLES is reported as a typo: the list must hold every
    variable the package's sources (and the launcher's options) name."""
    import re
    from pathlib import Path

    from kdtree_backend import config

    root = Path(config.__file__).resolve().parent
    named = set()
    for path in root.rglob("*.py"):
        named |= set(re.findall(r"\bKDTREE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    named -= {"KDTREE_ABI_VERSION", "KDTREE_MAX_QO_LEN", "KDTREE_CONFIG_PORTABLE", "KDTREE_CONFIG_HOPPER",
              "KDTREE_CONFIG_RESERVED_1", "KDTREE_WITH_HOPPER", "KDTREE_PROFILER", "KDTREE_BUILT_ARCHS",
              "KDTREE_LIBRARY_VERSION", "KDTREE_OK",  # C macros and enum names quoted in comments
              "KDTREE_VERIFIY"}  # the typo the comments use as the example of an unknown variable
    named = {n for n in named if not n.startswith(("KDTREE_ERR_", "KDTREE_CONFIG_"))}
    missing = sorted(named - set(config.KNOWN_VARIABLES))
    assert not missing, f"add to config.KNOWN_VARIABLES: {missing}"


def test_unknown_kdtree_variables_are_named_with_the_closest_known_one():
    from kdtree_backend.config import unknown_variables

    warnings = unknown_variables({"KDTREE_VERIFIY": "on", "KDTREE_VERIFY": "off", "OTHER": "1"})
    assert warnings == ["warning: KDTREE_VERIFIY is not a kdtree-backend variable and is ignored "
                        "(did you mean KDTREE_VERIFY?)"]


def test_read_settings_names_the_first_bad_variable():
    from kdtree_backend.config import read_settings
    from kdtree_backend.errors import KdtreeModeError

    s = read_settings({"KDTREE_VERIFY": "on", "KDTREE_KERNEL": "portable", "KDTREE_VALIDATE_SAMPLE_RATE": "0.5"})
    assert s.kernel == "portable" and s.validate.sample_rate == 0.5
    for env, name in [({"KDTREE_VALIDATE_SAMPLE_RATE": "abc"}, "KDTREE_VALIDATE_SAMPLE_RATE"),
                      ({"KDTREE_KERNEL": "fast"}, "KDTREE_KERNEL"),
                      ({"KDTREE_ALLOW_UNSUPPORTED_SGLANG": "yes"}, "KDTREE_ALLOW_UNSUPPORTED_SGLANG")]:
        with pytest.raises(KdtreeModeError, match=name):
            read_settings({"KDTREE_VERIFY": "on", **env})
