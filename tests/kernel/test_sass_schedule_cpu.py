"""tools/sass_schedule.py's SASS parsing on a fixed excerpt in cuobjdump's format (no toolkit needed):
functions per arch, setmaxnreg regions with their highest register and spills, and how many HMMA
ahead each B fragment's LDSM was issued (a register overwritten in between is not counted)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("sass_schedule", ROOT / "tools" / "sass_schedule.py")
sass_schedule = importlib.util.module_from_spec(_spec)
sys.modules["sass_schedule"] = sass_schedule  # dataclasses look their module up there
_spec.loader.exec_module(sass_schedule)


def _fn(name: str, body: list[str]) -> str:
    lines = [f"\t\tFunction : {name}", "\t.headerflags\t@\"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)\""]
    for i, t in enumerate(body):
        lines.append(f"        /*{i * 16:04x}*/                   {t} ;   /* 0x000000000000 */")
        lines.append("                                                   /* 0x000000000000 */")
    return "\n".join(lines)


def _sass() -> str:
    qk = [
        "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xb8",
        "LDSM.16.M88.4 R140, [R3]",
        "LDSM.16.M88.4 R152, [R3+0x4900]",
        "HMMA.16816.F32.BF16 R164, R4.reuse, R140, RZ",   # B loaded 0 HMMA ahead
        "HMMA.16816.F32.BF16 R136, R4, R152, RZ",          # 1 ahead
        "LDSM.16.M88.4 R148, [R3+0x20]",
        "IMAD R2, R172, 0x10, R3",
        "HMMA.16816.F32.BF16 R164, R8, R142, R164",        # R142 from the first LDSM: 2 ahead
        "MOV R150, R2",                                      # R150 overwritten: not counted
        "HMMA.16816.F32.BF16 R136, R8, R150, R136",
        "HMMA.16816.F32.BF16 R140, R8, R148, R140",        # LDSM after HMMA 2, used by HMMA 4: 2 ahead
        "STL [R1], R181",
    ]
    pv = ["USETMAXREG.DEALLOC.CTAPOOL 0xa0", "LDL R7, [R1]", "EXIT"]
    other = ["MOV R1, c[0x0][0x28]", "EXIT"]
    return "\n".join([
        "", "Fatbin elf code:", "================", "arch = sm_90a", "code version = [1,8]",
        _fn("_ZN6kdtree16verify_ws_kernelILb0EEEv18KdtreeVerifyParams", ["MOV R1, c[0x0][0x28]"] + qk + pv),
        "", "Fatbin elf code:", "================", "arch = sm_120a",
        _fn("_ZN6kdtree21combine_splits_kernel", other),
    ])


def test_functions_by_arch():
    fns = sass_schedule.parse_functions(_sass())
    assert [(a, n.split("kdtree")[1][:8]) for a, n, _ in fns] == [("sm_90a", "16verify"), ("sm_120a", "21combin")]
    assert fns[0][2][1].startswith("USETMAXREG.TRY_ALLOC")
    assert len(fns[0][2]) == 1 + 12 + 3


def test_a_cubins_arch_from_its_code_for_line():
    cubin = "\n\tcode for sm_120a\n\t.target\tsm_120a\n\n" + _fn("_ZN6kdtree16verify_ws_kernelILb1EEEv18KdtreeVerifyParams",
                                                                   ["MOV R1, c[0x0][0x28]", "EXIT"])
    assert [(a, len(i)) for a, _, i in sass_schedule.parse_functions(cubin)] == [("sm_120a", 2)]


def test_regions_name_the_highest_register_and_spills():
    _, _, instrs = sass_schedule.parse_functions(_sass())[0]
    regs = sass_schedule.regions(instrs)
    assert [(r.first, r.end) for r in regs] == [(0, 1), (1, 13), (13, 16)]
    assert regs[0].setmaxnreg == "" and regs[0].max_register == 1
    assert regs[1].setmaxnreg.endswith("0xb8") and regs[1].max_register == 181
    assert (regs[1].spill_stores, regs[1].spill_loads) == (1, 0)
    assert regs[2].setmaxnreg.endswith("0xa0") and (regs[2].spill_stores, regs[2].spill_loads) == (0, 1)


def test_ldsm_distance_histogram():
    _, _, instrs = sass_schedule.parse_functions(_sass())[0]
    hmma = [i for i, t in enumerate(instrs) if "HMMA" in t]
    d = sass_schedule.ldsm_distances(instrs, hmma[0], hmma[-1])
    assert dict(d) == {0: 1, 1: 1, 2: 2}


def test_report_filters_by_function_and_arch():
    reps = sass_schedule.report(_sass(), "verify_ws_kernel", {"sm_90a"}, min_hmma=4)
    assert len(reps) == 1 and reps[0].arch == "sm_90a"
    assert len(reps[0].loops) == 1 and reps[0].loops[0].hmma == 5 and reps[0].loops[0].ldsm == 1
    assert reps[0].loops[0].distance == {0: 1, 1: 1, 2: 2}
    assert sass_schedule.report(_sass(), "verify_ws_kernel", {"sm_120a"}, min_hmma=4) == []
