// The Hopper kernel's output: each warpgroup's normalised half of O, to `out` (bf16, staged through
// shared memory and bulk copies, or register stores) or to the split workspace (fp32).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../common/ptx.cuh"
#include "../common/request.cuh"
#include "../kdtree_api.h"
#include "traits.cuh"

namespace kdtree {
namespace hopper {

// Writes this thread's 2 rows x 256 columns of O (already normalised by 1/l) to `out` (bf16) or to
// the split workspace (fp32), by register stores.
__device__ __forceinline__ void store_half_registers(const float (&o)[128], const float (&inv_l)[2], const KdtreeVerifyParams& p,
                                           const RequestView& req, int slot, int row_tile,
                                           int row_in_tile0, int col_half, int lane, bool direct) {
  const int H = p.num_heads;
  const int rows = req.n * H;
  const int col_lane = col_half * 256 + 2 * (lane & 3);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = row_tile * HopperConfig::kM + row_in_tile0 + rr * 8;
    if (r >= rows) continue;
    if (direct) {
      __nv_bfloat16* dst = out_row(p, req, r) + col_lane;
#pragma unroll
      for (int nb = 0; nb < 32; ++nb) {
        *reinterpret_cast<uint32_t*>(dst + nb * 8) =
            pack_bf16x2(o[nb * 4 + 2 * rr] * inv_l[rr], o[nb * 4 + 2 * rr + 1] * inv_l[rr]);
      }
    } else {
      const WorkspaceView ws = launch_workspace<HopperConfig>(p);
      const int64_t ws_row = static_cast<int64_t>(slot) * ws.rows_per_slot + r;
      float* ws_o = ws.o + ws_row * kVDim + col_lane;
#pragma unroll
      for (int nb = 0; nb < 32; ++nb) {
        *reinterpret_cast<float2*>(ws_o + nb * 8) =
            make_float2(o[nb * 4 + 2 * rr] * inv_l[rr], o[nb * 4 + 2 * rr + 1] * inv_l[rr]);
      }
    }
  }
}

// The same output through shared memory (h9), for the direct (bf16) path: the warpgroup writes its
// normalised 64 x 256 half of O into the idle K stages (rows padded by 16 B: conflict-free), then
// one thread per row hands its 512 bytes to the copy engine (cp.async.bulk). The register path
// (store_half_registers) issues 64 four-byte stores per thread, each writing 8 half-used sectors; at L = 1k they
// held ~18% of the kernel's warp time (LSU throttle, then the drain at exit). Measured: one-wave
// shapes 9-22% faster. The fp32 partials keep the register path: their 8-byte stores fill whole
// sectors, and staging them measured 4-11% slower (journal h9).
// Requires the K stages to be idle (after NamedBarrier::kFinal) and 16-byte aligned output rows.
__device__ __forceinline__ void store_half_staged(const float (&o)[128], const float (&inv_l)[2],
                                                  const KdtreeVerifyParams& p, const RequestView& req, int row_tile,
                                                  int row_in_tile0, int col_half, int lane, int thread_in_wg,
                                                  uint32_t stage_smem, uint8_t* stage_ptr) {
  constexpr int kPitch = 256 * 2 + 16;
  const int col_lane = 2 * (lane & 3);
  uint8_t* base = stage_ptr + col_half * HopperConfig::kM * kPitch;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    uint8_t* row = base + (row_in_tile0 + 8 * rr) * kPitch;
#pragma unroll
    for (int nb = 0; nb < 32; ++nb) {
      *reinterpret_cast<uint32_t*>(row + (nb * 8 + col_lane) * 2) =
          pack_bf16x2(o[nb * 4 + 2 * rr] * inv_l[rr], o[nb * 4 + 2 * rr + 1] * inv_l[rr]);
    }
  }
  fence_proxy_async();  // the rows, written by the generic proxy, are read by the copy engine
  named_barrier(store_barrier(col_half), 128);
  const int j = thread_in_wg;
  const int r = row_tile * HopperConfig::kM + j;
  if (j < HopperConfig::kM && r < req.n * p.num_heads) {
    __nv_bfloat16* dst = out_row(p, req, r) + col_half * 256;
    bulk_store_s2g(dst, stage_smem + col_half * HopperConfig::kM * kPitch + j * kPitch, 512);
    bulk_commit();
    bulk_wait_read();  // the shared memory must outlive the copy's reads (the CTA exits next)
  }
}

// Where the segment's output rows go and how: it holds all of the request's tiles (direct) -> `out`,
// normalised bf16 rows; otherwise its piece's workspace slot, fp32 partial rows and one
// log2-sum-exp a row for the combine. Both warpgroups store their half of O through it.
struct OutputTile {
  const KdtreeVerifyParams& p;
  const RequestView& req;
  int slot, row_tile;  // slot: the piece's workspace slot (common/schedule.cuh)
  bool direct;  // the segment holds all of the request's tiles
  bool staged;  // direct, and `out`'s rows are 16-byte aligned: through shared memory and bulk copies (h9)

  // This warpgroup's half of O (col_half 0: WG0, 1: WG1), normalised by inv_l; stage_*: the idle
  // K stages (shared address and pointer), the staging area.
  __device__ __forceinline__ void store_half(const float (&o)[128], const float (&inv_l)[2], int row_in_tile0,
                                             int col_half, int lane, int tid, uint32_t stage_smem,
                                             uint8_t* stage_ptr) const {
    if (staged) {
      store_half_staged(o, inv_l, p, req, row_tile, row_in_tile0, col_half, lane, tid & 127, stage_smem, stage_ptr);
    } else {
      store_half_registers(o, inv_l, p, req, slot, row_tile, row_in_tile0, col_half, lane, direct);
    }
  }

  // Split partials only: this thread's rows' log2-sum-exp (from SharedStorage::lse) to the
  // workspace, after all partial rows; one thread per row (lane & 3 == 0 of WG0).
  __device__ __forceinline__ void store_lse(const float* s_lse, int rows, int row_in_tile0) const {
    const WorkspaceView ws = launch_workspace<HopperConfig>(p);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int r = row_tile * HopperConfig::kM + row_in_tile0 + 8 * rr;
      if (r < rows) {
        ws.lse[static_cast<int64_t>(slot) * ws.rows_per_slot + r] = s_lse[row_in_tile0 + 8 * rr];
      }
    }
  }
};

}  // namespace hopper
}  // namespace kdtree
