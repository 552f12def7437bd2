"""CPU checks that the GPU benchmark scripts get through their imports and set-up helpers, so a
refactor that breaks one is caught here rather than in a device run (bench/bench_modes.py once
failed on its first call on the H200: the test module it builds its scene from had started to
import a helper from tests/conftest.py, which only pytest made importable)."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import clean_env, run_python

ROOT = Path(__file__).resolve().parent.parent


def test_bench_modes_builds_its_scene_module():
    code = (
        "import sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/bench']\n"
        "import bench_modes\n"
        "m = bench_modes._scene_module()\n"
        "assert callable(m.kit_prefix_slot_collisions)\n"
        "print('scene ok')\n"
    )
    r = run_python(code, env=clean_env(), timeout=300, args=(str(ROOT),))
    assert r.returncode == 0 and "scene ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_device_shell_scripts_parse():
    """Every device script under bench/ is valid bash (a syntax error would cost a device call)."""
    import subprocess

    scripts = sorted((ROOT / "bench").glob("*.sh"))
    assert scripts
    for s in scripts:
        r = subprocess.run(["bash", "-n", str(s)], capture_output=True, text=True)
        assert r.returncode == 0, f"{s.name}: {r.stderr}"


def test_sanitize_path_runs_racecheck_and_memcheck_on_the_path(tmp_path):
    """bench/gpu_sanitize.sh (shared by gpu_ab.sh and gpu_release.sh), with a stand-in for
    compute-sanitizer that records its arguments and the kernel path: both tools run, on the path
    asked for, memcheck on the sanitizer-sized tests of that path only, and the summaries and exit
    codes reach stdout. racecheck also runs the sanitizer-sized consecutive-slot tests of the path
    (runs of cache slots, which the smoke cases' scattered slots never have; perf-notes h41)."""
    import os
    import subprocess

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    calls = tmp_path / "calls.txt"
    (fake_bin / "compute-sanitizer").write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$KDTREE_KERNEL small=${{KDTREE_TEST_SMALL:-0}} $*" >> {calls}\n'
        'case "$2" in racecheck) echo "========= RACECHECK SUMMARY: 0 hazards displayed";;\n'
        '  memcheck) echo "3 passed"; echo "========= ERROR SUMMARY: 0 errors"; exit 3;; esac\n'
    )
    (fake_bin / "compute-sanitizer").chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "OUT": str(out)}
    r = subprocess.run(["bash", "-c", "source bench/gpu_sanitize.sh && sanitize_path hopper 5 5"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = calls.read_text().splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("hopper small=0 --tool racecheck") and "bench/smoke.py --small --no-triton" in lines[0]
    assert lines[1].startswith("hopper small=1 --tool racecheck") and lines[1].endswith(
        "tests/gpu/test_kernel_gpu.py -k consecutive_slots and hopper")
    assert lines[2].startswith("hopper small=1 --tool memcheck") and lines[2].endswith("tests/gpu/test_kernel_gpu.py -k hopper")
    assert "racecheck (hopper) rc=0" in r.stdout and "RACECHECK SUMMARY: 0 hazards" in r.stdout
    assert "racecheck, consecutive slots (hopper) rc=0" in r.stdout
    assert "memcheck (hopper) rc=3" in r.stdout and "ERROR SUMMARY: 0 errors" in r.stdout
    assert (out / "racecheck-hopper.log").exists() and (out / "memcheck-hopper.log").exists()
    assert (out / "racecheck-slots-hopper.log").exists()


@pytest.mark.parametrize("probe", ["gather_probe", "cluster_probe"])
def test_device_probe_compiles_for_sm90a(tmp_path, probe):
    """The standalone device diagnostics under bench/ (gather_probe.cu: the gather's copy paths;
    cluster_probe.cu: how many CTA clusters of the Hopper kernel's shape fit) build with the
    project's nvcc for sm_90a without warnings or spills, so they are ready for a device run."""
    import subprocess

    from kdtree_backend.build import find_nvcc

    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (the kernel build tests skip too)")
    out = tmp_path / probe
    r = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                        str(ROOT / "bench" / f"{probe}.cu"), "-o", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.exists()
    assert "warning" not in r.stderr.lower(), r.stderr[-3000:]
    assert "spill stores" in r.stderr and " 0 bytes spill stores" in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("script,option", [("timeline.py", "--warm"), ("call_series.py", "--gap-ms")])
def test_diagnostic_scripts_get_through_their_imports(script, option):
    """bench/timeline.py and bench/call_series.py import the op and the smoke batch builder at
    start-up; their --help must come up on a machine without a GPU and name their options."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], capture_output=True, text=True,
                       timeout=300, env=clean_env(), cwd=ROOT)
    assert r.returncode == 0 and option in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
