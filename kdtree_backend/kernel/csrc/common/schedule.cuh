// The batch-wide part schedule (journal s1): how the key tiles of ALL requests of a launch are cut
// into `parts` near-equal ranges, one range per CTA of each row tile, so every CTA of a row tile has
// the same amount of work whatever the batch size and the prefixes. Shared by the portable and
// Hopper kernels and the split combine; the arithmetic is host and device code (no CUDA call), so
// tests/kernel/test_schedule_cpu.py checks it on the host.
//
// The cost axis: request b occupies [C_b, C_b + cost_b), cost_b = kOverheadTiles + its key tiles
// (prefix tiles, then draft tiles; 0 for a request without drafts), C_b the sum of the earlier
// requests' costs. The overhead charges each request's start (Q load, pipeline fill, epilogue) in
// tile units, so a part that touches many short requests gets fewer tiles. Part p owns
// [p * len, (p + 1) * len), len = max(ceil(total / parts), min_len): the tiles of request b whose
// cost positions C_b + kOverheadTiles + t fall in it. A CTA walks its part's requests in order, one
// segment (a contiguous tile range of one request) at a time.
//
// Outputs: a segment holding all of its request's tiles writes `out` directly. Otherwise the
// request is cut into pieces (one per part it touches) written as fp32 partials with their log2-sum-
// exp, merged by the combine. A part holds at most two pieces: the end of a request begun in an
// earlier part (a "head" piece, slot 2p) and the start of one that continues past it (slot 2p + 1);
// a request's pieces are therefore in slots 2f + 1, 2(f + 1), ..., 2l for its parts f..l. In each
// row tile, the CTA that holds a request's first tile records (f, pieces) there for the combine.
//
// Remainder CTAs (journal s3): a grid of row tiles x parts leaves SMs - R P SMs idle (n = 65 at H = 8:
// 9 x 14 = 126 of 132). A batch launch gives them work: main part p owns [p w, (p + 1) w) of EVERY
// row tile's axis (the rectangle keeps a K tile shared through L2 by the R row tiles that read it at
// once), w = R total / SMs, and the R remainders [P w, total) are laid end to end and cut among the
// E = SMs - R P extra CTAs (part_geometry). For row tile t the remainder's cuts are virtual
// parts P, P + 1, ... after the main ones, so a request's pieces still lie in consecutive (virtual)
// parts and slots; the records are per (request, row tile), written by the CTA that holds the
// request's first tile in that row tile.
#pragma once
#include <stddef.h>  // offsetof
#include <stdint.h>
#include <vector_types.h>  // int2

#include "../kdtree_api.h"
#include "mla.h"
#include "split_rule.cuh"

namespace kdtree {

// A request's start in tiles of work (FlashMLA's scheduler charges 5 blocks of 64 keys).
constexpr int kOverheadTiles = 4;

// Key tiles of a request of `prefix` committed keys and `n` drafts (0 without drafts: no rows).
__host__ __device__ __forceinline__ int request_key_tiles(int64_t prefix, int64_t n, int bn) {
  if (n <= 0) return 0;
  return static_cast<int>((prefix + bn - 1) / bn + (n + bn - 1) / bn);
}

__host__ __device__ __forceinline__ int64_t request_cost(int key_tiles) {
  return key_tiles > 0 ? key_tiles + kOverheadTiles : 0;
}

// The smallest part in tiles: min_keys / bn (at least 1), or, for min_keys == 0 (the Hopper plan),
// the split length h29 measured best for the batch's longest request: round(sqrt(tiles) / 3).
__host__ __device__ __forceinline__ int min_part_tiles(int min_keys, int bn, int max_key_tiles) {
  if (min_keys > 0) {
    const int t = min_keys / bn;
    return t < 1 ? 1 : t;
  }
  return auto_split_tiles(max_key_tiles < 1 ? 1 : max_key_tiles);
}

__host__ __device__ __forceinline__ int64_t part_length(int64_t total, int parts, int min_tiles) {
  int64_t len = (total + parts - 1) / parts;
  if (len < min_tiles) len = min_tiles;
  return len < 1 ? 1 : len;
}

// The part that holds cost position x.
__host__ __device__ __forceinline__ int part_of(int64_t x, int64_t len) { return static_cast<int>(x / len); }

// Request b's tiles in the part [lo, hi) of the cost axis, given its start c_b and its key tiles.
struct Piece {
  int t_begin, t_end;  // empty when t_begin >= t_end
  bool head;           // tiles before t_begin belong to earlier parts
  bool tail;           // tiles from t_end on belong to later parts
};

__host__ __device__ __forceinline__ Piece piece_in_part(int64_t c_b, int key_tiles, int64_t lo, int64_t hi) {
  const int64_t first = c_b + kOverheadTiles;  // cost position of tile 0
  int64_t b0 = lo - first, b1 = hi - first;
  b0 = b0 < 0 ? 0 : b0;
  b1 = b1 > key_tiles ? key_tiles : b1;
  Piece pc;
  pc.t_begin = static_cast<int>(b0 > key_tiles ? key_tiles : b0);
  pc.t_end = static_cast<int>(b1 < 0 ? 0 : b1);
  pc.head = pc.t_begin > 0;
  pc.tail = pc.t_end < key_tiles;
  return pc;
}

// Remainder CTAs (s3): the idle SMs of a one-wave batch grid. None for a batch of one (its own
// instantiation keeps the rectangle), a grid of more than one wave, or too few to share the
// remainders of at most two row tiles each: every row tile an extra CTA enters costs it a segment's
// start (Q load, pipeline fill, epilogue), which its cost-axis share does not charge (16 row tiles
// and 4 idle SMs would give each extra CTA four starts for a sliver of each remainder).
__host__ __device__ __forceinline__ int extra_ctas(int batch, int row_tiles, int parts, int num_sms) {
  const int64_t main = static_cast<int64_t>(row_tiles) * parts;
  if (batch <= 1 || main >= num_sms) return 0;
  const int extra = static_cast<int>(num_sms - main);
  return 2 * extra >= row_tiles ? extra : 0;
}

// Whether request [c_b, c_b + cost) lies across a boundary of parts `len` long: the rectangle cuts it.
// A batch whose rectangle cuts no request (uniform batches of B a multiple of the parts: B32 at 16
// parts) keeps it and leaves its extra CTAs idle: the extra CTAs' shorter parts would cut every
// request there, and the partials and merge cost more than the ~3% the span gains (s3: B32 H8 n64
// L2k 139 -> 153 us on the Hopper path with extra CTAs).
__host__ __device__ __forceinline__ bool cut_by_parts(int64_t c_b, int64_t cost, int64_t len) {
  return cost > 0 && part_of(c_b, len) != part_of(c_b + cost - 1, len);
}

// The virtual parts a row tile's remainder can touch, for which the workspace holds slots:
// floor(E / R) + 2 (an extra CTA's remainder length is at least R rem / E), at most E.
__host__ __device__ __forceinline__ int remainder_parts(int row_tiles, int extra) {
  if (extra <= 0) return 0;
  const int v = extra / row_tiles + 2;
  return v < extra ? v : extra;
}

// Where the parts of a cut launch lie on each row tile's cost axis.
struct PartGeometry {
  int64_t w;          // a main part's length: part p owns [p w, min((p + 1) w, rem_start))
  int64_t rem_start;  // where each row tile's remainder begins (total without extra CTAs)
  int64_t rem;        // each row tile's remainder length
  int64_t le;         // an extra CTA's length on the remainder axis (R remainders end to end)
};

__host__ __device__ __forceinline__ PartGeometry part_geometry(int64_t total, int parts, int row_tiles, int extra,
                                                               int min_tiles) {
  PartGeometry g;
  if (extra <= 0) {
    g.w = part_length(total, parts, min_tiles);
    g.rem_start = total;
    g.rem = 0;
    g.le = 1;
    return g;
  }
  // Every CTA the same work: the R row tiles' axes and, charged like a request's start, the R - 1
  // row-tile boundaries the extra CTAs cross (each costs one of them a segment's start).
  const int64_t ctas = static_cast<int64_t>(row_tiles) * parts + extra;
  const int64_t work = static_cast<int64_t>(row_tiles) * total + static_cast<int64_t>(kOverheadTiles) * (row_tiles - 1);
  int64_t w = (work + ctas - 1) / ctas;
  if (w < min_tiles) w = min_tiles;
  if (static_cast<int64_t>(parts) * w >= total) {
    // The main parts alone cover each row tile's axis at that length (the share rounded up, or the
    // smallest part, reaches past total / parts). Shortening them to floor(total / parts) leaves up to
    // parts - 1 tiles a row tile, which only E extra CTAs take: journal m31, one row tile, 128 parts
    // and 4 extra CTAs, 11-tile parts and 30-tile remainders, the launch 1.8x longer. Keep that cut
    // only while an extra CTA's share exceeds a shortened part by at most a start's charge (a main
    // part's own spill: its last request start may reach past its end; as before m31, the shortened
    // parts may be below the smallest part); otherwise the main parts cover the axis at their
    // covering length and the extra CTAs stay idle.
    const int64_t cover = part_length(total, parts, min_tiles);
    const int64_t wb = total / parts;
    const int64_t rb = static_cast<int64_t>(row_tiles) * (total - static_cast<int64_t>(parts) * wb);
    if (wb < 1 || (rb + extra - 1) / extra > wb + kOverheadTiles) {
      g.w = cover;
      g.rem_start = total;
      g.rem = 0;
      g.le = 1;
      return g;
    }
    w = wb;
  }
  if (w < 1) w = 1;
  g.w = w;
  g.rem_start = static_cast<int64_t>(parts) * w < total ? static_cast<int64_t>(parts) * w : total;
  g.rem = total - g.rem_start;
  const int64_t axis = static_cast<int64_t>(row_tiles) * g.rem;
  g.le = (axis + extra - 1) / extra;
  if (g.le < 1) g.le = 1;
  return g;
}

// The first extra CTA whose range touches row tile t's remainder.
__host__ __device__ __forceinline__ int first_extra_of(const PartGeometry& g, int t) {
  return static_cast<int>(static_cast<int64_t>(t) * g.rem / g.le);
}

// The (virtual) part that holds cost position x of row tile t: main parts 0..P-1, then the
// remainder's cuts P, P + 1, ... in order.
__host__ __device__ __forceinline__ int part_at(const PartGeometry& g, int parts, int t, int64_t x) {
  if (x < g.rem_start) return part_of(x, g.w);
  const int64_t y = static_cast<int64_t>(t) * g.rem + (x - g.rem_start);
  return parts + static_cast<int>(y / g.le) - first_extra_of(g, t);
}

// The aligned mode (s1b): when the batch has no more requests than parts, request b may instead own
// the s = parts / batch parts [b s, (b + 1) s) and be cut into k = min(s, ceil(tiles / smallest part))
// pieces of ceil(tiles / k) tiles, one a part: h29's per-request split, one segment a CTA, no request
// sharing a part. The device takes it when its longest piece (with a start's charge) is no longer
// than the cut's part plus the charge of cutting across requests (kCutPenaltyKeys: the extra
// segment's start and drain, the partials and their merge; ~10 µs on the H200 measured in s1):
// uniform batches of short requests (L = 1k) and batches that fill the parts with whole requests.
constexpr int kCutPenaltyKeys = 384;

__host__ __device__ __forceinline__ int aligned_pieces(int key_tiles, int s, int min_tiles) {
  const int k = (key_tiles + min_tiles - 1) / min_tiles;
  return k < s ? (k < 1 ? 1 : k) : s;
}

__host__ __device__ __forceinline__ bool use_aligned(int parts, int batch, int64_t total, int max_tiles, int min_tiles,
                                                     int bn) {
  const int s = parts / batch;
  if (s < 1 || max_tiles < 1) return false;
  const int k = aligned_pieces(max_tiles, s, min_tiles);
  int64_t longest = (max_tiles + k - 1) / k;  // a shorter request's piece is at most min_tiles
  if (longest < min_tiles && min_tiles <= max_tiles) longest = min_tiles;
  return longest + kOverheadTiles <= part_length(total, parts, min_tiles) + kCutPenaltyKeys / bn;
}

// Request b's piece in part `part` of the aligned mode (s parts a request).
__host__ __device__ __forceinline__ Piece aligned_piece(int key_tiles, int s, int j, int min_tiles, int& pieces) {
  const int k = aligned_pieces(key_tiles, s, min_tiles);
  const int tps = (key_tiles + k - 1) / k;
  pieces = (key_tiles + tps - 1) / tps;
  Piece pc;
  pc.t_begin = j * tps < key_tiles ? j * tps : key_tiles;
  pc.t_end = pc.t_begin + tps < key_tiles ? pc.t_begin + tps : key_tiles;
  pc.head = pc.t_begin > 0;
  pc.tail = pc.t_end < key_tiles;
  return pc;
}

// The workspace slot of a piece of part `part` (head pieces 2p, the others 2p + 1), and of piece s
// of a request whose first part is f (the combine's view of the same rule): 2 f + piece_slot_step(s),
// piece 0 being the tail of part f and piece s the head of part f + s.
__host__ __device__ __forceinline__ int piece_slot(int part, bool head) { return 2 * part + (head ? 0 : 1); }
__host__ __device__ __forceinline__ int piece_slot_step(int s) { return s == 0 ? 1 : 2 * s; }
__host__ __device__ __forceinline__ int request_piece_slot(int first_part, int s) {
  return 2 * first_part + piece_slot_step(s);
}

// The split workspace of a plan with `parts` (virtual) parts: the main parts and the remainder's
// (remainder_parts), for row tiles of rows_per_tile rows:
//   partial rows  [2 * parts slots][row_tiles * rows_per_tile][kVDim] fp32
//   lse           [2 * parts slots][row_tiles * rows_per_tile]        fp32 (log2-sum-exp)
//   request info  [batch][row_tiles] int2: (first part, pieces) of each request with drafts in
//                 each row tile where it has rows
struct WorkspaceView {
  float* o;       // partial rows
  float* lse;     // their log2-sum-exp
  int2* request;  // per (request, row tile): (first part, pieces), at b * row_tiles + t
  int64_t rows_per_slot;
};

// slot_parts: the main parts and the remainder's (slot_parts below).
__host__ __device__ __forceinline__ WorkspaceView workspace_view(void* ws, int slot_parts, int row_tiles,
                                                                 int rows_per_tile) {
  WorkspaceView v;
  v.rows_per_slot = static_cast<int64_t>(row_tiles) * rows_per_tile;
  v.o = reinterpret_cast<float*>(ws);
  v.lse = v.o + 2 * static_cast<int64_t>(slot_parts) * v.rows_per_slot * kVDim;
  v.request = reinterpret_cast<int2*>(v.lse + 2 * static_cast<int64_t>(slot_parts) * v.rows_per_slot);
  return v;
}

// The (virtual) parts the workspace holds slots for: the main ones and a row tile's remainder's.
__host__ __device__ __forceinline__ int slot_parts(int parts, int row_tiles, int extra) {
  return parts + remainder_parts(row_tiles, extra);
}

// Row tiles of a launch: every request's rows (max_qo_len x heads) in tiles of rows_per_tile.
__host__ __device__ __forceinline__ int row_tiles_of(int num_heads, int max_qo_len, int rows_per_tile) {
  const int64_t rows = static_cast<int64_t>(num_heads) * max_qo_len;
  return static_cast<int>((rows + rows_per_tile - 1) / rows_per_tile);
}

// A launch writes pieces (and needs the workspace and the combine) when its rows are cut into parts
// or it has extra CTAs.
__host__ __device__ __forceinline__ bool split_launch(int parts, int extra) { return parts > 1 || extra > 0; }

// The split region of the workspace (WorkspaceView above): 2 slots a (virtual) part of row_tiles x
// rows_per_tile partial rows (kVDim fp32 and one fp32 log2-sum-exp each), then one int2 a (request,
// row tile). None when nothing is cut: every request is then written directly.
__host__ __device__ __forceinline__ int64_t split_workspace_bytes(int batch, int parts, int row_tiles, int rows_per_tile,
                                                                  int extra) {
  if (!split_launch(parts, extra)) return 0;
  const int64_t slots = 2 * static_cast<int64_t>(slot_parts(parts, row_tiles, extra));
  return slots * row_tiles * rows_per_tile * (kVDim + 1) * 4 + static_cast<int64_t>(batch) * row_tiles * 8;
}

// The schedule cache (journal m35), the last bytes of a batch launch's workspace (batch > 1; a launch
// of one request has no batch schedule to keep). part_begin's result for each CTA depends on the
// launch's parameters and the batch's index arrays only, so a launch whose parameters and qo_indptr /
// kv_indptr equal those of the launch that computed it may take it as it is: the header holds the
// parameters, the snapshot the arrays, one record a CTA the part state (common/request.cuh,
// cached_part_begin). It ends at the workspace's end (rounded down to 16 bytes), so the kernel finds
// it from the batch, the grid and workspace_bytes alone:
//   records   [grid CTAs][kScheduleRecordBytes]: int64 generation, int64 part_begin's result, the state
//   snapshot  int64 [2][batch + 1]: qo_indptr, then kv_indptr, as the computing launch read them
//   header    ScheduleCacheHeader (64 bytes)
// The workspace must be zeroed when allocated (a zero header matches no launch).
constexpr int kScheduleRecordBytes = 192;
constexpr int32_t kScheduleCacheMagic = 0x6b647363;  // "kdsc"

struct ScheduleCacheHeader {
  int32_t magic;
  int32_t kernel;       // the configuration and its row tile and key tile (schedule_kernel_id)
  int32_t batch;
  int32_t num_heads;
  int32_t max_qo_len;
  int32_t num_splits;
  int32_t min_keys_per_split;
  int32_t grid;         // CTAs of the launch: its records
  int32_t index_types;  // qo_indptr_is_int64 | kv_indptr_is_int64 << 1
  uint32_t arrived;     // CTAs of the computing launch that have written their record
  int64_t generation;   // the records' generation
  int64_t reserved[2];
};
static_assert(sizeof(ScheduleCacheHeader) == 64, "the schedule cache header is 64 bytes");
// The header's launch fields, magic .. index_types: what a later launch must match.
constexpr int kScheduleLaunchWords = 9;
static_assert(offsetof(ScheduleCacheHeader, arrived) == 4 * kScheduleLaunchWords,
              "the launch fields are the header's first kScheduleLaunchWords int32 words");

struct ScheduleCacheView {
  int64_t* records;  // kScheduleRecordBytes / 8 words a CTA
  int64_t* snapshot;
  ScheduleCacheHeader* header;
};

__host__ __device__ __forceinline__ int64_t schedule_cache_bytes(int batch, int64_t grid_ctas) {
  if (batch <= 1) return 0;
  return grid_ctas * kScheduleRecordBytes + 16 * (static_cast<int64_t>(batch) + 1) + sizeof(ScheduleCacheHeader);
}

// The split region's size rounded up to 16 bytes: where a planned workspace's schedule cache starts.
__host__ __device__ __forceinline__ int64_t schedule_cache_offset(int64_t split_bytes) { return (split_bytes + 15) / 16 * 16; }

// The cache of a launch of `grid_ctas` CTAs in a workspace of ws_bytes (at least the plan's).
__host__ __device__ __forceinline__ ScheduleCacheView schedule_cache_view(void* ws, int64_t ws_bytes, int batch,
                                                                          int64_t grid_ctas) {
  ScheduleCacheView v;
  const uintptr_t end = reinterpret_cast<uintptr_t>(ws) + static_cast<uintptr_t>(ws_bytes);
  char* base = reinterpret_cast<char*>((end - static_cast<uintptr_t>(schedule_cache_bytes(batch, grid_ctas))) &
                                       ~static_cast<uintptr_t>(15));
  v.records = reinterpret_cast<int64_t*>(base);
  v.snapshot = reinterpret_cast<int64_t*>(base + grid_ctas * kScheduleRecordBytes);
  v.header = reinterpret_cast<ScheduleCacheHeader*>(base + grid_ctas * kScheduleRecordBytes +
                                                    16 * (static_cast<int64_t>(batch) + 1));
  return v;
}

// A batch launch's whole workspace: the split region, then the schedule cache.
__host__ __device__ __forceinline__ int64_t launch_workspace_bytes(int batch, int parts, int row_tiles,
                                                                   int rows_per_tile, int extra) {
  const int64_t split = split_workspace_bytes(batch, parts, row_tiles, rows_per_tile, extra);
  const int64_t cache = schedule_cache_bytes(batch, static_cast<int64_t>(row_tiles) * parts + extra);
  return cache > 0 ? schedule_cache_offset(split) + cache : split;
}

}  // namespace kdtree
