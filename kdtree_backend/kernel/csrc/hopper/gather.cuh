// The helper warpgroup's K gather: a 64-key tile of 576-wide rows, page-size-1 cache slots through
// kv_indices (prefix tiles) or draft rows of `k` (draft tiles), copied by 16-byte cp.async straight
// into a K stage's swizzled atoms. (FlashMLA needs none of this: its pages are TMA boxes.)
#pragma once
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

// Thread j of WG1 copies 16-byte chunk (j & 7) of each 64-column atom for keys 16u + j/8 (u = 0..3):
// a warp reads 4 whole 128-byte segments per instruction. Tile t of the CTA's range lands in stage
// (t - t_begin) & 1, whose full barrier its 128 threads' cp.async complete (noinc arrivals).
struct KGather {
  const KdtreeVerifyParams& p;
  const RequestView& req;
  const KeyTiles& w;
  int t_begin, t_end;
  uint32_t stages;    // shared address of the K stages (SharedStorage::k)
  uint32_t bar_full;  // shared address of the stages' full barriers (+ 8 * stage)
  int chunk;          // this thread's 16-byte chunk of each atom
  int key0;           // this thread's first key of the tile (+ 16u)

  __device__ __forceinline__ KGather(const KdtreeVerifyParams& p_, const RequestView& req_, const KeyTiles& w_,
                                     int t_begin_, int t_end_, uint32_t stages_, uint32_t bar_full_, int tid)
      : p(p_), req(req_), w(w_), t_begin(t_begin_), t_end(t_end_), stages(stages_), bar_full(bar_full_),
        chunk((tid & 127) & 7), key0((tid & 127) >> 3) {}

  // The slot ids of `tile`'s keys, fetched a tile ahead and range-checked only when the copy is
  // issued, so the index load's latency hides behind the next PV (checking at once stalled WG1:
  // journal h1). -1 past the prefix or the range.
  __device__ __forceinline__ void fetch_slots(int tile, int64_t (&slots)[4]) const {
    const int64_t* kv_indices = reinterpret_cast<const int64_t*>(p.kv_indices);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      slots[u] = -1;
      if (tile < t_end && tile < w.prefix_tiles) {
        const int key = tile * HopperConfig::kBN + key0 + 16 * u;
        if (key < req.prefix) slots[u] = __ldg(kv_indices + req.kv0 + key);
      }
    }
  }

  // Issues `tile`'s copies into its stage and the arrival on the stage's full barrier. A slot outside
  // the cache, a key past the prefix and a draft key past the request read as zeros.
  __device__ __forceinline__ void issue_tile(int tile, const int64_t (&slots)[4]) const {
    using Cfg = HopperConfig;
    const __nv_bfloat16* kd = reinterpret_cast<const __nv_bfloat16*>(p.k);
    const __nv_bfloat16* kv = reinterpret_cast<const __nv_bfloat16*>(p.kv_cache);
    const uint32_t dst_base = stages + ((tile - t_begin) & 1) * Cfg::kBlockBytes;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int key_local = key0 + 16 * u;
      const __nv_bfloat16* src;
      bool valid;
      if (tile < w.prefix_tiles) {
        valid = slots[u] >= 0 && slots[u] < p.kv_num_slots;  // out of range reads as zeros
        src = kv + (valid ? slots[u] : 0) * p.kv_stride_slot;
      } else {
        const int c = (tile - w.prefix_tiles) * Cfg::kBN + key_local;
        valid = c < req.n;
        src = kd + (req.q0 + (valid ? c : 0)) * p.k_stride_tok;
      }
      const uint32_t dst = dst_base + swizzled(key_local, chunk);
#pragma unroll
      for (int a = 0; a < Cfg::kAtoms; ++a) cp_async_16(dst + a * Cfg::kAtomBytes, src + a * 64 + chunk * 8, valid);
    }
    cp_async_mbar_arrive(bar_full + 8 * ((tile - t_begin) & 1));
  }
};

}  // namespace hopper
}  // namespace kdtree
