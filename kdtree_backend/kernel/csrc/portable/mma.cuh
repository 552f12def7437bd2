// The portable kernel's warp-level tensor-core helpers: the padded shared-memory layout of 576-wide
// bf16 rows, ldmatrix and mma.sync m16n8k16 bf16. Plain sm_80+ PTX: the same code runs on sm_90
// and sm_120.
#pragma once
#include <stdint.h>

#include "../common/mla.h"

namespace kdtree {

// In shared memory a 576-wide row takes 1168 B: 72 chunks of 16 B plus one chunk of padding.
// 1152 B alone is a multiple of 128 B, so the 8 rows one ldmatrix reads would all hit the same
// banks; with the pad, row r starts 16*r bytes later modulo 128 and the 8 rows land in 8
// distinct 16-byte bank groups. Padding rather than an XOR swizzle keeps every ldmatrix address a
// per-lane base plus a compile-time constant (one register per operand, one add per load).
constexpr int kSmemRowBytes = kRowBytes + 16;

__device__ __forceinline__ uint32_t row_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * kSmemRowBytes + (chunk << 4));
}

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

// Diagnostics build only (`python -m kdtree_backend.build --pipe-factor F`, journal m27; never ship it):
// each mma is followed by F - 1 more on the same accumulator with B = 0 (D + A x 0 = D for finite A:
// results stay exact), so the tensor pipe spends F times its time while every load, barrier and
// softmax stays as it is. sm_120's mma.sync retires ~2.5-3x fewer FLOP per SM-clock than the H200's:
// F = 3 puts the portable kernels in that regime on the H200 (docs/kernel/portable.md). The extras
// share the accumulator: for a warp of few chains (the QK warps' 4) that is pessimistic at F = 2 (m27b:
// ~6 points of pipe share), not at F = 3.
#ifndef KDTREE_PIPE_FACTOR
#define KDTREE_PIPE_FACTOR 1
#endif
static_assert(KDTREE_PIPE_FACTOR >= 1 && KDTREE_PIPE_FACTOR <= 8, "KDTREE_PIPE_FACTOR: 1 (release) to 8");

// D += A(16x16, row) * B(16x8, col); bf16 inputs, fp32 accumulators. Not volatile: it only
// reads and writes registers, so the compiler may interleave independent mma chains.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#if KDTREE_PIPE_FACTOR > 1
#pragma unroll
  for (int k = 1; k < KDTREE_PIPE_FACTOR; ++k) {
    uint32_t z;
    asm volatile("mov.b32 %0, 0;\n" : "=r"(z));  // a zero the compiler cannot fold the mma away with
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%8}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(z));
  }
#endif
}

}  // namespace kdtree
