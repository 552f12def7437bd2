// Kernel launches with programmatic dependent launch (PDL): the kernel may be scheduled while the
// previous kernel on the stream is still finishing, and waits for it on the device
// (grid_dependency_wait in mma_utils.cuh). That hides the launch gap between our main kernel and
// its split combine, and between consecutive calls; stream order and CUDA-graph capture are kept
// (capture records a programmatic edge). -DKDTREE_NO_PDL launches the ordinary way.
#pragma once
#include <cuda_runtime.h>

namespace kdtree {

template <typename... KernelArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
#ifndef KDTREE_NO_PDL
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
#else
  (void)attr;
  cfg.attrs = nullptr;
  cfg.numAttrs = 0;
#endif
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Args&&>(args)...);
}

}  // namespace kdtree
