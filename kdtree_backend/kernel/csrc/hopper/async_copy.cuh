// The Hopper kernel's asynchronous-copy plumbing (sm_90): the tensor-memory-access (TMA) copy Q
// arrives by; the mbarriers it completes are common/mbarrier.cuh's. h23: one thread arms the Q barrier
// with the bytes to expect and issues the boxes; everyone waits on the phase. The map (a
// __grid_constant__ parameter) is addressed generically, as the PTX ISA allows for kernel parameters.
#pragma once
#include <cuda.h>  // CUtensorMap (the type only: the map is encoded on the host, hopper/launch.cu)
#include <stdint.h>

#include "../common/mbarrier.cuh"

namespace kdtree {
namespace hopper {

__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

}  // namespace hopper
}  // namespace kdtree
