"""tools/sass_schedule.py's SASS parsing on a fixed excerpt in cuobjdump's format (no toolkit needed):
functions per arch, setmaxnreg regions with their highest register and spills, how many HMMA
ahead each B fragment's LDSM was issued (a register overwritten in between is not counted), and the
wgmma chains' commit groups with what stands between them (journal h49)."""
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


def _chain(group_gap: list[str], top: list[str], groups: int = 3, per_group: int = 4) -> list[str]:
    """A QK^T-like chain of HGMMA into R152 in `groups` commit groups, `group_gap` between two groups
    and `top` before the first; then a PV group into R24 (another chain, too short to report)."""
    body = list(top) + ["WARPGROUP.ARRIVE"]
    for g in range(groups):
        for k in range(per_group):
            first = g == 0 and k == 0
            gsb = ", gsb0" if k == per_group - 1 else ""
            body.append(f"HGMMA.64x64x16.F32.BF16 R152, gdesc[UR8], {'RZ, !UPT' if first else 'R152'}{gsb}")
            body.append("UIADD3 UR8, UR8, 0x2, URZ")
        if g + 1 < groups:
            body += group_gap
    body += ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "HGMMA.64x256x16.F32.BF16 R24, R152, gdesc[UR4].tnspB, R24, gsb0", "EXIT"]
    return body


def test_wgmma_chains_name_what_stands_between_the_groups():
    """h49's reading (journal): FlashMLA's QK^T waits on a barrier between its groups and nothing
    else; h24's waited and fenced (MEMBAR) there; a drain (WARPGROUP.DEPBAR) would be reported too. A
    predicated branch over the loop top's fence marks it `(cond)`, the try-wait's own retry branch
    does not."""
    wait = ["SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR11+0x38308], R202", "@!P0 BRA 0x22500"]
    top = wait + ["@P1 BRA 0x17b60", "MEMBAR.ALL.CTA", "FENCE.VIEW.ASYNC.S"]
    flash = sass_schedule.wgmma_chains(_chain(wait, wait))
    assert [(c.shape, c.accumulator, c.wgmma, c.groups, c.between, c.before) for c in flash] == [
        ("64x64x16", "R152", 12, 3, [["wait"], ["wait"]], ["wait"])]
    h24 = sass_schedule.wgmma_chains(_chain(wait + ["MEMBAR.ALL.CTA", "FENCE.VIEW.ASYNC.S"], wait + ["MEMBAR.ALL.CTA"]))
    assert h24[0].between == [["wait", "membar"], ["wait", "membar"]] and h24[0].before == ["wait", "membar"]
    drained = sass_schedule.wgmma_chains(_chain(["WARPGROUP.DEPBAR.LE gsb0, 0x0"], top))
    assert drained[0].between == [["drain"], ["drain"]] and drained[0].before == ["wait", "membar(cond)"]
    one = sass_schedule.wgmma_chains(_chain([], top, groups=1, per_group=36))
    assert (one[0].wgmma, one[0].groups, one[0].between) == (36, 1, [])
    assert sass_schedule.wgmma_chains(_chain(wait, wait, groups=1, per_group=4)) == []  # below min_wgmma
