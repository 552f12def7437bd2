// P, the tile's probabilities, between the warpgroups: WG0 packs them to bf16 wgmma A fragments (its
// own PV reads them from registers) and writes them, with each row's O rescale factor, to shared
// memory for WG1's PV. The named barriers around it (P full, P free) are the kernel's.
#pragma once
#include <stdint.h>

#include "../common/ptx.cuh"
#include "traits.cuh"
#include "wgmma.cuh"

namespace kdtree {
namespace hopper {

// P's k16 step kk (keys 16kk .. 16kk + 15) to bf16 A fragments, scaled by ps: the accumulator layout
// of two adjacent n8 blocks is the A layout of one k16 step.
__device__ __forceinline__ void pack_p(uint32_t (&pa)[4][4], const float (&s)[32], float ps, int kk) {
  pa[kk][0] = pack_bf16x2(s[8 * kk + 0] * ps, s[8 * kk + 1] * ps);
  pa[kk][1] = pack_bf16x2(s[8 * kk + 2] * ps, s[8 * kk + 3] * ps);
  pa[kk][2] = pack_bf16x2(s[8 * kk + 4] * ps, s[8 * kk + 5] * ps);
  pa[kk][3] = pack_bf16x2(s[8 * kk + 6] * ps, s[8 * kk + 7] * ps);
}

// WG0: this thread's P fragments into SharedStorage::p (the K-major swizzled atom WG1's PV reads)
// and its rows' rescale factors into SharedStorage::alpha. Rows row_in_tile0 and + 8.
__device__ __forceinline__ void share_p(uint8_t* p_smem, float* s_alpha, const uint32_t (&pa)[4][4],
                                        const float (&alpha)[2], int row_in_tile0, int lane) {
  const int r_lo = row_in_tile0, r_hi = row_in_tile0 + 8;
  const int byte = 4 * (lane & 3);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    *reinterpret_cast<uint32_t*>(p_smem + swizzled(r_lo, 2 * kk) + byte) = pa[kk][0];
    *reinterpret_cast<uint32_t*>(p_smem + swizzled(r_hi, 2 * kk) + byte) = pa[kk][1];
    *reinterpret_cast<uint32_t*>(p_smem + swizzled(r_lo, 2 * kk + 1) + byte) = pa[kk][2];
    *reinterpret_cast<uint32_t*>(p_smem + swizzled(r_hi, 2 * kk + 1) + byte) = pa[kk][3];
  }
  if ((lane & 3) == 0) {
    s_alpha[r_lo] = alpha[0];
    s_alpha[r_hi] = alpha[1];
  }
}

}  // namespace hopper
}  // namespace kdtree
