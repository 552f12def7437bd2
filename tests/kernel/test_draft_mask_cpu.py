"""The premise of the warp's mask read (csrc/common/draft_mask.cuh, s8), compiled for the host with nvcc:
`warp_reads_group_mask(heads)` must hold exactly for the head counts where every 8-row group of an mma
fragment (rows r8 .. r8 + 7, r8 a multiple of 8; row = token x heads + head) spans at most two draft
tokens, because `group_draft_bits` reads the group's first token and the one after it and nothing else.
The rows past a request (padding) are covered by the GPU test `test_mask_read_by_row_groups`. Skipped
without nvcc."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kdtree_backend.kernel import build

pytestmark = pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not on PATH")

CSRC = Path(build.__file__).resolve().parent / "csrc"

# For heads 1..512: the rule's answer and the widest token span of any 8-row group (r8 over a whole
# period of 8 x heads rows, and far rows: the span depends on r8 mod heads only).
PROGRAM = r"""
#include <cstdio>
#include "common/draft_mask.cuh"
int main() {
  for (int heads = 1; heads <= 512; ++heads) {
    int widest = 0;
    for (long long r8 = 0; r8 < 16LL * heads + 64; r8 += 8) {
      const long long t0 = r8 / heads, t1 = (r8 + 7) / heads;
      if (t1 - t0 + 1 > widest) widest = static_cast<int>(t1 - t0 + 1);
    }
    std::printf("%d %d %d\n", heads, kdtree::warp_reads_group_mask(heads) ? 1 : 0, widest);
  }
  return 0;
}
"""


def test_the_warp_read_rule_is_the_two_token_span(tmp_path):
    src = tmp_path / "rule.cu"
    src.write_text(PROGRAM)
    exe = tmp_path / "rule"
    r = subprocess.run([build.find_nvcc(), "-std=c++17", "-I", str(CSRC), str(src), "-o", str(exe)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [tuple(map(int, line.split())) for line in subprocess.run([str(exe)], capture_output=True, text=True,
                                                                      check=True).stdout.split("\n") if line]
    assert len(rows) == 512
    for heads, rule, widest in rows:
        assert bool(rule) == (widest <= 2), f"heads {heads}: rule {rule}, a group spans {widest} tokens"
    # the head counts of the models this serves (Kimi K2 64 heads, DeepSeek-V3 128, over TP 1..128)
    on = {h for h, rule, _ in rows if rule}
    assert {4, 8, 16, 32, 64, 128} <= on and not {1, 2, 3, 5} & on
