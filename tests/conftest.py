"""Shared test helpers: the `gpu` marker, fake kernel libraries, clean subprocess environments."""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"


# --- gpu marker ------------------------------------------------------------------------------

def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    try:
        import torch

        have_gpu = torch.cuda.is_available()
    except Exception:  # no torch, or a broken CUDA install: no GPU tests here
        have_gpu = False
    if have_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


# --- subprocess environment ------------------------------------------------------------------

def clean_env(**overrides: str) -> dict:
    """os.environ without any KDTREE_*/SGLANG_PLUGINS setting, offline HF, plus `overrides`.

    A value of None in overrides removes the variable.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDTREE_") and k != "SGLANG_PLUGINS"}
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    for k, v in overrides.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


FAKE_SERVER = Path(__file__).resolve().parent / "fixtures_ops" / "fake_server.py"


def fake_launch_env(tmp_path: Path, **settings) -> dict:
    """The environment of a launcher run whose child is the fake SGLang (fixtures_ops/fake_server.py):
    clean_env() without FAKE_*/NOTIFY_SOCKET either, mode off, the fake's record in tmp_path, plus
    `settings` (values turned into strings). The launcher and preflight tests share it."""
    env = {k: v for k, v in clean_env().items() if not k.startswith(("FAKE_", "NOTIFY_SOCKET"))}
    env.update(KDTREE_VERIFY="off", KDTREE_LAUNCH_CHILD_CMD=f"{sys.executable} {FAKE_SERVER}",
               FAKE_RECORD=str(tmp_path / "record.json"))
    env.update({k: str(v) for k, v in settings.items()})
    return env


def free_port() -> int:
    """A loopback TCP port that was free a moment ago (for fake servers and readiness waits)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kit_prefix_slot_collisions(case_name: str, page_size: int, prefix=(4, 7), ctx: int = 64) -> int:
    """How many prefix tokens of SGLang's attention test kit get their KV slot overwritten when the
    kit's graph-eager leg rewrites the prefix with the contiguous layout over a `shuffled_pages`
    fixture (docs/validate.md). Mirrors the kit: seed 3090 + len(case name), one page permutation
    per request r seeded with seed + 17 * (r + 1)."""
    seed = 3090 + len(case_name)
    bad = 0
    for r, P in enumerate(prefix):
        perm = list(range(max(1, ctx // page_size)))
        random.Random(seed + 17 * (r + 1)).shuffle(perm)
        slot = [perm[(p // page_size) % len(perm)] * page_size + p % page_size for p in range(P)]
        bad += sum(1 for p in range(P) if slot[p] < P and slot[p] != p)
    return bad


def run_python(code: str, env: dict, timeout: float = 120, args=()) -> subprocess.CompletedProcess:
    """Run `python -c code` (this interpreter) and capture its output."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- fake kernel libraries ---------------------------------------------------------------------

@dataclass(frozen=True)
class FakeLibs:
    good: Path  # every symbol, the right ABI, built for sm_90 and sm_120
    missing_symbol: Path  # lacks kdtree_verify_run
    wrong_abi: Path  # reports abi.ABI_VERSION + 1
    sm120_only: Path  # built for sm_120 only (an H200, 9.0, is not covered)
    with_ptx: Path  # built for sm_90, sm_100, sm_120 + compute_120 PTX (the default build's shape)
    diagnostics: Path  # as good, its version naming a --pipe-factor 3 diagnostics build ("+pipe3")
    not_elf: Path  # a text file named like a library: dlopen fails
    missing: Path  # does not exist


def _gcc(src: Path, out: Path, *defines: str) -> None:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("needs a C compiler (gcc or cc) on PATH to build the fake kernel libraries")
    cmd = [cc, "-shared", "-fPIC", "-O0", "-o", str(out), str(src), *defines]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building a fake library failed: {' '.join(cmd)}\n{proc.stderr}")


@pytest.fixture(scope="session")
def fake_libs(tmp_path_factory) -> FakeLibs:
    from kdtree_backend.kernel import abi

    d = tmp_path_factory.mktemp("fake_libs")
    src = FIXTURES / "fake_kdtree_lib.c"
    v = abi.ABI_VERSION
    libs = FakeLibs(
        good=d / "good" / abi.LIB_FILENAME,
        missing_symbol=d / "missing_symbol" / abi.LIB_FILENAME,
        wrong_abi=d / "wrong_abi" / abi.LIB_FILENAME,
        sm120_only=d / "sm120_only" / abi.LIB_FILENAME,
        with_ptx=d / "with_ptx" / abi.LIB_FILENAME,
        diagnostics=d / "diagnostics" / abi.LIB_FILENAME,
        not_elf=d / "not_elf" / abi.LIB_FILENAME,
        missing=d / "missing" / abi.LIB_FILENAME,
    )
    for p in (libs.good, libs.missing_symbol, libs.wrong_abi, libs.sm120_only, libs.with_ptx, libs.diagnostics,
              libs.not_elf):
        p.parent.mkdir()
    _gcc(src, libs.good, f"-DFAKE_ABI_VERSION={v}", '-DFAKE_ARCHS="90,120"')
    _gcc(src, libs.missing_symbol, f"-DFAKE_ABI_VERSION={v}", "-DOMIT_VERIFY_RUN")
    _gcc(src, libs.wrong_abi, f"-DFAKE_ABI_VERSION={v + 1}")
    _gcc(src, libs.sm120_only, f"-DFAKE_ABI_VERSION={v}", '-DFAKE_ARCHS="120"')
    _gcc(src, libs.with_ptx, f"-DFAKE_ABI_VERSION={v}", '-DFAKE_ARCHS="90,100,120"', "-DFAKE_PTX_ARCH=120")
    _gcc(src, libs.diagnostics, f"-DFAKE_ABI_VERSION={v}", '-DFAKE_ARCHS="90,120"',
         '-DFAKE_VERSION="0.1.0+src.fake+pipe3"')
    libs.not_elf.write_text("this is a text file, not a shared library\n")
    return libs
