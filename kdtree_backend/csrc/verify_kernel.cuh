// MLA tree-verify attention, one kernel family: paged latent KV (576-dim K rows, V = their first
// 512 columns), all H x n query rows of a request sharing one K stream, ancestor-only draft mask,
// split-KV with a device-side split count, fp32 online softmax, mma.sync bf16 tensor cores.
//
// CTA = one row tile (kM query rows of one request) x one KV split. Warps form a kRG x kCS grid:
//   * row group g (16 query rows each) and partition h (of kCS);
//   * QK^T: warp (g, h) multiplies its 16 Q rows (held in registers) by the K tile over depth slice
//     h (576/kCS columns); the kCS partial scores of a row group are summed through shared memory;
//   * softmax: every warp of the group holds the full score rows (identical bits) and its own
//     running max / sum;
//   * PV: warp (g, h) accumulates output columns slice h (512/kCS) in registers.
// So each K tile is loaded into shared memory once and feeds both matmuls (V = K[:, :512]), and
// the output accumulator (kM x 512 fp32) is spread over all warps (128 registers a thread for the
// portable configuration).
#pragma once
#include <cuda_bf16.h>
#include <math_constants.h>
#include <stdint.h>

#include "kdtree_api.h"
#include "mma_utils.cuh"

namespace kdtree {

// The kernel's dynamic shared memory. A namespace-scope symbol so device functions can address
// the exchange area as symbol + constant (no pointer held in registers).
extern __shared__ __align__(128) uint8_t g_smem[];

template <int RG, int CS, int BN, int ST>
struct VerifyConfig {
  static constexpr int kRG = RG;      // row groups of 16 query rows
  static constexpr int kCS = CS;      // depth (QK) / column (PV) partitions
  static constexpr int kBN = BN;      // keys per tile
  static constexpr int kStages = ST;  // cp.async pipeline depth
  static constexpr int kWarps = RG * CS;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kM = RG * 16;  // query rows per CTA
  // The portable plan always gives a split length (64 keys); the device-chosen length (h29) is the
  // Hopper kernel's, and its code stays out of this kernel (sm_120 has no register to spare).
  static constexpr bool kAutoSplitLength = false;
  static constexpr int kQkSlice = kQkDim / CS;    // depth per warp
  static constexpr int kKSteps = kQkSlice / 16;   // mma k-steps per warp for QK^T
  static constexpr int kVSlice = kVDim / CS;      // output columns per warp
  static constexpr int kVTiles = kVSlice / 8;     // n8 accumulator tiles per warp
  static constexpr int kNTiles = BN / 8;          // n8 score tiles per key tile
  static constexpr int kTileBytes = BN * kSmemRowBytes;
  static constexpr int kQBytes = kM * kSmemRowBytes;
  static constexpr int kKvBytes = ST * kTileBytes;
  static constexpr int kStageBytes = kKvBytes > kQBytes ? kKvBytes : kQBytes;  // Q is staged here first
  static constexpr int kExchangeBytes = CS > 1 ? CS * kM * BN * 4 : 0;
  // Slot ids of the next two tiles, staged by cp.async with the K rows (int64 each).
  static constexpr int kSlotRingOff = kStageBytes + kExchangeBytes;
  static constexpr int kSlotRingBytes = 2 * BN * 8;
  static constexpr int kKv0Off = kSlotRingOff + kSlotRingBytes;  // int64: the request's first kv_indices entry
  static constexpr int kSmemBytes = kKv0Off + 16;

  static_assert(kQkSlice % 16 == 0, "each warp's QK depth slice must be whole mma k-steps");
  static_assert(kVSlice % 16 == 0, "each warp's output slice must be whole ldmatrix.x4 pairs");
  static_assert(BN % 16 == 0, "key tiles are whole mma k-steps for PV");
  static_assert(kThreads % BN == 0 && kThreads % kM == 0, "load mapping: whole threads per row");
  static_assert(ST == 2, "the slot-id ring assumes double buffering: ids staged with tile t land by tile t+1's issue");
  static_assert(RG + 1 <= 16, "named barrier ids 1..RG");
};

// The portable configuration: what sm_120 (RTX PRO 6000 Blackwell) runs and what the H200 tests
// select. 64 query rows x 32-key tiles, double-buffered: 2 x 37,376 B of K tiles + 16,384 B of
// score exchange + 512 B of staged slot ids + 16 B for kv0 = 91,664 B of shared memory. ptxas:
// 0 spills on sm_120; on sm_90 8 B (see docs/perf-notes.md: 25-35% faster than 16-key tiles on
// the H200, which spill nothing).
using PortableConfig = VerifyConfig<4, 2, 32, 2>;
// Experimental (bench only, built with -DKDTREE_EXPERIMENTAL_CONFIGS, KDTREE_KERNEL_CONFIG=1):
// 32 query rows x 32-key tiles, 8 warps = 2 row groups x 4 slices (O 64 + Q 36 registers a
// thread instead of 128 + 72: ~210 registers, room for the compiler to overlap loads).
using Rows32Config = VerifyConfig<2, 4, 32, 2>;
constexpr int kSm120MaxSmemPerBlock = 101376;
static_assert(PortableConfig::kSmemBytes <= kSm120MaxSmemPerBlock,
              "the portable configuration must fit sm_120's 99 KB of shared memory per block");

// How one request's keys (prefix tiles, then draft tiles) are cut into KV splits. Computed on the
// device from the request's lengths, so a graph captured with dummy lengths replays correctly.
struct SplitWork {
  int prefix_tiles;
  int key_tiles;
  int tiles_per_split;
  int active;  // splits that own at least one tile
};

// h29: the split length the Hopper plan leaves to the device (min_keys_per_split = 0):
// round(sqrt(key tiles) / 3) tiles, at least 1 (17 -> 1, 129 -> 4, 513 -> 8), the best length of the
// split-count sweep at every prefix (perf-notes "The split count on small batches"): a split's tile
// time against the fp32 partials it writes and the combine re-reads. It sits on every CTA's
// prologue chain (request -> split -> first K tile), so it is a float estimate plus an exact
// integer correction: the result is the largest m >= 1 with 3m - 1.5 <= sqrt(key_tiles), i.e.
// (6m - 3)^2 <= 4 key_tiles, whatever the sqrt's rounding, so the verify kernel and the combine
// agree. (An integer binary search here cost the split shapes ~1-2%: perf-notes h29.)
__host__ __device__ __forceinline__ int auto_split_tiles(int key_tiles) {
  const int64_t k4 = 4 * static_cast<int64_t>(key_tiles);
  int m = static_cast<int>(sqrtf(static_cast<float>(key_tiles)) * (1.f / 3.f) + 0.5f);
  m = m < 1 ? 1 : m;
  const int64_t up = 6 * static_cast<int64_t>(m) + 3, down = 6 * static_cast<int64_t>(m) - 3;
  if (up * up <= k4) return m + 1;              // the estimate rounded down
  if (m > 1 && down * down > k4) return m - 1;  // the estimate rounded up
  return m;
}

// kAuto: the configuration may be handed min_tiles = 0 (the Hopper plan) and then cuts by
// auto_split_tiles; otherwise a split is at least one tile, and the rule's code is not compiled in.
template <bool kAuto>
__host__ __device__ __forceinline__ SplitWork split_work(int prefix_len, int qo_len, int num_splits,
                                                         int min_tiles, int bn) {
  SplitWork w;
  w.prefix_tiles = (prefix_len + bn - 1) / bn;
  w.key_tiles = w.prefix_tiles + (qo_len + bn - 1) / bn;
  if (w.key_tiles <= 0) {
    w.tiles_per_split = 1;
    w.active = 0;
    return w;
  }
  if (min_tiles <= 0) min_tiles = kAuto ? auto_split_tiles(w.key_tiles) : 1;  // 0: the device's choice (h29)
  int s = (w.key_tiles + min_tiles - 1) / min_tiles;
  s = s < num_splits ? s : num_splits;
  s = s < 1 ? 1 : s;
  w.tiles_per_split = (w.key_tiles + s - 1) / s;
  w.active = (w.key_tiles + w.tiles_per_split - 1) / w.tiles_per_split;
  return w;
}

struct RequestView {
  int64_t q0;   // first query token of the request
  int n;        // draft tokens (query tokens) of the request
  int64_t kv0;  // first kv_indices entry of the request
  int prefix;   // committed prefix length
};

__device__ __forceinline__ RequestView load_request(const KdtreeVerifyParams& p, int b) {
  RequestView r;
  const bool qo64 = p.qo_indptr_is_int64 != 0;
  const bool kv64 = p.kv_indptr_is_int64 != 0;
  r.q0 = load_index(p.qo_indptr, b, qo64);
  int64_t n = load_index(p.qo_indptr, b + 1, qo64) - r.q0;
  // The grid covers max_qo_len rows per request; never index past what the grid was sized for.
  n = n < 0 ? 0 : (n > p.max_qo_len ? p.max_qo_len : n);
  r.n = static_cast<int>(n);
  r.kv0 = load_index(p.kv_indptr, b, kv64);
  const int64_t prefix = load_index(p.kv_indptr, b + 1, kv64) - r.kv0;
  r.prefix = prefix < 0 ? 0 : static_cast<int>(prefix);
  return r;
}

// The plan's smallest split in tiles; 0 (min_keys_per_split = 0, the Hopper plan) lets split_work
// choose from the request's length (h29).
__host__ __device__ __forceinline__ int min_tiles_per_split(int min_keys, int bn) {
  if (min_keys == 0) return 0;
  const int t = min_keys / bn;
  return t < 1 ? 1 : t;
}

// How a request's keys are cut for configuration Cfg: the one place the verify kernels and the
// split combine compute it, so they always agree on a request's splits.
template <class Cfg>
__device__ __forceinline__ SplitWork request_split_work(const KdtreeVerifyParams& p, const RequestView& req) {
  return split_work<Cfg::kAutoSplitLength>(req.prefix, req.n, p.num_splits,
                                           min_tiles_per_split(p.min_keys_per_split, Cfg::kBN), Cfg::kBN);
}

// What one CTA (a row tile x one KV split of one request) works on. Both kernels start here: the
// grid is sized for the longest request and the most splits, and each CTA reads its real work
// on the device (CUDA-graph replays change the lengths). False: nothing to do, exit.
struct CtaWork {
  RequestView req;
  int rows;     // the request's query rows (n x H)
  SplitWork w;
  int t_begin;  // this split's key tiles: [t_begin, t_end)
  int t_end;
};

template <class Cfg>
__device__ __forceinline__ bool cta_work(const KdtreeVerifyParams& p, int b, int row_tile, int split, CtaWork& cw) {
  cw.req = load_request(p, b);
  cw.rows = cw.req.n * p.num_heads;
  if (row_tile * Cfg::kM >= cw.rows) return false;
  // The draft mask is addressed with 32-bit offsets within a request (draft_mask_row): a block of
  // 2 GiB or more (a prefix over 33M tokens at n = 64) stops the kernel instead of reading wrong.
  if (p.custom_mask != nullptr && static_cast<int64_t>(cw.req.n) * (cw.req.prefix + cw.req.n) > 0x7fffffffLL) __trap();
  cw.w = request_split_work<Cfg>(p, cw.req);
  cw.t_begin = split * cw.w.tiles_per_split;
  if (cw.t_begin >= cw.w.key_tiles) return false;
  cw.t_end = min(cw.w.key_tiles, cw.t_begin + cw.w.tiles_per_split);
  return true;
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

// The request's FULL_MASK block (row stride prefix + n; its prefix columns are never read), or
// null when the draft block is causal.
__device__ __forceinline__ const uint8_t* request_mask(const KdtreeVerifyParams& p, int b) {
  if (p.custom_mask == nullptr) return nullptr;
  return reinterpret_cast<const uint8_t*>(p.custom_mask) + __ldg(reinterpret_cast<const int64_t*>(p.mask_indptr) + b);
}

// The mask row of draft token `query` from its draft columns on (null when causal). The offset
// is 32-bit: the request's mask block (n x (prefix + n) bytes) stays below 2 GiB (cta_work stops
// the kernel otherwise: a prefix over 33M tokens at n = 64); 64-bit math here costs the portable
// kernel 20 B of spills on sm_120.
__device__ __forceinline__ const uint8_t* draft_mask_row(const uint8_t* mask, int prefix, int n, int query) {
  return mask == nullptr ? nullptr : mask + (query * (prefix + n) + prefix);
}

// May draft token `query` see draft key `key` (0-based within the draft block)? Rows past the
// request (row_valid false) see key 0 only: finite and never stored.
__device__ __forceinline__ bool draft_key_visible(const uint8_t* mask_row, int n, bool row_valid, int query, int key) {
  if (!row_valid) return key == 0;
  if (key >= n) return false;
  if (mask_row != nullptr) return mask_row[key] != 0;
  return key <= query;
}

// Query row r of the tile's draft block: which draft token it is and where its mask row starts.
struct DraftRow {
  bool valid;  // r is one of the request's rows (padding rows see key 0 only)
  int query;
  const uint8_t* mask_row;
};
__device__ __forceinline__ DraftRow draft_row(const uint8_t* mask, int heads, int prefix, int n, int r) {
  DraftRow d;
  d.valid = r < n * heads;
  d.query = d.valid ? r / heads : 0;
  d.mask_row = draft_mask_row(mask, prefix, n, d.query);
  return d;
}

// Per-warp state carried across key tiles.
template <class Cfg>
struct WarpState {
  uint32_t q[Cfg::kKSteps][4];      // this warp's 16 Q rows x depth slice, as mma A fragments
  float o[Cfg::kVTiles][4];         // output accumulator, 16 rows x column slice
  float m[2];                       // running max (log2 domain) for rows lane/4 and lane/4+8
  float l[2];                       // this thread's share of the running sum
};

template <class Cfg, int kH>
__device__ __forceinline__ void load_q_fragments(WarpState<Cfg>& st, uint32_t stage_base, int g, int lane) {
  constexpr int kChunk0 = kH * (Cfg::kQkSlice / 8);
  const int row = g * 16 + (lane & 15);
#pragma unroll
  for (int ks = 0; ks < Cfg::kKSteps; ++ks) {
    const int chunk = kChunk0 + 2 * ks + (lane >> 4);
    ldmatrix_x4(stage_base + row_offset(row, chunk), st.q[ks][0], st.q[ks][1], st.q[ks][2], st.q[ks][3]);
  }
}

// Per-lane parts of the ldmatrix addresses; the rest (chunk, key block) is a compile-time constant.
struct LaneOffsets {
  uint32_t qk;  // K rows for QK^T (ldmatrix, B operand)
  uint32_t pv;  // V rows for PV (ldmatrix.trans, B operand)
};

__device__ __forceinline__ LaneOffsets make_lane_offsets(int lane) {
  LaneOffsets o;
  o.qk = row_offset((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
  o.pv = row_offset((lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
  return o;
}

// S(16 x BN) partial = Q(16 x slice kH) * K_tile(BN x slice kH)^T. Even and odd k-steps go to
// separate accumulators: two independent mma chains per n8 tile instead of one, so the tensor
// pipe is not idle waiting on a single accumulator's latency.
template <class Cfg, int kH, int kKs = 0>
__device__ __forceinline__ void qk_steps(float (&s0)[Cfg::kNTiles][4], float (&s1)[Cfg::kNTiles][4],
                                         const WarpState<Cfg>& st, uint32_t tile_base, const LaneOffsets& lo) {
  if constexpr (kKs < Cfg::kKSteps) {
    constexpr int kChunk = kH * (Cfg::kQkSlice / 8) + 2 * kKs;
    // With 4+ n8 tiles there are already enough independent chains: one accumulator set.
    float(&s)[Cfg::kNTiles][4] = (Cfg::kNTiles >= 4 || kKs % 2 == 0) ? s0 : s1;
#pragma unroll
    for (int np = 0; np < Cfg::kNTiles / 2; ++np) {
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4(tile_base + lo.qk + kChunk * 16 + np * 16 * kSmemRowBytes, b0, b1, b2, b3);
      mma_bf16_16816(s[2 * np], st.q[kKs], b0, b1);
      mma_bf16_16816(s[2 * np + 1], st.q[kKs], b2, b3);
    }
    qk_steps<Cfg, kH, kKs + 1>(s0, s1, st, tile_base, lo);
  }
}

template <class Cfg, int kH>
__device__ __forceinline__ void qk_partial(float (&s)[Cfg::kNTiles][4], const WarpState<Cfg>& st,
                                           uint32_t tile_base, const LaneOffsets& lo) {
  float s1[Cfg::kNTiles][4];
#pragma unroll
  for (int f = 0; f < Cfg::kNTiles; ++f) {
    s[f][0] = s[f][1] = s[f][2] = s[f][3] = 0.f;
    s1[f][0] = s1[f][1] = s1[f][2] = s1[f][3] = 0.f;
  }
  qk_steps<Cfg, kH>(s, s1, st, tile_base, lo);
  if constexpr (Cfg::kNTiles < 4) {
#pragma unroll
    for (int f = 0; f < Cfg::kNTiles; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[f][e] += s1[f][e];
  }
}

// O(16 x slice kH) += P(16 x BN) * V_tile(BN x slice kH), V = the K tile's first 512 columns.
template <class Cfg, int kH, int kJ = 0>
__device__ __forceinline__ void pv_steps(WarpState<Cfg>& st, const uint32_t (&pa)[Cfg::kBN / 16][4],
                                         uint32_t tile_base, const LaneOffsets& lo) {
  if constexpr (kJ < Cfg::kVTiles / 2) {
    constexpr int kChunk = kH * (Cfg::kVSlice / 8) + 2 * kJ;
#pragma unroll
    for (int kk = 0; kk < Cfg::kBN / 16; ++kk) {
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4_trans(tile_base + lo.pv + kChunk * 16 + kk * 16 * kSmemRowBytes, b0, b1, b2, b3);
      mma_bf16_16816(st.o[2 * kJ], pa[kk], b0, b1);
      mma_bf16_16816(st.o[2 * kJ + 1], pa[kk], b2, b3);
    }
    pv_steps<Cfg, kH, kJ + 1>(st, pa, tile_base, lo);
  }
}

// What a tile needs beyond the kernel parameters (which stay in the constant bank, not registers).
struct TileContext {
  bool is_prefix;
  int key_base;  // first key of the tile: prefix position, or draft index for draft tiles
  int prefix;    // P
  int n;         // draft tokens
  int row0;      // this thread's first query row (r = token * H + head) in the request
};

// Everything a warp does with one key tile once it sits in shared memory.
template <class Cfg, int kH>
__device__ __forceinline__ void process_tile(WarpState<Cfg>& st, uint32_t tile_base, int g,
                                             int lane, const LaneOffsets& lo, const TileContext& tc,
                                             const KdtreeVerifyParams& p) {
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int NT = Cfg::kNTiles;
  float s[NT][4];
  qk_partial<Cfg, kH>(s, st, tile_base, lo);

  if constexpr (Cfg::kCS > 1) {
    // Sum the depth slices of this row group. Every warp of the group adds the partials in the
    // same order, so all of them hold bit-identical scores and take identical softmax decisions.
    float* exchange = reinterpret_cast<float*>(g_smem + Cfg::kStageBytes);
    float* mine = exchange + ((kH * Cfg::kRG + g) * NT * 4) * 32;
#pragma unroll
    for (int f = 0; f < NT; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) mine[(f * 4 + e) * 32 + lane] = s[f][e];
    named_barrier(1 + g, 32 * Cfg::kCS);
    float tot[NT][4];
#pragma unroll
    for (int f = 0; f < NT; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) tot[f][e] = 0.f;
#pragma unroll
    for (int hh = 0; hh < Cfg::kCS; ++hh) {
      const float* part = exchange + ((hh * Cfg::kRG + g) * NT * 4) * 32;
#pragma unroll
      for (int f = 0; f < NT; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) tot[f][e] += (hh == kH) ? s[f][e] : part[(f * 4 + e) * 32 + lane];
    }
#pragma unroll
    for (int f = 0; f < NT; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[f][e] = tot[f][e];
  }

  // Scale into the log2 domain and mask: prefix keys past P; draft keys by the tree mask.
  const int col_lane = 2 * (lane & 3);
  if (tc.is_prefix) {
#pragma unroll
    for (int f = 0; f < NT; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = tc.key_base + f * 8 + col_lane + (e & 1);
        s[f][e] = key < tc.prefix ? s[f][e] * (p.sm_scale * p.k_scale * kLog2e) : -CUDART_INF_F;
      }
  } else {
    // Draft tiles are a few per request: fetch the mask block start here.
    const uint8_t* mask = request_mask(p, blockIdx.z);
    const int heads = p.num_heads;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const DraftRow d = draft_row(mask, heads, tc.prefix, tc.n, tc.row0 + rr * 8);
#pragma unroll
      for (int f = 0; f < NT; ++f)
#pragma unroll
        for (int e = 2 * rr; e < 2 * rr + 2; ++e) {
          const int key = tc.key_base + f * 8 + col_lane + (e & 1);
          s[f][e] = draft_key_visible(d.mask_row, tc.n, d.valid, d.query, key) ? s[f][e] * (p.sm_scale * kLog2e) : -CUDART_INF_F;
        }
    }
  }

  // Online softmax (fp32, exp2) with a lazily moved reference max: m only moves when a row's
  // max exceeds it by more than kRescaleThreshold (log2 units), so p <= 2^threshold (exact in the
  // math, fine in bf16/fp32) and the O rescale below runs on few tiles. A row with nothing
  // visible so far keeps m = -inf and l = 0.
  constexpr float kRescaleThreshold = 8.f;
  float m_new[2];
  bool move[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int f = 0; f < NT; ++f) mx = fmaxf(mx, fmaxf(s[f][2 * rr], s[f][2 * rr + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    move[rr] = mx > st.m[rr] + kRescaleThreshold;  // also true the first time a row sees a key
    m_new[rr] = move[rr] ? mx : st.m[rr];
  }
  // Warp-uniform: the two warps of a row-group pair hold identical scores, so they agree too.
  if (__any_sync(0xffffffffu, move[0] || move[1])) {
    float alpha[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      alpha[rr] = move[rr] ? exp2f(st.m[rr] - m_new[rr]) : 1.f;  // m = -inf -> 0 (l and O are 0)
      st.l[rr] *= alpha[rr];
      st.m[rr] = m_new[rr];
    }
#pragma unroll
    for (int f = 0; f < Cfg::kVTiles; ++f) {
      st.o[f][0] *= alpha[0];
      st.o[f][1] *= alpha[0];
      st.o[f][2] *= alpha[1];
      st.o[f][3] *= alpha[1];
    }
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const float base = st.m[rr] == -CUDART_INF_F ? 0.f : st.m[rr];
    float sum = 0.f;
#pragma unroll
    for (int f = 0; f < NT; ++f) {
      s[f][2 * rr] = exp2f(s[f][2 * rr] - base);
      s[f][2 * rr + 1] = exp2f(s[f][2 * rr + 1] - base);
      sum += s[f][2 * rr] + s[f][2 * rr + 1];
    }
    st.l[rr] += sum;
  }

  // P to bf16 A fragments: the C layout of two adjacent n8 tiles is the A layout of one k16 step.
  uint32_t pa[Cfg::kBN / 16][4];
  const float ps = tc.is_prefix ? p.v_scale : 1.f;
#pragma unroll
  for (int kk = 0; kk < Cfg::kBN / 16; ++kk) {
    pa[kk][0] = pack_bf16x2(s[2 * kk][0] * ps, s[2 * kk][1] * ps);
    pa[kk][1] = pack_bf16x2(s[2 * kk][2] * ps, s[2 * kk][3] * ps);
    pa[kk][2] = pack_bf16x2(s[2 * kk + 1][0] * ps, s[2 * kk + 1][1] * ps);
    pa[kk][3] = pack_bf16x2(s[2 * kk + 1][2] * ps, s[2 * kk + 1][3] * ps);
  }
  pv_steps<Cfg, kH>(st, pa, tile_base, lo);
}

template <class Cfg, int kH>
__device__ __forceinline__ void store_results(const WarpState<Cfg>& st, const KdtreeVerifyParams& p,
                                              const RequestView& req, int b, int split, int row_tile,
                                              int num_row_tiles, int g, int lane, bool direct) {
  const int H = p.num_heads;
  const int rows = req.n * H;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float l = st.l[rr];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row_local = g * 16 + (lane >> 2) + rr * 8;
    const int r = row_tile * Cfg::kM + row_local;
    if (r >= rows) continue;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int col0 = kH * Cfg::kVSlice + 2 * (lane & 3);
    if (direct) {
      __nv_bfloat16* dst = out_row(p, req, r) + col0;
#pragma unroll
      for (int f = 0; f < Cfg::kVTiles; ++f) {
        *reinterpret_cast<uint32_t*>(dst + f * 8) =
            pack_bf16x2(st.o[f][2 * rr] * inv, st.o[f][2 * rr + 1] * inv);
      }
    } else {
      const int64_t ws_row =
          (static_cast<int64_t>(b) * p.num_splits + split) * (num_row_tiles * Cfg::kM) + r;
      float* ws_o = reinterpret_cast<float*>(p.workspace) + ws_row * kVDim + col0;
#pragma unroll
      for (int f = 0; f < Cfg::kVTiles; ++f) {
        *reinterpret_cast<float2*>(ws_o + f * 8) = make_float2(st.o[f][2 * rr] * inv, st.o[f][2 * rr + 1] * inv);
      }
      if (kH == 0 && (lane & 3) == 0) {
        const int64_t lse_base = static_cast<int64_t>(p.batch) * p.num_splits * num_row_tiles * Cfg::kM * kVDim;
        reinterpret_cast<float*>(p.workspace)[lse_base + ws_row] = l > 0.f ? st.m[rr] + log2f(l) : -CUDART_INF_F;
      }
    }
  }
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) verify_attention_kernel(const KdtreeVerifyParams p) {
  const int row_tile = blockIdx.x;
  const int split = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = warp % Cfg::kRG;
  const int h = warp / Cfg::kRG;

  CtaWork cw;
  if (!cta_work<Cfg>(p, b, row_tile, split, cw)) return;
  const RequestView& req = cw.req;
  const SplitWork& w = cw.w;
  const int rows = cw.rows, t_begin = cw.t_begin, t_end = cw.t_end;

  const uint32_t stage_base = smem_addr(g_smem);
  const __nv_bfloat16* kd = reinterpret_cast<const __nv_bfloat16*>(p.k);
  const __nv_bfloat16* kv = reinterpret_cast<const __nv_bfloat16*>(p.kv_cache);
  const int64_t* kv_indices = reinterpret_cast<const int64_t*>(p.kv_indices);

  // ---- K-tile loading: each thread copies chunks of one key row. The row's slot id reaches shared
  // memory by cp.async one tile ahead (with the previous tile's rows), so issuing a tile never
  // waits on an index load: range-checking an id right after its __ldg stalled every warp once
  // per tile (perf-notes p6).
  constexpr int kTprK = Cfg::kThreads / Cfg::kBN;
  constexpr int kChunksPerThread = (kRowChunks + kTprK - 1) / kTprK;
  const int my_key = tid / kTprK;
  const int my_chunk0 = tid % kTprK;
  // The ring: int64 [2][kBN] at kSlotRingOff, entry (tile - t_begin) & 1.
  auto slot_addr = [&](int tile) {
    return stage_base + Cfg::kSlotRingOff + (((tile - t_begin) & 1) * Cfg::kBN + my_key) * 8;
  };
  auto stage_slot = [&](int tile) {
    if (my_chunk0 == 0 && tile < t_end && tile < w.prefix_tiles) {
      const int j = tile * Cfg::kBN + my_key;
      const bool in_prefix = j < req.prefix;  // beyond it: zeros, never used as a slot
      // kv0 from shared memory: a register holding it across the tile loop pushed the sm_120
      // build past 255 registers (spills).
      const int64_t kv0 = ld_shared_s64(stage_base + Cfg::kKv0Off);
      cp_async_8(slot_addr(tile), kv_indices + kv0 + (in_prefix ? j : 0), in_prefix);
    }
  };

  // ---- Q tile -> shared memory (zeros past the request) -> registers.
  {
    constexpr int kTpr = Cfg::kThreads / Cfg::kM;
    const int row = tid / kTpr;
    bool valid;
    const __nv_bfloat16* src = q_row_src(p, req, row_tile * Cfg::kM + row, rows, valid);
#pragma unroll
    for (int u = 0; u < kRowChunks / kTpr; ++u) {
      const int c = tid % kTpr + kTpr * u;
      cp_async_16(stage_base + row_offset(row, c), src + c * 8, valid);
    }
    if (tid == 0) *reinterpret_cast<int64_t*>(g_smem + Cfg::kKv0Off) = req.kv0;
    __syncthreads();
    stage_slot(t_begin);
    stage_slot(t_begin + 1);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
  }
  WarpState<Cfg> st;
  if (h == 0) {
    load_q_fragments<Cfg, 0>(st, stage_base, g, lane);
  } else if constexpr (Cfg::kCS > 1) {
    if (h == 1) load_q_fragments<Cfg, 1>(st, stage_base, g, lane);
    if constexpr (Cfg::kCS > 2) {
      if (h == 2) load_q_fragments<Cfg, 2>(st, stage_base, g, lane);
      if (h == 3) load_q_fragments<Cfg, 3>(st, stage_base, g, lane);
    }
  }
#pragma unroll
  for (int f = 0; f < Cfg::kVTiles; ++f) st.o[f][0] = st.o[f][1] = st.o[f][2] = st.o[f][3] = 0.f;
  st.m[0] = st.m[1] = -CUDART_INF_F;
  st.l[0] = st.l[1] = 0.f;
  __syncthreads();  // the staging area now becomes the K pipeline

  // Slot ids are range-checked when used: an id outside the cache reads as a zero row.
  auto issue_tile = [&](int tile) {
    const uint32_t dst_base = stage_base + ((tile - t_begin) % Cfg::kStages) * Cfg::kTileBytes;
    const __nv_bfloat16* src;
    bool valid;
    if (tile < w.prefix_tiles) {
      const int j = tile * Cfg::kBN + my_key;
      const int64_t slot = ld_shared_s64(slot_addr(tile));
      valid = j < req.prefix && slot >= 0 && slot < p.kv_num_slots;
      src = kv + (valid ? slot : 0) * p.kv_stride_slot;
    } else {
      const int c = (tile - w.prefix_tiles) * Cfg::kBN + my_key;
      valid = c < req.n;
      src = kd + (req.q0 + (valid ? c : 0)) * p.k_stride_tok;
    }
#pragma unroll
    for (int u = 0; u < kChunksPerThread; ++u) {
      const int c = my_chunk0 + kTprK * u;
      if (kRowChunks % kTprK == 0 || c < kRowChunks) {
        cp_async_16(dst_base + row_offset(my_key, c), src + c * 8, valid);
      }
    }
  };

  issue_tile(t_begin);  // its slot ids landed with Q
  cp_async_commit();

  const LaneOffsets lo = make_lane_offsets(lane);
  TileContext tc;
  tc.prefix = req.prefix;
  tc.n = req.n;
  tc.row0 = row_tile * Cfg::kM + g * 16 + (lane >> 2);

  for (int t = t_begin; t < t_end; ++t) {
    cp_async_wait<Cfg::kStages - 2>();
    __syncthreads();  // tile t landed for everyone; everyone is done with tile t-1's buffer
    // Tile t+1's slot ids landed with tile t (the wait above); tile t+2's go into the ring entry
    // tile t's used, which everyone has passed (the barrier above).
    if (t + 1 < t_end) issue_tile(t + 1);
    stage_slot(t + 2);
    cp_async_commit();

    tc.is_prefix = t < w.prefix_tiles;
    tc.key_base = tc.is_prefix ? t * Cfg::kBN : (t - w.prefix_tiles) * Cfg::kBN;
    const uint32_t tile_base = stage_base + ((t - t_begin) % Cfg::kStages) * Cfg::kTileBytes;
    if (h == 0) {
      process_tile<Cfg, 0>(st, tile_base, g, lane, lo, tc, p);
    } else if constexpr (Cfg::kCS > 1) {
      if (h == 1) process_tile<Cfg, 1>(st, tile_base, g, lane, lo, tc, p);
      if constexpr (Cfg::kCS > 2) {
        if (h == 2) process_tile<Cfg, 2>(st, tile_base, g, lane, lo, tc, p);
        if (h == 3) process_tile<Cfg, 3>(st, tile_base, g, lane, lo, tc, p);
      }
    }
  }
  cp_async_wait<0>();

  const bool direct = w.active == 1;
  const int num_row_tiles = gridDim.x;
  if (h == 0) {
    store_results<Cfg, 0>(st, p, req, b, split, row_tile, num_row_tiles, g, lane, direct);
  } else if constexpr (Cfg::kCS > 1) {
    if (h == 1) store_results<Cfg, 1>(st, p, req, b, split, row_tile, num_row_tiles, g, lane, direct);
    if constexpr (Cfg::kCS > 2) {
      if (h == 2) store_results<Cfg, 2>(st, p, req, b, split, row_tile, num_row_tiles, g, lane, direct);
      if (h == 3) store_results<Cfg, 3>(st, p, req, b, split, row_tile, num_row_tiles, g, lane, direct);
    }
  }
}

}  // namespace kdtree
