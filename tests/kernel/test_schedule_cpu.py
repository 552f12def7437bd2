"""The batch-wide part schedule both kernels and the combine share (csrc/common/schedule.cuh, s1),
compiled for the host with nvcc and checked on random batches (ragged prefixes, requests without
drafts, one request, many parts, forced minimum lengths): every request's key tiles are covered
exactly once per row tile, a request's pieces lie in consecutive parts and in the slots the combine
reads, a request held by one part is written directly, no two pieces share a slot, and no part holds
more work than its length. Also the split-length rule (h29) at every length and the plan's part
count. Skipped without nvcc."""
from __future__ import annotations

import math
import random
import subprocess
from pathlib import Path

import pytest

from kdtree_backend.kernel import build

pytestmark = pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not on PATH")

CSRC = Path(build.__file__).resolve().parent / "csrc"

# Reads batches ("parts min_keys bn B n_0 prefix_0 ... n_B-1 prefix_B-1" a line); for each prints
# "batch" then one line per piece: part b t_begin t_end head tail slot, then "info b first pieces"
# for the row-tile-0 record, the way the device walks (common/request.cuh: part_begin, next_segment).
PROGRAM = r"""
#include <cstdio>
#include <vector>
#include "common/launch_plan.h"
using namespace kdtree;
int main() {
  int parts, min_keys, bn, B;
  while (std::scanf("%d %d %d %d", &parts, &min_keys, &bn, &B) == 4) {
    std::vector<long long> n(B), prefix(B);
    for (int b = 0; b < B; ++b) std::scanf("%lld %lld", &n[b], &prefix[b]);
    std::vector<long long> c(B + 1, 0);
    int max_tiles = 0;
    for (int b = 0; b < B; ++b) {
      const int kt = request_key_tiles(prefix[b], n[b], bn);
      max_tiles = kt > max_tiles ? kt : max_tiles;
      c[b + 1] = c[b] + request_cost(kt);
    }
    const long long total = c[B];
    const int min_tiles = min_part_tiles(min_keys, bn, max_tiles);
    const long long len = part_length(total, parts, min_tiles);
    const bool aligned = use_aligned(parts, B, total, max_tiles, min_tiles, bn);
    std::printf("batch %lld %lld %d\n", total, len, aligned ? parts / B : 0);
    if (aligned) {  // part p: piece p %% s of request p / s (common/request.cuh, next_segment)
      const int s = parts / B;
      for (int part = 0; part < parts && part / s < B; ++part) {
        const int b = part / s, j = part % s;
        const int kt = request_key_tiles(prefix[b], n[b], bn);
        if (kt == 0) continue;
        int pieces;
        const Piece pc = aligned_piece(kt, s, j, min_tiles, pieces);
        if (pc.t_begin >= pc.t_end) continue;
        if (j == 0) std::printf("info %d %d %d\n", b, part, pieces);
        std::printf("piece %d %d %d %d %d %d %d\n", part, b, pc.t_begin, pc.t_end, pc.head, pc.tail,
                    piece_slot(part, pc.head));
      }
      std::printf("slots 1 2 4 3 4 6 5 6 8\n");
      continue;
    }
    for (int part = 0; part < parts; ++part) {
      const long long lo = part * len;
      if (lo >= total) continue;
      const long long hi = lo + len < total ? lo + len : total;
      int b = 0;
      while (!(lo < c[b + 1])) ++b;  // the finder: the first request whose range passes lo
      for (; b < B && c[b] < hi; ++b) {
        const int kt = request_key_tiles(prefix[b], n[b], bn);
        const Piece pc = piece_in_part(c[b], kt, lo, hi);
        if (pc.t_begin >= pc.t_end) continue;
        if (pc.t_begin == 0) {
          const int last = part_of(c[b] + kOverheadTiles + kt - 1, len);
          std::printf("info %d %d %d\n", b, part, last - part + 1);
        }
        std::printf("piece %d %d %d %d %d %d %d\n", part, b, pc.t_begin, pc.t_end, pc.head, pc.tail,
                    piece_slot(part, pc.head));
      }
    }
    std::printf("slots");
    for (int f = 0; f < 3; ++f)
      for (int s = 0; s < 3; ++s) std::printf(" %d", request_piece_slot(f, s));
    std::printf("\n");
  }
  // The plan's part count for row tiles 1..300 on 132 and 188 SMs, and split lengths.
  for (int sms : {132, 188})
    for (int rt = 1; rt <= 300; ++rt) std::printf("parts %d %d %d\n", sms, rt, choose_parts(rt, sms));
  for (long long k = 1; k <= (1LL << 25); k = k < 3000 ? k + 1 : k * 5 / 4 + 7)
    std::printf("auto %lld %d\n", k, auto_split_tiles(static_cast<int>(k)));
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


def _batches(rng: random.Random) -> list:
    """(parts, min_keys, bn, [(n, prefix)]): hostile-but-legal batches."""
    out = [(14, 0, 64, [(65, 8192)] * 8), (1, 64, 32, [(16, 1000)] * 3), (66, 0, 64, [(8, 8192)]),
           (128, 0, 64, [(0, 500), (3, 0), (0, 0), (1, 1)]), (7, 64, 32, [(0, 100)] * 5 + [(5, 70)])]
    for _ in range(300):
        B = rng.choice([1, 2, 3, 8, 31, 64, 300])
        reqs = []
        for _ in range(B):
            n = 0 if rng.random() < 0.1 else rng.choice([1, 7, 33, 64, 65, 129, 257])
            prefix = rng.choice([0, 1, 63, 64, 65, rng.randrange(0, 40000)])
            reqs.append((n, prefix))
        parts = rng.choice([1, 2, 3, 9, 14, 29, 66, 128])
        min_keys = rng.choice([0, 0, 64, 512, 4096])
        out.append((parts, min_keys, rng.choice([32, 64]), reqs))
    return out


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    d = tmp_path_factory.mktemp("schedule")
    (d / "schedule.cu").write_text(PROGRAM)
    r = subprocess.run([build.find_nvcc(), "-std=c++17", "-I", str(CSRC), str(d / "schedule.cu"), "-o", str(d / "schedule")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return d / "schedule"


def test_every_tile_once_pieces_in_the_combines_slots(program):
    batches = _batches(random.Random(20261202))
    stdin = "".join(f"{p} {mk} {bn} {len(reqs)} " + " ".join(f"{n} {pre}" for n, pre in reqs) + "\n"
                    for p, mk, bn, reqs in batches)
    out = subprocess.run([str(program)], input=stdin, capture_output=True, text=True, timeout=120, check=True).stdout
    blocks = out.split("batch ")[1:]
    assert len(blocks) == len(batches)
    modes = set()
    for (parts, min_keys, bn, reqs), block in zip(batches, blocks):
        lines = block.strip().split("\n")
        total, length, aligned = map(int, lines[0].split())
        pieces, info = [], {}
        for line in lines[1:]:
            w = line.split()
            if w[0] == "piece":
                pieces.append(tuple(map(int, w[1:])))
            elif w[0] == "info":
                b, f, k = map(int, w[1:])
                assert b not in info, "one record a request"
                info[b] = (f, k)
            elif w[0] == "slots":
                assert list(map(int, w[1:])) == [1, 2, 4, 3, 4, 6, 5, 6, 8]
        ctx = (parts, min_keys, bn, len(reqs))
        assert length * parts >= total, ctx
        modes.add(aligned > 0)
        used = {p for p, *_ in pieces}
        assert all(0 <= p < parts for p in used), ctx
        work = {}
        for b, (n, prefix) in enumerate(reqs):
            kt = (-(-prefix // bn) + -(-n // bn)) if n > 0 else 0
            mine = sorted((p, t0, t1, head, tail, slot) for p, bb, t0, t1, head, tail, slot in pieces if bb == b)
            if kt == 0:
                assert not mine and b not in info, (ctx, b)
                continue
            # the tiles, once, in order, over consecutive parts
            assert [t for p, t0, t1, *_ in mine for t in range(t0, t1)] == list(range(kt)), (ctx, b, mine)
            ps = [p for p, *_ in mine]
            assert ps == list(range(ps[0], ps[0] + len(ps))), (ctx, b, ps)
            f, k = info[b]
            assert (f, k) == (ps[0], len(ps)), (ctx, b)
            for s, (p, t0, t1, head, tail, slot) in enumerate(mine):
                assert head == (t0 > 0) and tail == (t1 < kt)
                if k > 1:  # the combine reads piece s from slot request_piece_slot(f, s)
                    assert slot == (2 * f + 1 if s == 0 else 2 * (f + s)), (ctx, b, s, slot)
            for p, t0, t1, *_ in mine:
                work[p] = work.get(p, 0) + (t1 - t0) + (4 if t0 == 0 else 0)
        split = [(p, slot) for p, b, t0, t1, head, tail, slot in pieces if head or tail]
        assert len({slot for _, slot in split}) == len(split), (ctx, "two pieces share a slot")
        assert all(slot < 2 * parts for _, slot in split)
        if aligned:  # one piece a part, pieces of ceil(tiles / k) tiles
            assert len(used) == len(pieces), ctx
            for b, (n, prefix) in enumerate(reqs):
                if b in info:
                    assert info[b][0] == b * aligned and info[b][1] <= aligned, (ctx, b)
        else:
            assert all(w <= length + 4 for w in work.values()), (ctx, work, length)  # a start's overhead may spill in
        if parts == 1:
            assert all(not head and not tail for _, _, _, _, head, tail, _ in pieces)
    assert modes == {True, False}, "the batches reach both modes"


def test_split_length_rule_and_the_plans_part_count(program):
    out = subprocess.run([str(program)], input="", capture_output=True, text=True, timeout=120, check=True).stdout
    autos = [tuple(map(int, line.split()[1:])) for line in out.split("\n") if line.startswith("auto ")]
    assert len(autos) > 3000
    for k, m in autos:
        assert m == _round_sqrt_third(k), (k, m)
    assert dict(autos)[129] == 4 and dict(autos)[513] == 8 and dict(autos)[17] == 1
    parts = {(s, rt): p for s, rt, p in (tuple(map(int, line.split()[1:])) for line in out.split("\n") if line.startswith("parts "))}
    for (sms, rt), p in parts.items():
        waves = -(-rt // sms)  # the fewest waves row tiles alone need
        assert p == max(1, min(128, waves * sms // rt)), (sms, rt, p)  # as many parts as fill them
    assert parts[(132, 9)] == 14    # B8 H8 n65: one wave of 126 CTAs
    assert parts[(132, 17)] == 7    # one wave of 119 (s1: 2 waves of 255 measured 35% slower at B = 1)
    assert parts[(132, 1)] == 128   # the kMaxSplits bound
    assert parts[(132, 133)] == 1 and parts[(188, 9)] == 20
