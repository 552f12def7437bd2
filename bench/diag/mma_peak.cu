// mma.sync peak: the ceiling of the portable kernel path's tensor-core instruction.
//
// bf16 inputs, fp32 accumulation, `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`, operands
// in registers only (no shared or global memory in the loop), kAcc independent accumulators per
// warp so the tensor pipe never waits on a previous result, 2 blocks of 8 warps on every SM. The
// iteration count is grown until one launch runs at least `min_ms` milliseconds (50 by default:
// long enough to include the H200's power-cap step, as the benchmark's long rows do); the result
// is the median of `repeats` such launches. FLOPs = 2 * 16 * 8 * 16 per instruction.
//
// Used in-process by bench/bench_verify.py (ceilings.mma_sync_tflops), which compiles it at run
// time for the GPU's architecture:
//   nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC -gencode=arch=compute_90,code=sm_90 mma_peak.cu -o mma_peak.so
// Standalone:
//   nvcc -O3 -std=c++17 -DMMA_PEAK_MAIN -gencode=arch=compute_90,code=sm_90 bench/diag/mma_peak.cu -o /tmp/mma_peak
//   /tmp/mma_peak [min_ms] [repeats]
#include <cuda_runtime.h>

#include "mma_operands.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

constexpr int kAcc = 8;             // independent m16n8 accumulators per warp
constexpr int kWarpsPerBlock = 8;
constexpr int kBlocksPerSm = 2;

__global__ void __launch_bounds__(kWarpsPerBlock * 32) mma_peak_kernel(long long iters, float* out) {
  uint32_t a[4], b[2];
  mma_operands(a, b);
  float acc[kAcc][4];
  zero_chains(acc);
  mma_chains(acc, a, b, iters);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < kAcc; ++j) s += acc[j][0] + acc[j][1] + acc[j][2] + acc[j][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;  // keeps the loop's results alive
}

int time_launch(int blocks, long long iters, float* out, float* ms) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  mma_peak_kernel<<<blocks, kWarpsPerBlock * 32>>>(iters, out);
  cudaEventRecord(e1);
  cudaError_t err = cudaEventSynchronize(e1);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err == cudaSuccess) cudaEventElapsedTime(ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return static_cast<int>(err);
}

}  // namespace

extern "C" {

// The peak on the current device: TFLOP/s (median of `repeats` launches of >= min_ms each), the
// median launch time, the iteration count and the launch's blocks. Returns a cudaError_t (0: ok).
int mma_peak(double min_ms, int repeats, double* tflops, double* median_ms, long long* iters_out, int* blocks_out) {
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const int blocks = std::max(1, sms) * kBlocksPerSm;
  float* out = nullptr;
  int rc = static_cast<int>(cudaMalloc(&out, sizeof(float) * blocks * kWarpsPerBlock * 32));
  if (rc != 0) return rc;
  long long iters = 1024;
  float ms = 0.f;
  rc = time_launch(blocks, iters, out, &ms);  // warm-up (module load, clocks up)
  for (int grow = 0; rc == 0 && ms < min_ms && grow < 40; ++grow) {
    const double scale = ms > 0.f ? std::min(64.0, 1.15 * min_ms / ms) : 64.0;
    iters = static_cast<long long>(iters * std::max(1.5, scale));
    rc = time_launch(blocks, iters, out, &ms);
  }
  std::vector<float> runs;
  for (int r = 0; rc == 0 && r < std::max(1, repeats); ++r) {
    rc = time_launch(blocks, iters, out, &ms);
    runs.push_back(ms);
  }
  cudaFree(out);
  if (rc != 0) return rc;
  std::sort(runs.begin(), runs.end());
  const double med = runs[runs.size() / 2];
  const double flops = kFlopsPerMma16816 * kAcc * static_cast<double>(iters) * blocks * kWarpsPerBlock;
  *tflops = flops / (med * 1e-3) / 1e12;
  *median_ms = med;
  *iters_out = iters;
  *blocks_out = blocks;
  return 0;
}

const char* mma_peak_error_string(int rc) { return cudaGetErrorString(static_cast<cudaError_t>(rc)); }

}  // extern "C"

#ifdef MMA_PEAK_MAIN
#include <cstdlib>
int main(int argc, char** argv) {
  const double min_ms = argc > 1 ? std::atof(argv[1]) : 50.0;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 5;
  double tflops = 0, ms = 0;
  long long iters = 0;
  int blocks = 0;
  const int rc = mma_peak(min_ms, repeats, &tflops, &ms, &iters, &blocks);
  if (rc != 0) {
    std::fprintf(stderr, "mma_peak: %s\n", mma_peak_error_string(rc));
    return 1;
  }
  std::printf("{\"mma_sync_tflops\": %.1f, \"median_ms\": %.2f, \"iters\": %lld, \"blocks\": %d}\n", tflops, ms,
              iters, blocks);
  return 0;
}
#endif
