// The merge inside the verify kernel (journal s2), for plans where merge_in_kernel holds
// (common/schedule.cuh): no combine kernel runs after them. Each CTA that wrote a piece (a segment
// holding part of a request's key tiles) adds the piece's tiles to the (request, row tile) arrival
// counter in the workspace; the CTA that brings it to the request's key tiles holds the last piece,
// resets the counter to zero for the next launch and, after its walk, merges that row tile's pieces:
// out = sum_s w_s O_s / sum_s w_s, w_s = 2^(lse_s - max lse), over the pieces in their fixed slot
// order (the combine's arithmetic, combine/kernel.cuh), so a replay gives the same bits.
// Shared by the portable and Hopper kernels through walk_part (common/walk.cuh).
#pragma once
#include <cuda_bf16.h>
#include <math_constants.h>

#include "../kdtree_api.h"
#include "mla.h"
#include "ptx.cuh"
#include "request.cuh"
#include "schedule.cuh"

namespace kdtree {

// Block-wide, right after each segment of the walk (every thread calls it): when the segment (sc.seg)
// was a piece, every thread fences its partial rows and lse, then thread 0 arrives for the CTA and,
// when its piece completes the row tile, queues the request for merge_pending. Every thread reads
// sc.seg.direct BEFORE the barrier: after it thread 0 moves on to the next segment and overwrites
// sc.seg (a thread reading it later could take the other branch and meet a different barrier).
template <class Cfg>
__device__ __forceinline__ void merge_arrive(const KdtreeVerifyParams& p, ScheduleScratch& sc) {
  const bool piece = !sc.seg.direct;
  if (piece) __threadfence();  // this thread's partials, before the CTA's arrival (release)
  __syncthreads();
  if (!piece || threadIdx.x != 0) return;
  const CtaWork& cw = sc.seg;
  const WorkspaceView ws = workspace_view(p.workspace, p.num_splits, grid_dim_x(), Cfg::kM, p.batch);
  int* counter = ws.arrivals + static_cast<int64_t>(cw.b) * grid_dim_x() + block_idx_x();  // the row tile
  const int tiles = cw.t_end - cw.t_begin;
  const int before = atomicAdd(counter, tiles);
  // A count past the request's tiles is a workspace that was not zero-filled (kdtree_api.h).
  if (before < 0 || before + tiles > cw.w.key_tiles) __trap();
  if (before + tiles < cw.w.key_tiles) return;
  *counter = 0;       // every piece of this launch has arrived: zero for the next launch
  __threadfence();    // the other pieces' partials, before this CTA reads them (acquire)
  // A part holds at most two pieces (a head and a tail, common/schedule.cuh).
  if (sc.merges.count >= ScheduleScratch::kMaxMerges) __trap();
  sc.merges.b[sc.merges.count++] = cw.b;
}

// Block-wide, after the CTA's walk: merges row tile `row_tile` of request b, whose pieces have all
// arrived. Warps take 4 rows at a time (lanes over the 512 columns, 4 float4 a lane and row): the
// rows' lse of 32 pieces per load round (lane s holds piece s), then each piece's partial rows with
// 16 float4 loads a thread in flight. Reads bypass L1 (__ldcg): other SMs wrote them in this launch.
template <class Cfg>
__device__ __forceinline__ void merge_rows(const KdtreeVerifyParams& p, int b, int row_tile) {
  constexpr int kWarps = Cfg::kThreads / 32;
  constexpr int kRows = 4;  // rows a warp merges at once
  constexpr int kF4 = kVDim / 128;  // float4 a lane per row
  static_assert(Cfg::kM % (kWarps * kRows) == 0, "whole row groups a warp");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int num_row_tiles = grid_dim_x();
  const WorkspaceView ws = workspace_view(p.workspace, p.num_splits, num_row_tiles, Cfg::kM, p.batch);
  const int2 info = __ldcg(&ws.request[b]);  // (first part, pieces): written by this row tile's first piece
  const int f = info.x, pieces = info.y;
  if (f < 0 || pieces < 2 || f + pieces > p.num_splits) __trap();  // no such record was written
  const RequestView req = load_request(p, b);
  const int rows = req.n * p.num_heads;
  const int64_t slot_stride = ws.rows_per_slot;
  for (int r0 = row_tile * Cfg::kM + warp * kRows; r0 < (row_tile + 1) * Cfg::kM; r0 += kWarps * kRows) {
    if (r0 >= rows) break;
    const int64_t base = 2 * static_cast<int64_t>(f) * slot_stride + r0;  // row r0 of the first part's slots
    // The weights: lane s of chunk k holds piece 32 k + s.
    float wt[kRows][kMaxSplits / 32], inv[kRows];
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      float mx = -CUDART_INF_F;
#pragma unroll
      for (int k = 0; k < kMaxSplits / 32; ++k) {
        const int s = lane + 32 * k;
        wt[j][k] = s < pieces && r0 + j < rows ? __ldcg(ws.lse + base + j + piece_slot_step(s) * slot_stride)
                                               : -CUDART_INF_F;
        mx = fmaxf(mx, wt[j][k]);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < kMaxSplits / 32; ++k) {
        // A piece that saw none of the row's keys has lse = -inf: weight 0 (its partial row is 0).
        wt[j][k] = mx == -CUDART_INF_F || wt[j][k] == -CUDART_INF_F ? 0.f : exp2f(wt[j][k] - mx);
        sum += wt[j][k];
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      inv[j] = sum > 0.f ? 1.f / sum : 0.f;
    }
    float4 acc[kRows][kF4];
#pragma unroll
    for (int j = 0; j < kRows; ++j)
#pragma unroll
      for (int i = 0; i < kF4; ++i) acc[j][i] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int k = 0; k < kMaxSplits / 32; ++k) {
      if (32 * k >= pieces) break;
      const int chunk = min(32, pieces - 32 * k);
      for (int ss = 0; ss < chunk; ++ss) {
        const int s = 32 * k + ss;
        const float4* src = reinterpret_cast<const float4*>(ws.o + (base + piece_slot_step(s) * slot_stride) * kVDim) + lane;
        float4 v[kRows][kF4];
#pragma unroll
        for (int j = 0; j < kRows; ++j)
#pragma unroll
          for (int i = 0; i < kF4; ++i)
            v[j][i] = r0 + j < rows ? __ldcg(src + j * (kVDim / 4) + 32 * i) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
          const float w = __shfl_sync(0xffffffffu, wt[j][k], ss);
#pragma unroll
          for (int i = 0; i < kF4; ++i) {
            acc[j][i].x += w * v[j][i].x;
            acc[j][i].y += w * v[j][i].y;
            acc[j][i].z += w * v[j][i].z;
            acc[j][i].w += w * v[j][i].w;
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      if (r0 + j >= rows) break;
      __nv_bfloat16* dst = out_row(p, req, r0 + j);
#pragma unroll
      for (int i = 0; i < kF4; ++i) {
        uint2 packed;
        packed.x = pack_bf16x2(acc[j][i].x * inv[j], acc[j][i].y * inv[j]);
        packed.y = pack_bf16x2(acc[j][i].z * inv[j], acc[j][i].w * inv[j]);
        *reinterpret_cast<uint2*>(dst + 4 * (lane + 32 * i)) = packed;
      }
    }
  }
}

// Block-wide, after the walk: the row tiles this CTA completed (merge_arrive queued them; the walk's
// last __syncthreads made the queue visible). The row tile is blockIdx.x, read here (block_idx_x).
template <class Cfg>
__device__ __forceinline__ void merge_pending(const KdtreeVerifyParams& p, const ScheduleScratch& sc) {
  const int count = sc.merges.count;
  for (int i = 0; i < count; ++i) merge_rows<Cfg>(p, sc.merges.b[i], block_idx_x());
}

}  // namespace kdtree
