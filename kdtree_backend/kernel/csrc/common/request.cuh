// What a CTA reads about its work before any tile: the request view (its query tokens, prefix and
// slot range from the index arrays), its part's walk over the batch (common/schedule.cuh: segments,
// each a tile range of one request), and where its query rows come from and its output rows go.
// Shared by the portable and Hopper kernels and the split combine, so they agree.
#pragma once
#include <cuda_bf16.h>
#include <stddef.h>
#include <stdint.h>

#include "../kdtree_api.h"
#include "mla.h"
#include "ptx.cuh"
#include "schedule.cuh"

namespace kdtree {

struct RequestView {
  int64_t q0;   // first query token of the request
  int n;        // draft tokens (query tokens) of the request
  int64_t kv0;  // first kv_indices entry of the request
  int prefix;   // committed prefix length
};

// The view from the request's index entries qo_indptr[b], [b + 1], kv_indptr[b], [b + 1].
__device__ __forceinline__ RequestView request_view(const KdtreeVerifyParams& p, int64_t q0, int64_t q1, int64_t kv0,
                                                    int64_t kv1) {
  RequestView r;
  r.q0 = q0;
  int64_t n = q1 - q0;
  // The grid covers max_qo_len rows per request; never index past what the grid was sized for.
  n = n < 0 ? 0 : (n > p.max_qo_len ? p.max_qo_len : n);
  r.n = static_cast<int>(n);
  r.kv0 = kv0;
  const int64_t prefix = kv1 - kv0;
  r.prefix = prefix < 0 ? 0 : static_cast<int>(prefix);
  return r;
}

__device__ __forceinline__ RequestView load_request(const KdtreeVerifyParams& p, int b) {
  const bool qo64 = p.qo_indptr_is_int64 != 0;
  const bool kv64 = p.kv_indptr_is_int64 != 0;
  return request_view(p, load_index(p.qo_indptr, b, qo64), load_index(p.qo_indptr, b + 1, qo64),
                      load_index(p.kv_indptr, b, kv64), load_index(p.kv_indptr, b + 1, kv64));
}

struct KeyTiles {
  int prefix_tiles;  // the request's prefix tiles come first, then its draft tiles
  int key_tiles;
};

// One segment of a part: a contiguous range of one request's key tiles, for one row tile.
struct CtaWork {
  RequestView req;
  int b;
  int rows;     // the request's query rows (n x H)
  KeyTiles w;
  int t_begin;  // this segment's key tiles: [t_begin, t_end)
  int t_end;
  bool direct;  // the segment holds all of the request's tiles: it writes `out`
  int slot;     // otherwise its partials' workspace slot (common/schedule.cuh)
  bool last;    // no later request starts inside the part (the part's last segment, barring empty ones)
  int row_tile; // the segment's row tile (an extra CTA's segments lie in one or two row tiles, s3)
};

// The launch's row tiles and extra CTAs (s3), from the parameters and the grid as the launcher set
// them: the batch instantiation's 1-D grid holds row tiles x parts main CTAs and then the extra ones;
// the single-request instantiation's 2-D grid (row tiles, parts) has none.
template <class Cfg>
__device__ __forceinline__ int launch_row_tiles(const KdtreeVerifyParams& p) {
  return row_tiles_of(p.num_heads, p.max_qo_len, Cfg::kM);
}
template <class Cfg>
__device__ __forceinline__ int launch_extra(const KdtreeVerifyParams& p) {
  const int64_t e = static_cast<int64_t>(grid_dim_x()) - static_cast<int64_t>(launch_row_tiles<Cfg>(p)) * p.num_splits;
  return e > 0 ? static_cast<int>(e) : 0;
}
// The launch's workspace (its slots: the main parts and a row tile's remainder's).
template <class Cfg>
__device__ __forceinline__ WorkspaceView launch_workspace(const KdtreeVerifyParams& p) {
  const int R = launch_row_tiles<Cfg>(p);
  return workspace_view(p.workspace, slot_parts(p.num_splits, R, launch_extra<Cfg>(p)), R, Cfg::kM);
}

// The part schedule's state in shared memory (a member of each kernel's SharedStorage): the scan's
// scratch, the part's range, the walk's position and the next segment. Thread 0 walks
// (next_segment); after a __syncthreads every thread copies the segment from here, so nothing of the
// walk is live in registers across a segment (the portable kernel has none to spare on sm_120).
struct ScheduleScratch {
  int64_t warp_cost[32];   // each warp's sum of its requests' costs
  int warp_max_tiles[32];  // each warp's longest request in key tiles
  // The part state: what part_begin leaves for the walk, first_index up to generation (a CTA's
  // record in the schedule cache, m35; cached_part_begin copies it as 8-byte words).
  int64_t first_index[4];  // the part's first request: qo_indptr[b], [b + 1], kv_indptr[b], [b + 1]
  int64_t rem_index[4];    // an extra CTA's: the request at the remainder's start (s3), its entries
  PartGeometry geom;       // where the parts lie on each row tile's cost axis (cut mode)
  int64_t lo, hi;          // the current range of the row tile's cost axis
  int64_t x_hi;            // an extra CTA's end on the remainder axis
  int64_t next_c;          // the walk's position: the next request's cost position
  int64_t rem_c;           // the remainder's first request's cost position
  int part;                // the (virtual) part of the current range
  int row_tile;            // the current range's row tile
  int extra;               // -1: a main CTA; else the extra CTA's index
  int rem_b;               // the remainder's first request
  int next_b;              // the next request to look at
  int has_first;           // first_index holds request next_b's index entries (the first request only)
  int aligned;             // 0: the cut over the cost axis; s >= 1: the aligned mode, s parts a request
  int min_tiles;           // the smallest part
  int64_t generation;      // (the part state ends here) cached_part_begin: the cache's generation
  int begun;               // cached_part_begin: the record's part_begin result (-1: not this generation's)
  int last_arrival;        // cached_part_begin: this CTA was the last of its launch to write its record
  int more;                // next_segment found a segment: it is `seg`
  CtaWork seg;             // the segment every thread runs next (written by thread 0)
};
constexpr int kPartStateWords =
    static_cast<int>((offsetof(ScheduleScratch, generation) - offsetof(ScheduleScratch, first_index)) / 8);
static_assert(offsetof(ScheduleScratch, first_index) % 8 == 0 && (2 + kPartStateWords) * 8 <= kScheduleRecordBytes,
              "a schedule cache record holds the generation, the result and the part state");

// One thread only: segment `pc` of request b (kt key tiles) in `part` into sc.seg, if the row tile has
// rows of the request (sc.more = 1); false otherwise.
template <class Cfg>
__device__ __forceinline__ bool fill_work(const KdtreeVerifyParams& p, const RequestView& req, int b, int kt,
                                          const Piece& pc, int part, bool last, int row_tile, CtaWork& cw) {
  const int rows = req.n * p.num_heads;
  if (row_tile * Cfg::kM >= rows) return false;
  // The draft mask is addressed with 32-bit offsets within a request (draft_mask_row): a block of
  // 2 GiB or more (a prefix over 33M tokens at n = 64) stops the kernel instead of reading wrong.
  if (p.custom_mask != nullptr && static_cast<int64_t>(req.n) * (req.prefix + req.n) > 0x7fffffffLL) __trap();
  cw.req = req;
  cw.b = b;
  cw.rows = rows;
  cw.w.prefix_tiles = (req.prefix + Cfg::kBN - 1) / Cfg::kBN;
  cw.w.key_tiles = kt;
  cw.t_begin = pc.t_begin;
  cw.t_end = pc.t_end;
  cw.direct = !pc.head && !pc.tail;
  cw.slot = piece_slot(part, pc.head);
  cw.last = last;
  cw.row_tile = row_tile;
  return true;
}

// One thread only: fill_work into sc.seg (sc.more = 1 when the row tile has rows of the request).
template <class Cfg>
__device__ __forceinline__ bool fill_segment(const KdtreeVerifyParams& p, const RequestView& req, int b, int kt,
                                             const Piece& pc, int part, bool last, int row_tile, ScheduleScratch& sc) {
  if (!fill_work<Cfg>(p, req, b, kt, pc, part, last, row_tile, sc.seg)) return false;
  sc.more = 1;
  return true;
}

// One thread only: the part's next segment that has rows in its row tile, from the walk's position
// in `sc`, into sc.seg (sc.more = 0 when the part is done), and the new position. An extra CTA (s3)
// whose range goes on into the next row tile's remainder moves there. The CTA that holds a request's
// first tile in a row tile records (first part, pieces) there for the combine. The caller syncs
// before any thread reads sc.seg.
template <class Cfg>
__device__ __forceinline__ void next_segment(const KdtreeVerifyParams& p, ScheduleScratch& sc) {
  const int R = launch_row_tiles<Cfg>(p);
  if (sc.aligned > 0) {  // one segment: piece part % s of request part / s
    sc.more = 0;
    if (!sc.has_first) return;
    sc.has_first = 0;
    const int b = sc.next_b;
    const RequestView req = request_view(p, sc.first_index[0], sc.first_index[1], sc.first_index[2], sc.first_index[3]);
    const int kt = request_key_tiles(req.prefix, req.n, Cfg::kBN);
    if (kt == 0) return;
    int pieces;
    const int j = sc.part % sc.aligned;
    const Piece pc = aligned_piece(kt, sc.aligned, j, sc.min_tiles, pieces);
    if (pc.t_begin >= pc.t_end) return;
    if (j == 0 && p.num_splits > 1) {
      const WorkspaceView ws = launch_workspace<Cfg>(p);
      ws.request[static_cast<int64_t>(b) * R + sc.row_tile] = make_int2(sc.part, pieces);
    }
    fill_segment<Cfg>(p, req, b, kt, pc, sc.part, true, sc.row_tile, sc);
    return;
  }
  int b = sc.next_b;
  int64_t c_b = sc.next_c;
  bool has_first = sc.has_first != 0;
  sc.more = 0;
  for (;;) {
    const int64_t lo = sc.lo, hi = sc.hi;
    const int t = sc.row_tile;
    const bool more_row_tiles = sc.extra >= 0 && t + 1 < R && static_cast<int64_t>(t + 1) * sc.geom.rem < sc.x_hi;
    bool found = false;
    for (; c_b < hi && b < p.batch; has_first = false) {
      const RequestView req = has_first ? request_view(p, sc.first_index[0], sc.first_index[1], sc.first_index[2],
                                                       sc.first_index[3])
                                        : load_request(p, b);
      const int kt = request_key_tiles(req.prefix, req.n, Cfg::kBN);
      const int64_t c_this = c_b;
      const int b_this = b;
      c_b += request_cost(kt);
      ++b;
      const Piece pc = piece_in_part(c_this, kt, lo, hi);
      if (pc.t_begin >= pc.t_end) continue;
      if (pc.t_begin == 0 && split_launch(p.num_splits, launch_extra<Cfg>(p))) {
        const int last_part = part_at(sc.geom, p.num_splits, t, c_this + kOverheadTiles + kt - 1);
        const WorkspaceView ws = launch_workspace<Cfg>(p);
        ws.request[static_cast<int64_t>(b_this) * R + t] = make_int2(sc.part, last_part - sc.part + 1);
      }
      const bool last = !(c_b < hi && b < p.batch) && !more_row_tiles;
      if (fill_segment<Cfg>(p, req, b_this, kt, pc, sc.part, last, t, sc)) {
        found = true;
        break;
      }
    }
    if (found || !more_row_tiles) break;
    // The range is done; an extra CTA goes on with the next row tile's remainder, from its start.
    const int tn = t + 1;
    const PartGeometry& g = sc.geom;
    const int64_t xs = static_cast<int64_t>(tn) * g.rem;
    sc.row_tile = tn;
    sc.lo = g.rem_start;
    sc.hi = g.rem_start + (sc.x_hi - xs < g.rem ? sc.x_hi - xs : g.rem);
    sc.part = p.num_splits + sc.extra - first_extra_of(g, tn);
#pragma unroll
    for (int i = 0; i < 4; ++i) sc.first_index[i] = sc.rem_index[i];
    b = sc.rem_b;
    c_b = sc.rem_c;
    has_first = true;
  }
  sc.next_b = b;
  sc.next_c = c_b;
  sc.has_first = 0;
}

// One thread's part of finding the request that holds cost position x: true for the thread whose
// chunk [b_lo, b_hi) (starting at cost position excl, `sum` long, its first request's entries in
// idx0) holds x; it returns the request, its cost position and its index entries.
__device__ __forceinline__ bool find_in_chunk(const KdtreeVerifyParams& p, int bn, int64_t x, int64_t excl, int64_t sum,
                                              int b_lo, int b_hi, const int64_t (&idx0)[4], int& b_out,
                                              int64_t& c_out, int64_t (&idx)[4]) {
  if (!(sum > 0 && excl <= x && x < excl + sum)) return false;
  const bool qo64 = p.qo_indptr_is_int64 != 0;
  const bool kv64 = p.kv_indptr_is_int64 != 0;
  int64_t c = excl;
  int64_t q_prev = idx0[0], k_prev = idx0[2];
  for (int b = b_lo; b < b_hi; ++b) {
    const int64_t q_next = b == b_lo ? idx0[1] : load_index(p.qo_indptr, b + 1, qo64);
    const int64_t k_next = b == b_lo ? idx0[3] : load_index(p.kv_indptr, b + 1, kv64);
    const RequestView r = request_view(p, q_prev, q_next, k_prev, k_next);
    const int64_t cost = request_cost(request_key_tiles(r.prefix, r.n, bn));
    if (x < c + cost) {
      b_out = b;
      c_out = c;
      idx[0] = q_prev;
      idx[1] = q_next;
      idx[2] = k_prev;
      idx[3] = k_next;
      return true;
    }
    c += cost;
    q_prev = q_next;
    k_prev = k_next;
  }
  return false;
}

// One thread's part of the rectangle's vote (part_begin): true when a request of its chunk [b_lo,
// b_hi) (starting at cost position excl, its first request's entries in idx0) lies across a boundary
// of parts `len` long.
__device__ __forceinline__ bool chunk_cut_by_parts(const KdtreeVerifyParams& p, int bn, int64_t excl, int b_lo,
                                                   int b_hi, const int64_t (&idx0)[4], int64_t len) {
  const bool qo64 = p.qo_indptr_is_int64 != 0;
  const bool kv64 = p.kv_indptr_is_int64 != 0;
  int64_t c = excl;
  int64_t q_prev = idx0[0], k_prev = idx0[2];
  for (int b = b_lo; b < b_hi; ++b) {
    const int64_t q_next = b == b_lo ? idx0[1] : load_index(p.qo_indptr, b + 1, qo64);
    const int64_t k_next = b == b_lo ? idx0[3] : load_index(p.kv_indptr, b + 1, kv64);
    const RequestView r = request_view(p, q_prev, q_next, k_prev, k_next);
    const int64_t cost = request_cost(request_key_tiles(r.prefix, r.n, bn));
    if (cut_by_parts(c, cost, len)) return true;
    c += cost;
    q_prev = q_next;
    k_prev = k_next;
  }
  return false;
}

// Block-wide (every thread calls it, once; walk_part below) for CTA `cta` of the batch grid: the
// batch's cost prefix over the requests (each thread sums a contiguous chunk of requests, then a
// block scan), the mode, the CTA's part and range (a main CTA: part cta / R of row tile cta % R; an
// extra one, s3: its cut of the row tiles' remainders laid end to end), and the request that holds
// the range's first position (and, for an extra CTA, the remainder's first) with its index entries,
// written by the thread that read it, before one __syncthreads; thread 0 then finds the first
// segment (next_segment). False: nothing for this CTA (the batch has less work than the grid); the
// same on every thread. (Launches of one request run the single-request instantiation.)
template <class Cfg>
__device__ __forceinline__ bool part_begin(const KdtreeVerifyParams& p, int cta, ScheduleScratch& sc) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int kWarps = Cfg::kThreads / 32;
  static_assert(Cfg::kThreads % 32 == 0 && kWarps <= 32, "the schedule's scan takes whole warps, at most 32");
  const bool qo64 = p.qo_indptr_is_int64 != 0;
  const bool kv64 = p.kv_indptr_is_int64 != 0;
  const int per = (p.batch + Cfg::kThreads - 1) / Cfg::kThreads;
  const int b_lo = tid * per;
  const int b_hi = min(p.batch, b_lo + per);
  int64_t sum = 0;
  int max_tiles = 0;
  int64_t idx0[4] = {0, 0, 0, 0};  // this chunk's first request's index entries
  if (b_lo < b_hi) {
    int64_t q_prev = load_index(p.qo_indptr, b_lo, qo64), k_prev = load_index(p.kv_indptr, b_lo, kv64);
    for (int b = b_lo; b < b_hi; ++b) {
      const int64_t q_next = load_index(p.qo_indptr, b + 1, qo64), k_next = load_index(p.kv_indptr, b + 1, kv64);
      if (b == b_lo) {
        idx0[0] = q_prev;
        idx0[1] = q_next;
        idx0[2] = k_prev;
        idx0[3] = k_next;
      }
      const RequestView r = request_view(p, q_prev, q_next, k_prev, k_next);
      const int kt = request_key_tiles(r.prefix, r.n, Cfg::kBN);
      sum += request_cost(kt);
      max_tiles = max(max_tiles, kt);
      q_prev = q_next;
      k_prev = k_next;
    }
  }
  int64_t incl = sum;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int64_t v = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += v;
  }
  int wmax = max_tiles;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) wmax = max(wmax, __shfl_xor_sync(0xffffffffu, wmax, off));
  if (lane == 31) sc.warp_cost[warp] = incl;
  if (lane == 0) sc.warp_max_tiles[warp] = wmax;
  __syncthreads();
  int64_t excl = incl - sum, total = 0;
  int batch_max_tiles = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int64_t c = sc.warp_cost[w];
    excl += w < warp ? c : 0;
    total += c;
    batch_max_tiles = max(batch_max_tiles, sc.warp_max_tiles[w]);
  }
  const int R = launch_row_tiles<Cfg>(p);
  const int P = p.num_splits;
  const int main_ctas = R * P;
  const int min_tiles = min_part_tiles(p.min_keys_per_split, Cfg::kBN, batch_max_tiles);
  if (use_aligned(P, p.batch, total, batch_max_tiles, min_tiles, Cfg::kBN)) {
    // The aligned mode: this part is piece `part % s` of request `part / s` (the same on every
    // thread); extra CTAs have nothing.
    if (cta >= main_ctas) return false;
    const int part = cta / R;
    const int s = P / p.batch;
    const int b = part / s;
    if (b >= p.batch) return false;
    if (b_lo <= b && b < b_hi) {  // the thread that read request b's entries
      sc.aligned = s;
      sc.min_tiles = min_tiles;
      sc.part = part;
      sc.row_tile = cta - part * R;
      sc.extra = -1;
      sc.next_b = b;
      sc.has_first = 1;
      if (b == b_lo) {
#pragma unroll
        for (int i = 0; i < 4; ++i) sc.first_index[i] = idx0[i];
      } else {
        sc.first_index[0] = load_index(p.qo_indptr, b, qo64);
        sc.first_index[1] = load_index(p.qo_indptr, b + 1, qo64);
        sc.first_index[2] = load_index(p.kv_indptr, b, kv64);
        sc.first_index[3] = load_index(p.kv_indptr, b + 1, kv64);
      }
    }
    __syncthreads();
    return true;
  }
  // Extra CTAs only where the rectangle cuts a request anyway (cut_by_parts): each thread looks at its
  // chunk's requests again, one vote for the block.
  int E = launch_extra<Cfg>(p);
  if (E > 0 && !__syncthreads_or(chunk_cut_by_parts(p, Cfg::kBN, excl, b_lo, b_hi, idx0,
                                                     part_length(total, P, min_tiles)))) {
    E = 0;
  }
  if (cta >= main_ctas && E == 0) return false;  // the same on every thread
  const PartGeometry g = part_geometry(total, P, R, E, min_tiles);
  int64_t lo, hi, x_hi = 0;
  int t, part, extra;
  if (cta < main_ctas) {
    part = cta / R;
    t = cta - part * R;
    extra = -1;
    lo = static_cast<int64_t>(part) * g.w;
    hi = min(lo + g.w, g.rem_start);
  } else {
    extra = cta - main_ctas;
    const int64_t x_lo = static_cast<int64_t>(extra) * g.le;
    x_hi = min(x_lo + g.le, static_cast<int64_t>(R) * g.rem);
    if (x_lo >= x_hi) return false;  // the same on every thread
    t = static_cast<int>(x_lo / g.rem);
    part = P + extra - first_extra_of(g, t);
    lo = g.rem_start + (x_lo - static_cast<int64_t>(t) * g.rem);
    hi = g.rem_start + min(x_hi - static_cast<int64_t>(t) * g.rem, g.rem);
  }
  if (lo >= hi) return false;  // the same on every thread
  if (tid == 0) {
    sc.aligned = 0;
    sc.lo = lo;
    sc.hi = hi;
    sc.geom = g;
    sc.x_hi = x_hi;
    sc.part = part;
    sc.row_tile = t;
    sc.extra = extra;
    sc.has_first = 1;
  }
  // The thread whose chunk holds position lo names the request there (thread 0's next_segment then
  // finds the first segment); for an extra CTA, the one holding the remainder's start too.
  int fb;
  int64_t fc, fidx[4];
  if (find_in_chunk(p, Cfg::kBN, lo, excl, sum, b_lo, b_hi, idx0, fb, fc, fidx)) {
    sc.next_b = fb;
    sc.next_c = fc;
#pragma unroll
    for (int i = 0; i < 4; ++i) sc.first_index[i] = fidx[i];
  }
  if (extra >= 0 && find_in_chunk(p, Cfg::kBN, g.rem_start, excl, sum, b_lo, b_hi, idx0, fb, fc, fidx)) {
    sc.rem_b = fb;
    sc.rem_c = fc;
#pragma unroll
    for (int i = 0; i < 4; ++i) sc.rem_index[i] = fidx[i];
  }
  __syncthreads();
  return true;
}

// A launch of one request (journal s1e; its own kernel instantiation, picked by the launcher when
// batch == 1): every thread finds the part's segment itself from request 0's entries (one load round
// trip, no scan, no barrier, no walk), by the rules part_begin + next_segment apply with the batch's
// totals = the request's; a part then holds at most one segment. False: nothing for this CTA. The
// CTA of each row tile holding the first tile records (first part, pieces) there for the combine.
template <class Cfg>
__device__ __forceinline__ bool single_request_segment(const KdtreeVerifyParams& p, int part, int row_tile,
                                                       CtaWork& cw) {
  const RequestView req = load_request(p, 0);
  const int kt = request_key_tiles(req.prefix, req.n, Cfg::kBN);
  if (kt == 0) return false;
  const int64_t total = request_cost(kt);
  const int min_tiles = min_part_tiles(p.min_keys_per_split, Cfg::kBN, kt);
  Piece pc;
  int pieces;
  if (use_aligned(p.num_splits, 1, total, kt, min_tiles, Cfg::kBN)) {
    pc = aligned_piece(kt, p.num_splits, part, min_tiles, pieces);  // s = parts: piece j = part
  } else {
    const int64_t len = part_length(total, p.num_splits, min_tiles);
    const int64_t lo = static_cast<int64_t>(part) * len;
    if (lo >= total) return false;
    pc = piece_in_part(0, kt, lo, min(lo + len, total));
    pieces = part_of(kOverheadTiles + kt - 1, len) - part + 1;  // read only where pc.t_begin == 0
  }
  if (pc.t_begin >= pc.t_end) return false;
  if (pc.t_begin == 0 && p.num_splits > 1 && threadIdx.x == 0) {  // request 0's record in this row tile
    const WorkspaceView ws = launch_workspace<Cfg>(p);
    ws.request[row_tile] = make_int2(part, pieces);
  }
  return fill_work<Cfg>(p, req, 0, kt, pc, part, true, row_tile, cw);
}

// The schedule cache of a batch launch (common/schedule.cuh): the workspace's last bytes. (From the
// parameters and the grid only: row tiles and extra CTAs here would be kept live by the compiler
// for the epilogue's workspace view, which spilled the warp-specialised kernel on sm_100 / sm_120.)
__device__ __forceinline__ ScheduleCacheView launch_schedule_cache(const KdtreeVerifyParams& p) {
  return schedule_cache_view(p.workspace, p.workspace_bytes, p.batch, grid_dim_x());
}

// What a cache header must hold for this launch to take its records (the generation and the counter
// aside).
template <class Cfg>
__device__ __forceinline__ int32_t schedule_kernel_id(const KdtreeVerifyParams& p) {
  return (p.config << 16) | (Cfg::kM << 8) | Cfg::kBN;
}
__device__ __forceinline__ int32_t schedule_index_types(const KdtreeVerifyParams& p) {
  return (p.qo_indptr_is_int64 != 0 ? 1 : 0) | (p.kv_indptr_is_int64 != 0 ? 2 : 0);
}
// The header a launch computing its schedule writes: the launch's fields (the first
// kScheduleLaunchWords words), no arrivals, and the records' generation.
template <class Cfg>
__device__ __forceinline__ ScheduleCacheHeader schedule_header(const KdtreeVerifyParams& p, int64_t generation) {
  ScheduleCacheHeader h;
  h.magic = kScheduleCacheMagic;
  h.kernel = schedule_kernel_id<Cfg>(p);
  h.batch = p.batch;
  h.num_heads = p.num_heads;
  h.max_qo_len = p.max_qo_len;
  h.num_splits = p.num_splits;
  h.min_keys_per_split = p.min_keys_per_split;
  h.grid = static_cast<int32_t>(grid_dim_x());
  h.index_types = schedule_index_types(p);
  h.arrived = 0;
  h.generation = generation;
  h.reserved[0] = h.reserved[1] = 0;
  return h;
}
// Whether a stored header was written by a launch of this one's shape: its launch fields equal.
template <class Cfg>
__device__ __forceinline__ bool schedule_header_matches(const KdtreeVerifyParams& p, const ScheduleCacheHeader& h) {
  const ScheduleCacheHeader want = schedule_header<Cfg>(p, 0);
  const int32_t* a = &h.magic;
  const int32_t* b = &want.magic;
  bool same = true;
#pragma unroll
  for (int i = 0; i < kScheduleLaunchWords; ++i) same &= a[i] == b[i];
  return same;
}

// part_begin through the schedule cache (journal m35), block-wide like it. Every thread compares its
// share of the snapshot with the live index arrays and the header with the launch while the CTA's
// record is copied into sc (one round trip of independent loads); one __syncthreads_or decides.
// - A match, and the record of the header's generation: the record is part_begin's result for this
//   launch.
// - A mismatch (the same for every CTA of the launch: the header and snapshot change only after all
//   of them have compared): part_begin runs, the CTA writes its record (generation + 1) and counts
//   itself in; the last of the launch's CTAs to arrive writes the snapshot and the header. Records and
//   header are read by later launches only (the kernel boundary orders them), so no fence is needed.
// - A match but a record of another generation (the workspace was overwritten): part_begin runs for
//   this CTA alone, which neither writes nor counts, so the counter only ever counts whole launches.
template <class Cfg>
__device__ __forceinline__ bool cached_part_begin(const KdtreeVerifyParams& p, int cta, ScheduleScratch& sc) {
  // threadIdx.x read where used: predicates on it shared with part_begin's were held across the scan
  // and spilled by sm_100 / sm_120's ptxas in the warp-specialised kernel.
  int tid = thread_index_volatile();
  const bool qo64 = p.qo_indptr_is_int64 != 0;
  const bool kv64 = p.kv_indptr_is_int64 != 0;
  const int n = p.batch + 1;
  bool stale = false;
  {
    const ScheduleCacheView c = launch_schedule_cache(p);
    stale = !schedule_header_matches<Cfg>(p, *c.header);
    for (int j = tid; j < n; j += Cfg::kThreads) {
      stale |= load_index(p.qo_indptr, j, qo64) != c.snapshot[j];
      stale |= load_index(p.kv_indptr, j, kv64) != c.snapshot[n + j];
    }
    const int64_t* record = c.records + static_cast<int64_t>(cta) * (kScheduleRecordBytes / 8);
    if (tid < kPartStateWords) (&sc.first_index[0])[tid] = record[2 + tid];
    if (tid == 0) {
      const int64_t generation = c.header->generation;
      sc.generation = generation;
      sc.begun = record[0] == generation ? static_cast<int>(record[1]) : -1;
    }
    stale = __syncthreads_or(stale) != 0;
    if (!stale && sc.begun >= 0) return sc.begun != 0;
  }
  const bool begun = part_begin<Cfg>(p, cta, sc);  // its state is in sc on every path that returns true
  if (!stale) return begun;  // an overwritten record: this CTA computes, nothing is written
  tid = thread_index_volatile();
  const ScheduleCacheView c = launch_schedule_cache(p);
  int64_t* record = c.records + static_cast<int64_t>(cta) * (kScheduleRecordBytes / 8);
  if (begun && tid < kPartStateWords) record[2 + tid] = (&sc.first_index[0])[tid];
  if (tid == 0) {
    record[0] = sc.generation + 1;
    record[1] = begun ? 1 : 0;
    sc.last_arrival = atomicAdd(&c.header->arrived, 1u) == static_cast<unsigned>(grid_dim_x()) - 1u ? 1 : 0;
  }
  __syncthreads();  // the flag; and the state is copied before thread 0's walk changes it
  if (sc.last_arrival != 0) {
    for (int j = tid; j < n; j += Cfg::kThreads) {
      c.snapshot[j] = load_index(p.qo_indptr, j, qo64);
      c.snapshot[n + j] = load_index(p.kv_indptr, j, kv64);
    }
    if (tid == 0) {
      *c.header = schedule_header<Cfg>(p, sc.generation + 1);
    }
  }
  return begun;
}

// The CTA's walk over its part (s1), for both kernels: part_begin, then one segment at a time. Thread 0
// finds the next segment (so next_segment exists once in the binary), a __syncthreads publishes it
// and ends the previous segment (its copies landed, its stores read their shared memory), every
// thread copies it and runs it: `between()` before each segment but the first, then `run(cw)` (the
// segment names its row tile). kSingle (a launch of one request): the one segment of
// single_request_segment, no walk, on the 2-D grid (row tiles, parts); otherwise the 1-D grid of
// row tiles x parts main CTAs and the extra ones (s3).
// kCached: part_begin through the schedule cache (m35): the warp-specialised portable kernel. The
// Hopper kernel measured no gain from it (m35b) and the tiled one spilled with it (255 registers on
// sm_100 / sm_120); both keep the scan.
template <class Cfg, bool kSingle, bool kCached, class Between, class Run>
__device__ __forceinline__ void walk_part(const KdtreeVerifyParams& p, ScheduleScratch& sc, Between between, Run run) {
  if constexpr (kSingle) {
    CtaWork cw;
    if (single_request_segment<Cfg>(p, blockIdx.y, blockIdx.x, cw)) run(cw);
    return;
  } else {
    if (!(kCached ? cached_part_begin<Cfg>(p, blockIdx.x, sc) : part_begin<Cfg>(p, blockIdx.x, sc))) return;
    for (bool first = true;; first = false) {
      if (threadIdx.x == 0) next_segment<Cfg>(p, sc);
      __syncthreads();
      if (!sc.more) break;
      const CtaWork cw = sc.seg;
      if (!first) between();
      run(cw);
    }
  }
}

// Query row r of the request is (token r / H, head r % H). Rows past the request read row 0 and
// are copied as zeros (valid = false), so no garbage enters a matmul.
__device__ __forceinline__ const __nv_bfloat16* q_row_src(const KdtreeVerifyParams& p, const RequestView& req, int r,
                                                          int rows, bool& valid) {
  valid = r < rows;
  const int H = p.num_heads;
  const int tok = valid ? r / H : 0;
  const int head = valid ? r - tok * H : 0;
  return reinterpret_cast<const __nv_bfloat16*>(p.q) + (req.q0 + tok) * p.q_stride_tok +
         static_cast<int64_t>(head) * p.q_stride_head;
}

// Where query row r of the request (token r / H, head r % H) writes its 512 output columns (bf16),
// for every kernel that writes `out`: the portable and Hopper epilogues and the split combine.
__device__ __forceinline__ __nv_bfloat16* out_row(const KdtreeVerifyParams& p, const RequestView& req, int r) {
  const int H = p.num_heads;
  const int tok = r / H, head = r - (r / H) * H;
  return reinterpret_cast<__nv_bfloat16*>(p.out) + (req.q0 + tok) * p.out_stride_tok + static_cast<int64_t>(head) * kVDim;
}

}  // namespace kdtree
