// The Hopper kernel's tensor-core work on one 64-key tile: QK^T (WG0) and the two halves of PV
// (WG0 with P from registers, WG1 with P from shared memory). V is the K stage's first 512 columns,
// read N-major through the descriptor's transpose bit: each K tile feeds both matmuls.
#pragma once
#include <stdint.h>

#include "traits.cuh"
#include "wgmma.cuh"

namespace kdtree {
namespace hopper {

// S = Q K^T over 36 k16 steps (4 per 64-column atom), both operands K-major in shared memory; waits
// for the result. Descriptors advance by adding (byte offset >> 4) to the start-address field:
// every address stays below 256 KB, so the 14-bit field never carries.
__device__ __forceinline__ void qk_tile(float (&s)[32], uint32_t sQ, uint32_t stage) {
  const uint64_t desc_q = make_desc(sQ, 16, 1024);
  const uint64_t desc_k = make_desc(stage, 16, 1024);
  wgmma_fence_operand(s);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 36; ++ks) {
    const uint32_t off = ((ks >> 2) * HopperConfig::kAtomBytes + (ks & 3) * 32) >> 4;
    wgmma_m64n64k16_ss_kmajor(s, desc_q + off, desc_k + off, ks > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operand(s);
}

// WG0: O[:, 0:256] += P V[:, 0:256] for k16 steps [kk0, kk1) (16 keys each) with P in registers,
// one commit group (not waited for). desc_v: the stage's V descriptor (make_desc(stage, kVLeading,
// kVStride)).
__device__ __forceinline__ void pv_issue_wg0(float (&o)[128], const uint32_t (&pa)[4][4], uint64_t desc_v, int kk0,
                                             int kk1) {
  wgmma_fence();  // orders the pa registers just written (and O's rescale) before the wgmmas
#pragma unroll
  for (int kk = kk0; kk < kk1; ++kk) wgmma_m64n256k16_rs_bmn(o, pa[kk], desc_v + kk * (2048 >> 4), 1);
  wgmma_commit();
}

// WG1: O[:, 256:512] += P V[:, 256:512] over the tile's 4 k16 steps, P from shared memory; waits for
// the result.
__device__ __forceinline__ void pv_tile_wg1(float (&o)[128], uint32_t sP, uint32_t stage) {
  wgmma_fence_operand(o);
  wgmma_fence();
  const uint64_t desc_p = make_desc(sP, 16, 1024);
  const uint64_t desc_v = make_desc(stage + 4 * HopperConfig::kAtomBytes, kVLeading, kVStride);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_ss_bmn(o, desc_p + kk * (32 >> 4), desc_v + kk * (2048 >> 4), 1);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operand(o);
}

}  // namespace hopper
}  // namespace kdtree
