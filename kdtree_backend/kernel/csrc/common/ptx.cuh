// Architecture-neutral PTX helpers of every kernel (sm_90 and sm_120 alike): cp.async, index loads
// through the read-only path, bf16 packing, exp2, the async-proxy fence, bulk copies shared -> global
// and named barriers. The mma.sync helpers are the portable kernel's (portable/mma.cuh); wgmma,
// mbarriers and TMA the Hopper kernel's (hopper/).
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

namespace kdtree {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy; src_bytes = 0 writes zeros (rows past the end, padded rows) so
// that no garbage (possibly Inf/NaN bits) ever enters a matmul.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// 8-byte asynchronous copy through L1 (cp.async.cg takes 16 bytes only); src_bytes = 0 writes zeros.
__device__ __forceinline__ void cp_async_8(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ int64_t ld_shared_s64(uint32_t addr) {
  int64_t v;
  asm volatile("ld.shared.s64 %0, [%1];\n" : "=l"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ int ld_shared_s32(uint32_t addr) {
  int v;
  asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
// gridDim.x, read where it is used (volatile: not hoisted into a register held across a loop, which
// ptxas spilled in the portable kernel rather than re-reading the constant).
__device__ __forceinline__ int grid_dim_x() {
  int v;
  asm volatile("mov.u32 %0, %%nctaid.x;\n" : "=r"(v));
  return v;
}
// threadIdx.x, read where it is used (volatile, as grid_dim_x: a predicate on it held across the
// batch scan was spilled by sm_100 / sm_120's ptxas in the warp-specialised kernel, m35).
__device__ __forceinline__ int thread_index_volatile() {
  int v;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(v));
  return v;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 2^x for the softmax: one MUFU.EX2 (flush-to-zero). exp2f adds a range check and two predicated
// multiplies per call to produce denormal results, which no probability here needs (p = 2^(s - m)
// with s - m <= 8; anything below 2^-126 of the row max is 0 for the output). -inf -> +0.
// Used by the Hopper kernel (journal h7: ~1-2% there) and the warp-specialised portable kernel
// (p22: 0.994-0.996x); the tiled portable kernel keeps exp2f (there it raised the sm_90 spills and
// measured slower).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Generic-proxy shared-memory writes (st.shared, cp.async) -> visible to the async proxy (wgmma
// reads, bulk copies). sm_90+, as are the bulk copies below (both kernels build for sm_90/sm_120).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Bulk copy (the copy engine, one instruction) of `bytes` (a multiple of 16; both addresses 16-byte
// aligned) from shared to global memory, in this thread's bulk group. The source must stay
// unchanged until bulk_wait_read() returns; the global writes complete on their own.
__device__ __forceinline__ void bulk_store_s2g(void* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }

// Programmatic dependent launch (sm_90+). The primary kernel's CTAs let the dependent grid start
// (its CTAs may run ahead to work that does not read the primary's results) ...
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
// ... and the dependent waits here until the primary grid has completed and its writes are visible.
// Without a programmatic launch it returns at once.
__device__ __forceinline__ void pdl_wait_primary() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// Barrier among `count` threads (a multiple of 32) using hardware barrier `id` (1..15; 0 is
// __syncthreads). Lets the warps that share a row group meet without stopping the others.
__device__ __forceinline__ void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// Arrives on named barrier `id` (counted in `count`) without waiting: the producer side of a
// barrier that other warps sync on.
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// %laneid, read where it is used: a volatile read that the compiler cannot hoist out of a loop, so
// values derived from it are not held in registers across the loop either (p24, p27: the portable
// kernel's PV role has no registers to spare for the gather's per-lane addresses).
__device__ __forceinline__ int lane_id_volatile() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lane));
  return lane;
}

// An entry of an index array. A coherent load, not __ldg: the verify kernels are programmatic
// dependents (h47), and ptxas moves a non-coherent load (LDG.CONSTANT: data it may assume unchanged
// while the kernel runs) whose address is known at entry above the kernel's griddepcontrol.wait,
// where the previous kernel may still be writing it (the Hopper kernel's one-request launch did).
template <bool kIs64>
__device__ __forceinline__ int64_t load_index(const void* p, int64_t i) {
  if constexpr (kIs64) {
    return reinterpret_cast<const int64_t*>(p)[i];
  } else {
    return static_cast<int64_t>(reinterpret_cast<const int32_t*>(p)[i]);
  }
}

__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, bool is64) {
  return is64 ? load_index<true>(p, i) : load_index<false>(p, i);
}

}  // namespace kdtree
