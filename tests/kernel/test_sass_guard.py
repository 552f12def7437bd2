"""tools/sass_diff.py, the guard of behaviour-neutral kernel refactors, on a CPU machine (nvcc and
cuobjdump only; skipped without them): the tree compared with itself is identical, and a copy with
one changed constant in a kernel source is reported as different, kernel by kernel, with the first
differing instructions. One arch (sm_120: the portable kernels and their combines) keeps it to two
builds; the built sides are cached per source digest in a temporary directory."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kdtree_backend.kernel import build

pytestmark = pytest.mark.skipif(build.find_nvcc() is None or build.find_cuobjdump() is None,
                                reason="nvcc or cuobjdump not available")

ROOT = Path(build.PACKAGE_DIR).parent
TOOL = ROOT / "tools" / "sass_diff.py"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("sass-cache")


def _run(cache: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), "--arch", "120", "--cache-dir", str(cache), *args],
                          capture_output=True, text=True, timeout=900)


def test_tree_compared_with_itself_is_identical(cache):
    proc = _run(cache, "--ref-tree", str(ROOT), "--tree", str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # 2 portable (s1e: one request, any batch) + 3 combines (s9: one a programmatic dependent)
    assert "sm_120: SASS of 5 of 5 kernels identical" in out
    assert "sm_120: ptxas resources: 6 of 6 entries identical" in out
    # the warp-specialised portable kernel (s1e: two) in its own translation unit, sm_120a only
    assert "sm_120a: SASS of 2 of 2 kernels identical" in out
    assert "cubins (nvcc -cubin, no -lineinfo): 2 identical byte for byte" in out
    assert "IDENTICAL" in out


def test_a_changed_constant_in_a_kernel_source_is_reported(cache, tmp_path):
    copy = tmp_path / "tree"
    shutil.copytree(ROOT / "kdtree_backend", copy / "kdtree_backend",
                    ignore=shutil.ignore_patterns("__pycache__", "_lib", "*.so"))
    kernel = copy / "kdtree_backend" / "kernel" / "csrc" / "portable" / "softmax.cuh"  # both tilings' softmax
    text = kernel.read_text()
    assert text.count("constexpr float kRescaleThreshold = 8.f;") == 1
    kernel.write_text(text.replace("constexpr float kRescaleThreshold = 8.f;", "constexpr float kRescaleThreshold = 7.f;"))
    proc = _run(cache, "--ref-tree", str(ROOT), "--tree", str(copy))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "DIFFERENT" in out
    assert "sm_120: SASS of void verify_attention_kernel<VerifyConfig<4, 2, 32, 2>, false>(KdtreeVerifyParams) differs" in out
    assert "first difference at instruction" in out
    assert any(line.startswith("      - ") for line in out.splitlines())
    assert any(line.startswith("      + ") for line in out.splitlines())
    # the combine kernels of the same translation unit are untouched; the cubin holding them all is not
    assert "sm_120: SASS of 3 of 5 kernels identical" in out  # both portable instantiations hold the constant
    assert ("cubin kdtree_backend/kernel/csrc/portable/launch.cu -> kdtree_backend/kernel/csrc/portable/launch.cu "
            "(sm_120): bytes differ") in out


def test_unknown_ref_is_a_tool_error(cache):
    proc = subprocess.run([sys.executable, str(TOOL), "--ref", "no-such-ref-kdtree", "--cache-dir", str(cache)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no-such-ref-kdtree" in proc.stderr
