"""The kernel library builds on a CPU machine (nvcc only) for sm_90, sm_100 and sm_120 with the
portable kernels' compute_120 PTX, with no register spills on sm_120 and sm_100, the shared memory
within sm_120's limit (a static_assert in the source), and a C ABI that matches
kdtree_backend/kernel/abi.py. Runs in CI; skipped where nvcc is absent."""
from __future__ import annotations

import ctypes
import dataclasses

import pytest

from kdtree_backend.kernel import abi
from kdtree_backend.kernel import build

pytestmark = pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not on PATH")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("lib") / abi.LIB_FILENAME
    return build.build(out, check=True)


def test_every_arch_and_the_newest_ptx_in_the_fat_binary(report):
    assert report.archs == (90, 100, 120) and report.ptx_arch == 120
    archs = build.elf_archs(report.path)
    if archs is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton wheel) to list the fat binary")
    assert set(archs) == {90, 100, 120}  # sm_90a (Hopper kernel) lists as 90
    assert build.ptx_archs(report.path) == [120]


def test_no_spills_on_sm120_and_sm100_and_every_kernel_reported(report):
    kernels = {(r.arch, "verify_attention" in r.kernel) for r in report.resources}
    assert {(a, k) for a in (90, 100, 120) for k in (True, False)} <= kernels
    assert report.problems() == []
    strict = [r for r in report.resources if r.arch in (100, 120)]
    assert {r.arch for r in strict} == {100, 120} == set(build.STRICT_SPILL_ARCHS)
    assert all(r.spill_loads == r.spill_stores == r.stack_bytes == 0 for r in strict)


@pytest.mark.parametrize("line", [
    "ptxas info    : (C7506) Potential Performance Loss: 'setmaxnreg' ignored to maintain compatibility into "
    "'extern' call.",
    "ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg' ignored; unable to determine register "
    "count at entry.",
], ids=["C7506", "C7508"])
def test_a_dropped_setmaxnreg_fails_the_check(report, line):
    """ptxas reports a setmaxnreg it ignores only as "info" (C7506, C7507, C7508): the check must refuse it."""
    assert not any(code in report.ptxas_log for code in ("C7506", "C7507", "C7508"))
    bad = build.BuildReport(report.path, report.archs, report.command, report.resources,
                            report.ptxas_log + line + "\n", report.ptx_arch)
    assert bad.problems() == [f"ptxas ignored setmaxnreg: {line}"]


def test_a_launch_count_off_the_setmaxnreg_plan_fails_the_check(report):
    """The warp-specialised kernel's setmaxnreg plan redistributes exactly its launch registers; built at
    another count it would hang in setmaxnreg.inc, so the check refuses it (and the built one passes)."""
    want = build.ws_launch_registers()
    ws = [r for r in report.resources if "verify_ws_kernel" in r.kernel]
    assert {r.arch for r in ws} == {90, 100, 120} and all(r.registers == want for r in ws)
    off = [dataclasses.replace(r, registers=want - 8) if r is ws[0] else r for r in report.resources]
    bad = build.BuildReport(report.path, report.archs, report.command, off, report.ptxas_log, report.ptx_arch)
    assert [p for p in bad.problems() if "setmaxnreg plan" in p] == [
        f"sm_{ws[0].arch}a {ws[0].kernel}: launched at {want - 8} registers a thread; its setmaxnreg plan needs "
        f"{want} (WsConfig::kLaunchRegs), or setmaxnreg.inc would wait forever"]


def test_build_without_ptx_embeds_none_and_reports_zero(tmp_path):
    rep = build.build(tmp_path / abi.LIB_FILENAME, archs=(120,), ptx=False, check=True)
    assert rep.ptx_arch == 0 and not any("code=compute_" in a for a in rep.command)
    lib = ctypes.CDLL(str(rep.path))
    abi.declare_signatures(lib)
    assert lib.kdtree_ptx_arch() == 0 and lib.kdtree_built_archs().decode() == "120"
    if build.find_cuobjdump() is not None:
        assert build.ptx_archs(rep.path) == []


def test_hopper_kernel_built_for_sm90a_without_spills_or_wgmma_serialisation(report):
    # Two instantiations (h13): the scales folded into the softmax (what SGLang's positive scales
    # run) and applied as given (zero, negative or extreme scales).
    hopper = [r for r in report.resources if "hopper" in r.kernel and "verify_attention" in r.kernel]
    assert len(hopper) == 4 and {r.arch for r in hopper} == {90}  # scales folded or not x one request or any (s1e)
    assert {"ILb0E" in r.kernel for r in hopper} == {True, False}
    assert all(r.spill_stores == r.spill_loads == r.stack_bytes == 0 for r in hopper)
    assert "Compiling entry function '_ZN6kdtree6hopper30verify_attention_hopper_kernel" in report.ptxas_log
    assert "for 'sm_90a'" in report.ptxas_log
    # ptxas serialises wgmma (and warns) when accumulators are touched while in flight.
    assert "wgmma" not in report.ptxas_log.lower().replace("wgmma_", "")
    lib = ctypes.CDLL(str(report.path))
    abi.declare_signatures(lib)
    plan = abi.VerifyPlan()
    assert lib.kdtree_verify_plan(1, 8, 16, 132, abi.CONFIG_HOPPER, ctypes.byref(plan)) == 0
    # s1: one wave of CTAs planned (2 row tiles: 66 parts); the smallest part is the device's (0, h29).
    assert plan.rows_per_tile == 64 and plan.row_tiles == 2 and plan.num_splits == 66
    assert plan.min_keys_per_split == 0
    assert lib.kdtree_verify_plan(1, 8, 8, 132, abi.CONFIG_HOPPER, ctypes.byref(plan)) == 0
    assert plan.row_tiles == 1 and plan.num_splits == 66  # one row tile in all: half the SMs' worth of parts (h29b)
    assert lib.kdtree_verify_plan(8, 8, 8, 132, abi.CONFIG_HOPPER, ctypes.byref(plan)) == 0
    assert plan.row_tiles == 1 and plan.num_splits == 128  # the batch's tiles over 128 parts (kMaxSplits)
    assert lib.kdtree_verify_plan(8, 8, 65, 132, abi.CONFIG_HOPPER, ctypes.byref(plan)) == 0
    assert plan.row_tiles == 9 and plan.num_splits == 14  # B8 H8 n65: 126 CTAs, each 1/14 of the batch (s1)


def test_compiler_reports_no_warnings(report):
    """nvcc's front end warns about what a refactor leaves behind (unused variables, narrowing);
    the build log must stay clean so a new warning is seen."""
    warnings = [line for line in report.ptxas_log.splitlines() if "warning" in line.lower()]
    assert warnings == []


def test_sm120_only_build_has_no_hopper_kernel_and_says_so(tmp_path):
    rep = build.build(tmp_path / abi.LIB_FILENAME, archs=(120,))
    assert not any("hopper" in r.kernel for r in rep.resources)
    lib = ctypes.CDLL(str(rep.path))
    abi.declare_signatures(lib)
    rc = lib.kdtree_verify_plan(1, 8, 16, 132, abi.CONFIG_HOPPER, ctypes.byref(abi.VerifyPlan()))
    assert rc != 0 and "without the Hopper kernel" in lib.kdtree_error_string(rc).decode()


def test_generated_wgmma_wrappers_are_up_to_date():
    import importlib.util
    from pathlib import Path

    root = Path(build.PACKAGE_DIR).parent
    spec = importlib.util.spec_from_file_location("gen_wgmma", root / "tools" / "gen_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    header = build.CSRC_DIR / "hopper" / "wgmma_ops.cuh"
    assert gen.OUTPUT == header
    assert header.read_text() == gen.render(), (
        "csrc/hopper/wgmma_ops.cuh is stale: run `python tools/gen_wgmma.py > kdtree_backend/kernel/csrc/hopper/wgmma_ops.cuh`")


def test_c_abi_matches_python_mirror(report):
    lib = ctypes.CDLL(str(report.path))
    abi.declare_signatures(lib)
    assert lib.kdtree_abi_version() == abi.ABI_VERSION
    assert lib.kdtree_built_archs().decode() == "90,100,120"
    assert lib.kdtree_ptx_arch() == 120
    # kdtree_api.cu static_asserts the same sizes on the C side.
    assert ctypes.sizeof(abi.VerifyParams) == 184
    assert ctypes.sizeof(abi.VerifyPlan) == 32
    for name in abi.REQUIRED_SYMBOLS:
        assert hasattr(lib, name)


def test_abi_constants_mirror_the_header():
    """abi.py's ABI version and largest draft count are kdtree_api.h's (the ids and sizes are checked
    against the built library above)."""
    import re

    header = (build.CSRC_DIR / "kdtree_api.h").read_text()
    assert int(re.search(r"#define KDTREE_ABI_VERSION (\d+)", header).group(1)) == abi.ABI_VERSION == 2
    assert int(re.search(r"#define KDTREE_MAX_QO_LEN (\d+)", header).group(1)) == abi.MAX_QO_LEN
    ids = dict(re.findall(r"(KDTREE_CONFIG_\w+) = (\d+)", header))
    assert ids == {"KDTREE_CONFIG_PORTABLE": "0", "KDTREE_CONFIG_RESERVED_1": "1", "KDTREE_CONFIG_HOPPER": "2",
                   "KDTREE_CONFIG_PORTABLE_TILED": "3"}
    assert (abi.CONFIG_PORTABLE, abi.CONFIG_HOPPER) == (0, 2) and 1 not in abi.CONFIG_NAMES  # rows32's id stays unused


def test_plan_refuses_draft_counts_above_the_abi_limit(report):
    lib = ctypes.CDLL(str(report.path))
    abi.declare_signatures(lib)
    for config in (abi.CONFIG_PORTABLE, abi.CONFIG_HOPPER):
        assert lib.kdtree_verify_plan(1, 8, abi.MAX_QO_LEN, 132, config, ctypes.byref(abi.VerifyPlan())) == 0
        rc = lib.kdtree_verify_plan(1, 8, abi.MAX_QO_LEN + 1, 132, config, ctypes.byref(abi.VerifyPlan()))
        assert rc != 0 and f"not in [1, {abi.MAX_QO_LEN}]" in lib.kdtree_error_string(rc).decode()


def _schedule_cache_bytes(batch, grid_ctas):
    """The schedule cache a batch launch keeps at its workspace's end (common/schedule.cuh, journal
    m35): a 192-byte record a CTA, the int64 snapshot of qo_indptr and kv_indptr, a 64-byte header."""
    return 0 if batch <= 1 else grid_ctas * 192 + 16 * (batch + 1) + 64


@pytest.mark.parametrize("config", [abi.CONFIG_PORTABLE, abi.CONFIG_HOPPER])
def test_requested_splits_are_planned_with_their_workspace(report, config):
    """KDTREE_NUM_SPLITS / KDTREE_MIN_KEYS_PER_SPLIT reach the plan as its inputs, and the plan alone
    sizes the workspace for them (ops.py no longer re-derives it)."""
    lib = ctypes.CDLL(str(report.path))
    abi.declare_signatures(lib)
    plan = abi.VerifyPlan(requested_splits=8, requested_min_keys_per_split=128)
    assert lib.kdtree_verify_plan(32, 16, 64, 132, config, ctypes.byref(plan)) == 0  # would plan 8 parts
    assert plan.num_splits == 8 and plan.min_keys_per_split == 128 and plan.row_tiles == 16
    # two slots a part of 16 x 64 rows (512 fp32 + 1 lse each), then (first part, pieces) a (request,
    # row tile) (s3: 16 x 8 = 128 CTAs leave 4 of 132 SMs idle, too few for 16 row tiles' remainders),
    # then the schedule cache of the 128 CTAs
    assert plan.workspace_bytes == (2 * 8 * 16 * 64 * (abi.V_HEAD_DIM + 1) * 4 + 32 * 16 * 8
                                    + _schedule_cache_bytes(32, 128))
    plan = abi.VerifyPlan(requested_splits=1)
    assert lib.kdtree_verify_plan(1, 8, 16, 132, config, ctypes.byref(plan)) == 0  # would plan 33-66
    assert plan.num_splits == 1 and plan.workspace_bytes == 0
    for bad, needle in [(dict(requested_splits=129), "requested_splits 129"), (dict(requested_splits=-1), "requested_splits -1"),
                        (dict(requested_min_keys_per_split=-64), "requested_min_keys_per_split -64")]:
        rc = lib.kdtree_verify_plan(1, 8, 16, 132, config, ctypes.byref(abi.VerifyPlan(**bad)))
        assert rc != 0 and needle in lib.kdtree_error_string(rc).decode()


def test_plan_is_host_only_and_covers_the_gpu(report):
    lib = ctypes.CDLL(str(report.path))
    abi.declare_signatures(lib)
    plan = abi.VerifyPlan()
    # One request, Kimi K2 at TP8 (H=8, 16 drafts): 2 row tiles, split so ~every SM has work.
    assert lib.kdtree_verify_plan(1, 8, 16, 132, abi.CONFIG_PORTABLE, ctypes.byref(plan)) == 0
    assert plan.rows_per_tile == 64 and plan.row_tiles == 2 and plan.min_keys_per_split == 64
    assert plan.row_tiles * plan.num_splits <= 132 < plan.row_tiles * (plan.num_splits + 1)
    assert plan.workspace_bytes == 2 * plan.num_splits * 2 * 64 * (512 + 1) * 4 + 1 * 2 * 8  # one request: no extra CTAs
    # A batch of 16 row tiles: 8 parts a row tile (128 CTAs, one wave) over the whole batch.
    assert lib.kdtree_verify_plan(32, 16, 64, 132, abi.CONFIG_PORTABLE, ctypes.byref(plan)) == 0
    assert plan.num_splits == 8
    assert plan.workspace_bytes == 2 * 8 * 16 * 64 * 513 * 4 + 32 * 16 * 8 + _schedule_cache_bytes(32, 128)
    # B8 H8 n65 (s3): 9 row tiles x 14 parts and 6 extra CTAs for the remainders: 2 more parts' slots
    assert lib.kdtree_verify_plan(8, 8, 65, 132, abi.CONFIG_PORTABLE, ctypes.byref(plan)) == 0
    assert (plan.row_tiles, plan.num_splits) == (9, 14)
    assert plan.workspace_bytes == 2 * (14 + 2) * 9 * 64 * 513 * 4 + 8 * 9 * 8 + _schedule_cache_bytes(8, 9 * 14 + 6)
    # Row tiles that fill the GPU alone are not split: a batch's workspace is its schedule cache only,
    # and one request's is empty.
    assert lib.kdtree_verify_plan(4, 128, 64, 132, abi.CONFIG_PORTABLE, ctypes.byref(plan)) == 0
    assert plan.row_tiles == 128 and plan.num_splits == 1 and plan.workspace_bytes == _schedule_cache_bytes(4, 128)
    assert lib.kdtree_verify_plan(1, 128, 64, 132, abi.CONFIG_PORTABLE, ctypes.byref(plan)) == 0
    assert plan.num_splits == 1 and plan.workspace_bytes == 0


@pytest.mark.parametrize(
    "args, needle",
    [((0, 8, 16, 132, 0), "batch 0"), ((1, 0, 16, 132, 0), "num_heads 0"), ((1, 8, 0, 132, 0), "max_qo_len 0"),
     ((1, 8, 16, 132, 7), "configuration 7")],
)
def test_bad_plan_arguments_are_named(report, args, needle):
    lib = ctypes.CDLL(str(report.path))
    abi.declare_signatures(lib)
    rc = lib.kdtree_verify_plan(*args, ctypes.byref(abi.VerifyPlan()))
    assert rc != 0
    assert needle in lib.kdtree_error_string(rc).decode()


def test_run_rejects_null_pointers_before_touching_the_gpu(report):
    lib = ctypes.CDLL(str(report.path))
    abi.declare_signatures(lib)
    params = abi.VerifyParams()
    rc = lib.kdtree_verify_run(ctypes.byref(params), None)
    assert rc != 0 and "NULL" in lib.kdtree_error_string(rc).decode()


def _sm90a_sass(report):
    """The library's sm_90a SASS: per function (mangled name), its instruction lines, each cut at
    its ';' (the encoding comments dropped)."""
    return _sass(report, "sm_90a")


def _sass(report, arch):
    """The library's SASS for `arch` (sm_90a, sm_90, sm_120), per function as _sm90a_sass."""
    import subprocess  # noqa: PLC0415

    tool = build.find_cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton wheel) to read the SASS")
    sass = subprocess.run([tool, "-sass", "-arch", arch, str(report.path)], capture_output=True, text=True,
                          check=True).stdout
    functions = {}
    for body in sass.split("Function : ")[1:]:
        name, _, rest = body.partition("\n")
        functions[name.strip()] = [ln.split(";")[0] for ln in rest.splitlines() if "/*" in ln and ";" in ln]
    return functions


def _hopper_kernel_sass(report):
    """The instruction lines of the library's Hopper verify kernels (every instantiation: scales folded
    or not, x one request or any batch)."""
    hopper = [v for k, v in _sm90a_sass(report).items() if k.startswith("_ZN6kdtree6hopper30verify_attention_hopper_kernel")]
    assert len(hopper) == 4
    return hopper


@pytest.mark.parametrize("arch", ["sm_120", "sm_90"])
def test_portable_tile_loop_exists_once(report, arch):
    """s1d: the column slice is a run-time offset, so the portable kernel's tile loop (per warp and
    32-key tile 72 QK^T + 64 PV mma.sync) is in the binary once. A copy per slice (the slice as a
    template argument) doubles it, and the two warps of a scheduler then run different copies: the
    instruction fetch stalled (journal m12: 3x the no_inst samples, the large shapes 2-4% slower, the
    small ones 1-2 µs) with nothing else failing."""
    portable = [v for k, v in _sass(report, arch).items() if k.startswith("_ZN6kdtree23verify_attention_kernel")]
    assert len(portable) == 2, "one request, any batch (s1e)"
    for lines in portable:
        hmma = sum("HMMA.16816" in ln for ln in lines)
        assert hmma == 72 + 64, f"{hmma} mma.sync in a portable kernel: the tile loop is not there exactly once"


def test_hopper_qk_issue_uses_uniform_descriptors(report):
    """h18: the role branches are warp-uniform to ptxas (the warpgroup index comes from a warp
    reduction), so QK^T's K descriptor stays in uniform registers. A role index ptxas sees as
    divergent brings back two R2UR before every QK^T wgmma (~7.5 instructions per wgmma, 239
    registers, 1.3% slower on the GPU). Since s1d (walk_part) ptxas moves the next tile's base
    descriptor into its uniform register once, before the block's last wgmma (one R2UR a tile,
    measured no slower: journal s1d); the failure this guards against puts them before every wgmma."""
    for lines in _hopper_kernel_sass(report):
        qk = [i for i, ln in enumerate(lines) if "HGMMA.64x64x16" in ln]
        assert len(qk) == 36, "one QK^T block of 36 m64n64k16 wgmmas"
        between = [ln.strip() for ln in lines[qk[0]:qk[-1]] if "R2UR" in ln]
        assert len(between) <= 2, f"QK^T descriptors moved from regular registers: {between[:4]}"


def test_hopper_pv_starts_under_the_softmax(report):
    """h34: WG0 issues its PV of the tile's first 32 keys (wgmma m64n256k16 with P from registers)
    before the exp2s of the last 32 keys are done, the one overlap of tensor work with the softmax
    that measured faster (0.98-0.99). If a refactor lets ptxas put every exp2 in front of the PV
    again, the kernel is ~1.5% slower with nothing failing; this keeps the order in the SASS."""
    for lines in _hopper_kernel_sass(report):
        qk = [i for i, ln in enumerate(lines) if "HGMMA.64x64x16" in ln]
        # WG0's PV: P (A) from registers, so its second operand is a register, not a descriptor.
        pv = [i for i, ln in enumerate(lines) if "HGMMA.64x256x16" in ln and i > qk[-1]
              and ln.split("HGMMA.64x256x16")[1].split(",")[1].strip().startswith("R")]
        assert len(pv) == 4, "WG0's four PV k16 steps, A from registers"
        exp2 = [i for i in range(qk[-1], pv[-1]) if "MUFU.EX2" in lines[i]]
        assert len(exp2) >= 32, "the tile's 32 exp2s a thread sit between QK^T and the last PV step"
        assert pv[0] < exp2[-1], "the first PV step is issued before the softmax's last exp2"


def test_hopper_split_combine_is_a_programmatic_dependent(report):
    """h39b: each Hopper verify CTA triggers its dependents once its tile loop is done
    (griddepcontrol.launch_dependents, SASS PREEXIT), and the combine launched as their programmatic
    dependent (2-4-split plans) waits for the verify grid (griddepcontrol.wait, SASS ACQBULK) before it
    reads the partials; only the request's indices are loaded ahead. Without the trigger the merge
    would start only when the verify kernel exits (the 2-5.5% it measured gone, nothing failing);
    without the wait it would read partials still being written."""
    functions = _sm90a_sass(report)
    for lines in _hopper_kernel_sass(report):
        assert sum("PREEXIT" in ln for ln in lines) == 1, "one trigger per verify kernel"
    combine = {k: v for k, v in functions.items() if k.startswith("_ZN6kdtree21combine_splits_kernelINS_6hopper")}
    pdl = [v for k, v in combine.items() if k.endswith("ELb1EEEv18KdtreeVerifyParamsii")]
    plain = [v for k, v in combine.items() if k.endswith("ELb0EEEv18KdtreeVerifyParamsii")]
    assert len(pdl) == 1 and len(plain) == 2, sorted(combine)
    waits = [i for i, ln in enumerate(pdl[0]) if "ACQBULK" in ln]
    assert len(waits) == 1
    ahead = [ln for ln in pdl[0][:waits[0]] if "LDG" in ln]
    assert len(ahead) <= 8, f"only the request's indices (int32 or int64) are read before the wait: {ahead}"
    assert sum("LDG" in ln for ln in pdl[0][waits[0]:]) >= 8, "the lse and partials are read after it"
    assert all(not any("ACQBULK" in ln for ln in v) for v in plain), "an ordinary launch has nothing to wait for"


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_120a"])
def test_verify_kernels_wait_for_the_previous_kernel_before_touching_memory(report, arch):
    """h47: the Hopper and warp-specialised verify kernels are launched as programmatic dependents of
    the kernel before them (as FlashMLA's decode kernel is), so their CTAs may run while that kernel
    still writes q, the cache and the index arrays. Each waits once (griddepcontrol.wait, SASS
    ACQBULK) before any global memory instruction. ptxas moves a non-coherent load (LDG.CONSTANT,
    __ldg) whose address is known at entry above the wait: the one-request Hopper kernel read its
    indptr entries there until load_index became a coherent load. Nothing fails without this test:
    the stale read needs the previous kernel to write the indices in its last microseconds."""
    import re  # noqa: PLC0415

    memory = re.compile(r"\b(LDG|STG|LD|ST|LDGSTS|ATOMG|ATOM|RED|UBLKCP|UTMALDG|UTMASTG|UTMAPF)\b")
    functions = _sass(report, arch)
    dependents = {k: v for k, v in functions.items()
                  if k.startswith(("_ZN6kdtree6hopper30verify_attention_hopper_kernel", "_ZN6kdtree16verify_ws_kernel"))}
    assert len(dependents) == (6 if arch == "sm_90a" else 2), sorted(functions)
    for name, lines in dependents.items():
        waits = [i for i, ln in enumerate(lines) if "ACQBULK" in ln]
        assert len(waits) == 1, f"{name}: {len(waits)} griddepcontrol.wait"
        early = [ln for ln in lines[:waits[0]] if memory.search(ln)]
        assert not early, f"{name} touches global memory before its griddepcontrol.wait: {early}"
    tiled = [v for k, v in functions.items() if k.startswith("_ZN6kdtree23verify_attention_kernel")]
    assert all(not any("ACQBULK" in ln for ln in v) for v in tiled), "the tiled kernel is launched ordinarily"


def test_release_sources_have_no_experiment_switches():
    """The release kernels carry no A/B compile switches (they were removed: issue 22): the only
    preprocessor conditionals in csrc/ are the product variant (KDTREE_WITH_HOPPER), arch guards
    (__CUDA_ARCH__, __CUDA_ARCH_FEAT_SM<n>_ALL), the C header's __cplusplus, the build-provided strings of the C API, and the
    diagnostics build's two headers (common/profiler.cuh: the Hopper kernel's CTA milestones, defined in its translation
    unit; common/tile_stamps.cuh: the per-tile stamps, a record in each kernel's translation unit) and the pipe-factor
    diagnostics build's mma.sync (portable/mma.cuh, journal m27: 1 in a release build)."""
    import re

    allowed = {"KDTREE_WITH_HOPPER", "__CUDA_ARCH__", "__cplusplus"}
    per_file = {"kdtree_api.cu": {"KDTREE_BUILT_ARCHS", "KDTREE_PTX_ARCH", "KDTREE_LIBRARY_VERSION"}, "common/profiler.cuh": {"KDTREE_PROFILER"},
                "common/tile_stamps.cuh": {"KDTREE_PROFILER"}, "portable/mma.cuh": {"KDTREE_PIPE_FACTOR"}}
    found = {}
    for path in build.source_files():
        rel = path.relative_to(build.CSRC_DIR).as_posix()
        for line in path.read_text().splitlines():
            m = re.match(r"\s*#\s*(if|ifdef|ifndef|elif)\b(.*)", line)
            if m:
                names = set(re.findall(r"[A-Za-z_]\w*", m.group(2))) - {"defined"}
                bad = {n for n in names - allowed - per_file.get(rel, set())
                       if not re.fullmatch(r"__CUDA_ARCH_FEAT_SM\d+_ALL", n)}  # arch-specific targets: arch guards
                if bad:
                    found.setdefault(rel, set()).update(bad)
    assert found == {}
    text = "".join(p.read_text() for p in build.source_files())
    for gone in ("KDTREE_NO_SCORE_FOLD", "KDTREE_Q_CP_ASYNC", "KDTREE_NO_COMBINE_PDL", "KDTREE_WG1_ALWAYS_RESCALE",
                 "KDTREE_NO_MASK_PREFETCH", "KDTREE_PV_SPLIT", "KDTREE_Q_HALF_LINES", "KDTREE_PROLOGUE_TWO_TILES",
                 "KDTREE_REGISTER_EPILOGUE", "KDTREE_EXP2_EXACT", "KDTREE_SPLIT_PLAN_ONE_WAVE",
                 "KDTREE_EXPERIMENTAL_CONFIGS", "KDTREE_TIMELINE", "Rows32", "ROWS32"):
        assert gone not in text, gone


def test_profiler_build_exports_its_reader_and_the_release_build_does_not(report, tmp_path):
    """bench/diag/timeline.py reads the per-CTA milestone stamps through kdtree_timeline_copy, which only the
    diagnostics build (`--profiler`, common/profiler.cuh) has; a release library must not carry it."""
    diag = build.build(tmp_path / abi.LIB_FILENAME, archs=(90,), profiler=True)
    assert "-DKDTREE_PROFILER" in diag.command
    assert hasattr(ctypes.CDLL(str(diag.path)), "kdtree_timeline_copy")
    assert hasattr(ctypes.CDLL(str(diag.path)), "kdtree_tile_stamps_copy")  # common/tile_stamps.cuh
    assert hasattr(ctypes.CDLL(str(diag.path)), "kdtree_hopper_tile_stamps_copy")
    hopper = [r for r in diag.resources if "verify_attention_hopper" in r.kernel]
    assert len(hopper) == 4 and all(r.spill_stores == r.spill_loads == 0 for r in hopper)
    assert not hasattr(ctypes.CDLL(str(report.path)), "kdtree_timeline_copy")
    assert not hasattr(ctypes.CDLL(str(report.path)), "kdtree_tile_stamps_copy")
    assert not hasattr(ctypes.CDLL(str(report.path)), "kdtree_hopper_tile_stamps_copy")
    assert "-DKDTREE_PROFILER" not in report.command


def test_pipe_factor_build_multiplies_the_portable_mma_and_says_so(report, tmp_path):
    """The sm_120-regime diagnostics build (journal m27): every portable mma.sync is followed by F - 1
    zero-B ones (the tensor pipe spends F times its time; results stay exact), the Hopper kernel is
    untouched, and the library's version names the build so doctor and the start-up line show it. The
    release build has exactly one mma per product (test_portable_tile_loop_exists_once) and no suffix."""
    diag = build.build(tmp_path / abi.LIB_FILENAME, archs=(90,), ptx=False, pipe_factor=3)
    assert "-DKDTREE_PIPE_FACTOR=3" in diag.command and "-DKDTREE_PIPE_FACTOR=3" not in report.command
    tiled = [v for k, v in _sass(diag, "sm_90").items() if k.startswith("_ZN6kdtree23verify_attention_kernel")]
    assert len(tiled) == 2 and all(sum("HMMA.16816" in ln for ln in v) == 3 * (72 + 64) for v in tiled)
    release_ws = [v for k, v in _sm90a_sass(report).items() if "verify_ws_kernel" in k]
    diag_ws = [v for k, v in _sm90a_sass(diag).items() if "verify_ws_kernel" in k]
    assert len(release_ws) == len(diag_ws) == 2
    assert sorted(sum("HMMA.16816" in ln for ln in v) for v in diag_ws) == sorted(
        3 * sum("HMMA.16816" in ln for ln in v) for v in release_ws)
    def hgmma(rep):
        return sorted(sum("HGMMA" in ln for ln in v) for k, v in _sm90a_sass(rep).items() if "hopper" in k)

    assert hgmma(diag) == hgmma(report)
    for path, suffix in ((diag.path, "+pipe3"), (report.path, "")):
        lib = ctypes.CDLL(str(path))
        abi.declare_signatures(lib)
        version = lib.kdtree_library_version().decode()
        assert version.endswith(suffix) and ("+pipe" in version) == bool(suffix), version


@pytest.mark.parametrize("factor", [0, 9, -1, 2.5, True, "3"])
def test_pipe_factor_outside_one_to_eight_is_refused(factor):
    with pytest.raises(build.BuildError, match="pipe factor"):
        build.pipe_factor_flags(factor)


def test_diagnostics_suffix_names_each_diagnostics_build():
    assert build.diagnostics_suffix(()) == ""
    assert build.diagnostics_suffix(("-DKDTREE_PROFILER",)) == "+profiler"
    assert build.diagnostics_suffix(build.PROFILER_FLAGS + build.pipe_factor_flags(3)) == "+profiler+pipe3"
    assert build.pipe_factor_flags(1) == ()


def test_tile_stamp_record_is_what_bench_tile_timeline_reads():
    """The per-tile stamp record (common/tile_stamps.cuh: CTAs, tiles, events, the record's header slot,
    both kernels' event orders) is the contract with bench/diag/tile_timeline.py's indices, and every
    event is stamped by its kernel."""
    import re
    from pathlib import Path

    header = (build.CSRC_DIR / "common" / "tile_stamps.cuh").read_text()
    dims = [int(re.search(rf"{k} = (\d+);", header).group(1)) for k in ("kTileStampCtas", "kTileStampTiles",
                                                                        "kTileEvents")]
    assert "kTileRecord = 1 + kTileStampTiles * kTileEvents;" in header
    reader = (Path(build.PACKAGE_DIR).parent / "bench" / "diag" / "tile_timeline.py").read_text()
    m = re.search(r"^CTAS, TILES, EVENTS = (\d+), (\d+), (\d+)", reader, re.M)
    assert m and [int(g) for g in m.groups()] == dims
    assert re.search(r"^RECORD = 1 \+ TILES \* EVENTS$", reader, re.M)
    for enum, first, source in (("TileEvent", "QK_KFULL", "portable/kernel_ws.cuh"),
                                ("HopperTileEvent", "WG0_KFULL", "hopper/kernel.cuh")):
        body = re.search(rf"enum class {enum} : int {{(.*?)}};", header, re.S).group(1)
        events = re.findall(r"^  k(\w+) = (\d+),", body, re.M)
        assert [int(v) for _, v in events] == list(range(len(events))) and len(events) <= dims[2], enum
        names = re.search(rf"^({first}, [^=]*?) = \\?\s*range\(", reader, re.M | re.S).group(1)
        names = [x.strip() for x in names.replace("\\", "").split(",")]
        assert [x.replace("_", "").lower() for x in names] == [k.lower() for k, _ in events], (names, events)
        text = (build.CSRC_DIR / source).read_text()
        for k, _ in events:  # every event is stamped by its kernel
            assert f"{enum}::k{k})" in text, (enum, k)
    for tu, name in (("portable/launch_ws.cu", "kdtree_tile_stamps_copy"),
                     ("hopper/launch.cu", "kdtree_hopper_tile_stamps_copy")):
        assert f"KDTREE_TILE_STAMPS_READER({name})" in (build.CSRC_DIR / tu).read_text()
        assert f'"{name}"' in reader


def test_profiler_record_layout_is_what_bench_timeline_reads():
    """The stamp record (slots a CTA, CTAs kept, the milestone slots) is the contract with
    bench/diag/timeline.py, which reads the library's buffer with these numbers."""
    import re
    from pathlib import Path

    header = (build.CSRC_DIR / "common" / "profiler.cuh").read_text()
    slots = int(re.search(r"kProfilerSlots = (\d+);", header).group(1))
    ctas = int(re.search(r"kProfilerMaxCtas = (\d+);", header).group(1))
    milestones = {int(v): k for k, v in re.findall(r"(k\w+) = (\d+),\s*//", header)}
    assert (slots, ctas) == (12, 8192) and sorted(milestones) == list(range(9))
    readers = sorted((Path(build.PACKAGE_DIR).parent / "bench").rglob("timeline.py"))
    for timeline in readers:  # bench/diag/timeline.py (bench/ is not shipped with the package)
        m = re.search(r"^SLOTS, CTAS = (\d+), (\d+)", timeline.read_text(), re.M)
        assert m and (int(m.group(1)), int(m.group(2))) == (slots, ctas), timeline


@pytest.mark.parametrize("arch", ["sm_120a", "sm_100a", "sm_90a"])
def test_ws_qk_loop_loads_k_fragments_ahead(report, arch):
    """p34: the warp-specialised kernel's QK warps load each K fragment two k-steps ahead of its mma
    (`ws::qk_tile_mma`, WsConfig::kQkAhead, a __syncwarp every kQkPin k-steps so ptxas keeps them
    there). What that buys is on sm_120a, the customer's GPU, which the H200 cannot time: before p34
    ptxas issued 123 of the QK loop's 144 HMMA 2-3 after their B fragment's ldmatrix there, with p34
    ~94% are >= 4 after (journal m19, p34). A refactor that loses it would pass every GPU test and
    every H200 timing; this reads it off the built library's SASS (tools/sass_schedule.py)."""
    import importlib.util  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    tool = build.find_cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (CUDA toolkit or triton wheel) to read the SASS")
    path = Path(build.PACKAGE_DIR).parent / "tools" / "sass_schedule.py"
    spec = importlib.util.spec_from_file_location("sass_schedule", path)
    sass_schedule = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("sass_schedule", sass_schedule)  # its dataclasses look their module up there
    spec.loader.exec_module(sass_schedule)
    sass = subprocess.run([tool, "-sass", "-arch", arch, str(report.path)], capture_output=True, text=True,
                          check=True).stdout
    reps = sass_schedule.report(sass, "verify_ws_kernel", {arch}, min_hmma=32)
    assert len(reps) == 2, "one request, any batch (s1e)"
    for rep in reps:
        qk = [lp for lp in rep.loops if lp.hmma == 144]
        assert len(qk) == 1, f"{rep.name}: one QK loop of 144 HMMA a 32-key tile, found {[lp.hmma for lp in rep.loops]}"
        ahead = sum(v for k, v in qk[0].distance.items() if k >= 4)
        assert ahead >= 0.85 * 144, (f"{arch} {rep.name}: only {ahead} of 144 QK HMMA issued >= 4 after their "
                                     f"K fragment's ldmatrix ({qk[0].distance}); p34 keeps ~94%")
