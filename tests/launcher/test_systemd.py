"""The systemd files: lint (systemd-analyze verify, failing on any output), sandbox exposure (systemd-analyze
security), content, env file, arguments.

The lint is skipped ONLY when systemd-analyze is absent on this machine; CI installs it (Debian
package `systemd`; `systemd/lint.sh` installs it itself when run outside pytest).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "systemd"
LINT = SYSTEMD / "lint.sh"

# CI sets KDTREE_REQUIRE_SYSTEMD_ANALYZE=1 (after `systemd/lint.sh` installed it): there, a missing
# systemd-analyze is a failure, not a skip.
_REQUIRED = os.environ.get("KDTREE_REQUIRE_SYSTEMD_ANALYZE") == "1"
needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None and not _REQUIRED,
                                   reason="systemd-analyze not installed (CI installs the Debian package systemd)")


def parse_unit(path: Path) -> dict:
    """{section: [(key, value), ...]} with backslash continuations joined (order kept)."""
    sections: dict = {}
    current = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip() if pending else raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections.setdefault(current, [])
            continue
        key, _, value = line.partition("=")
        sections[current].append((key.strip(), re.sub(r"\s+", " ", value.strip())))
    return sections


def values(sections, section, key):
    return [v for k, v in sections.get(section, []) if k == key]


def run_lint(directory: Path):
    return subprocess.run(["bash", str(LINT), str(directory)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, KDTREE_LINT_NO_INSTALL="1"))


@needs_analyze
def test_units_pass_systemd_analyze_verify_without_any_output():
    proc = run_lint(SYSTEMD)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    assert "OK" in proc.stdout


@needs_analyze
@pytest.mark.parametrize(
    "edit, needle",
    [
        (("TimeoutStartSec=35min", "TimeoutStartSecs=35min"), "Unknown key 'TimeoutStartSecs'"),  # exit 0, warns
        (("ExecStart=\nExecStart=", "ExecStart="), "more than one ExecStart="),
    ],
)
def test_lint_fails_on_warnings_too(tmp_path, edit, needle):
    for f in ("50-kdtree.conf", "sglang-kdtree.service"):
        shutil.copy(SYSTEMD / f, tmp_path / f)
    dropin = tmp_path / "50-kdtree.conf"
    text = dropin.read_text()
    assert edit[0] in text
    dropin.write_text(text.replace(edit[0], edit[1], 1))
    proc = run_lint(tmp_path)
    assert proc.returncode == 1
    assert needle in proc.stderr


def exposure(unit: Path, env=None) -> float:
    """`systemd-analyze security --offline=yes` (no running systemd needed): the overall exposure, 0-10."""
    proc = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
                          capture_output=True, text=True, timeout=60, env=env)
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", proc.stdout)
    assert m, f"no exposure level in systemd-analyze output (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return float(m.group(1))


@needs_analyze
def test_full_unit_sandbox_exposure_at_most_4_5(tmp_path):
    unit = tmp_path / "sglang-kdtree.service"
    unit.write_text((SYSTEMD / "sglang-kdtree.service").read_text())
    level = exposure(unit)
    assert level <= 4.5, level
    # the measurement itself can fail: without the sandbox lines the same unit is rated UNSAFE
    text = unit.read_text()
    unit.write_text(text.split("# --- Sandbox", 1)[0] + "[Install]\nWantedBy=multi-user.target\n")
    assert exposure(unit) > 8.0


@needs_analyze
def test_dropin_sandbox_exposure_on_a_root_base_unit(tmp_path):
    """The drop-in on a bare base unit (runs as root, no sandbox of its own: rated about 9.6)."""
    base = tmp_path / "sglang.service"
    base.write_text("[Unit]\nDescription=base\n[Service]\nType=simple\n"
                    "ExecStart=/usr/bin/python3 -m sglang.launch_server --model-path /models/x\n"
                    "[Install]\nWantedBy=multi-user.target\n")
    bare = exposure(base)
    (tmp_path / "sglang.service.d").mkdir()
    (tmp_path / "sglang.service.d" / "50-kdtree.conf").write_text((SYSTEMD / "50-kdtree.conf").read_text())
    level = exposure(base)
    assert bare > 9.0 and level <= 4.5, (bare, level)


def _check_service(sections, dropin: bool):
    svc = "Service"
    assert values(sections, svc, "Type") == ["notify"]
    assert values(sections, svc, "NotifyAccess") == ["main"]
    execs = values(sections, svc, "ExecStart")
    if dropin:
        assert execs[0] == "" and len(execs) == 2, execs  # the empty ExecStart= first
    launcher = execs[-1]
    assert launcher.startswith("/opt/sglang/venv/bin/python -m kdtree_backend.launcher ")
    assert "--attention-backend triton" in launcher and "--enable-metrics" in launcher
    envs = values(sections, svc, "Environment")
    assert "KDTREE_VERIFY=off" in envs
    assert values(sections, svc, "RuntimeDirectory") == ["sglang-prometheus"]
    assert "PROMETHEUS_MULTIPROC_DIR=/run/sglang-prometheus" in envs
    assert values(sections, svc, "EnvironmentFile") == ["-/etc/sglang/kdtree.env"]
    assert values(sections, svc, "Restart") == ["on-failure"]
    assert values(sections, svc, "RestartPreventExitStatus") == ["78"]
    assert values(sections, svc, "KillMode") == ["mixed"]
    assert values(sections, svc, "TimeoutStartSec") == ["35min"]
    assert values(sections, "Unit", "StartLimitBurst") == ["3"]
    assert values(sections, "Unit", "StartLimitIntervalSec") == ["30min"]
    # health after READY: a watchdog that tolerates a long generation, restarted on failure
    watchdog = values(sections, svc, "WatchdogSec")
    assert watchdog == ["5min"], watchdog
    docs = " ".join(values(sections, "Unit", "Documentation")).split()
    assert docs[0] == "file:///opt/sglang/kdtree-backend/docs/operations.md", docs
    _check_sandbox(sections, dropin)
    return launcher


NVIDIA_DEVICES = {"/dev/nvidiactl rw", "/dev/nvidia-uvm rw", "/dev/nvidia-uvm-tools rw", "char-nvidia rw",
                  "char-nvidia-frontend rw", "char-nvidia-caps rw"}


def _check_sandbox(sections, dropin: bool):
    svc = "Service"
    one = {k: v for k, v in sections[svc]}  # last value of each key
    for key, want in (("NoNewPrivileges", "yes"), ("PrivateTmp", "yes"), ("ProtectKernelTunables", "yes"),
                      ("ProtectKernelModules", "yes"), ("ProtectKernelLogs", "yes"), ("ProtectControlGroups", "yes"),
                      ("RestrictSUIDSGID", "yes"), ("LockPersonality", "yes"), ("RestrictRealtime", "yes"),
                      ("RestrictNamespaces", "yes"), ("SystemCallArchitectures", "native"), ("ProtectClock", "yes"),
                      ("ProtectHostname", "yes"), ("CapabilityBoundingSet", ""), ("DevicePolicy", "closed"),
                      ("ProtectProc", "invisible")):
        assert one.get(key) == want, (key, one.get(key))
    # the GPUs stay reachable, explicitly; never a private /dev, never W^X (Triton and torch JIT)
    assert set(values(sections, svc, "DeviceAllow")) == NVIDIA_DEVICES
    assert "PrivateDevices" not in one and "MemoryDenyWriteExecute" not in one and "ProcSubset" not in one
    if dropin:
        assert one["ProtectSystem"] == "full"
    else:
        assert one["ProtectSystem"] == "strict" and one["ProtectHome"] == "yes"
        envs = values(sections, svc, "Environment")
        # everything SGLang writes is a directory systemd makes writable under ProtectSystem=strict
        assert values(sections, svc, "StateDirectory") == ["sglang"] and "HOME=/var/lib/sglang" in envs
        assert values(sections, svc, "CacheDirectory") == ["sglang"]
        for var in ("XDG_CACHE_HOME=/var/cache/sglang", "TRITON_CACHE_DIR=/var/cache/sglang/triton",
                    "TORCHINDUCTOR_CACHE_DIR=/var/cache/sglang/torchinductor"):
            assert var in envs, var
        assert values(sections, svc, "ReadWritePaths") == ["/dev/shm"]


def test_dropin_content():
    _check_service(parse_unit(SYSTEMD / "50-kdtree.conf"), dropin=True)


def test_full_unit_content():
    s = parse_unit(SYSTEMD / "sglang-kdtree.service")
    _check_service(s, dropin=False)
    assert values(s, "Install", "WantedBy") == ["multi-user.target"]


def test_environment_file_is_valid_for_the_launcher():
    from kdtree_backend.config import read_mode
    from kdtree_backend.launcher.main import parse_duration, split_args

    env = {}
    for raw in (SYSTEMD / "kdtree.env").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        assert re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", line), f"not KEY=value: {line!r}"
        k, _, v = line.partition("=")
        env[k] = v
    assert str(read_mode(env)) == "off"
    opts, _ = split_args([], env)  # the launcher accepts every value in it
    timeout_start = parse_duration(values(parse_unit(SYSTEMD / "50-kdtree.conf"), "Service", "TimeoutStartSec")[0],
                                   "TimeoutStartSec")
    assert opts["start_timeout"] == 1800 < timeout_start  # the launcher's deadline fires first


@pytest.mark.timeout(120)
def test_example_sglang_arguments_are_real_sglang_flags():
    """The ExecStart arguments parse with SGLang 0.5.23's own parser, with no abbreviations."""
    argvs = []
    for f, dropin in (("50-kdtree.conf", True), ("sglang-kdtree.service", False)):
        launcher = _check_service(parse_unit(SYSTEMD / f), dropin)
        argvs.append(launcher.split(" -m kdtree_backend.launcher ", 1)[1].split())
    code = (
        "import argparse, json, sys\n"
        "from sglang.srt.server_args import ServerArgs\n"
        "from kdtree_backend.launcher.preflight import analyze_flags\n"
        "p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    errors, warnings = analyze_flags(argv, p._option_string_actions)\n"
        "    assert not errors and not warnings, (errors, warnings)\n"
        "    p.parse_args(argv)\n"
        "print('PARSED')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=110, cwd=ROOT)
    assert proc.returncode == 0 and "PARSED" in proc.stdout, proc.stderr[-3000:]
