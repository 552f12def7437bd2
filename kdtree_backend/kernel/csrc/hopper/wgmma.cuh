// wgmma plumbing of the Hopper kernel (sm_90a only): shared-memory descriptors of the 128-byte
// swizzled layout, the swizzle itself, and the fence / commit / wait of warpgroup MMAs. The
// m64nNk16 wrappers themselves are generated (wgmma_ops.cuh, tools/gen_wgmma.py).
#pragma once
#include <stdint.h>

#include "traits.cuh"
#include "wgmma_ops.cuh"

namespace kdtree {
namespace hopper {

// V (N-major) descriptor offsets: 64-column atoms kAtomBytes apart (leading), 8-key groups 1024 B
// apart (stride). Checked on the H200 against the float64 reference (journal h1).
constexpr uint32_t kVLeading = HopperConfig::kAtomBytes, kVStride = 1024;

// wgmma shared-memory descriptor, 128-byte swizzle. Start address, leading and stride byte
// offsets are stored >> 4; bits 62-63 = 1 selects the 128-byte swizzle.
//   K-major (Q, K, P): rows of 128 B, 8-row groups 1024 B apart (stride offset); the leading
//     offset is unused because one k16 step stays inside a 128-byte row.
//   N-major (V): 64-column atoms 8192 B apart (leading offset), 8-key groups 1024 B apart.
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4);  // 14 bits: addresses below 256 KB
  d |= static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32;
  d |= static_cast<uint64_t>(1) << 62;
  return d;
}

__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

}  // namespace hopper
}  // namespace kdtree
