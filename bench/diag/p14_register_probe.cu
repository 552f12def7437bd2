// Journal p14: the register budget of the two warp roles proposed for the portable kernel's next form,
// read from ptxas (compile only; the kernel computes nothing meaningful and is never launched):
//   * QK role (warps 0-3, one warpgroup): 32 rows x 288 depth, Q fragments in registers (144), the
//     scores of 32 rows x 32 keys (32), K fragments by ldmatrix;
//   * PV role (warps 4-11): 64 rows x 64 columns of fp32 accumulators (128), P and V by ldmatrix.
// 384 threads at one CTA an SM start at 168 registers; setmaxnreg moves them between the roles.
//     for q in 184 192 200; do nvcc -arch=sm_120a -DSETMAXNREG -DQKREG="\"$q\"" -DPVREG="\"160\"" \
//         -cubin -o /tmp/p.cubin bench/diag/p14_register_probe.cu -Xptxas -v 2>&1 | grep spill; done
// Measured (nvcc 13.0): PV needs 160 (152 spills 636 B); QK at 192 spills 4 B on sm_120a, 0 on
// sm_90a; 200 / 160 would be 66,560 registers, 1,024 over the SM's 65,536.
#include <cuda_runtime.h>
#include <stdint.h>
__device__ __forceinline__ void ldsm4(uint32_t a, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
__device__ __forceinline__ void ldsm4t(uint32_t a, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
extern __shared__ __align__(16) unsigned char smem[];
__global__ void __launch_bounds__(384, 1) roles(float* out, int tiles) {
  const int lane = threadIdx.x & 31;
  const int warp = static_cast<int>(__reduce_max_sync(0xffffffffu, static_cast<unsigned>(threadIdx.x >> 5)));
  const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if (wg == 0) {
#ifdef SETMAXNREG
    asm volatile("setmaxnreg.inc.sync.aligned.u32 " QKREG ";\n");
#endif
    const int g = warp >> 1, half = warp & 1;
    uint32_t q[2][18][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int ks = 0; ks < 18; ++ks)
        ldsm4(base + ((32 * g + 16 * mt + (lane & 15)) * 1168 + (half * 288 + ks * 16 + (lane >> 4) * 8) * 2), q[mt][ks][0], q[mt][ks][1], q[mt][ks][2], q[mt][ks][3]);
    for (int t = 0; t < tiles; ++t) {
      float s[2][4][4] = {};
      const uint32_t kt = base + 74752 * 0 + (t & 1) * 37376;
#pragma unroll
      for (int ks = 0; ks < 18; ++ks) {
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) {
          uint32_t b0, b1, b2, b3;
          ldsm4(kt + ((16 * nb + (lane & 15)) * 1168 + (half * 288 + ks * 16 + (lane >> 4) * 8) * 2), b0, b1, b2, b3);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma(s[mt][2 * nb], q[mt][ks], b0, b2);
            mma(s[mt][2 * nb + 1], q[mt][ks], b1, b3);
          }
        }
      }
      float* dst = reinterpret_cast<float*>(smem + 90000) + (warp * 32 + lane) * 32;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int n = 0; n < 4; ++n)
#pragma unroll
          for (int i = 0; i < 4; ++i) dst[(mt * 16 + n * 4 + i) & 31] = s[mt][n][i];
      asm volatile("bar.sync 1, 384;\n");
    }
  } else {
#ifdef SETMAXNREG
    asm volatile("setmaxnreg.dec.sync.aligned.u32 " PVREG ";\n");
#endif
    const int w = warp - 4;
    float o[4][8][4] = {};
    for (int t = 0; t < tiles; ++t) {
      asm volatile("bar.sync 1, 384;\n");
      const uint32_t vt = base + (t & 1) * 37376;
      const uint32_t pb = base + 80000 + (t & 1) * 4096;
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {
        uint32_t pa[4][4];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) ldsm4(pb + (16 * mt + (lane & 15)) * 64 + ((2 * kk + (lane >> 4)) << 4), pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t b0, b1, b2, b3;
          ldsm4t(vt + (16 * kk + (lane & 15)) * 1168 + (64 * w + 16 * j + (lane >> 4) * 8) * 2, b0, b1, b2, b3);
#pragma unroll
          for (int mt = 0; mt < 4; ++mt) {
            mma(o[mt][2 * j], pa[mt], b0, b1);
            mma(o[mt][2 * j + 1], pa[mt], b2, b3);
          }
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int f = 0; f < 8; ++f)
#pragma unroll
        for (int i = 0; i < 4; ++i) out[((mt * 8 + f) * 4 + i) * 384 + threadIdx.x] = o[mt][f][i];
  }
}
