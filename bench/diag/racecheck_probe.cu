// Does compute-sanitizer racecheck understand the Hopper kernel's P hand-off? (issue 26, item 2)
//
// The Hopper verify kernel (kernel/csrc/hopper/) hands each tile's row rescale factors (s_alpha) from
// the math warpgroup WG0 to the helper warpgroup WG1 with two named barriers in strict alternation:
//   WG0, tile i:  [i > 0: bar.sync PFree, 256]  write s_alpha[64]   bar.arrive PFull, 256
//   WG1, tile i:  bar.sync PFull, 256   read s_alpha[64]   [i + 1 < tiles: bar.arrive PFree, 256]
// so WG1's read of tile i happens before its PFree arrive, which WG0's write of tile i + 1 waits for.
// Racecheck reported hazards between exactly these writes and reads on some shapes (daeca01).
//
// This probe runs that protocol alone, with nothing else in the kernel, for 1..8 tiles:
//   mode 0: the protocol as the kernel has it (one s_alpha buffer);
//   mode 1: s_alpha double-buffered by tile parity (a write never targets the buffer the other
//           warpgroup read last);
//   mode 2: the hand-off by __syncthreads (the textbook form racecheck certainly understands).
// Each block checks the values it read (a real race would show as a mismatch, counted in errors).
//
//   nvcc -O3 -std=c++17 -arch=sm_90a bench/diag/racecheck_probe.cu -o /tmp/rp
//   for m in 0 1 2; do compute-sanitizer --tool racecheck /tmp/rp $m 8; done
#include <cstdio>
#include <cstdlib>

__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

constexpr int kPFull = 1, kPFree = 2, kFinal = 4;

__global__ void __launch_bounds__(256, 1) probe(int mode, int tiles, int* errors, float* sink) {
  __shared__ float s_alpha[2][64];
  const int tid = threadIdx.x;
  const int wg = tid >> 7;
  const int row = (tid & 127) >> 1;  // two threads per row, as the kernel's (lane & 3) == 0 writers
  float acc = 0.f;
  for (int i = 0; i < tiles; ++i) {
    const int buf = mode == 1 ? (i & 1) : 0;
    if (mode == 2) {
      if (wg == 0 && (tid & 1) == 0) s_alpha[buf][row] = static_cast<float>(i * 1000 + row + blockIdx.x);
      __syncthreads();
      if (wg == 1) {
        const float a = s_alpha[buf][row];
        if (a != static_cast<float>(i * 1000 + row + blockIdx.x)) atomicAdd(errors, 1);
        acc += a;
      }
      __syncthreads();
      continue;
    }
    if (wg == 0) {
      if (i > 0) bar_sync(kPFree, 256);  // WG1 is done with tile i-1's values
      if ((tid & 1) == 0) s_alpha[buf][row] = static_cast<float>(i * 1000 + row + blockIdx.x);
      bar_arrive(kPFull, 256);
    } else {
      bar_sync(kPFull, 256);
      const float a = s_alpha[buf][row];
      if (a != static_cast<float>(i * 1000 + row + blockIdx.x)) atomicAdd(errors, 1);
      acc += a;
      if (i + 1 < tiles) bar_arrive(kPFree, 256);
    }
  }
  bar_sync(kFinal, 256);
  if (acc == -1.f) sink[tid] = acc;  // keep the reads
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? atoi(argv[1]) : 0;
  const int max_tiles = argc > 2 ? atoi(argv[2]) : 8;
  int* errors;
  float* sink;
  cudaMalloc(&errors, sizeof(int));
  cudaMalloc(&sink, 256 * sizeof(float));
  int total = 0;
  for (int tiles = 1; tiles <= max_tiles; ++tiles) {
    cudaMemset(errors, 0, sizeof(int));
    probe<<<4, 256>>>(mode, tiles, errors, sink);
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      printf("mode %d tiles %d: CUDA error %s\n", mode, tiles, cudaGetErrorString(e));
      return 2;
    }
    int h = 0;
    cudaMemcpy(&h, errors, sizeof(int), cudaMemcpyDeviceToHost);
    total += h;
    printf("mode %d tiles %d: %d wrong values read\n", mode, tiles, h);
  }
  printf("RESULT mode %d: %d wrong values over 1..%d tiles\n", mode, total, max_tiles);
  return total == 0 ? 0 : 1;
}
