// How many clusters of 1, 2, 4, 8 CTAs of the Hopper verify kernel's shape (256 threads, 230,184 B
// of dynamic shared memory, one CTA per SM) the GPU holds at once (cudaOccupancyMaxActiveClusters).
// A one-wave plan cut into clusters loses a wave if the GPCs' SM counts leave too few pairs.
//     nvcc -O2 -arch=sm_90a -o /tmp/cluster_probe bench/diag/cluster_probe.cu && /tmp/cluster_probe
#include <cstdio>
#include <cuda_runtime.h>

__global__ void __launch_bounds__(256, 1) shape_kernel(int* p) {
  extern __shared__ int smem[];
  smem[threadIdx.x] = threadIdx.x;
  __syncthreads();
  if (p) p[blockIdx.x] = smem[255 - threadIdx.x];
}

int main() {
  const int smem = 230184;
  cudaFuncSetAttribute(shape_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(shape_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  printf("{\"sms\": %d", sms);
  for (int c = 1; c <= 16; c *= 2) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(c * 64, 1, 1);
    cfg.blockDim = dim3(256, 1, 1);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = c;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int n = -1;
    cudaError_t e = cudaOccupancyMaxActiveClusters(&n, shape_kernel, &cfg);
    printf(", \"clusters_of_%d\": %d", c, e == cudaSuccess ? n : -1);
    if (e != cudaSuccess) cudaGetLastError();
  }
  printf("}\n");
  return 0;
}
