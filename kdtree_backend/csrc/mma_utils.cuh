// Warp-level building blocks shared by the verify kernels: cp.async, ldmatrix, mma.sync bf16,
// the padded shared-memory layout of 576-wide bf16 rows, and named barriers.
// Everything here is plain sm_80+ PTX so the same code runs on sm_90 and sm_120.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

namespace kdtree {

constexpr int kQkDim = 576;              // 512 latent + 64 rope
constexpr int kVDim = 512;               // V = the first 512 columns of the K row
constexpr int kRowBytes = kQkDim * 2;    // 1152 bytes per bf16 row
constexpr int kRowChunks = kRowBytes / 16;  // 72 chunks of 16 bytes

// In shared memory a 576-wide row takes 1168 B: 72 chunks of 16 B plus one chunk of padding.
// 1152 B alone is a multiple of 128 B, so the 8 rows one ldmatrix reads would all hit the same
// banks; with the pad, row r starts 16*r bytes later modulo 128 and the 8 rows land in 8
// distinct 16-byte bank groups. Padding rather than an XOR swizzle keeps every ldmatrix address a
// per-lane base plus a compile-time constant (one register per operand, one add per load).
constexpr int kSmemRowBytes = kRowBytes + 16;

__device__ __forceinline__ uint32_t row_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * kSmemRowBytes + (chunk << 4));
}

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
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// D += A(16x16, row) * B(16x8, col); bf16 inputs, fp32 accumulators. Not volatile: it only
// reads and writes registers, so the compiler may interleave independent mma chains.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 2^x for the softmax: one MUFU.EX2 (flush-to-zero). exp2f adds a range check and two predicated
// multiplies per call to produce denormal results, which no probability here needs (p = 2^(s - m)
// with s - m <= 8; anything below 2^-126 of the row max is 0 for the output). -inf -> +0.
// Used by the Hopper kernel (perf-notes h7: ~1-2% there); the portable kernel keeps exp2f (the
// asm raised its sm_90 spills and it measured slower). -DKDTREE_EXP2_EXACT restores exp2f.
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef KDTREE_EXP2_EXACT
  return exp2f(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
#endif
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

// Barrier among `count` threads (a multiple of 32) using hardware barrier `id` (1..15; 0 is
// __syncthreads). Lets the warps that share a row group meet without stopping the others.
__device__ __forceinline__ void named_barrier(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

template <bool kIs64>
__device__ __forceinline__ int64_t load_index(const void* p, int64_t i) {
  if constexpr (kIs64) {
    return __ldg(reinterpret_cast<const int64_t*>(p) + i);
  } else {
    return static_cast<int64_t>(__ldg(reinterpret_cast<const int32_t*>(p) + i));
  }
}

__device__ __forceinline__ int64_t load_index(const void* p, int64_t i, bool is64) {
  return is64 ? load_index<true>(p, i) : load_index<false>(p, i);
}

}  // namespace kdtree
