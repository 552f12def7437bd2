// Merge of a request's pieces (common/schedule.cuh): for every query row of a request whose key tiles
// were cut over more than one part, out = sum_s w_s O_s / sum_s w_s with w_s = 2^(lse_s - max lse).
// Requests held whole by one part were written directly by the main kernel and are skipped here;
// the main kernel records each request's (first part, pieces) in the workspace.
#pragma once
#include <cuda_bf16.h>
#include <math_constants.h>

#include "../common/mla.h"
#include "../common/ptx.cuh"
#include "../common/request.cuh"
#include "../kdtree_api.h"

namespace kdtree {

// Two layouts of the same merge, picked per launch by the planned split count (journal c1):
//  * whole rows: one warp per row, 8 rows per block, 4 float4 a lane per split, 8 splits' loads in
//    flight. Best when there are many rows and few splits (each warp's fixed chain of request,
//    lse and weight work is spread over 2 KB a split).
//  * quarter rows: one warp per (row, 128-column quarter), one row per block, 1 float4 a lane per
//    split, 16 splits' loads in flight. A small batch is split 33-66 ways over few rows (B = 1:
//    128 rows or fewer), and whole rows put all of a row's partials (66 KB at 33 splits) through
//    one SM's L2 port in a long serial chain: quartering measured 1.1-1.5x faster end to end there,
//    and 2-17% slower at 2-8 splits over 1-4k rows.
template <int ColsPerWarp>
struct CombineLayout {
  static constexpr int kColsPerWarp = ColsPerWarp;
  static constexpr int kWarpsPerRow = kVDim / ColsPerWarp;
  static constexpr int kWarps = ColsPerWarp == kVDim ? 8 : kWarpsPerRow;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerBlock = kWarps / kWarpsPerRow;
  static constexpr int kF4 = ColsPerWarp / 128;                 // float4 per lane per split
  static constexpr int kUnroll = ColsPerWarp == kVDim ? 8 : 16;  // splits whose loads are in flight at once
  // h38: splits whose partials are loaded beside the row's lse values, before the weights exist
  // (they only scale them): one L2 round trip fewer for plans of up to kFirst splits. Whole rows
  // hold 2 (8 float4 a lane: the block stays at 4 per SM), quarter rows 32 (1 float4 a lane each;
  // their grids are small, B = 1).
  static constexpr int kFirst = ColsPerWarp == kVDim ? 2 : 32;
  static_assert(kVDim % ColsPerWarp == 0 && ColsPerWarp % 128 == 0, "whole float4 per lane");
};
using CombineWholeRows = CombineLayout<kVDim>;
using CombineQuarterRows = CombineLayout<128>;
// From this many pieces a request on, the quarter layout runs (measured: 33 and 66 splits gain,
// 16 is even, 8 and fewer lose).
constexpr int kCombineQuarterMinSplits = 17;

// The row's lse over pieces [0, limit) and the first kFirst pieces' partials, for first part f;
// returns the row's partials' base (piece s at + piece_slot_step(s) * stride4).
template <class Lay>
__device__ __forceinline__ const float4* load_pieces(const WorkspaceView& ws, int r, int col0, int lane, int64_t stride4,
                                                     int f, int limit, float4 (&first)[Lay::kFirst][Lay::kF4],
                                                     float (&lse_l)[kMaxSplits / 32]) {
  const int64_t base_row = 2 * static_cast<int64_t>(f) * ws.rows_per_slot + r;
  const float4* src = reinterpret_cast<const float4*>(ws.o + base_row * kVDim + col0) + lane;
#pragma unroll
  for (int s = 0; s < Lay::kFirst; ++s)
#pragma unroll
    for (int i = 0; i < Lay::kF4; ++i)
      first[s][i] = s < limit ? src[piece_slot_step(s) * stride4 + 32 * i] : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int k = 0; k < kMaxSplits / 32; ++k) {
    const int s = lane + 32 * k;
    lse_l[k] = s < limit ? ws.lse[base_row + piece_slot_step(s) * ws.rows_per_slot] : -CUDART_INF_F;
  }
  return src;
}

// kPdl (h39, the Hopper path): launched as a programmatic dependent of the verify kernel, whose
// CTAs trigger it at their epilogue: the blocks start while the verify kernel's last CTAs store,
// load the request's indices (inputs, which that kernel does not write), and wait for it to
// complete (griddepcontrol.wait) before reading its partials. Without PDL the wait returns at once.
template <class Cfg, class Lay, bool kPdl>
__global__ void __launch_bounds__(Lay::kThreads) combine_splits_kernel(const KdtreeVerifyParams p, int num_row_tiles,
                                                                        int num_slot_parts) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int r = blockIdx.x * Lay::kRowsPerBlock + warp / Lay::kWarpsPerRow;
  const int col0 = (warp % Lay::kWarpsPerRow) * Lay::kColsPerWarp;  // this warp's first column
  const int b = blockIdx.y;
  RequestView req;
  if constexpr (kPdl) {
    req = load_request(p, b);
    pdl_wait_primary();
  }
  // num_slot_parts: the main parts and a row tile's remainder's (s3), as the launch sized them.
  const WorkspaceView ws = workspace_view(p.workspace, num_slot_parts, num_row_tiles, Cfg::kM);
  // Piece s of the request is in slot 2 f + 1 (s = 0) or 2 (f + s) for its first part f, which the
  // main kernel records. One L2 round trip (h38, h38b) for that record, the request's indices, the
  // row's lse over the pieces and the first kFirst pieces' partials (the weights only scale them), at
  // the first part the aligned mode gives the request (b * (parts / batch); 0 for a batch of one in
  // either mode); a second one only when the record says otherwise (a cut across requests). Reads
  // stay inside the workspace (slots of parts f_guess.. parts - 1); what a piece the request does not
  // have holds (any bits) is discarded by selects below, never scaled.
  // (The whole-rows layout reads the record first: the guess's registers spilled it on sm_120, and its
  // plans are the many-row ones where one more round trip is a small share.)
  constexpr bool kGuess = Lay::kColsPerWarp != kVDim;
  const int f_guess = b * (p.num_splits / p.batch);
  const int max_pieces = num_slot_parts - f_guess;
  const int64_t split_stride4 = ws.rows_per_slot * (kVDim / 4);
  float4 first[Lay::kFirst][Lay::kF4];
  float lse_l[kMaxSplits / 32];
  // (first part, pieces) of the request in this row's row tile: written by this launch's main kernel
  const int2 info = ws.request[static_cast<int64_t>(b) * num_row_tiles + r / Cfg::kM];
  const float4* src = nullptr;
  if constexpr (kGuess) src = load_pieces<Lay>(ws, r, col0, lane, split_stride4, f_guess, max_pieces, first, lse_l);
  if constexpr (!kPdl) req = load_request(p, b);
  const int H = p.num_heads;
  if (r >= req.n * H) return;
  const int pieces = info.y;
  if (pieces <= 1) return;
  if (info.x < 0 || info.x + pieces > num_slot_parts) __trap();  // the main kernel wrote no such record
  if (!kGuess || info.x != f_guess) src = load_pieces<Lay>(ws, r, col0, lane, split_stride4, info.x, pieces, first, lse_l);
#pragma unroll
  for (int k = 0; k < kMaxSplits / 32; ++k) lse_l[k] = lane + 32 * k < pieces ? lse_l[k] : -CUDART_INF_F;
#pragma unroll
  for (int s = 0; s < Lay::kFirst; ++s)
#pragma unroll
    for (int i = 0; i < Lay::kF4; ++i) first[s][i] = s < pieces ? first[s][i] : make_float4(0.f, 0.f, 0.f, 0.f);

  // The weights, in parallel over the warp's lanes (one split per lane), kept in shared memory;
  // then the first splits' partials and a branch-free accumulation of the rest, with several
  // splits' loads in flight.
  __shared__ float weights[Lay::kWarps][kMaxSplits];
  float* wrow = weights[warp];
  float lse_max = -CUDART_INF_F;
#pragma unroll
  for (int k = 0; k < kMaxSplits / 32; ++k) lse_max = fmaxf(lse_max, lse_l[k]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, off));
  float wsum = 0.f;
#pragma unroll
  for (int k = 0; k < kMaxSplits / 32; ++k) {
    const int s = lane + 32 * k;
    if (s < pieces) {
      // A piece that saw none of this row's keys has lse = -inf: weight 0 (its partial row is 0).
      const float wt = lse_max == -CUDART_INF_F ? 0.f : exp2f(lse_l[k] - lse_max);
      wrow[s] = wt;
      wsum += wt;
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) wsum += __shfl_xor_sync(0xffffffffu, wsum, off);
  __syncwarp();

  float4 acc[Lay::kF4];
#pragma unroll
  for (int i = 0; i < Lay::kF4; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int s = 0; s < Lay::kFirst; ++s) {
    const float wt = s < pieces ? wrow[s] : 0.f;
#pragma unroll
    for (int i = 0; i < Lay::kF4; ++i) {
      acc[i].x += wt * first[s][i].x;
      acc[i].y += wt * first[s][i].y;
      acc[i].z += wt * first[s][i].z;
      acc[i].w += wt * first[s][i].w;
    }
  }
#pragma unroll Lay::kUnroll
  for (int s = Lay::kFirst; s < pieces; ++s) {
    const float wt = wrow[s];
    const float4* sp = src + piece_slot_step(s) * split_stride4;
#pragma unroll
    for (int i = 0; i < Lay::kF4; ++i) {
      const float4 v = sp[32 * i];
      acc[i].x += wt * v.x;
      acc[i].y += wt * v.y;
      acc[i].z += wt * v.z;
      acc[i].w += wt * v.w;
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  __nv_bfloat16* dst = out_row(p, req, r) + col0;
#pragma unroll
  for (int i = 0; i < Lay::kF4; ++i) {
    uint2 packed;
    packed.x = pack_bf16x2(acc[i].x * inv, acc[i].y * inv);
    packed.y = pack_bf16x2(acc[i].z * inv, acc[i].w * inv);
    *reinterpret_cast<uint2*>(dst + 4 * (lane + 32 * i)) = packed;
  }
}

}  // namespace kdtree
