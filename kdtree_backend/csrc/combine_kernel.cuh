// Merge of the KV splits: for every query row of a request whose keys were cut into more than one
// split, out = sum_s w_s O_s / sum_s w_s with w_s = 2^(lse_s - max lse). Requests that ran in a
// single split were written directly by the main kernel and are skipped here.
#pragma once
#include <cuda_bf16.h>
#include <math_constants.h>

#include "verify_kernel.cuh"

namespace kdtree {

#ifdef KDTREE_COMBINE_LEGACY  // A/B only: one warp per row, 8 rows per block (the layout before c1)
constexpr int kCombineColsPerWarp = kVDim;
constexpr int kCombineWarps = 8;
constexpr int kCombineUnroll = 8;
#else
// One warp per (row, 128-column quarter): a lane holds one float4 per split. Small batches have few
// rows (B = 1: 128), and one warp per row put all of a row's partials (splits x 2 KB, e.g. 66 KB
// at 33 splits) through one SM's L2 port; quartering the rows spreads them over 4x the SMs and
// halves each lane's serial chain of loads (perf-notes c1).
constexpr int kCombineColsPerWarp = 128;
constexpr int kCombineWarps = 4;  // the 4 quarters of one row
constexpr int kCombineUnroll = 16;  // splits whose loads are in flight at once
#endif
constexpr int kCombineThreads = kCombineWarps * 32;
constexpr int kCombineQuarters = kVDim / kCombineColsPerWarp;  // warps per row
constexpr int kCombineF4 = kCombineColsPerWarp / 128;          // float4 per lane per split
constexpr int kMaxSplits = 128;                                // kdtree_verify_run refuses more
static_assert(kCombineWarps % kCombineQuarters == 0, "a block holds whole rows");

// The combine grid for a launch of `row_tiles` x `rows_per_tile` rows per request (both launchers).
inline dim3 combine_grid(int row_tiles, int rows_per_tile, int batch) {
  constexpr int rows_per_block = kCombineWarps / kCombineQuarters;
  return dim3((row_tiles * rows_per_tile + rows_per_block - 1) / rows_per_block, batch);
}

template <class Cfg>
__global__ void __launch_bounds__(kCombineThreads) combine_splits_kernel(const KdtreeVerifyParams p, int num_row_tiles) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int r = blockIdx.x * (kCombineWarps / kCombineQuarters) + warp / kCombineQuarters;
  const int col0 = (warp % kCombineQuarters) * kCombineColsPerWarp;  // this warp's first column
  const int b = blockIdx.y;
  const RequestView req = load_request(p, b);
  const int H = p.num_heads;
  if (r >= req.n * H) return;
  const SplitWork w = split_work(req.prefix, req.n, p.num_splits,
                                 min_tiles_per_split(p.min_keys_per_split, Cfg::kBN), Cfg::kBN);
  if (w.active <= 1) return;

  const int64_t rows_per_split = static_cast<int64_t>(num_row_tiles) * Cfg::kM;
  const float* ws_o = reinterpret_cast<const float*>(p.workspace);
  const float* ws_lse = ws_o + static_cast<int64_t>(p.batch) * p.num_splits * rows_per_split * kVDim;
  const int64_t row0 = static_cast<int64_t>(b) * p.num_splits * rows_per_split + r;

  // Weights first, in parallel over the warp's lanes (one split per lane per step), kept in
  // shared memory; then a branch-free accumulation with several splits' loads in flight.
  __shared__ float weights[kCombineWarps][kMaxSplits];
  float* wrow = weights[warp];
  float lse_max = -CUDART_INF_F;
  for (int s = lane; s < w.active; s += 32) lse_max = fmaxf(lse_max, ws_lse[row0 + s * rows_per_split]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, off));
  float wsum = 0.f;
  for (int s = lane; s < w.active; s += 32) {
    const float lse = ws_lse[row0 + s * rows_per_split];
    // A split that saw none of this row's keys has lse = -inf: weight 0 (its partial row is 0).
    const float wt = lse_max == -CUDART_INF_F ? 0.f : exp2f(lse - lse_max);
    wrow[s] = wt;
    wsum += wt;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) wsum += __shfl_xor_sync(0xffffffffu, wsum, off);
  __syncwarp();

  float4 acc[kCombineF4];
#pragma unroll
  for (int i = 0; i < kCombineF4; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  const float4* src = reinterpret_cast<const float4*>(ws_o + row0 * kVDim + col0) + lane;
  const int64_t split_stride4 = rows_per_split * (kVDim / 4);
#pragma unroll kCombineUnroll
  for (int s = 0; s < w.active; ++s) {
    const float wt = wrow[s];
    const float4* sp = src + s * split_stride4;
#pragma unroll
    for (int i = 0; i < kCombineF4; ++i) {
      const float4 v = sp[32 * i];
      acc[i].x += wt * v.x;
      acc[i].y += wt * v.y;
      acc[i].z += wt * v.z;
      acc[i].w += wt * v.w;
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  const int tok = r / H, head = r - (r / H) * H;
  __nv_bfloat16* dst =
      reinterpret_cast<__nv_bfloat16*>(p.out) + (req.q0 + tok) * p.out_stride_tok + static_cast<int64_t>(head) * kVDim + col0;
#pragma unroll
  for (int i = 0; i < kCombineF4; ++i) {
    uint2 packed;
    packed.x = pack_bf16x2(acc[i].x * inv, acc[i].y * inv);
    packed.y = pack_bf16x2(acc[i].z * inv, acc[i].w * inv);
    *reinterpret_cast<uint2*>(dst + 4 * (lane + 32 * i)) = packed;
  }
}

}  // namespace kdtree
