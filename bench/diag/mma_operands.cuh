// The mma.sync loop pieces that bench/diag/mma_peak.cu (the ceiling) and bench/diag/mma_issue.cu (the
// issue-rate sweep, journal m13) share: per-thread operands that fold to no constant, one m16n8k16
// bf16 mma with fp32 accumulation kept in program order (volatile), and the loop of kChains
// independent accumulator chains both time.
#pragma once
#include <cstdint>

constexpr double kFlopsPerMma16816 = 2.0 * 16 * 8 * 16;  // one m16n8k16 mma: 2 * M * N * K

// Operands differ per thread (nothing folds to a constant); bf16 ~1.0 times ~2^-7.
__device__ __forceinline__ void mma_operands(uint32_t (&a)[4], uint32_t (&b)[2]) {
  const uint32_t seed = threadIdx.x * 2654435761u + blockIdx.x;
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = 0x3f803f80u ^ ((seed >> i) & 0x00010001u);
#pragma unroll
  for (int i = 0; i < 2; ++i) b[i] = 0x3c003c00u ^ ((seed >> (i + 4)) & 0x00010001u);
}

__device__ __forceinline__ void mma_16816(float (&acc)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <int kChains>
__device__ __forceinline__ void zero_chains(float (&acc)[kChains][4]) {
#pragma unroll
  for (int j = 0; j < kChains; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
}

// `iters` rounds of one mma on each of the kChains independent accumulators.
template <int kChains>
__device__ __forceinline__ void mma_chains(float (&acc)[kChains][4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                           long long iters) {
  for (long long it = 0; it < iters; ++it) {
#pragma unroll
    for (int j = 0; j < kChains; ++j) mma_16816(acc[j], a, b);
  }
}
