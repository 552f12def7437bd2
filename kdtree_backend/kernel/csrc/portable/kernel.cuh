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

#include "../common/draft_mask.cuh"
#include "../common/ptx.cuh"
#include "../common/request.cuh"
#include "../kdtree_api.h"
#include "mma.cuh"
#include "softmax.cuh"
#include "traits.cuh"

namespace kdtree {

// Per-warp state carried across key tiles.
template <class Cfg>
struct WarpState {
  uint32_t q[Cfg::kKSteps][4];      // this warp's 16 Q rows x depth slice, as mma A fragments
  float o[Cfg::kVTiles][4];         // output accumulator, 16 rows x column slice
  float m[2];                       // running max (log2 domain) for rows lane/4 and lane/4+8
  float l[2];                       // this thread's share of the running sum
};

// Warp (g, h)'s Q rows over depth slice h, from the staged Q tile.
template <class Cfg>
__device__ __forceinline__ void load_q_fragments(WarpState<Cfg>& st, uint32_t stage_base, int g, int h, int lane) {
  const uint32_t base = stage_base + row_offset(g * 16 + (lane & 15), h * (Cfg::kQkSlice / 8) + (lane >> 4));
#pragma unroll
  for (int ks = 0; ks < Cfg::kKSteps; ++ks) {
    ldmatrix_x4(base + ks * 32, st.q[ks][0], st.q[ks][1], st.q[ks][2], st.q[ks][3]);
  }
}

// Per-lane parts of the ldmatrix addresses, this warp's slice h included; the rest (chunk within
// the slice, key block) is a compile-time constant. The slice is a run-time offset rather than a
// template argument so that the tile loop exists once in the binary, not once per slice: two copies
// (one per warp of a scheduler) overflowed the instruction cache (journal m12: 7% of the stall
// samples were instruction fetches on B32 H8 n16 L1k).
struct LaneOffsets {
  uint32_t qk;  // K rows for QK^T (ldmatrix, B operand), depth slice h
  uint32_t pv;  // V rows for PV (ldmatrix.trans, B operand), column slice h
};

template <class Cfg>
__device__ __forceinline__ LaneOffsets make_lane_offsets(int lane, int h) {
  LaneOffsets o;
  o.qk = row_offset((lane & 7) + ((lane >> 4) << 3), h * (Cfg::kQkSlice / 8) + ((lane >> 3) & 1));
  o.pv = row_offset((lane & 7) + (((lane >> 3) & 1) << 3), h * (Cfg::kVSlice / 8) + (lane >> 4));
  return o;
}

// S(16 x BN) partial = Q(16 x slice h) * K_tile(BN x slice h)^T. Even and odd k-steps go to
// separate accumulators: two independent mma chains per n8 tile instead of one, so the tensor
// pipe is not idle waiting on a single accumulator's latency.
template <class Cfg, int kKs = 0>
__device__ __forceinline__ void qk_steps(float (&s0)[Cfg::kNTiles][4], float (&s1)[Cfg::kNTiles][4],
                                         const WarpState<Cfg>& st, uint32_t tile_base, const LaneOffsets& lo) {
  if constexpr (kKs < Cfg::kKSteps) {
    constexpr int kChunk = 2 * kKs;
    // With 4+ n8 tiles there are already enough independent chains: one accumulator set.
    float(&s)[Cfg::kNTiles][4] = (Cfg::kNTiles >= 4 || kKs % 2 == 0) ? s0 : s1;
#pragma unroll
    for (int np = 0; np < Cfg::kNTiles / 2; ++np) {
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4(tile_base + lo.qk + kChunk * 16 + np * 16 * kSmemRowBytes, b0, b1, b2, b3);
      mma_bf16_16816(s[2 * np], st.q[kKs], b0, b1);
      mma_bf16_16816(s[2 * np + 1], st.q[kKs], b2, b3);
    }
    qk_steps<Cfg, kKs + 1>(s0, s1, st, tile_base, lo);
  }
}

template <class Cfg>
__device__ __forceinline__ void qk_partial(float (&s)[Cfg::kNTiles][4], const WarpState<Cfg>& st,
                                           uint32_t tile_base, const LaneOffsets& lo) {
  float s1[Cfg::kNTiles][4];
#pragma unroll
  for (int f = 0; f < Cfg::kNTiles; ++f) {
    s[f][0] = s[f][1] = s[f][2] = s[f][3] = 0.f;
    s1[f][0] = s1[f][1] = s1[f][2] = s1[f][3] = 0.f;
  }
  qk_steps<Cfg>(s, s1, st, tile_base, lo);
  if constexpr (Cfg::kNTiles < 4) {
#pragma unroll
    for (int f = 0; f < Cfg::kNTiles; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[f][e] += s1[f][e];
  }
}

// O(16 x slice h) += P(16 x BN) * V_tile(BN x slice h), V = the K tile's first 512 columns.
template <class Cfg, int kJ = 0>
__device__ __forceinline__ void pv_steps(WarpState<Cfg>& st, const uint32_t (&pa)[Cfg::kBN / 16][4],
                                         uint32_t tile_base, const LaneOffsets& lo) {
  if constexpr (kJ < Cfg::kVTiles / 2) {
    constexpr int kChunk = 2 * kJ;
#pragma unroll
    for (int kk = 0; kk < Cfg::kBN / 16; ++kk) {
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4_trans(tile_base + lo.pv + kChunk * 16 + kk * 16 * kSmemRowBytes, b0, b1, b2, b3);
      mma_bf16_16816(st.o[2 * kJ], pa[kk], b0, b1);
      mma_bf16_16816(st.o[2 * kJ + 1], pa[kk], b2, b3);
    }
    pv_steps<Cfg, kJ + 1>(st, pa, tile_base, lo);
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
template <class Cfg>
__device__ __forceinline__ void process_tile(WarpState<Cfg>& st, uint32_t tile_base, int g, int h,
                                             int lane, const LaneOffsets& lo, const TileContext& tc,
                                             const KdtreeVerifyParams& p) {
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int NT = Cfg::kNTiles;
  float s[NT][4];
  qk_partial<Cfg>(s, st, tile_base, lo);

  if constexpr (Cfg::kCS > 1) {
    // Sum the depth slices of this row group. Every warp of the group adds the partials in the
    // same order, so all of them hold bit-identical scores and take identical softmax decisions.
    float* exchange = reinterpret_cast<float*>(g_smem + SmemLayout<Cfg>::kExchange);
    float* mine = exchange + ((h * Cfg::kRG + g) * NT * 4) * 32;
#pragma unroll
    for (int f = 0; f < NT; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) mine[(f * 4 + e) * 32 + lane] = s[f][e];
    named_barrier(1 + g, 32 * Cfg::kCS);
    if constexpr (Cfg::kCS == 2) {
      // Own + partner's: IEEE addition is commutative, so both warps get the same bits.
      const float* part = exchange + (((1 - h) * Cfg::kRG + g) * NT * 4) * 32;
#pragma unroll
      for (int f = 0; f < NT; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[f][e] += part[(f * 4 + e) * 32 + lane];
    } else {
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
          for (int e = 0; e < 4; ++e) tot[f][e] += (hh == h) ? s[f][e] : part[(f * 4 + e) * 32 + lane];
      }
#pragma unroll
      for (int f = 0; f < NT; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[f][e] = tot[f][e];
    }
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
    const uint8_t* mask = request_mask(p, ld_shared_s32(smem_addr(g_smem) + SmemLayout<Cfg>::kSegB));
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

  // Online softmax (fp32, exp2) with a lazily moved reference max (softmax.cuh).
  float m_new[2];
  bool move[2];
  moved_reference_max(s, st, move, m_new);
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
  exponentiate_scores(s, st);

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
  pv_steps<Cfg>(st, pa, tile_base, lo);
}

template <class Cfg>
__device__ __forceinline__ void store_results(const WarpState<Cfg>& st, const KdtreeVerifyParams& p,
                                              const RequestView& req, int slot, int row_tile, int g, int h,
                                              int lane, bool direct) {
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
    const int col0 = h * Cfg::kVSlice + 2 * (lane & 3);
    if (direct) {
      __nv_bfloat16* dst = out_row(p, req, r) + col0;
#pragma unroll
      for (int f = 0; f < Cfg::kVTiles; ++f) {
        *reinterpret_cast<uint32_t*>(dst + f * 8) =
            pack_bf16x2(st.o[f][2 * rr] * inv, st.o[f][2 * rr + 1] * inv);
      }
    } else {
      const WorkspaceView ws = launch_workspace<Cfg>(p);
      const int64_t ws_row = static_cast<int64_t>(slot) * ws.rows_per_slot + r;
      float* ws_o = ws.o + ws_row * kVDim + col0;
#pragma unroll
      for (int f = 0; f < Cfg::kVTiles; ++f) {
        *reinterpret_cast<float2*>(ws_o + f * 8) = make_float2(st.o[f][2 * rr] * inv, st.o[f][2 * rr + 1] * inv);
      }
      if (h == 0 && (lane & 3) == 0) {
        ws.lse[ws_row] = l > 0.f ? st.m[rr] + log2f(l) : -CUDART_INF_F;
      }
    }
  }
}

// One segment of the CTA's part (common/schedule.cuh): row tile `row_tile` of request cw.b over its
// key tiles [t_begin, t_end). It ends with its copies landed and its output stored; the caller syncs
// before the next segment reuses shared memory.
template <class Cfg>
__device__ __forceinline__ void run_segment(const KdtreeVerifyParams& p, const CtaWork& cw, const int row_tile,
                                            const int tid, const int lane, const int g, const int h) {
  const RequestView& req = cw.req;
  const KeyTiles& w = cw.w;
  const int rows = cw.rows, t_begin = cw.t_begin, t_end = cw.t_end;

  const uint32_t stage_base = smem_addr(g_smem);
  const __nv_bfloat16* kd = reinterpret_cast<const __nv_bfloat16*>(p.k);
  const __nv_bfloat16* kv = reinterpret_cast<const __nv_bfloat16*>(p.kv_cache);
  const int64_t* kv_indices = reinterpret_cast<const int64_t*>(p.kv_indices);

  // ---- K-tile loading: each thread copies chunks of one key row. The row's slot id reaches shared
  // memory by cp.async one tile ahead (with the previous tile's rows), so issuing a tile never
  // waits on an index load: range-checking an id right after its __ldg stalled every warp once
  // per tile (journal p6).
  constexpr int kTprK = Cfg::kThreads / Cfg::kBN;
  constexpr int kChunksPerThread = (kRowChunks + kTprK - 1) / kTprK;
  const int my_key = tid / kTprK;
  const int my_chunk0 = tid % kTprK;
  // The ring: SharedStorage::slot_ring, entry (tile - t_begin) & 1.
  auto slot_addr = [&](int tile) {
    return stage_base + SmemLayout<Cfg>::kSlotRing + (((tile - t_begin) & 1) * Cfg::kBN + my_key) * 8;
  };
  auto stage_slot = [&](int tile) {
    if (my_chunk0 == 0 && tile < t_end && tile < w.prefix_tiles) {
      const int j = tile * Cfg::kBN + my_key;
      const bool in_prefix = j < req.prefix;  // beyond it: zeros, never used as a slot
      // kv0 from shared memory: a register holding it across the tile loop pushed the sm_120
      // build past 255 registers (spills).
      const int64_t kv0 = ld_shared_s64(stage_base + SmemLayout<Cfg>::kKv0);
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
    if (tid == 0) {
      *reinterpret_cast<int64_t*>(g_smem + SmemLayout<Cfg>::kKv0) = req.kv0;
      *reinterpret_cast<int64_t*>(g_smem + SmemLayout<Cfg>::kSegQ0) = req.q0;
      *reinterpret_cast<int*>(g_smem + SmemLayout<Cfg>::kSegB) = cw.b;
      *reinterpret_cast<int*>(g_smem + SmemLayout<Cfg>::kSegSlot) = cw.slot;
      *reinterpret_cast<int*>(g_smem + SmemLayout<Cfg>::kSegDirect) = cw.direct ? 1 : 0;
      *reinterpret_cast<int*>(g_smem + SmemLayout<Cfg>::kSegRowTile) = row_tile;
    }
    __syncthreads();
    stage_slot(t_begin);
    stage_slot(t_begin + 1);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
  }
  WarpState<Cfg> st;
  load_q_fragments<Cfg>(st, stage_base, g, h, lane);
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
      src = kd + (ld_shared_s64(stage_base + SmemLayout<Cfg>::kSegQ0) + (valid ? c : 0)) * p.k_stride_tok;
    }
    // The row's shared address from %tid here: held over the tile loop it spilled 4 B on sm_120 in
    // the single-request instantiation (s1e).
    const uint32_t dst_row = dst_base + row_offset(thread_index_volatile() / kTprK, 0);
#pragma unroll
    for (int u = 0; u < kChunksPerThread; ++u) {
      const int c = my_chunk0 + kTprK * u;
      if (kRowChunks % kTprK == 0 || c < kRowChunks) {
        cp_async_16(dst_row + c * 16, src + c * 8, valid);
      }
    }
  };

  issue_tile(t_begin);  // its slot ids landed with Q
  cp_async_commit();

  const LaneOffsets lo = make_lane_offsets<Cfg>(lane, h);
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
    process_tile<Cfg>(st, tile_base, g, h, lane, lo, tc, p);
  }
  cp_async_wait<0>();

  const bool direct = ld_shared_s32(stage_base + SmemLayout<Cfg>::kSegDirect) != 0;
  const int slot = ld_shared_s32(stage_base + SmemLayout<Cfg>::kSegSlot);
  RequestView req_out = req;  // q0 back from shared memory: not held in registers over the tile loop
  req_out.q0 = ld_shared_s64(stage_base + SmemLayout<Cfg>::kSegQ0);
  // The row tile back from shared memory (s3: it comes from the segment now; held over the tile loop it
  // spilled 4 B on sm_100).
  const int row_tile_out = ld_shared_s32(stage_base + SmemLayout<Cfg>::kSegRowTile);
  store_results<Cfg>(st, p, req_out, slot, row_tile_out, g, h, lane, direct);
}

// Grid: (row tiles, parts) for kSingle (the launch holds one request, s1e: no scan, no walk); a batch:
// row tiles x parts main CTAs and the extra CTAs of the wave's idle SMs, 1-D (s3). Each CTA runs its
// part's segments one after another (s1), each segment naming its row tile.
template <class Cfg, bool kSingle>
__global__ void __launch_bounds__(Cfg::kThreads, 1) verify_attention_kernel(const KdtreeVerifyParams p) {
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = warp % Cfg::kRG;
  const int h = warp / Cfg::kRG;
  ScheduleScratch& sched = *reinterpret_cast<ScheduleScratch*>(g_smem + SmemLayout<Cfg>::kSched);
  walk_part<Cfg, kSingle, /*kCached=*/false>(
      p, sched, [] {}, [&](const CtaWork& cw) { run_segment<Cfg>(p, cw, cw.row_tile, tid, lane, g, h); });
}

}  // namespace kdtree
