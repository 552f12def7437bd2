// Hopper (sm_90a) verify kernel: the same semantics, split plan, workspace and combine step as the
// portable kernel (portable/kernel.cuh), with wgmma tensor cores and 64-key tiles. The body below
// orchestrates the pieces: Q load (q_load.cuh), K gather (gather.cuh), QK^T and PV (tile_mma.cuh),
// softmax (softmax.cuh), P hand-off (p_handoff.cuh), output (epilogue.cuh). docs/kernel/hopper.md.
//
// CTA = 64 query rows of one request x one KV split; 2 warpgroups (256 threads):
//   WG0 "math":   S = Q K^T over the full 576 depth (36 x wgmma m64n64k16, Q and K from shared
//                 memory), mask, online softmax (owns the running max / sum), P (bf16) kept in
//                 registers for its own PV and written to shared memory for WG1, then
//                 O[:, 0:256] += P V[:, 0:256] (4 x wgmma m64n256k16, P from registers).
//   WG1 "helper": gathers the K tiles (16-byte cp.async through kv_indices into the 128-byte
//                 swizzled layout wgmma reads), then O[:, 256:512] += P V[:, 256:512] with P from
//                 shared memory. Its PV of tile t runs while WG0 computes QK^T of tile t+1.
// Each K tile is gathered once and feeds QK^T (all 576 columns, K-major) and PV (first 512
// columns, read N-major through the descriptor's transpose bit): V = K[:, :512].
//
// Shared memory (SharedStorage, traits.cuh; 230,184 B of the H200's 232,448 per block):
//   Q 64 x 576 bf16 (72 KB) | 2 K stages of 64 x 576 (144 KB) | P 64 x 64 bf16 (8 KB) | row stats.
// Every 576-wide block is stored as 9 column atoms of 64 columns (8 KB each): row r of an atom at
// r * 128 B, its 16-byte chunk c at ((c ^ (r & 7)) * 16): the canonical 128-byte swizzle.
//
// Synchronisation (why it cannot deadlock or race: docs/kernel/hopper.md): K stage full = mbarrier
// completed by WG1's cp.async (noinc arrivals); K stage empty = mbarrier WG0's threads arrive on
// after their PV of the stage; P full / P free = named barriers (NamedBarrier) between the two
// warpgroups, in strict alternation.
#pragma once
#include <cuda.h>  // CUtensorMap (the type only: the map is encoded on the host, hopper/launch.cu)
#include <cuda_bf16.h>
#include <math_constants.h>
#include <stdint.h>

#include "../common/draft_mask.cuh"
#include "../common/profiler.cuh"
#include "../common/ptx.cuh"
#include "../common/request.cuh"
#include "../common/tile_stamps.cuh"
#include "../kdtree_api.h"
#include "async_copy.cuh"
#include "epilogue.cuh"
#include "gather.cuh"
#include "p_handoff.cuh"
#include "q_load.cuh"
#include "softmax.cuh"
#include "tile_mma.cuh"
#include "traits.cuh"
#include "wgmma.cuh"

namespace kdtree {
namespace hopper {

// One segment of the CTA's part (common/schedule.cuh): row tile `row_tile` of request cw.b over its
// key tiles [t_begin, t_end). Starts with idle barriers (initialised here; the caller ends the previous
// segment's with mbar_inval after a __syncthreads) and ends with every copy landed and every output
// row stored, so the next segment may reuse all of shared memory.
template <bool kFold>
__device__ __forceinline__ void run_segment(const KdtreeVerifyParams& p, const CUtensorMap& q_map, const int q_tma,
                                            const CtaWork& cw, const int row_tile, const int tid, const int lane,
                                            const int wg, const int warp_in_wg) {
  using Cfg = HopperConfig;
  KDTREE_PROFILER_INIT();  // the diagnostics build records each CTA's last segment
  KDTREE_MILESTONE(Milestone::kCtaStart);
  KDTREE_MILESTONE(Milestone::kRequestLoaded);
  const RequestView& req = cw.req;
  const KeyTiles& w = cw.w;
  const int rows = cw.rows, t_begin = cw.t_begin, t_end = cw.t_end;
  const int num_tiles = t_end - t_begin;
  KDTREE_TILE_SEGMENT(tid == 0, num_tiles);

  const uint32_t smem = smem_addr(g_hopper_smem);
  if ((smem & 1023) != 0) __trap();  // the swizzle pattern is tied to 1024-byte-aligned atoms
  const uint32_t sQ = smem + SmemLayout::kQ;
  const uint32_t sK = smem + SmemLayout::kK;
  const uint32_t sP = smem + SmemLayout::kP;
  float* s_alpha = reinterpret_cast<float*>(g_hopper_smem + SmemLayout::kAlpha);
  float* s_inv_l = reinterpret_cast<float*>(g_hopper_smem + SmemLayout::kInvL);
  float* s_lse = reinterpret_cast<float*>(g_hopper_smem + SmemLayout::kLse);
  const uint32_t bar_full = smem + SmemLayout::kKFull;        // + 8 * stage
  const uint32_t bar_empty = smem + SmemLayout::kKEmpty;  // + 8 * stage

  const uint32_t bar_q = smem + SmemLayout::kQFull;
  // A tile wholly inside the request: its 64 rows are 64 / H whole tokens from token row0 / H (H
  // divides 64), or heads row0 % H .. + 63 of one token (64 divides H), so one box of the map is
  // the tile's 64 rows of one 64-column atom, in the swizzled layout wgmma reads.
  const bool tma_q = q_tma != 0 && (row_tile + 1) * Cfg::kM <= rows && req.q0 + req.n <= 0x7fffffff;  // int32 coordinates
  if (tid == 0) {
    mbar_init(bar_full, 128);
    mbar_init(bar_full + 8, 128);
    mbar_init(bar_empty, 128);
    mbar_init(bar_empty + 8, 128);
    mbar_init(bar_q, 1);
    fence_mbarrier_init();  // the copy engine sees the initialised barrier
    if (tma_q) issue_q_tma(sQ, &q_map, bar_q, p, req, row_tile);
  }
  // The helper's K gather (WG1).
  const KGather gather(p, req, w, t_begin, t_end, sK, bar_full, tid);

  // Prologue: barriers initialised and visible, then Q (its own cp.async group) and, without
  // waiting for Q, K tile 0 (tracked by its mbarrier only). Tile 1 follows once Q has landed
  // (h21b): every CTA of a wave pulls Q and its first tiles at once, and a first burst of Q +
  // one tile lands ~1 µs sooner than Q + two (h25: both at once again measured 1.4% slower).
  int64_t slots[4];
  if (wg == 1) gather.fetch_slots(t_begin, slots);
  __syncthreads();  // mbarrier initialisation visible before any cp.async arrives on them
  if (!tma_q) load_q_cp_async(sQ, p, req, row_tile, rows, tid);
  const int row_in_tile0 = warp_in_wg * 16 + (lane >> 2);  // this thread's rows: + 0 and + 8
  uint32_t first_bits[2] = {0u, 0u};
  if (wg == 0 && t_begin <= w.prefix_tiles && w.prefix_tiles < t_end)  // owns the first draft tile
    first_draft_tile_bits(p, cw.b, req.prefix, req.n, row_tile * Cfg::kM + row_in_tile0, lane, first_bits);
  if (wg == 1) {
    gather.issue_tile(t_begin, slots);
    gather.fetch_slots(t_begin + 1, slots);  // h21b: tile 1 is issued once Q has landed (a smaller first burst)
    KDTREE_MILESTONE(Milestone::kPrologueTilesIssued);
  }
  if (tma_q) {
    mbar_wait(bar_q, 0);  // the copy engine's writes are visible to wgmma once the phase completes
  } else {
    cp_async_wait<0>();  // this thread's Q group (the tiles' copies belong to no group)
    fence_proxy_async();
  }
  __syncthreads();  // Q visible to everyone
  KDTREE_MILESTONE(Milestone::kQVisible);

  float o[128];
  const bool direct = cw.direct;
  // The direct output goes through shared memory and bulk copies when its rows are 16-byte aligned
  // (always, for a torch-allocated tensor; an 8-byte aligned `out` view takes the register path).
  const bool staged_store = direct && (reinterpret_cast<uintptr_t>(p.out) & 15) == 0 && (p.out_stride_tok & 7) == 0;
  const OutputTile out{p, req, cw.slot, row_tile, direct, staged_store};

  if (wg == 0) {
    // =========================== math warpgroup ===========================
    SoftmaxState st;
    st.m[0] = st.m[1] = -CUDART_INF_F;
    st.l[0] = st.l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    const int row0 = row_tile * Cfg::kM + row_in_tile0;
    constexpr float kLog2e = 1.4426950408889634f;
    const float prefix_scale = p.sm_scale * p.k_scale * kLog2e, draft_scale = p.sm_scale * kLog2e;
    const float log2_vs = kFold ? log2f(p.v_scale) : 0.f, inv_vs = kFold ? 1.f / p.v_scale : 1.f;
    for (int i = 0; i < num_tiles; ++i) {
      const int t = t_begin + i;
      const uint32_t stage = sK + (i & 1) * Cfg::kBlockBytes;
      mbar_wait(bar_full + 8 * (i & 1), (i >> 1) & 1);
      if (i == 0) KDTREE_MILESTONE(Milestone::kTileLoopBegin);
      fence_proxy_async();
      KDTREE_TILE_STAMP(tid == 0, i, HopperTileEvent::kWg0KFull);

      float s[32];
      qk_tile(s, sQ, stage);  // S = Q K^T
      KDTREE_TILE_STAMP(tid == 0, i, HopperTileEvent::kWg0Scores);

      const bool is_prefix = t < w.prefix_tiles;
      const int key_base = is_prefix ? t * Cfg::kBN : (t - w.prefix_tiles) * Cfg::kBN;
      const float tile_scale = is_prefix ? prefix_scale : draft_scale;
      scale_and_mask<kFold>(s, p, is_prefix, tile_scale, key_base, cw.b, req.prefix, req.n, row0, lane, first_bits);
      float alpha[2];
      bool any_move;
      softmax_rows<kFold>(s, st, alpha, any_move, tile_scale);
      if (any_move) rescale(o, alpha);  // before any of this tile's PV (the previous one has completed)

      // P (bf16): registers for this warpgroup's PV; shared memory for the helper's. The exp2s go
      // in kPvGroups key ranges, each range's PV k16 steps issued before the next range's exp2s
      // (h34); the last range's after P is shared, so the helper's PV starts as early as before.
      const float ps = kFold ? 1.f : (is_prefix ? p.v_scale : 1.f);
      uint32_t pa[4][4];
      const uint64_t desc_v = make_desc(stage, kVLeading, kVStride);
      constexpr int kSteps = 4 / kPvGroups;  // k16 steps a group
      float sum[2] = {0.f, 0.f};
      wgmma_fence_operand(o);
#pragma unroll
      for (int g = 0; g < kPvGroups; ++g) {
        softmax_exp_range<kFold>(s, st, sum, tile_scale, is_prefix ? log2_vs : 0.f, 2 * kSteps * g, 2 * kSteps * (g + 1));
#pragma unroll
        for (int kk = kSteps * g; kk < kSteps * (g + 1); ++kk) pack_p(pa, s, ps, kk);
        if (g + 1 < kPvGroups) pv_issue_wg0(o, pa, desc_v, kSteps * g, kSteps * (g + 1));
      }
      const float inv_ps = kFold && is_prefix ? inv_vs : 1.f;  // the row sum keeps sum(P') / ps (kFold)
      st.l[0] += sum[0] * inv_ps;
      st.l[1] += sum[1] * inv_ps;
      KDTREE_TILE_STAMP(tid == 0, i, HopperTileEvent::kWg0Softmax);

      if (i > 0) named_barrier(NamedBarrier::kPFree, 256);  // the helper is done with P and alpha of tile t-1
      KDTREE_TILE_STAMP(tid == 0, i, HopperTileEvent::kWg0PFree);
      share_p(g_hopper_smem + SmemLayout::kP, s_alpha, pa, alpha, row_in_tile0, lane);
      fence_proxy_async();
      named_arrive(NamedBarrier::kPFull, 256);
      KDTREE_TILE_STAMP(tid == 0, i, HopperTileEvent::kWg0PFull);
      pv_issue_wg0(o, pa, desc_v, 4 - kSteps, 4);
      wgmma_wait<0>();
      wgmma_fence_operand(o);
      KDTREE_TILE_STAMP(tid == 0, i, HopperTileEvent::kWg0PvDone);
      if (i + 2 < num_tiles) mbar_arrive(bar_empty + 8 * (i & 1));  // the helper may refill this stage
    }
    KDTREE_MILESTONE(Milestone::kTileLoopEnd);
    float inv_l[2];
    finish_rows(st, inv_l, s_inv_l, s_lse, row_in_tile0, lane);  // row statistics for WG1 and the combine
    named_barrier(NamedBarrier::kFinal, 256);  // also: both warpgroups are done with the K stages
    KDTREE_MILESTONE(Milestone::kFinalBarrier);
    // h39: the split combine (a programmatic dependent) may start once every CTA is here (at its
    // part's last segment): its blocks load the request's indices while the output stores drain,
    // then wait for this grid to finish.
    if (cw.last && tid == 0) pdl_launch_dependents();
    out.store_half(o, inv_l, row_in_tile0, 0, lane, tid, sK, g_hopper_smem + SmemLayout::kK);
    if (!direct && (lane & 3) == 0) out.store_lse(s_lse, rows, row_in_tile0);
    KDTREE_MILESTONE(Milestone::kOutputStored);
    KDTREE_PROFILER_COMMIT(0, num_tiles, NamedBarrier::kProfiler);
  } else {
    // =========================== helper warpgroup ===========================
    if (t_begin + 1 < t_end) gather.issue_tile(t_begin + 1, slots);  // tile 1, now that Q has landed (h21b)
    gather.fetch_slots(t_begin + 2, slots);
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    for (int i = 0; i < num_tiles; ++i) {
      const uint32_t stage = sK + (i & 1) * Cfg::kBlockBytes;
      mbar_wait(bar_full + 8 * (i & 1), (i >> 1) & 1);  // already complete: WG0 waited first
      named_barrier(NamedBarrier::kPFull, 256);
      fence_proxy_async();
      KDTREE_TILE_STAMP(tid == 128, i, HopperTileEvent::kWg1PFull);
      const float alpha[2] = {s_alpha[row_in_tile0], s_alpha[row_in_tile0 + 8]};
      // Only when a row of this warp moved its max, as WG0 does (h15): 128 FMULs a tile fewer on the
      // schedulers WG0's softmax issues on.
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) rescale(o, alpha);
      pv_tile_wg1(o, sP, stage);
      KDTREE_TILE_STAMP(tid == 128, i, HopperTileEvent::kWg1PvDone);
      if (i + 1 < num_tiles) named_arrive(NamedBarrier::kPFree, 256);  // WG0 may write P of tile t+1
      if (i + 2 < num_tiles) {
        // Refill this stage with tile t+2 once WG0's PV of tile t is done too. WG0 cannot arrive
        // on this stage's empty barrier again before tile t+2 has landed: phases never run ahead.
        mbar_wait(bar_empty + 8 * (i & 1), (i >> 1) & 1);
        KDTREE_TILE_STAMP(tid == 128, i, HopperTileEvent::kWg1Empty);
        gather.issue_tile(t_begin + i + 2, slots);
        gather.fetch_slots(t_begin + i + 3, slots);
        KDTREE_TILE_STAMP(tid == 128, i, HopperTileEvent::kWg1Refill);
      }
    }
    named_barrier(NamedBarrier::kFinal, 256);
    const float inv_l[2] = {s_inv_l[row_in_tile0], s_inv_l[row_in_tile0 + 8]};
    out.store_half(o, inv_l, row_in_tile0, 1, lane, tid, sK, g_hopper_smem + SmemLayout::kK);
    KDTREE_MILESTONE(Milestone::kHelperOutputStored);
    KDTREE_PROFILER_COMMIT(1, num_tiles, NamedBarrier::kProfiler);
  }
}


// kFold (h13): the score and P scales are folded into the softmax's exp2 (positive, finite scales
// only: the launcher picks the instantiation, so the hot loop has one softmax body either way).
// q_map / q_tma (h23): when the launcher could encode q as a {576, H, tokens} tensor map whose
// 64-column x 64-row box is one row tile (H divides 64, or 64 divides H), q_tma is 1 and every row
// tile wholly inside its request loads Q with nine TMA boxes; otherwise (and for a tile with
// padding rows) Q comes through cp.async, which zero-fills the padding rows.
// Grid: (row tiles, parts) for kSingle (the launch holds one request, s1e: no scan, no walk); a batch:
// row tiles x parts main CTAs and the extra CTAs of the wave's idle SMs, 1-D (s3). Each CTA runs its
// part's segments one after another (s1), each segment naming its row tile.
template <bool kFold, bool kSingle>
__global__ void __launch_bounds__(HopperConfig::kThreads, 1)
    verify_attention_hopper_kernel(const KdtreeVerifyParams p, const __grid_constant__ CUtensorMap q_map, const int q_tma) {
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  // The warpgroup index through a warp reduction (REDUX writes a uniform register): ptxas then
  // knows the role branches below are warp-uniform, and the K-stage descriptor inside WG0's loop
  // stays in uniform registers (2-3 uniform instructions per QK^T wgmma instead of ~7.5 with two
  // R2UR), and 30 registers fewer are live (journal h18).
  const int wg = static_cast<int>(__reduce_max_sync(0xffffffffu, static_cast<unsigned>(tid >> 7)));  // 0: math, 1: helper
  const int warp_in_wg = (tid >> 5) & 3;

  if (q_tma && threadIdx.x == 0) prefetch_tensormap(&q_map);  // its descriptor fetch, off the request's path
  // h47: launched as a programmatic dependent (hopper/launch.cu), the CTA starts during the previous
  // kernel's tail; nothing above reads or writes global memory, everything below may.
  pdl_wait_primary();
  ScheduleScratch& sched = *reinterpret_cast<ScheduleScratch*>(g_hopper_smem + SmemLayout::kSched);
  // kCached false: the schedule cache measured no gain here (m35, m35b: -0.9..+2.0 µs on the short
  // shapes, with and without its check; the portable path gained 0.3-6 µs).
  walk_part<HopperConfig, kSingle, /*kCached=*/false>(
      p, sched,
      [&] {
        if (tid != 0) return;
        // End the previous segment's barriers (all phases complete) so run_segment can initialise them.
        const uint32_t smem = smem_addr(g_hopper_smem);
        for (int i = 0; i < HopperConfig::kStages; ++i) {
          mbar_inval(smem + SmemLayout::kKFull + 8 * i);
          mbar_inval(smem + SmemLayout::kKEmpty + 8 * i);
        }
        mbar_inval(smem + SmemLayout::kQFull);
      },
      [&](const CtaWork& cw) { run_segment<kFold>(p, q_map, q_tma, cw, cw.row_tile, tid, lane, wg, warp_in_wg); });
}

}  // namespace hopper
}  // namespace kdtree
