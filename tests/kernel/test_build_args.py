"""The build's arguments, checked before nvcc runs (CPU, no nvcc needed): an arch the kernels are not
written for is one line naming the supported ones (issue 23: `--arch 75` used to print 865 lines of
ptxas errors), and the diagnostics build is a flag, not -D flags passed by the caller."""
from __future__ import annotations

import pytest

from kdtree_backend.kernel import build


def _no_nvcc(monkeypatch):
    def boom():
        raise AssertionError("nvcc must not be looked up for a refused arch")

    monkeypatch.setattr(build, "find_nvcc", boom)


@pytest.mark.parametrize("arch", [75, 80, 89, 91, 121])
def test_unsupported_arch_is_one_line_before_nvcc(monkeypatch, capsys, arch):
    _no_nvcc(monkeypatch)
    assert build.main(["--arch", str(arch), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert f"unsupported arch {arch}" in err[0]
    assert all(str(a) in err[0] for a in build.SUPPORTED_ARCHS)


def test_build_refuses_an_unsupported_arch_among_good_ones(monkeypatch, tmp_path):
    _no_nvcc(monkeypatch)
    with pytest.raises(build.BuildError, match=r"unsupported arch 75: the kernels build for 90, 100, 120"):
        build.build(tmp_path / "lib.so", archs=(90, 75))


def test_supported_archs_pass_the_check():
    assert build.check_archs([90]) == (90,)
    assert build.check_archs([100]) == (100,)  # the portable kernel builds for sm_100 (no spills); not run on a GPU here
    assert build.check_archs(("120", 90)) == (120, 90)
    assert set(build.DEFAULT_ARCHS) <= set(build.SUPPORTED_ARCHS)


def test_profiler_flag_requests_the_diagnostics_build(monkeypatch, tmp_path):
    seen = {}

    class _Report:
        path = tmp_path / "lib.so"
        archs = (90,)
        ptx_arch = 90

    def fake_build(out, archs, **kw):
        seen.update(kw, archs=archs)
        return _Report()

    monkeypatch.setattr(build, "build", fake_build)
    assert build.main(["--profiler", "--arch", "90", "--quiet"]) == 0
    assert seen["profiler"] is True and seen["archs"] == [90]
    assert build.main(["--quiet"]) == 0
    assert seen["profiler"] is False and seen["ptx"] is True
    assert build.main(["--quiet", "--no-ptx"]) == 0
    assert seen["ptx"] is False
    assert build.PROFILER_FLAGS == ("-DKDTREE_PROFILER",)
    assert seen["pipe_factor"] == 1
    assert build.main(["--quiet", "--pipe-factor", "3", "--arch", "90"]) == 0
    assert seen["pipe_factor"] == 3 and seen["profiler"] is False


def test_pipe_factor_out_of_range_is_one_line_before_nvcc(monkeypatch, capsys):
    _no_nvcc(monkeypatch)
    assert build.main(["--pipe-factor", "9", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pipe factor 9: an integer from 1 (release) to 8" in err[0]
