"""CPU checks that the GPU benchmark scripts get through their imports and set-up helpers, so a
refactor that breaks one is caught here rather than in a device run (bench/bench_modes.py once
failed on its first call on the H200: the test module it builds its scene from had started to
import a helper from tests/conftest.py, which only pytest made importable)."""
from __future__ import annotations

from pathlib import Path

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
