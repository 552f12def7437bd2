// The Hopper kernel's Q tile: 64 query rows x 576 columns into shared memory (SharedStorage::q), in
// the 128-byte swizzled atoms wgmma reads, by TMA or by cp.async.
#pragma once
#include <cuda.h>  // CUtensorMap (the type only)
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/ptx.cuh"
#include "../common/request.cuh"
#include "../kdtree_api.h"
#include "async_copy.cuh"
#include "traits.cuh"
#include "wgmma.cuh"

namespace kdtree {
namespace hopper {

// Q by TMA (h23), for a row tile wholly inside its request: one thread arms the Q barrier with the
// tile's bytes and issues nine boxes (64 columns x 64 rows, one atom each) of the map {576, H,
// tokens}. The tile's 64 rows are 64 / H whole tokens from token row0 / H (H divides 64), or heads
// row0 % H .. + 63 of one token (64 divides H), so one box is the tile's rows of one atom.
__device__ __forceinline__ void issue_q_tma(uint32_t sQ, const CUtensorMap* q_map, uint32_t bar_q,
                                            const KdtreeVerifyParams& p, const RequestView& req, int row_tile) {
  using Cfg = HopperConfig;
  const int r0 = row_tile * Cfg::kM;
  const int tok = static_cast<int>(req.q0) + r0 / p.num_heads, head = r0 % p.num_heads;
  mbar_arrive_expect_tx(bar_q, Cfg::kBlockBytes);
#pragma unroll
  for (int a = 0; a < Cfg::kAtoms; ++a) tma_load_3d(sQ + a * Cfg::kAtomBytes, q_map, bar_q, a * 64, head, tok);
}

// Q by cp.async, by all 256 threads (zeros past the request), in one commit group: a warp
// instruction copies 4 whole 128-byte lines (rows tid/8 and +32, chunk tid & 7 of each atom), as
// the gather does (h21c; 8 rows x 64 bytes before).
__device__ __forceinline__ void load_q_cp_async(uint32_t sQ, const KdtreeVerifyParams& p, const RequestView& req,
                                                int row_tile, int rows, int tid) {
  using Cfg = HopperConfig;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int row = (tid >> 3) + 32 * pass;
    bool valid;
    const __nv_bfloat16* src = q_row_src(p, req, row_tile * Cfg::kM + row, rows, valid);
#pragma unroll
    for (int a = 0; a < Cfg::kAtoms; ++a) {
      const int c = 8 * a + (tid & 7);
      cp_async_16(sQ + a * Cfg::kAtomBytes + swizzled(row, c), src + c * 8, valid);
    }
  }
  cp_async_commit();
}

}  // namespace hopper
}  // namespace kdtree
