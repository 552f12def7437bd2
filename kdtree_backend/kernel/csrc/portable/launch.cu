// Host side of the portable configuration: the launch of the verify kernel (and of the split combine
// after a split plan) and the device probe. This translation unit holds the portable kernels; the
// library builds it for every arch it ships (sm_90 and sm_120).
#include <cuda_runtime.h>

#include <cstdio>

#include "../combine/launch.cuh"
#include "../common/launch.h"
#include "../common/launch_plan.h"
#include "kernel.cuh"
#include "kernel_ws.cuh"
#include "launch.h"

namespace kdtree {
namespace portable {
namespace {

// p14 experiment: the warp-specialised kernel (arch-specific targets only).
using Cfg = WsConfig;
constexpr int kSmemBytes = WsLayout::kBytes;
using Kernel = void (*)(KdtreeVerifyParams);
// s1e: a launch of one request (no batch scan, no walk), and any batch (the last: the probe's).
const Kernel kKernels[] = {verify_ws_kernel<true>, verify_ws_kernel<false>};
KernelFamily<Kernel, 2> g_kernels("the portable verify kernel", "", kSmemBytes, kKernels);

}  // namespace

static_assert(kRowsPerTile == Cfg::kM, "portable/launch.h and the kernel disagree on the row tile");

int launch(const KdtreeVerifyParams& p, cudaStream_t stream, char* err, size_t err_len) {
  int row_tiles = 0, extra = 0;
  int rc = g_kernels.prepare(p, Cfg::kM, row_tiles, extra, err, err_len);
  if (rc != KDTREE_OK) return rc;
  // A launch of one request: the 2-D grid (row tiles, parts); a batch: row tiles x parts main CTAs
  // (row tile fastest) and the extra CTAs of the wave's idle SMs (s3), in one dimension
  // (common/schedule.cuh).
  const dim3 grid = p.batch == 1 ? dim3(row_tiles, p.num_splits) : dim3(row_tiles * p.num_splits + extra);
  kKernels[p.batch == 1 ? 0 : 1]<<<grid, Cfg::kThreads, kSmemBytes, stream>>>(p);
  rc = g_kernels.launched(grid, err, err_len);
  if (rc != KDTREE_OK) return rc;
  if (split_launch(p.num_splits, extra)) {
    const cudaError_t e = launch_combine<Cfg>(p, row_tiles, extra, stream);
    if (e != cudaSuccess)
      return report(KDTREE_ERR_CUDA, err, err_len, "launch of the split-combine kernel failed: %s", cudaGetErrorString(e));
  }
  return KDTREE_OK;
}

int probe(int device, char* msg, size_t msg_len) {
  cudaFuncAttributes attr;
  const int rc = g_kernels.probe(device, attr, msg, msg_len);
  if (rc != KDTREE_OK) return rc;
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, device);
  snprintf(msg, msg_len,
           "device %d (%s, compute capability %d.%d): kernel binary sm_%d, %d registers/thread, %d B static + %d B "
           "dynamic shared memory, %d local bytes",
           device, prop.name, prop.major, prop.minor, attr.binaryVersion, attr.numRegs,
           static_cast<int>(attr.sharedSizeBytes), kSmemBytes, static_cast<int>(attr.localSizeBytes));
  return KDTREE_OK;
}

}  // namespace portable
}  // namespace kdtree
