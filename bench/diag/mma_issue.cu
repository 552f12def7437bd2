// How fast ONE warp can issue mma.sync (journal m13): the tensor-pipe rate of an SM sub-partition
// (scheduler) as a function of the warps it runs and the independent accumulator chains each warp
// has. The warp-specialised portable kernel runs one QK warp and two PV warps a scheduler; its QK
// warp issues 144 mma a tile at one per ~16 cycles (ncu, B32 H8 n64 L8k), far below the pipe's
// rate: is that the warp's own issue limit, its chains' latency, or its other work?
//
// One CTA of 4 * W warps per SM (W warps a scheduler), kChains independent m16n8k16 bf16 chains a
// warp, operands in registers; each chain's result is stored on its own (every chain stays live and
// no reduction follows the loop). Reports TFLOP/s over all SMs (the number to read) and cycles per mma per warp from each
// warp's clock64 span (the per-scheduler column divides it by W, which flatters W > 1 when the warps'
// spans do not overlap fully).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 bench/diag/mma_issue.cu -o /tmp/mma_issue
//   /tmp/mma_issue
#include <cuda_runtime.h>

#include "mma_operands.cuh"

#include <cstdint>
#include <cstdio>

template <int kChains>
__global__ void mma_issue_kernel(long long iters, float* out, long long* cycles) {
  uint32_t a[4], b[2];
  mma_operands(a, b);
  float acc[kChains][4];
  zero_chains(acc);
  __syncthreads();
  const long long t0 = clock64();
  mma_chains(acc, a, b, iters);
  const long long t1 = clock64();
  float* o = out + (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * kChains * 4;
#pragma unroll
  for (int j = 0; j < kChains; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j * 4 + e] = acc[j][e];
  if ((threadIdx.x & 31) == 0) cycles[blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32] = t1 - t0;
}

template <int kChains>
void run(int sms, int warps_per_sched, float* out, long long* cycles) {
  const int threads = 4 * warps_per_sched * 32;
  const long long iters = 4096 / kChains * 16;
  mma_issue_kernel<kChains><<<sms, threads>>>(iters, out, cycles);  // warm-up
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  mma_issue_kernel<kChains><<<sms, threads>>>(iters, out, cycles);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  const int nw = sms * threads / 32;
  long long* h = new long long[nw];
  cudaMemcpy(h, cycles, nw * sizeof(long long), cudaMemcpyDeviceToHost);
  double mean = 0;
  for (int i = 0; i < nw; ++i) mean += static_cast<double>(h[i]) / nw;
  delete[] h;
  const double mmas_per_warp = static_cast<double>(iters) * kChains;
  const double flops = kFlopsPerMma16816 * mmas_per_warp * nw;
  printf("warps/scheduler %d  chains %d  %7.1f TFLOP/s  %6.2f cycles/mma/warp  %6.2f cycles/mma/scheduler\n",
         warps_per_sched, kChains, flops / (ms * 1e-3) / 1e12, mean / mmas_per_warp,
         mean / mmas_per_warp / warps_per_sched);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out;
  long long* cycles;
  cudaMalloc(&out, static_cast<size_t>(sms) * 512 * 16 * 4 * sizeof(float));
  cudaMalloc(&cycles, static_cast<size_t>(sms) * 16 * sizeof(long long));
  for (int w = 1; w <= 3; ++w) {
    run<1>(sms, w, out, cycles);
    run<2>(sms, w, out, cycles);
    run<4>(sms, w, out, cycles);
    run<8>(sms, w, out, cycles);
    run<16>(sms, w, out, cycles);
  }
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("CUDA error %s\n", cudaGetErrorString(e));
    return 1;
  }
  return 0;
}
