"""CPU checks of the GPU tools under bench/, so a refactor that breaks one is caught here rather
than in a device run: the device driver (bench/device/run.py: step parsing, budgets, the commands
it would run, runs with fake tools), bench_modes.py's arithmetic and batch sizes, perf_table.py,
the diagnostics' start-up, the device probes' compilation, and the results index.
(bench_verify.py's own checks are in tests/testing/test_reference_cpu.py.)"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import clean_env

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "bench" / "device" / "run.py"


def _load(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def drv():
    return _load("bench/device/run.py", "_kdtree_device_run")


def _dry(drv, capsys, *words, capability="9.0"):
    rc = drv.main(["--dry-run", "--commit", "abc1234", "--capability", capability, *words])
    assert rc == 0
    return capsys.readouterr().out


# ------------------------------------------------------------------------------------------
# the device driver: parsing and budgets
# ------------------------------------------------------------------------------------------
def test_driver_groups_words_into_steps(drv):
    steps = drv.parse_steps(["setup", "tests", "both", "sanitize:300", "hopper", "bench", "main,ddtree", "both",
                             "--budget-ms", "100", "modes", "--iters", "20", "profile", "portable", "8,16,64,8192",
                             "lib=/tmp/x.so"])
    assert [s.name for s in steps] == ["setup", "tests", "sanitize", "bench", "modes", "profile"]
    assert steps[1].args == ["both"] and steps[2].budget == 300.0 and steps[2].args == ["hopper"]
    assert steps[3].plain() == ["main,ddtree", "both", "--budget-ms", "100"]
    assert steps[4].args == ["--iters", "20"]
    assert steps[5].option("lib") == "/tmp/x.so" and steps[5].plain() == ["portable", "8,16,64,8192"]
    assert drv.parse_paths("both") == ["hopper", "portable"] and drv.parse_paths("portable") == ["portable"]


@pytest.mark.parametrize("words,match", [
    (["hopper"], "is not a step"),
    ([], "no steps"),
    (["tests"], "tests PATHS"),
    (["tests", "ampere"], "kernel paths"),
    (["tests", "hopper,hopper"], "kernel paths"),
    (["sanitize", "both", "extra"], "unexpected"),
    (["bench", "main"], "GRID PATHS"),
    (["bench", "Main!", "both"], "grid"),
    (["profile", "both", "8,16,64,8192"], "hopper, portable or portable-tiled"),
    (["profile", "hopper", "8x16"], "B,H,n,L"),
    (["setup", "now"], "no arguments"),
    (["ab"], "NAME=LIB"),
    (["ab", "default=/tmp/x.so"], "not default"),
    (["setup:soon"], "seconds"),
    (["stamps", "portable-tiled", "8,8,65,8192"], "portable or hopper"),
    (["stamps", "hopper"], "stamps PATH SHAPE"),
    (["stamps", "portable", "8x8"], "B,H,n,L"),
    (["ragged", "ampere"], "step ragged"),
    (["power"], "power SHAPE"),
    (["power", "8,8,65"], "B,H,n,L"),
    (["power", "8,8,65,8192", "rounds=0"], "positive"),
    (["power", "8,8,65,8192", "paths=ampere"], "kernel paths"),
    (["ab", "x=/tmp/x.so", "seconds=2"], "power step's option"),
    (["bench", "main", "both"] * 4 + ["modes", "ab", "x=/tmp/x.so", "bench", "quick", "hopper"], "result files"),
])
def test_driver_refuses_bad_command_lines(drv, words, match):
    with pytest.raises(drv.UsageError, match=match):
        drv.parse_steps(words)


def test_driver_budgets(drv):
    steps = drv.parse_steps(["setup", "tests", "both", "bench", "main", "both", "modes:90", "bench", "ddtree", "hopper"])
    assert drv.nominal_budget(steps[0]) == 240 and drv.nominal_budget(steps[1]) == 300  # 150 per path
    assert drv.nominal_budget(steps[2]) is None and drv.nominal_budget(steps[3]) == 90
    # a fixed step takes its own budget, at most what is left
    assert drv.step_budget(steps, 0, 570) == 240 and drv.step_budget(steps, 1, 100) == 100
    # the first bench step shares what modes leaves with the second bench step
    assert drv.step_budget(steps, 2, 400) == pytest.approx((400 - 90) / 2)
    assert drv.step_budget(steps, 4, 123) == 123
    assert drv.step_budget(steps, 2, 50) == 0  # nothing left: the run skips it


def test_driver_command_timeouts_pass_unused_time_on(drv):
    cmds = [drv.Command("a", ["x"], "a.log", share=0.5), drv.Command("b", ["x"], "b.log", share=0.5),
            drv.Command("sum", [], "s.log", share=0.1, call=lambda: "")]
    assert drv.command_timeout(cmds, 0, 100, 100, 500) == 50  # the next command keeps its share
    assert drv.command_timeout(cmds, 1, 100, 90, 500) == 90  # the first used 10 s: the rest is the second's
    assert drv.command_timeout(cmds, 0, 100, 100, 30) == 30  # never past the whole run's end
    assert drv.command_timeout(cmds, 0, 100, 40, 500) == 40  # a late step: the share, at most what is left


def test_driver_command_timeouts_hold_each_commands_floor(drv):
    """A command's measured floor (a library build's ~30 s) wins over a smaller share, and the commands
    before it leave it that floor."""
    cmds = [drv.Command("a", ["x"], "a.log", share=0.1), drv.Command("b", ["x"], "b.log", share=0.1, floor_s=30),
            drv.Command("c", ["x"], "c.log", share=0.8)]
    assert drv.command_timeout(cmds, 1, 100, 100, 500) == 30  # its floor, though c's share then shrinks
    assert drv.command_timeout(cmds, 1, 100, 120, 500) == 40
    assert drv.command_timeout(cmds, 0, 100, 100, 500) == 10  # b's floor (30) and c's share (80) are reserved
    assert drv.command_timeout(cmds, 1, 50, 200, 500) == 160  # b's floor above its share: 30 at least, plus what c leaves


def test_driver_refuses_a_plan_below_its_commands_floors(drv, capsys):
    """Session 29's first call: `ab:200` with four variant checkouts (four ~30 s builds, five ~22 s
    timings) timed out its last builds and timings and lost the call. The driver refuses such a plan
    before it runs anything, naming the step, what it holds and the budget to give."""
    words = ["--budget", "560", "setup:45", "ab:200", "p1=.ab-1", "p2=.ab-2", "p3=.ab-3", "p4=.ab-4", "paths=portable"]
    with pytest.raises(SystemExit) as e:
        drv.main(["--dry-run", "--commit", "abc1234", "--capability", "9.0", *words])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "step ab:200 cannot hold its commands" in err and "4 x variant build (30 s)" in err
    assert "5 x smoke timings (22 s)" in err and "give it ab:258 or more" in err
    _dry(drv, capsys, *[w.replace("ab:200", "ab:260") for w in words])
    with pytest.raises(SystemExit):  # the portable racecheck of the slot tests alone takes ~700 s (sessions 35, 37)
        drv.main(["--dry-run", "--commit", "abc1234", "--capability", "9.0", "sanitize:500", "portable"])
    assert "sanitize:500 cannot hold" in capsys.readouterr().err
    _dry(drv, capsys, "sanitize:300", "portable", "part=1/2")  # half of the families: ~260 s
    with pytest.raises(SystemExit):  # every step fits its own budget, the whole run does not fit --budget
        drv.main(["--dry-run", "--commit", "abc1234", "--capability", "9.0", "--budget", "250", "setup:40",
                  "sanitize:300", "portable", "part=1/2"])
    assert "the steps need at least 330 s" in capsys.readouterr().err


def test_driver_skips_a_step_whose_library_is_missing(drv, tmp_path):
    """`tests portable lib=WORK/lib_X.so` after a build that failed ran 150 s of tests against nothing
    (session 29); the step is skipped with the reason instead. A dry run does not look."""
    ctx = drv.Context(tmp_path, tmp_path, "abc1234", dry_run=False, capability="9.0")
    step = drv.parse_steps(["tests", "portable", f"lib={tmp_path}/lib_x.so"])[0]
    assert "does not exist" in drv.missing_library(step, ctx)
    (tmp_path / "lib_x.so").write_bytes(b"")
    assert drv.missing_library(step, ctx) is None
    assert drv.missing_library(drv.parse_steps(["tests", "portable"])[0], ctx) is None
    dry = drv.Context(tmp_path, tmp_path, "abc1234", dry_run=True, capability="9.0")
    assert drv.missing_library(drv.parse_steps(["tests", "portable", "lib=/nowhere/lib.so"])[0], dry) is None


def test_driver_result_file_names(drv):
    steps = drv.parse_steps(["bench", "main,ddtree", "both", "bench", "quick", "hopper", "bench", "quick", "portable",
                             "modes", "ab", "x=/tmp/x.so"])
    assert [drv.result_file(s, steps) for s in steps] == [
        "bench-main-ddtree.json", "bench-quick-1.json", "bench-quick-2.json", "modes.json", "ab.json"]
    for name in [drv.result_file(s, steps) for s in steps]:
        assert re.fullmatch(r"[A-Za-z0-9._-]+", name)  # what the device tool brings back


# ------------------------------------------------------------------------------------------
# the device driver: what it would run
# ------------------------------------------------------------------------------------------
def test_driver_dry_run_of_the_release_commands(drv, capsys):
    # the sanitizers take calls of their own since session 35 (bench/README.md): their floors alone
    # (the portable racecheck's 700 s, the Hopper probe's 40 s) are more than a call; listed here whole
    out = _dry(drv, capsys, "setup", "tests", "both", "modes") + _dry(drv, capsys, "--budget", "900", "sanitize:900", "both")
    assert "--target /tmp/site" in out and "--no-index --no-deps --no-compile --no-cache-dir --upgrade" in out
    assert "python3 -m kdtree_backend.build --check" in out
    assert ("KDTREE_KERNEL=hopper python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors "
            "tests/ -k 'not portable and not tiled'") in out
    assert ("KDTREE_KERNEL=portable python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors "
            "tests/ -k 'not hopper and not tiled'") in out
    assert "portable-tiled" not in out  # "both": the two paths an H200 serves by default
    tiled = _dry(drv, capsys, "tests", "portable-tiled", "sanitize", "portable-tiled")
    assert ("KDTREE_KERNEL=portable-tiled python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors "
            "tests/ -k 'not hopper and not portable'") in tiled
    assert "-k '(consecutive_slots or parts_span or two_split_merge or extra_ctas or many_short_segments or one_row_tile or schedule_cache) and tiled'" in tiled
    assert "tests/kernel/test_kernel_gpu.py -k tiled " in tiled
    for p in ("hopper", "portable"):
        assert (f"KDTREE_KERNEL={p} compute-sanitizer --print-limit 20 --tool racecheck python3 bench/diag/smoke.py "
                "--small --no-triton") in out
        assert (f"KDTREE_KERNEL={p} KDTREE_TEST_SMALL=1 compute-sanitizer --print-limit 20 --tool racecheck python3 -m "
                f"pytest -q -p no:cacheprovider -x tests/kernel/test_kernel_gpu.py -k '(consecutive_slots or parts_span or "
                f"two_split_merge or extra_ctas or many_short_segments or one_row_tile or schedule_cache) and {p}'") in out
        assert (f"KDTREE_TEST_SMALL=1 compute-sanitizer --print-limit 20 --tool memcheck python3 -m pytest -q -p "
                f"no:cacheprovider -x tests/kernel/test_kernel_gpu.py -k {p} ") in out
    assert "python3 bench/bench_modes.py --json /tmp/out/modes.json --bs 8,128" in out
    assert "back in /tmp/out: modes.json, run.json, logs.tar.gz" in out


def test_driver_sanitize_runs_the_probe_after_a_slow_build(tmp_path):
    """CI (session 35): the racecheck probe's build and runs had shares of a 300 s step (6 s, 3 s)
    below the 5 s under which the driver skips a command, so an nvcc that took 7 s left mode 0 out.
    They have floors now: every mode runs after a slow build."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls.txt"
    _fake_tool(bindir, "nvcc", "sleep 7\n")
    _fake_tool(bindir, "compute-sanitizer", f'echo "$*" >> {calls}\necho "========= RACECHECK SUMMARY: 0 hazards"\n')
    r, _ = _run_driver(tmp_path, bindir, "sanitize", "hopper")
    assert r.returncode == 0, r.stdout + r.stderr
    probe = [ln.split()[-2] for ln in calls.read_text().splitlines() if "racecheck_probe" in ln]
    assert probe == ["0", "1", "2"], r.stdout
    assert "skipped" not in r.stdout


def test_driver_sanitize_in_parts(drv, capsys):
    """The racecheck of the slot / part / merge / extra-CTA / short-segment / one-row-tile tests outgrew one
    device call (session 35): `part=N/M` runs the N-th of M consecutive runs of those families, the smoke
    racecheck (and Hopper's protocol probe) with part 1, memcheck with part M; together the parts run every
    family once."""
    fams = drv.RACECHECK_FAMILIES
    for m in range(1, len(fams) + 1):
        parts = [drv.racecheck_families(n, m) for n in range(1, m + 1)]
        assert all(parts) and tuple(f for part in parts for f in part) == fams
    one = _dry(drv, capsys, "sanitize", "both", "part=1/2")
    two = _dry(drv, capsys, "sanitize", "both", "part=2/2")
    for p in ("hopper", "portable"):
        assert f"-k '(consecutive_slots or parts_span or two_split_merge) and {p}'" in one
        assert f"-k '(extra_ctas or many_short_segments or one_row_tile or schedule_cache) and {p}'" in two
        assert f"racecheck-slots-{p}-part1of2.log" in one and f"racecheck-slots-{p}-part2of2.log" in two
    assert "smoke.py --small" in one and "racecheck_probe" in one and "--tool memcheck" not in one
    assert "smoke.py --small" not in two and "racecheck_probe" not in two and "--tool memcheck" in two
    for bad in ("3/2", "0/1", "1/8", "half"):
        with pytest.raises(drv.UsageError, match="part="):
            drv.parse_steps(["sanitize", "hopper", f"part={bad}"])
    with pytest.raises(drv.UsageError, match="sanitize step's option"):
        drv.parse_steps(["tests", "hopper", "part=1/2"])


def test_driver_dry_run_of_the_ragged_batches(drv, capsys):
    out = _dry(drv, capsys, "setup", "ragged:120", "portable", "--sets", "2", "ragged")
    assert "python3 bench/diag/ragged.py --paths portable --json /tmp/out/ragged-1.json --sets 2" in out
    assert "python3 bench/diag/ragged.py --paths hopper,portable --json /tmp/out/ragged-2.json" in out


def test_driver_dry_run_of_the_power_step(drv, capsys):
    """`power`: one clock_power.py process over every shape named, its options passed on, power.json
    (numbered when the step runs twice)."""
    out = _dry(drv, capsys, "power", "32,8,64,8192", "8,8,65,8192", "paths=hopper,portable", "seconds=1.2",
               "power:90", "1,8,65,8192")
    assert ("python3 bench/diag/clock_power.py 32,8,64,8192 8,8,65,8192 --paths=hopper,portable --seconds=1.2 "
            "--json /tmp/out/power-1.json") in out
    assert "python3 bench/diag/clock_power.py 1,8,65,8192 --json /tmp/out/power-2.json" in out


def test_driver_dry_run_of_the_benchmark_command(drv, capsys):
    out = _dry(drv, capsys, "--budget", "500", "setup", "bench", "main,ddtree", "both", "--budget-ms", "100", "modes:90")
    line = next(ln for ln in out.splitlines() if "bench/bench_verify.py" in ln)
    # a dry run spends no time: the bench step gets all but what modes keeps, less 60 s of tail
    assert ("python3 bench/bench_verify.py --grid main,ddtree --paths hopper,portable --no-plot --commit abc1234 "
            "--time-limit 350 --out /tmp/out/bench-main-ddtree.json --budget-ms 100") in line
    assert "[timeout 410s" in line
    assert "back in /tmp/out: bench-main-ddtree.json, modes.json, run.json, logs.tar.gz" in out


def test_driver_drops_the_hopper_path_off_hopper_gpus(drv, capsys):
    out = _dry(drv, capsys, "tests", "both", "bench", "quick", "both", "bench", "customer", "hopper", capability="12.0")
    assert "KDTREE_KERNEL=portable" in out and "KDTREE_KERNEL=hopper" not in out
    assert "--paths portable " in out and "none of hopper runs on compute capability 12.0" in out


def test_driver_dry_run_of_profile_and_ab(drv, capsys):
    out = _dry(drv, capsys, "profile", "hopper", "32,8,16,8192", "ab", "base=.ab/base", "prev=/tmp/prev.so",
               "paths=both")
    assert ("KDTREE_KERNEL=hopper ncu --clock-control none --kernel-name regex:hopper_kernel --launch-skip 1 "
            "--launch-count 1") in out and "--profile-shape 32,8,16,8192" in out
    assert "--page source --csv --print-source sass" in out
    assert ("python3 tools/stall_regions.py /tmp/kdtree-device/sass-stalls-hopper-32_8_16_8192.csv.gz --json "
            "/tmp/kdtree-device/stall-regions-hopper-32_8_16_8192.json") in out
    assert f"(cd {ROOT}/.ab/base) PYTHONPATH=" in out and "-m kdtree_backend.build --out /tmp/kdtree-device/lib_base.so" in out
    assert "python3 bench/diag/smoke.py --no-triton --configs hopper,portable --json /tmp/kdtree-device/ab-default.json" in out
    assert "KDTREE_LIB=/tmp/prev.so python3 bench/diag/smoke.py" in out
    assert "KDTREE_LIB=/tmp/kdtree-device/lib_base.so python3 bench/diag/smoke.py" in out
    assert "(driver) A/B summary" in out


def test_driver_dry_run_of_stamps(drv, capsys):
    """The stamps step: a --profiler build of this GPU's arch (of the tree, or of another checkout given
    with from=), then bench/diag/tile_timeline.py a shape with that library and the path."""
    out = _dry(drv, capsys, "stamps", "portable", "32,8,64,8192", "8,8,8,8192", "from=.ab-p27", "stamps", "hopper",
               "8,8,65,8192")
    assert (f"(cd {ROOT}/.ab-p27) PYTHONPATH={ROOT}/.ab-p27:" in out
            and "-m kdtree_backend.build --profiler --arch 90 --no-ptx --out /tmp/kdtree-device/lib_stamps_.ab-p27.so" in out)
    assert ("KDTREE_KERNEL=portable KDTREE_LIB=/tmp/kdtree-device/lib_stamps_.ab-p27.so python3 "
            "bench/diag/tile_timeline.py 32,8,64,8192 --json /tmp/kdtree-device/stamps-portable-.ab-p27-32_8_64_8192.json") in out
    assert "bench/diag/tile_timeline.py 8,8,8,8192" in out
    assert f"(cd {ROOT}) " in out and "--out /tmp/kdtree-device/lib_stamps_tree.so" in out
    assert "KDTREE_KERNEL=hopper KDTREE_LIB=/tmp/kdtree-device/lib_stamps_tree.so python3 bench/diag/tile_timeline.py 8,8,65,8192" in out
    out = _dry(drv, capsys, "stamps", "portable", "8,8,65,8192", capability="12.0")
    assert "--profiler --arch 120 --no-ptx" in out


def test_driver_dry_run_of_probes(drv, capsys):
    """The probe step: a bench/diag/NAME.cu built for this GPU's arch-specific target and run with the
    step's words; a probe that parses --json writes into $OUT (numbered when the same probe runs twice),
    one that does not only logs. No setup step is needed. An unknown probe is refused, naming those
    there are."""
    out = _dry(drv, capsys, "probe", "mma_phase", "4000", "probe", "mma_issue", "probe", "mma_phase", "4000")
    assert "back in /tmp/out: probe-mma_phase-1.json, probe-mma_phase-2.json, run.json" in out
    assert (f"nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v {ROOT}/bench/diag/mma_phase.cu "
            "-o /tmp/kdtree-device/probe_mma_phase") in out
    assert "/tmp/kdtree-device/probe_mma_phase 4000 --json /tmp/out/probe-mma_phase-1.json" in out
    assert "/tmp/kdtree-device/probe_mma_phase 4000 --json /tmp/out/probe-mma_phase-2.json" in out
    assert re.search(r"/tmp/kdtree-device/probe_mma_issue  \[timeout", out)  # no --json: mma_issue does not parse it
    assert "log probe-1-mma_phase.log" in out and "log probe-3-mma_phase.log" in out
    assert "compute_120a,code=sm_120a" in _dry(drv, capsys, "probe", "dsmem_exchange", capability="12.0")
    with pytest.raises(drv.UsageError, match="no bench/diag/nosuch.cu .*mma_phase"):
        drv.parse_steps(["probe", "nosuch"])
    with pytest.raises(drv.UsageError, match="probe NAME"):
        drv.parse_steps(["probe"])


def test_driver_ab_summary(drv, tmp_path):
    def smoke_json(name, scale):
        (tmp_path / f"ab-{name}.json").write_text(json.dumps({"timings": [
            {"by_config": {"hopper": 10.0 * scale, "portable": 20.0}}, {"by_config": {"hopper": 40.0 * scale, "portable": 80.0}}]}))

    smoke_json("default", 1.0)
    smoke_json("fast", 0.9)
    out = tmp_path / "ab.json"
    text = drv.ab_summary(tmp_path, ["default", "fast", "missing"], ["hopper", "portable"], out)
    res = json.loads(out.read_text())["variants"]
    assert res["fast"]["hopper"]["geomean_time_vs_default"] == pytest.approx(0.9)
    assert res["fast"]["portable"]["geomean_time_vs_default"] == pytest.approx(1.0)
    assert "error" in res["missing"]
    assert "fast/hopper time vs default: geomean 0.900" in text


def test_driver_ab_summary_echoes_every_variant(drv, tmp_path):
    """An A/B of five variants on two paths prints (and records in run.json) all ten summary lines; the
    default of 4 dropped the first variants (session 39: main-f3 and h49 were missing from the printout)."""
    ctx = drv.Context(tmp_path, tmp_path, "abc1234", dry_run=True, capability="9.0")
    names = [f"v{i}=lib{i}.so" for i in range(5)]
    step = drv.parse_steps(["ab", *names, "paths=both"])[0]
    summary = [c for c in drv.commands_ab(step, ctx, "ab.json") if c.label == "A/B summary"]
    assert len(summary) == 1 and summary[0].echo_last >= 5 * 2


# ------------------------------------------------------------------------------------------
# the device driver: real runs with stand-ins for the GPU tools
# ------------------------------------------------------------------------------------------
def _fake_tool(bindir: Path, name: str, body: str) -> None:
    p = bindir / name
    p.write_text("#!/usr/bin/env bash\n" + body)
    p.chmod(0o755)


def _run_driver(tmp_path, bindir, *words):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**clean_env(), "PATH": f"{bindir}:{os.environ['PATH']}"}
    env.pop("OUT", None)
    r = subprocess.run([sys.executable, str(DRIVER), "--capability", "9.0", "--out", str(out), "--work", str(work),
                        "--commit", "t1", *words], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return r, out


def test_driver_sanitize_runs_racecheck_and_memcheck_on_the_path(tmp_path):
    """With a stand-in for compute-sanitizer that records its arguments and the kernel path: both
    tools run, on the path asked for, memcheck on that path's sanitizer-sized tests only; the
    summaries and exit codes reach stdout and run.json, the logs come back in logs.tar.gz."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls.txt"
    _fake_tool(bindir, "compute-sanitizer",
               f'echo "$KDTREE_KERNEL small=${{KDTREE_TEST_SMALL:-0}} $*" >> {calls}\n'
               'case "$4" in racecheck) echo "========= RACECHECK SUMMARY: 0 hazards displayed";;\n'
               '  memcheck) echo "3 passed"; echo "========= ERROR SUMMARY: 0 errors"; exit 3;; esac\n')
    r, out = _run_driver(tmp_path, bindir, "sanitize", "hopper")
    assert r.returncode == 1, r.stdout + r.stderr  # memcheck's exit code 3 fails the run
    all_lines = calls.read_text().splitlines()
    # first the racecheck probe of the Hopper P hand-off, modes 0-2 (issue 26; built with nvcc
    # when it is on PATH), then the path's own racecheck and memcheck runs
    probe = [ln for ln in all_lines if "racecheck_probe" in ln]
    lines = [ln for ln in all_lines if "racecheck_probe" not in ln]
    assert all(ln.split()[-2:] in (["0", "4"], ["1", "4"], ["2", "4"]) for ln in probe), probe
    assert len(probe) in (0, 3) and all_lines[:len(probe)] == probe, all_lines
    assert len(lines) == 3, lines
    assert lines[0].startswith("hopper small=0 --print-limit 20 --tool racecheck") and lines[0].endswith(
        "bench/diag/smoke.py --small --no-triton")
    assert lines[1].startswith("hopper small=1 --print-limit 20 --tool racecheck") and lines[1].endswith(
        "tests/kernel/test_kernel_gpu.py -k (consecutive_slots or parts_span or two_split_merge or extra_ctas or "
        "many_short_segments or one_row_tile or schedule_cache) and hopper")
    assert lines[2].startswith("hopper small=1 --print-limit 20 --tool memcheck") and lines[2].endswith(
        "tests/kernel/test_kernel_gpu.py -k hopper")
    assert "racecheck, smoke cases (hopper): rc=0" in r.stdout and "RACECHECK SUMMARY: 0 hazards" in r.stdout
    assert "memcheck (hopper): rc=3" in r.stdout and "ERROR SUMMARY: 0 errors" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "run.json"]
    doc = json.loads((out / "run.json").read_text())
    assert [c["rc"] for c in doc["steps"][0]["commands"]][-3:] == [0, 0, 3] and doc["commit"] == "t1"
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"racecheck-hopper.log", "racecheck-slots-hopper.log", "memcheck-hopper.log", "run.json"} <= names


def test_driver_bench_writes_into_out_and_a_failed_setup_stops_the_run(tmp_path, monkeypatch):
    """A stand-in python3: its bench_verify.py writes the JSON it is told to (--out) and gets a time
    limit of its budget less the tail; a failing pip install (setup) skips the steps after it."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _fake_tool(bindir, "python3",
               'if [ "$2" = pip ]; then [ -f "$FAIL_PIP" ] && { echo "ERROR: no wheels"; exit 1; }; exit 0; fi\n'
               'if [ "$1" = bench/bench_verify.py ]; then\n'
               '  while [ $# -gt 0 ]; do case "$1" in --out) o=$2;; --time-limit) t=$2;; esac; shift; done\n'
               '  echo "{\\"time_limit\\": $t}" > "$o"; echo "speedup vs Triton: geomean 21x"; exit 0; fi\n'
               'echo "built /tmp/lib.so"; exit 0\n')
    _fake_tool(bindir, "nvidia-smi", 'echo "NVIDIA H200, 9.0"\n')
    r, out = _run_driver(tmp_path, bindir, "--budget", "300", "bench", "quick", "both")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((out / "bench-quick.json").read_text()) == {"time_limit": 240}
    assert "speedup vs Triton: geomean 21x" in r.stdout
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "bench-quick.log" in tar.getnames()

    flag = tmp_path / "fail-pip"
    flag.write_text("")
    monkeypatch.setenv("FAIL_PIP", str(flag))
    r, out = _run_driver(tmp_path, bindir, "setup", "bench", "quick", "hopper")
    assert r.returncode == 1 and "ERROR: no wheels" in r.stdout
    doc = json.loads((out / "run.json").read_text())
    assert [c["label"] for c in doc["steps"][0]["commands"]] == ["install the carried wheels"]
    assert doc["steps"][1]["skipped"] == "an earlier step failed fatally"


# ------------------------------------------------------------------------------------------
# bench_modes.py
# ------------------------------------------------------------------------------------------
def _mode_row(graph, eager_wall, eager_host):
    return {"graph_us_per_call_gpu": graph, "graph_us_per_call_wall": graph + 0.5, "eager_us_per_call_gpu": eager_wall - 1,
            "eager_us_per_call_wall": eager_wall, "eager_us_per_call_host": eager_host, "validations_published": 0}


def test_bench_modes_host_overhead_per_mode():
    """host_added_us = eager host time per call minus stock's (what our Python adds), per mode; the
    table shows it; the module imports on a machine without a GPU (its scene imports sglang lazily)."""
    bm = _load("bench/bench_modes.py", "_kdtree_bench_modes")
    rows = {"stock": _mode_row(400, 315, 20), "off": _mode_row(390, 318, 23.5), "validate": _mode_row(540, 1400, 60),
            "validate@0.25": _mode_row(430, 450, 30), "on": _mode_row(26, 155, 40)}
    bm.add_comparisons(rows)
    assert rows["stock"]["host_added_us"] == 0 and rows["off"]["host_added_us"] == pytest.approx(3.5)
    assert rows["on"]["host_added_us"] == pytest.approx(20) and rows["validate"]["eager_wall_added_us"] == pytest.approx(1085)
    assert rows["on"]["graph_gpu_vs_off"] == pytest.approx(26 / 390)
    table = bm.format_table({"bs": 8}, rows)
    assert "+host vs stock" in table and "eager host us" in table
    on = next(ln for ln in table.splitlines() if ln.startswith("on "))
    assert "20.0" in on and "40.0" in on
    assert [name for name, _, _ in bm.MODES] == ["stock", "off", "validate", "validate@0.25", "on"]
    assert bm.parse_bs("8,128") == [8, 128]
    with pytest.raises(ValueError):
        bm.parse_bs("0")


def test_bench_modes_runs_every_batch_size(tmp_path, monkeypatch):
    bm = _load("bench/bench_modes.py", "_kdtree_bench_modes2")
    seen = []

    def fake_bench(heads, bs, draft, prefix, kind, iters):
        seen.append((bs, prefix))
        return {"config": {"bs": bs}, "modes": {}}

    monkeypatch.setattr(bm, "bench", fake_bench)
    out = tmp_path / "modes.json"
    bm.main(["--bs", "8,128", "--json", str(out)])
    assert seen == [(8, 2048), (128, 2048)]
    assert set(json.loads(out.read_text())["by_bs"]) == {"8", "128"}


# ------------------------------------------------------------------------------------------
# perf_table.py, the results index
# ------------------------------------------------------------------------------------------
def test_performance_doc_table_is_the_generated_one():
    """docs/kernel/performance.md's table is exactly what perf_table.py makes of the result file it
    names (so it is regenerated, never edited by hand)."""
    pt = _load("bench/perf_table.py", "_kdtree_perf_table")
    doc = (ROOT / "docs" / "kernel" / "performance.md").read_text()
    section = doc[doc.index(pt.BEGIN):doc.index(pt.END) + len(pt.END)] + "\n"
    source = re.search(r"perf_table\.py (bench/results/\S+\.json)", section).group(1)
    assert (ROOT / source).exists(), source
    assert pt.render(json.loads((ROOT / source).read_text()), source) == section


def test_perf_table_two_paths_and_update(tmp_path):
    bv = _load("bench/bench_verify.py", "_kdtree_bench_verify")
    pt = _load("bench/perf_table.py", "_kdtree_perf_table2")
    ceil = {"copy_tbps": 4.25, "matmul_tflops": 790.0, "mma_sync_tflops": 645.0}
    paths = ["hopper", "portable"]
    rows = [bv.finish_row({"shape": s._asdict(), "times_us": {"hopper": 10.0, "portable": 25.0, "triton": 200.0,
                                                              "flashmla": 9.0}}, ceil, paths)
            for s in bv.build_grid("ddtree")]
    doc = bv.make_document(rows, ceil, bv.summarize(rows, ceil, paths), ["x"], {"gpu": "fake"}, paths)
    text = pt.render(doc, "bench/results/x.json")
    head = next(ln for ln in text.splitlines() if ln.startswith("| shape"))
    assert "hopper µs" in head and "portable / FlashMLA" in head and "portable % mma.sync" in head
    assert len([ln for ln in text.splitlines() if ln.startswith("| B")]) == 48
    assert "- ddtree, portable grid (48 of 48 shapes): time / FlashMLA geomean 2.778" in text
    assert "- customer, hopper grid (18 of 18 shapes)" in text and "time portable/hopper: geomean 2.500" in text
    # the issues' bars: from the summary, or judged from the rows for a result that predates them
    assert "- hopper, issue 26 targets met 0 of 2: time / FlashMLA, DDTree grid geomean 1.11 (<=1: no)" in text
    assert "- portable, issue 25 targets met " in text
    del doc["summary"]["paths"]["portable"]["targets"], doc["summary"]["paths"]["hopper"]["targets"]
    assert pt.render(doc, "bench/results/x.json") == text
    md = tmp_path / "perf.md"
    md.write_text(f"intro\n{pt.BEGIN}\nold\n{pt.END}\noutro\n")
    pt.update(md, text)
    new = md.read_text()
    assert new.startswith("intro\n") and new.endswith("\noutro\n") and "old" not in new and new.count(pt.BEGIN) == 1


def test_bench_verify_sets_fixes_the_calls_per_replay():
    """--sets N (exactly N calls a replay, e.g. one step of an N-layer model) parses; unset it is None
    (run_shape then sizes the sets to defeat L2); N < 1 is refused."""
    bv = _load("bench/bench_verify.py", "_kdtree_bench_verify_sets")
    assert bv.parse_args(["--grid", "quick"]).sets is None
    assert bv.parse_args(["--grid", "quick", "--sets", "61"]).sets == 61
    with pytest.raises(SystemExit):
        bv.parse_args(["--grid", "quick", "--sets", "0"])


def test_results_index_lists_every_kept_file_and_the_readme_cites_only_kept_ones():
    results = ROOT / "bench" / "results"
    index = (results / "README.md").read_text()
    kept = {p.name for p in results.iterdir() if p.name != "README.md"}
    listed = set()
    for m in re.finditer(r"`(20\d\d-\d\d-\d\d-[^`]+?)`(?: \(\+ `\.png`\))?", index):
        listed.add(m.group(1))
        if m.group(0).endswith("(+ `.png`)"):
            listed.add(m.group(1).replace(".json", ".png"))
    assert kept == listed, (kept - listed, listed - kept)
    readme = (ROOT / "README.md").read_text()
    cited = set(re.findall(r"(20\d\d-\d\d-\d\d-h200-[a-z0-9]+-[a-z-]+\.json)", readme))
    for m in re.finditer(r"(20\d\d-\d\d-\d\d-h200-[a-z0-9]+-)\{([^}]*)\}\.json", readme):
        cited |= {f"{m.group(1)}{part}.json" for part in m.group(2).split(",")}
    assert cited and cited <= kept, cited - kept
    for suffix in re.findall(r"\.\.\.-([a-z0-9]+-[a-z-]+\.json)", readme):  # `...-5aa5b7d-hopper-grid.json`
        assert [f for f in kept if f.endswith("-" + suffix)], suffix


# ------------------------------------------------------------------------------------------
# diagnostics
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("probe", ["gather_probe", "cluster_probe", "dsmem_exchange", "mma_phase"])
def test_device_probe_compiles_for_sm90a(tmp_path, probe):
    """The standalone device diagnostics (gather_probe.cu: the gather's copy paths; cluster_probe.cu:
    how many CTA clusters of the Hopper kernel's shape fit; dsmem_exchange.cu: journal m38's 2-CTA
    partial-score exchange; mma_phase.cu: journal m39's warp-specialised mma phase alone, from the
    kernel's own tile functions, m39b's pair-split mix and m44's chain model) build with the project's nvcc for sm_90a
    without warnings and with no spill in any kernel, so they are ready for a device run (a spill
    inside a timed loop would time the spill)."""
    from kdtree_backend.kernel.build import find_nvcc

    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (the kernel build tests skip too)")
    out = tmp_path / probe
    r = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                        str(ROOT / "bench" / "diag" / f"{probe}.cu"), "-o", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.exists()
    assert "warning" not in r.stderr.lower(), r.stderr[-3000:]
    spills = [int(b) for b in re.findall(r"(\d+) bytes spill stores", r.stderr)]
    assert spills and not any(spills), r.stderr[-3000:]


def test_mma_phase_both_mode_rereads_the_done_count(tmp_path):
    """In the `both` mode the PV warps loop until the QK warps' done count (an ATOMS by each QK warp)
    reaches its end; no barrier is in that loop, so a load ptxas may treat as invariant is read once
    and the loop never ends (pair_kernel<kBoth> hung on the GPU in session 43 with a plain
    `ld.shared`). In the SASS of every both-mode kernel, a plain LDS of the ATOMS's address must sit
    inside the loop that issues the PV warps' HMMA."""
    from kdtree_backend.kernel.build import find_cuobjdump, find_nvcc

    nvcc, cuobjdump = find_nvcc(), find_cuobjdump()
    if nvcc is None or cuobjdump is None:
        pytest.skip("nvcc or cuobjdump not found (the kernel build tests skip too)")
    cubin = tmp_path / "mma_phase.cubin"
    r = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-o", str(cubin),
                        str(ROOT / "bench" / "diag" / "mma_phase.cu")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, timeout=120, check=True).stdout
    checked = []
    # sm_90 instructions are 16 bytes each from address 0, so a branch target's index is its address / 16.
    for _, name, ins in _load("tools/sass_schedule.py", "_kdtree_sass_schedule").parse_functions(sass):
        if "chain_kernel" in name:
            continue  # the chain model (m44): its ATOMS is the stage's landing stamp (atomicMax), no done count
        atoms = [re.search(r"\+(0x[0-9a-f]+)\]", t) for t in ins if t.startswith("ATOMS")]
        if not atoms:
            continue  # not a both-mode kernel: no done count
        done = atoms[0].group(1)
        loops = [(int(m.group(1), 16) // 16, i) for i, t in enumerate(ins) if (m := re.search(r"\bBRA (0x[0-9a-f]+)$", t))
                 and int(m.group(1), 16) // 16 < i]
        pv_loops = [(lo, hi) for lo, hi in loops if any(t.startswith("HMMA") for t in ins[lo:hi + 1])]
        rereads = [i for i, t in enumerate(ins) if re.match(r"LDS(\.\S+)? R\d+, \[R\d+(\+URZ)?\+" + done + r"\]$", t)
                   and any(lo <= i <= hi for lo, hi in pv_loops)]
        assert rereads, f"{name}: no LDS of the done count ({done}) inside an HMMA loop"
        checked.append(name)
    assert len(checked) == 5, checked  # phase_kernel<kBoth> at four distances, pair_kernel<kBoth>


def test_p14_register_probe_shows_the_role_budgets(tmp_path):
    """Journal p14's numbers, from ptxas: with setmaxnreg the PV role needs more than 152 registers
    (spills there) and the QK role fits 192 with the PV role at 160 (one SM's 65,536 at 384 threads;
    0 spills on sm_90a). Compile only."""
    from kdtree_backend.kernel.build import find_nvcc

    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (the kernel build tests skip too)")

    def spill_bytes(arch, qk, pv):
        r = subprocess.run([nvcc, f"-arch={arch}", "-DSETMAXNREG", f'-DQKREG="{qk}"', f'-DPVREG="{pv}"', "-cubin",
                            "-o", str(tmp_path / "p.cubin"), str(ROOT / "bench" / "diag" / "p14_register_probe.cu"),
                            "-Xptxas", "-v"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "warning" not in r.stderr.lower(), r.stderr[-3000:]
        return int(re.search(r"(\d+) bytes spill stores", r.stderr).group(1))

    assert 4 * 32 * 192 + 8 * 32 * 160 == 65536
    assert spill_bytes("sm_90a", 192, 160) == 0
    assert spill_bytes("sm_120a", 192, 152) > 0


@pytest.mark.parametrize("script,option", [("timeline.py", "--warm"), ("timeline.py", "--ragged"),
                                           ("tile_timeline.py", "--calls"), ("ragged.py", "--batches"),
                                           ("call_series.py", "--gap-ms"), ("clock_power.py", "--seconds"),
                                           ("kernel_times.py", "--calls"), ("smoke.py", "--profile-shape")])
def test_diagnostic_scripts_get_through_their_imports(script, option):
    """bench/diag/*.py import the op and smoke.py's batch builder at start-up; their --help must come
    up on a machine without a GPU and name their options."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "diag" / script), "--help"], capture_output=True,
                       text=True, timeout=300, env=clean_env(), cwd=ROOT)
    assert r.returncode == 0 and option in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_driver_keeps_ab_libraries_between_calls_and_out_of_the_logs(tmp_path):
    """A warm machine's work directory: an earlier call's logs are removed, the libraries `ab` built
    (lib_NAME.so) stay for a later call's lib=, and no library goes into logs.tar.gz."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _fake_tool(bindir, "compute-sanitizer", 'echo "========= RACECHECK SUMMARY: 0 hazards displayed"\n')
    work = tmp_path / "work"
    work.mkdir()
    (work / "lib_s2.so").write_bytes(b"\x7fELF not really")
    (work / "old-step.log").write_text("from an earlier call\n")
    r, out = _run_driver(tmp_path, bindir, "sanitize", "hopper")
    assert (work / "lib_s2.so").exists(), r.stdout + r.stderr
    assert not (work / "old-step.log").exists()
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert "lib_s2.so" not in names and "run.json" in names



def _tile_record(tt, offs, ctas, refill_events):
    """A synthetic stamp buffer: every tile's events at fixed offsets from a 1,000-cycle period; the
    refill events only while two more tiles follow (as the kernels stamp them)."""
    buf = [0] * (tt.CTAS * tt.RECORD)
    for c, n in ctas:
        buf[c * tt.RECORD] = n
        for t in range(n):
            for k, o in enumerate(offs):
                if k in refill_events and t >= n - 2:
                    continue
                buf[c * tt.RECORD + 1 + t * tt.EVENTS + k] = 10_000 * (c + 1) + t * 1000 + o
    return buf


def test_tile_timeline_intervals_from_a_known_schedule():
    """bench/diag/tile_timeline.py's arithmetic on synthetic records of both kernels, so each interval
    is known; CTAs with few tiles are left out, and a record's stale tiles past its segment's tile
    count (an earlier, longer segment's) are not read."""
    tt = _load("bench/diag/tile_timeline.py", "tile_timeline_under_test")
    period, tiles = 1000, 20
    # portable: kQkKFull, Scores, Softmax, PFree, PFull, kPvPFull, MmaIssued, Stage, Refill, Fenced
    offs = [0, 400, 550, 560, 600, 650, 900, 950, 990, 965]
    buf = _tile_record(tt, offs, ((0, tiles), (1, tiles), (2, 5)), (tt.PV_STAGE, tt.PV_REFILL, tt.PV_FENCED))
    for t in range(tiles, tiles + 6):  # CTA 1: an earlier segment's stamps past this one's 20 tiles
        for k in range(10):
            buf[tt.RECORD + 1 + t * tt.EVENTS + k] = 7
    res = tt.summarise(buf, "portable")
    assert res["ctas"] == 2
    want = {"period": period, "qk.k_wait": period - 600, "qk.mma": 400, "qk.softmax": 150, "qk.p_free_wait": 10,
            "qk.handoff": 40, "pv.p_wait": period - 340, "pv.mma": 250, "pv.stage_wait": 50, "pv.refill": 40,
            "pv.refill.ids": 15, "pv.refill.copies": 25, "refill_to_k": 2 * period - 990, "p_to_pv": 50}
    assert {k: res[k]["median"] for k in want} == want
    assert res["period"]["n"] == 2 * (tiles - 4)
    # Hopper: kWg0KFull, Scores, Softmax, PFree, PFull, PvDone, kWg1PFull, PvDone, Empty, Refill
    offs = [0, 300, 500, 520, 560, 700, 580, 800, 820, 980]
    buf = _tile_record(tt, offs, ((0, tiles), (3, 6)), (tt.WG1_EMPTY, tt.WG1_REFILL))
    res = tt.summarise(buf, "hopper")
    assert res["ctas"] == 1
    want = {"period": period, "wg0.k_wait": period - 700, "wg0.qk": 300, "wg0.softmax": 200, "wg0.p_free_wait": 20,
            "wg0.share": 40, "wg0.pv": 140, "wg1.p_wait": period - 400, "wg1.pv": 220, "wg1.empty_wait": 20,
            "wg1.refill": 160, "refill_to_k": 2 * period - 980, "p_to_wg1": 20}
    assert {k: res[k]["median"] for k in want} == want


def test_tile_timeline_tail_reads_a_segments_last_tiles():
    """--tail (journal m32b): per position from the segment's end, the intervals of its last tiles;
    here the last two tiles' softmax is 3,000 cycles longer, as a draft tile's mask read was, and
    CTAs whose segment is shorter than the tail are left out."""
    tt = _load("bench/diag/tile_timeline.py", "tile_timeline_tail_under_test")
    offs = [0, 300, 500, 520, 560, 700, 580, 800, 820, 980]
    tiles = 12
    buf = _tile_record(tt, offs, ((0, tiles), (2, 3)), (tt.WG1_EMPTY, tt.WG1_REFILL))
    for c in (0,):  # (CTA 2's 3 tiles, if read, would pull the medians to 1,700)
        for t in (tiles - 2, tiles - 1):  # the last two tiles: softmax + 3,000, later events shifted
            for k in (tt.WG0_SOFTMAX, tt.WG0_PFREE, tt.WG0_PFULL, tt.WG0_PV_DONE):
                buf[c * tt.RECORD + 1 + t * tt.EVENTS + k] += 3000 * (t - (tiles - 3))
            if t == tiles - 1:
                for k in (tt.WG0_SCORES,):
                    buf[c * tt.RECORD + 1 + t * tt.EVENTS + k] += 3000
    tail = tt.tail_summary(buf, "hopper", 3)
    assert list(tail) == ["last", "last-1", "last-2"]
    assert tail["last-2"]["wg0.softmax"] == 200 and tail["last-2"]["tile"] == 1000
    assert tail["last-1"]["wg0.softmax"] == 3200 and tail["last-1"]["tile"] == 4000
    assert tail["last-1"]["wg0.qk"] == 300 and tail["last-1"]["wg0.pv"] == 140


def test_driver_ab_passes_slot_layouts_and_refuses_others(drv, capsys):
    out = _dry(drv, capsys, "ab", "base=/tmp/prev.so", "paths=portable", "slots=runs")
    smoke_lines = [line for line in out.splitlines() if "bench/diag/smoke.py" in line]
    assert len(smoke_lines) == 2 and all("--slots runs" in line for line in smoke_lines)
    assert "--slots" not in _dry(drv, capsys, "ab", "base=/tmp/prev.so", "paths=portable")
    with pytest.raises(SystemExit):
        drv.main(["--dry-run", "--commit", "abc1234", "--capability", "9.0", "ab", "base=/tmp/prev.so", "slots=pages"])
    assert "slots=pages" in capsys.readouterr().err


def test_driver_and_smoke_agree_on_slot_layouts(drv):
    """One list of slot layouts: the benchmark's --slots, which the driver's ab slots= and smoke.py's
    --slots both take."""
    import ast
    bv = _load("bench/bench_verify.py", "_kdtree_bench_verify_slots")
    assert drv.SLOT_ORDERS == bv.SLOT_ORDERS == ("random", "contiguous", "runs")
    tree = ast.parse((ROOT / "bench/diag/smoke.py").read_text())
    assert any(isinstance(n, ast.ImportFrom) and n.module == "bench.bench_verify"
               and [a.name for a in n.names] == ["SLOT_ORDERS", "kernel_path"] for n in tree.body)
    assert not any(isinstance(n, ast.FunctionDef) and n.name == "kernel_path" for n in tree.body)  # not written twice


def test_smoke_slot_layouts_keep_the_batch_and_make_runs():
    torch = pytest.importorskip("torch")
    smoke = _load("bench/diag/smoke.py", "_kdtree_smoke")
    perm = torch.randperm(1000, generator=torch.Generator().manual_seed(0))[:600]
    rnd = smoke.slot_order("random", 600, 1000, perm, 7)
    assert torch.equal(rnd, perm)
    assert smoke.slot_order("contiguous", 600, 1000, perm, 7).tolist() == list(range(600))
    runs = smoke.slot_order("runs", 600, 1000, perm, 7)
    assert len(set(runs.tolist())) == 600 and 0 <= int(runs.min()) and int(runs.max()) < 1000
    steps = (runs[1:] - runs[:-1]).tolist()
    assert steps.count(1) > 500  # runs of 1-300: most neighbours are consecutive slots
    with pytest.raises(ValueError, match="slot layout"):
        smoke.slot_order("pages", 600, 1000, perm, 7)
    a = smoke.make_batch(2, 8, 4, [50, 60], device="cpu", seed=1, pool_extra=10, slots="runs")
    b = smoke.make_batch(2, 8, 4, [50, 60], device="cpu", seed=1, pool_extra=10)
    assert torch.equal(a["q"], b["q"]) and torch.equal(a["custom_mask"], b["custom_mask"])
    assert not torch.equal(a["kv_indices"][:110], b["kv_indices"][:110])


def test_smoke_checks_every_timed_path(monkeypatch):
    """smoke.py's float64 cases run on each kernel path it times (--configs), not on the GPU's default
    path: an A/B of portable variants on an H200 (default: the Hopper kernel) must check the portable
    kernel. Each path's cases run with KDTREE_KERNEL set to it, and the caller's value comes back."""
    pytest.importorskip("torch")
    smoke = _load("bench/diag/smoke.py", "_kdtree_smoke_paths")
    seen = []

    def fake_case(i, case):
        seen.append((os.environ.get("KDTREE_KERNEL"), i))
        return i != 3 or os.environ["KDTREE_KERNEL"] != "portable", [dict(case=i)]

    monkeypatch.setattr(smoke, "check_case", fake_case)
    monkeypatch.setenv("KDTREE_KERNEL", "hopper")
    ok, rows = smoke.correctness(False, ("portable", "auto"))
    n = len(seen) // 2
    # "auto" leaves KDTREE_KERNEL as the caller set it (bench_verify.kernel_path, shared)
    assert n >= 5 and seen == [("portable", i) for i in range(n)] + [("hopper", i) for i in range(n)]
    assert not ok  # a bad case on one path fails the run
    assert [r["config"] for r in rows] == ["portable"] * n + ["auto"] * n
    assert os.environ["KDTREE_KERNEL"] == "hopper"
    monkeypatch.delenv("KDTREE_KERNEL")
    seen.clear()
    assert smoke.correctness(True, ("portable-tiled",))[0]
    assert {c for c, _ in seen} == {"portable-tiled"} and "KDTREE_KERNEL" not in os.environ


def test_clock_power_ratios_against_flashmla():
    """clock_power.py's summary of one shape: each of our paths' mean time and cycles over the rounds
    against FlashMLA's; nothing without FlashMLA's segments."""
    spec = importlib.util.spec_from_file_location("clock_power", ROOT / "bench" / "diag" / "clock_power.py")
    cp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cp)
    seg = lambda name, us, kc, mhz: {"name": name, "us_per_call": us, "kcycles_per_call": kc, "sm_clock_mhz": mhz}
    r = cp.ratios([seg("hopper", 100.0, 180.0, 1800.0), seg("flashmla", 90.0, 150.0, 1667.0),
                   seg("flashmla", 90.0, 150.0, 1667.0), seg("hopper", 102.0, 180.0, 1765.0)])
    assert list(r) == ["hopper"]
    assert abs(r["hopper"]["time_vs_flashmla"] - 101.0 / 90.0) < 1e-12
    assert abs(r["hopper"]["cycles_vs_flashmla"] - 1.2) < 1e-12
    assert r["hopper"]["clock_mhz"] == 1782.5 and r["hopper"]["flashmla_clock_mhz"] == 1667.0
    assert cp.ratios([seg("hopper", 1.0, 1.0, 1.0)]) == {}


def test_clock_power_reads_the_second_half_of_the_samples():
    """clock_power.py's reading of nvidia-smi's samples: only the second half (the clock has settled
    under the power cap by then), a truncated line or an [N/A] field left out, the reasons as a set."""
    spec = importlib.util.spec_from_file_location("clock_power", ROOT / "bench" / "diag" / "clock_power.py")
    cp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cp)
    text = "\n".join(["1980, 300.1, 0x0000000000000000", "1980, 450.0, 0x0000000000000000",
                      "1620, 697.5, 0x0000000000000004", "1605, 699.0, 0x0000000000000004",
                      "1590, [N/A], 0x0000000000000004", "1650, 696"])
    st = cp.smi_half_stats(text)
    assert st["samples"] == 3 and st["sm_clock_mhz"] == 1605.0
    assert st["power_w"] == (697.5 + 699.0) / 2
    assert st["reasons"] == ["0x0000000000000004"]
    assert cp.smi_half_stats("")["samples"] == 0
