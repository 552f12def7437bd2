"""The split arithmetic both kernels and the combine share (csrc/common/split_rule.cuh, split_work),
compiled for the host with nvcc and checked over every key-tile count a request can have up to
L = 128k: the device-chosen split length of the Hopper plan (h29, min_keys_per_split = 0) is
round(sqrt(key tiles) / 3) tiles (at least 1), exact at every length (a float estimate with an
integer correction), and every cut covers
the request's tiles with no empty split and no more splits than planned. Skipped without nvcc."""
from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from kdtree_backend.kernel import build

pytestmark = pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not on PATH")


PROGRAM = r"""
#include <cstdio>
#include "common/split_rule.cuh"
int main() {
  // key tiles k = prefix tiles + 1 draft tile (n = 16), prefix = 64 * (k - 1)
  for (int k = 1; k <= 2049; ++k) {
    const int prefix = 64 * (k - 1);
    for (int splits : {1, 2, 16, 33, 66, 128}) {
      const kdtree::SplitWork w = kdtree::split_work<true>(prefix, 16, splits, kdtree::min_tiles_per_split(0, 64), 64);
      std::printf("%d %d %d %d %d %d\n", k, splits, kdtree::auto_split_tiles(k), w.key_tiles, w.tiles_per_split, w.active);
    }
  }
  // the float estimate's correction at long prefixes (up to 2^31 keys): the length rule alone
  for (long long k = 2050; k <= (1LL << 25); k = k * 5 / 4 + 7) {
    std::printf("%lld\n%d\n", k, kdtree::auto_split_tiles(static_cast<int>(k)));
  }
  return 0;
}
"""


def _round_sqrt_third(k: int) -> int:
    """round(sqrt(k) / 3) in exact integers: the largest m with (6m - 3)^2 <= 4k, at least 1."""
    m = max(1, (math.isqrt(4 * k) + 3) // 6)
    while (6 * m + 3) ** 2 <= 4 * k:
        m += 1
    while m > 1 and (6 * m - 3) ** 2 > 4 * k:
        m -= 1
    return m


def test_device_chosen_split_length_and_cuts(tmp_path):
    src = tmp_path / "split_rule.cu"
    src.write_text(PROGRAM)
    exe = tmp_path / "split_rule"
    csrc = Path(build.__file__).resolve().parent / "csrc"
    r = subprocess.run([build.find_nvcc(), "-std=c++17", "-I", str(csrc), str(src), "-o", str(exe)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True).stdout.split("\n")
    lines = [line for line in out if line.strip()]
    rows = [tuple(map(int, line.split())) for line in lines[:2049 * 6]]
    assert all(len(r) == 6 for r in rows)
    long = [int(x) for x in lines[2049 * 6:]]
    assert len(long) > 40
    for k, auto in zip(long[0::2], long[1::2]):
        assert auto == _round_sqrt_third(k), (k, auto)
    for k, splits, auto, key_tiles, tps, active in rows:
        want = _round_sqrt_third(k)
        assert want == max(1, math.floor(math.sqrt(k) / 3 + 0.5))
        assert auto == want, (k, auto, want)
        assert key_tiles == k
        assert 1 <= active <= splits, (k, splits, active)
        assert tps * active >= k > tps * (active - 1), (k, splits, tps, active)  # no empty split
        if active < splits:  # the length rule, not the planned count, bounded the cut
            assert tps >= auto, (k, splits, tps, auto)
    # the sweep's points (journal "The split count on small batches"): L1k, 8k, 32k
    by = {(k, s): (tps, active) for k, s, _, _, tps, active in rows}
    assert by[(17, 66)] == (1, 17) and by[(129, 66)] == (4, 33) and by[(513, 66)] == (8, 65)
