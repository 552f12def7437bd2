"""The batch-wide part schedule both kernels and the combine share (csrc/common/schedule.cuh, s1),
compiled for the host with nvcc and checked on random batches (ragged prefixes, requests without
drafts, one request, many parts, forced minimum lengths): every request's key tiles are covered
exactly once per row tile, a request's pieces lie in consecutive (virtual) parts and in the slots the
combine reads, a request held by one part is written directly, no two pieces share a slot's rows, and
no part holds more work than its length; with the extra CTAs of s3 (the row tiles' remainders cut
among the wave's idle SMs) on random row-tile and SM counts. Also the split-length rule (h29) at every length and the plan's part
count. Skipped without nvcc."""
from __future__ import annotations

import collections
import math
import random
import subprocess
from pathlib import Path

import pytest

from kdtree_backend.kernel import build

pytestmark = pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not on PATH")

CSRC = Path(build.__file__).resolve().parent / "csrc"

# Reads batches ("parts min_keys bn R E B n_0 prefix_0 ... n_B-1 prefix_B-1" a line: R row tiles, E extra
# CTAs); for each prints "batch total w rem_start rem le aligned slot_parts", then for every CTA's
# ranges one line per piece: "piece cta t part b t_begin t_end head tail slot", and for the CTA holding
# a request's first tile in a row tile "info t b first pieces", the way the device walks
# (common/request.cuh: part_begin, next_segment; the extra CTAs of s3).
PROGRAM = r"""
#include <cstdio>
#include <vector>
#include "common/launch_plan.h"
using namespace kdtree;
int main() {
  int parts, min_keys, bn, R, E, B;
  while (std::scanf("%d %d %d %d %d %d", &parts, &min_keys, &bn, &R, &E, &B) == 6) {
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
    const bool aligned = use_aligned(parts, B, total, max_tiles, min_tiles, bn);
    const int E_grid = E;  // the launch's extra CTAs (the workspace's slots); part_begin's vote may idle them
    bool cut = false;
    for (int b = 0; b < B; ++b) cut = cut || cut_by_parts(c[b], c[b + 1] - c[b], part_length(total, parts, min_tiles));
    if (!cut) E = 0;
    const PartGeometry g = part_geometry(total, parts, R, E, min_tiles);
    std::printf("batch %lld %lld %lld %lld %lld %d %d %d\n", total, g.w, g.rem_start, g.rem, g.le, aligned ? parts / B : 0,
                slot_parts(parts, R, E_grid), E);
    if (aligned) {  // part p: piece p %% s of request p / s in every row tile (next_segment); no extra CTA works
      const int s = parts / B;
      for (int t = 0; t < R; ++t)
        for (int part = 0; part < parts && part / s < B; ++part) {
          const int b = part / s, j = part % s;
          const int kt = request_key_tiles(prefix[b], n[b], bn);
          if (kt == 0) continue;
          int pieces;
          const Piece pc = aligned_piece(kt, s, j, min_tiles, pieces);
          if (pc.t_begin >= pc.t_end) continue;
          if (j == 0) std::printf("info %d %d %d %d\n", t, b, part, pieces);
          std::printf("piece %d %d %d %d %d %d %d %d %d\n", part * R + t, t, part, b, pc.t_begin, pc.t_end, pc.head,
                      pc.tail, piece_slot(part, pc.head));
        }
      continue;
    }
    // Every CTA's ranges (t, lo, hi, part): main CTA (t, p), then the extra ones across row tiles.
    struct Range { int cta, t, part; long long lo, hi; };
    std::vector<Range> ranges;
    for (int part = 0; part < parts; ++part)
      for (int t = 0; t < R; ++t) {
        const long long lo = part * g.w, hi = lo + g.w < g.rem_start ? lo + g.w : g.rem_start;
        if (lo < hi) ranges.push_back({part * R + t, t, part, lo, hi});
      }
    for (int e = 0; e < E; ++e) {
      const long long x_lo = e * g.le, axis = static_cast<long long>(R) * g.rem;
      const long long x_hi = x_lo + g.le < axis ? x_lo + g.le : axis;
      for (long long x = x_lo; x < x_hi;) {
        const int t = static_cast<int>(x / g.rem);
        const long long end = (t + 1) * g.rem < x_hi ? (t + 1) * g.rem : x_hi;
        ranges.push_back({parts * R + e, t, parts + e - first_extra_of(g, t), g.rem_start + x - t * g.rem,
                          g.rem_start + end - t * g.rem});
        x = end;
      }
    }
    for (const Range& r : ranges) {
      int b = 0;
      while (!(r.lo < c[b + 1])) ++b;  // the finder: the first request whose range passes lo
      for (; b < B && c[b] < r.hi; ++b) {
        const int kt = request_key_tiles(prefix[b], n[b], bn);
        const Piece pc = piece_in_part(c[b], kt, r.lo, r.hi);
        if (pc.t_begin >= pc.t_end) continue;
        if (pc.t_begin == 0) {
          const int last = part_at(g, parts, r.t, c[b] + kOverheadTiles + kt - 1);
          std::printf("info %d %d %d %d\n", r.t, b, r.part, last - r.part + 1);
        }
        std::printf("piece %d %d %d %d %d %d %d %d %d\n", r.cta, r.t, r.part, b, pc.t_begin, pc.t_end, pc.head,
                    pc.tail, piece_slot(r.part, pc.head));
      }
    }
  }
  // The plan's part count for row tiles 1..300 on 132 and 188 SMs, its extra CTAs, and split lengths.
  for (int sms : {132, 188})
    for (int rt = 1; rt <= 300; ++rt) {
      const int p = choose_parts(rt, sms);
      std::printf("parts %d %d %d %d\n", sms, rt, p, extra_ctas(8, rt, p, sms));
    }
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
    """(parts, min_keys, bn, row_tiles, extra, [(n, prefix)]): hostile-but-legal batches, with the
    extra CTAs a 132- or 188-SM GPU gives the plan (s3) and some forced ones."""
    out = [(14, 0, 64, 9, 6, [(65, 8192)] * 8), (1, 64, 32, 2, 0, [(16, 1000)] * 3), (66, 0, 64, 2, 0, [(8, 8192)]),
           (128, 0, 64, 1, 0, [(0, 500), (3, 0), (0, 0), (1, 1)]), (7, 64, 32, 17, 13, [(0, 100)] * 5 + [(5, 70)]),
           (7, 0, 64, 17, 13, [(129, 8192)] * 8), (8, 0, 64, 16, 4, [(64, 32768)] + [(64, 1024)] * 31),
           (1, 0, 64, 100, 32, [(200, 5000), (3, 40000), (0, 7)]),
           (16, 0, 64, 8, 4, [(64, 1024)] * 32), (16, 0, 64, 8, 4, [(64, 2048)] * 32)]  # cut-free rectangles
    for _ in range(300):
        B = rng.choice([1, 2, 3, 8, 31, 64, 300])
        reqs = []
        for _ in range(B):
            n = 0 if rng.random() < 0.1 else rng.choice([1, 7, 33, 64, 65, 129, 257])
            prefix = rng.choice([0, 1, 63, 64, 65, rng.randrange(0, 40000)])
            reqs.append((n, prefix))
        parts = rng.choice([1, 2, 3, 9, 14, 29, 66, 128])
        min_keys = rng.choice([0, 0, 64, 512, 4096])
        R = rng.choice([1, 2, 5, 9, 17, 33])
        sms = rng.choice([132, 188, R * parts + rng.randrange(1, 40)])
        E = max(0, sms - R * parts) if B > 1 else 0
        out.append((parts, min_keys, rng.choice([32, 64]), R, E, reqs))
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
    stdin = "".join(f"{p} {mk} {bn} {R} {E} {len(reqs)} " + " ".join(f"{n} {pre}" for n, pre in reqs) + "\n"
                    for p, mk, bn, R, E, reqs in batches)
    out = subprocess.run([str(program)], input=stdin, capture_output=True, text=True, timeout=120, check=True).stdout
    blocks = out.split("batch ")[1:]
    assert len(blocks) == len(batches)
    modes, remainder_used, balanced, idled = set(), 0, 0, 0
    for (parts, min_keys, bn, R, E_grid, reqs), block in zip(batches, blocks):
        lines = block.strip().split("\n")
        total, w, rem_start, rem, le, aligned, slot_parts, E = map(int, lines[0].split())
        pieces, info = [], {}
        for line in lines[1:]:
            f = line.split()
            if f[0] == "piece":
                pieces.append(tuple(map(int, f[1:])))
            elif f[0] == "info":
                t, b, first, k = map(int, f[1:])
                assert (t, b) not in info, "one record a (request, row tile)"
                info[(t, b)] = (first, k)
        ctx = (parts, min_keys, bn, R, E_grid, E, len(reqs))
        assert E in (0, E_grid), ctx
        modes.add(aligned > 0)
        if not aligned:
            assert rem_start <= total and rem == total - rem_start and parts * w >= rem_start, ctx
            assert E > 0 or rem == 0, ctx
            # every CTA the same share of R row tiles' work and the extra CTAs' R - 1 crossings
            ideal = -(-(R * total + 4 * (R - 1)) // (R * parts + E))
            if E > 0 and w == ideal and rem > 0:  # (unless the smallest part or the rectangle's end bound w)
                balanced += 1
                # an extra CTA's share and its average row-tile crossings' starts: a main part's
                assert le * E + 4 * (R - 1) <= (w + 1) * E, (ctx, "an extra CTA's share exceeds a main part's", le, w)
            remainder_used += any(part >= parts for _, _, part, *_ in pieces)
        assert slot_parts == parts + (min(E_grid, E_grid // R + 2) if E_grid > 0 else 0), ctx
        work = {}
        for t in range(R):
            for b, (n, prefix) in enumerate(reqs):
                kt = (-(-prefix // bn) + -(-n // bn)) if n > 0 else 0
                mine = sorted((part, t0, t1, head, tail, slot) for _, tt, part, bb, t0, t1, head, tail, slot in pieces
                              if bb == b and tt == t)
                if kt == 0:
                    assert not mine and (t, b) not in info, (ctx, t, b)
                    continue
                # the tiles, once, in order, over consecutive (virtual) parts
                assert [x for _, t0, t1, *_ in mine for x in range(t0, t1)] == list(range(kt)), (ctx, t, b, mine)
                ps = [part for part, *_ in mine]
                assert ps == list(range(ps[0], ps[0] + len(ps))), (ctx, t, b, ps)
                first, k = info[(t, b)]
                assert (first, k) == (ps[0], len(ps)), (ctx, t, b, info[(t, b)], ps)
                for i, (part, t0, t1, head, tail, slot) in enumerate(mine):
                    assert head == (t0 > 0) and tail == (t1 < kt)
                    if k > 1:  # the combine reads piece i from slot request_piece_slot(first, i)
                        assert slot == (2 * first + 1 if i == 0 else 2 * (first + i)), (ctx, t, b, i, slot)
        for cta, t, part, b, t0, t1, head, tail, slot in pieces:
            work[cta] = work.get(cta, 0) + (t1 - t0) + (4 if t0 == 0 else 0)
        split = [(t, slot, cta) for cta, t, part, b, t0, t1, head, tail, slot in pieces if head or tail]
        assert len({(t, slot) for t, slot, _ in split}) == len(split), (ctx, "two pieces share a slot's rows")
        assert all(slot < 2 * slot_parts for _, slot, _ in split), (ctx, slot_parts)
        per_range = collections.Counter((cta, t) for t, _, cta in split)
        assert max(per_range.values(), default=0) <= 2, (ctx, "a CTA holds at most a head and a tail a row tile")
        if aligned:  # one piece a part and row tile, pieces of ceil(tiles / k) tiles; the extra CTAs idle
            assert all(cta < R * parts for cta, *_ in pieces), ctx
            for (t, b), (first, k) in info.items():
                assert first == b * aligned and k <= aligned, (ctx, t, b)
        else:
            if E > 0 and rem > 0:  # journal m31: an extra CTA's share at most a start's charge past a part's
                assert le <= w + 4, (ctx, "the remainder is piled on the extra CTAs", le, w)
            for cta, wk in work.items():
                if cta < R * parts:
                    assert wk <= w + 4, (ctx, cta, wk, w)  # a start's overhead may spill in
                else:
                    ranges = len({t for c2, t, *_ in pieces if c2 == cta})
                    assert wk <= le + 4 * ranges, (ctx, cta, wk, le)
        if (parts == 1 or E_grid > 0) and E == 0 and not aligned:
            # one part, or the vote idled the extra CTAs: the rectangle cuts no request
            assert all(not head and not tail for *_, head, tail, _ in pieces), ctx
            idled += E_grid > 0
    assert modes == {True, False}, "the batches reach both modes"
    assert remainder_used > 50 and balanced > 50, "the batches give the extra CTAs work, their share balanced"
    assert idled >= 2, "cut-free rectangles keep their extra CTAs idle"


def test_split_length_rule_and_the_plans_part_count(program):
    out = subprocess.run([str(program)], input="", capture_output=True, text=True, timeout=120, check=True).stdout
    autos = [tuple(map(int, line.split()[1:])) for line in out.split("\n") if line.startswith("auto ")]
    assert len(autos) > 3000
    for k, m in autos:
        assert m == _round_sqrt_third(k), (k, m)
    assert dict(autos)[129] == 4 and dict(autos)[513] == 8 and dict(autos)[17] == 1
    rows = [tuple(map(int, line.split()[1:])) for line in out.split("\n") if line.startswith("parts ")]
    parts = {(s, rt): p for s, rt, p, _ in rows}
    extra = {(s, rt): e for s, rt, _, e in rows}
    for (sms, rt), p in parts.items():
        waves = -(-rt // sms)  # the fewest waves row tiles alone need
        assert p == max(1, min(128, waves * sms // rt)), (sms, rt, p)  # as many parts as fill them
        # s3: a one-wave batch grid's idle SMs become extra CTAs
        # when they are enough to take at most two row tiles' remainders each
        idle = sms - rt * p
        assert extra[(sms, rt)] == (idle if idle > 0 and 2 * idle >= rt else 0), (sms, rt)
    assert extra[(132, 9)] == 6 and extra[(132, 17)] == 13 and extra[(132, 8)] == 4 and extra[(132, 2)] == 0
    assert extra[(132, 16)] == 0 and extra[(132, 128)] == 0 and extra[(188, 17)] == 0  # 16 x 8 = 128: 4 for 16
    assert parts[(132, 9)] == 14    # B8 H8 n65: one wave of 126 CTAs
    assert parts[(132, 17)] == 7    # one wave of 119 (s1: 2 waves of 255 measured 35% slower at B = 1)
    assert parts[(132, 1)] == 128   # the kMaxSplits bound
    assert parts[(132, 133)] == 1 and parts[(188, 9)] == 20


def _cta_work(out: str) -> tuple:
    """The program's first batch: its header fields and each CTA's tiles (+ 4 a request start)."""
    block = out.split("batch ")[1].strip().split("\n")
    head = tuple(map(int, block[0].split()))
    work = collections.Counter()
    for line in block[1:]:
        f = line.split()
        if f[0] == "piece":
            cta, t0, t1 = int(f[1]), int(f[5]), int(f[6])
            work[cta] += (t1 - t0) + (4 if t0 == 0 else 0)
    return head, work


@pytest.mark.parametrize("prefixes", [
    [int(round(1024 * 16 ** (i / 15))) for i in range(16)],  # ragged.py's "B16 H8 n8 spread 1k-16k" (m31)
    [700 + 613 * i for i in range(24)],
    [32768] + [1024] * 7,
])
def test_one_row_tile_ragged_batch_keeps_the_extra_ctas_share_at_a_parts(program, prefixes):
    """Journal m31: one row tile a request (H x n <= 64) gives 128 parts (kMaxSplits) + 4 extra CTAs on
    132 SMs. Shortening the main parts to floor(total / 128) piled up to 127 tiles on the 4 extra CTAs
    (30 tiles each against 11: the launch 1.8x FlashMLA). No CTA may now hold more than a covering
    part's tiles plus its segments' starts."""
    stdin = f"128 0 64 1 4 {len(prefixes)} " + " ".join(f"8 {L}" for L in prefixes) + "\n"
    out = subprocess.run([str(program)], input=stdin, capture_output=True, text=True, timeout=60, check=True).stdout
    (total, w, rem_start, rem, le, aligned, _slots, E), work = _cta_work(out)
    assert not aligned
    cover = -(-total // 128)
    assert max(work.values()) <= cover + 2 * 4, (total, w, rem, le, E, sorted(work.values())[-6:])
    if rem > 0:
        assert le <= w + 4, (le, w)
