"""tools/stall_regions.py on a fixed excerpt of ncu's SASS source page (CPU only): the roles, mma
loops and synchronisation windows it sums, and the instructions it ranks."""
from __future__ import annotations

import gzip
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sr():
    sys.path.insert(0, str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location("_stall_regions", ROOT / "tools" / "stall_regions.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["_stall_regions"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


# (address, SASS, all samples, not issued, barrier, long_sb, math); listed out of address order on
# purpose (ncu sorts by address; the tool must not rely on the file's order)
ROWS = [
    (0x10, "LDC R1, c[0x0][0x28]", 2, 2, 0, 0, 0),
    (0x20, "USETMAXREG.DEALLOC.CTAPOOL 0xa0", 1, 1, 0, 0, 0),
    (0x30, "HMMA.16816.F32.BF16 R4, R8, R12, R4", 10, 5, 0, 0, 5),
    (0x40, "HMMA.16816.F32.BF16 R16, R8, R14, R16", 12, 6, 0, 0, 6),
    (0x50, "BAR.SYNC.DEFER_BLOCKING 0x5, 0x100", 3, 3, 3, 0, 0),
    (0x60, "LDS.64 R2, [R2+0x17418]", 40, 40, 40, 0, 0),
    (0x70, "@!UP0 UBLKCP.S.G [UR14], [UR10], UR9", 7, 7, 0, 7, 0),
    (0x80, "LDGDEPBAR", 1, 1, 0, 0, 0),
    (0x90, "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xb8", 1, 1, 0, 0, 0),
    (0xa0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R3+UR8+0x17408], R2", 5, 5, 5, 0, 0),
    (0xb0, "@!P1 BRA 0xa0", 30, 30, 0, 30, 0),
    (0xc0, "HMMA.16816.F32.BF16 R20, R24, R28, R20", 8, 4, 0, 0, 4),
    (0xd0, "HMMA.16816.F32.BF16 R32, R24, R30, R32", 9, 4, 0, 0, 4),
    (0xe0, "EXIT", 0, 0, 0, 0, 0),
]


def _csv() -> str:
    head = ('"Kernel Name","void kdtree::verify_ws_kernel<(bool)0>(KdtreeVerifyParams)",\n'
            '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
            '"stall_barrier","stall_long_sb","stall_math","stall_barrier (Not Issued)"\n')
    order = ROWS[7:] + ROWS[:7]
    body = "".join(f'"0x{a:x}","      {t}","{s}","{n}","{b}","{l}","{m}","{b}"\n' for a, t, s, n, b, l, m in order)
    return head + body


def test_parse_orders_by_address_and_reads_reasons(sr):
    kernel, instrs = sr.parse(_csv())
    assert kernel == "void kdtree::verify_ws_kernel<(bool)0>(KdtreeVerifyParams)"
    assert [i.text for i in instrs] == [r[1] for r in ROWS]
    assert instrs[5].samples == 40 and instrs[5].reasons == {"barrier": 40}  # "(Not Issued)" columns left out
    assert instrs[13].reasons == {}


def test_roles_loops_windows_and_top(sr):
    _, instrs = sr.parse(_csv())
    s = sr.summarise(instrs, sr.DEFAULT_WINDOWS, top=3, min_hmma=2)
    total = sum(r[2] for r in ROWS)
    assert s["samples"] == total
    assert [r["samples"] for r in s["roles"]] == [2, 74, 53]  # entry, PV (DEALLOC), QK (TRY_ALLOC)
    assert sum(r["share"] for r in s["roles"]) == pytest.approx(1.0)
    assert "DEALLOC" in s["roles"][1]["name"] and s["roles"][1]["reasons"][0] == ("barrier", 43)
    assert [(b["first"], b["last"], b["samples"]) for b in s["loops"]] == [(2, 3, 22), (11, 12, 17)]
    win = {w["name"]: w for w in s["windows"]}
    assert win["refill"]["stretches"] == [[4, 7, 51]]  # the stage barrier to the ids' commit, inclusive
    assert win["k_full_wait"]["stretches"] == [[9, 10, 35]] and win["k_full_wait"]["reasons"][0] == ("long_sb", 30)
    assert [t["index"] for t in s["top"]] == [5, 10, 3] and s["top"][0]["role"] == 1
    text = sr.render("k", s)
    assert "window refill (1 stretches)" in text and "LDS.64 R2, [R2+0x17418]" in text


def test_cli_reads_gzip_takes_windows_and_refuses_other_files(sr, tmp_path, capsys):
    f = tmp_path / "s.csv.gz"
    f.write_bytes(gzip.compress(_csv().encode()))
    out = tmp_path / "s.json"
    assert sr.main([str(f), "--window", "copies=UBLKCP..LDGDEPBAR", "--min-hmma", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "window copies (1 stretches)" in printed and "window refill" not in printed
    assert '"kernel": "void kdtree::verify_ws_kernel' in out.read_text()
    bad = tmp_path / "bad.csv"
    bad.write_text('"a","b"\n"1","2"\n')
    with pytest.raises(SystemExit, match="not an ncu"):
        sr.main([str(bad)])
    with pytest.raises(SystemExit):
        sr.main([str(f), "--window", "nodots=UBLKCP"])


def test_hot_blocks_cut_the_kernel_and_name_its_opcodes(sr):
    _, instrs = sr.parse(_csv())
    total = sum(r[2] for r in ROWS)
    blocks = sr.hot_blocks(instrs, size=4, min_share=0.08)
    # [0,3] 25, [4,7] 51, [8,11] 44, [12,13] 9 of 129 samples: the last block (7%) is under 8%
    assert [(b["first"], b["last"], b["samples"]) for b in blocks] == [(0, 3, 25), (4, 7, 51), (8, 11, 44)]
    assert blocks[1]["share"] == pytest.approx(51 / total) and blocks[1]["reasons"][0] == ("barrier", 43)
    assert dict(blocks[0]["ops"]) == {"HMMA": 2, "LDC": 1, "USETMAXREG": 1}
    assert dict(blocks[1]["ops"])["UBLKCP"] == 1  # the predicate is not the opcode
    assert sr.opcode("@!P1 BRA 0xa0") == "BRA" and sr.opcode("") == ""
    assert sr.hot_blocks(instrs, size=0, min_share=0.0) == []
    s = sr.summarise(instrs, sr.DEFAULT_WINDOWS, top=3, min_hmma=2, block_size=4, min_block_share=0.08)
    assert len(s["blocks"]) == 3 and "hot blocks" in sr.render("k", s)


def test_cli_refuses_negative_block_size(sr, tmp_path):
    f = tmp_path / "s.csv"
    f.write_text(_csv())
    with pytest.raises(SystemExit, match="--blocks"):
        sr.main([str(f), "--blocks", "-1"])
