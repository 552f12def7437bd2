// Host side of the portable configuration: the launch of the verify kernel in the tiling the device
// runs (portable/launch.h), the split combine after a split plan, and the device probe. This
// translation unit holds the tiled kernels and the combine; the library builds it for every arch it
// ships (sm_90, sm_100, sm_120 SASS + the newest arch's PTX).
#include <cuda_runtime.h>

#include <cstdio>

#include "../combine/launch.cuh"
#include "../common/launch.h"
#include "../common/launch_plan.h"
#include "kernel.cuh"
#include "launch.h"

namespace kdtree {
namespace portable {
namespace {

using Cfg = PortableConfig;
constexpr int kSmemBytes = SmemLayout<Cfg>::kBytes;
using Kernel = void (*)(KdtreeVerifyParams);
// s1e: a launch of one request (no batch scan, no walk), and any batch (the last: the probe's).
const Kernel kKernels[] = {verify_attention_kernel<Cfg, true>, verify_attention_kernel<Cfg, false>};
KernelFamily<Kernel, 2> g_kernels("the portable verify kernel (tiled)", "", kSmemBytes, kKernels);

}  // namespace

static_assert(kRowsPerTile == Cfg::kM, "portable/launch.h and the kernel disagree on the row tile");

int combine(const KdtreeVerifyParams& p, int row_tiles, int extra, cudaStream_t stream, char* err, size_t err_len,
            bool pdl) {
  if (!split_launch(p.num_splits, extra)) return KDTREE_OK;
  // s9: after the warp-specialised kernel, whose CTAs trigger it at their part's last segment, the
  // merge of up to kCombinePdlMaxSplits pieces a request is a programmatic dependent (h39b's rule).
  const cudaError_t e = pdl ? launch_combine<Cfg, true>(p, row_tiles, extra, stream) : launch_combine<Cfg>(p, row_tiles, extra, stream);
  if (e != cudaSuccess)
    return report(KDTREE_ERR_CUDA, err, err_len, "launch of the split-combine kernel failed: %s", cudaGetErrorString(e));
  return KDTREE_OK;
}

int launch(const KdtreeVerifyParams& p, bool tiled_only, cudaStream_t stream, char* err, size_t err_len) {
  if (!tiled_only) {
    int device = 0;
    const int rc = current_device(device, err, err_len);
    if (rc != KDTREE_OK) return rc;
    if (ws::available(device)) return ws::launch(p, stream, err, err_len);
  }
  int row_tiles = 0, extra = 0;
  int rc = g_kernels.prepare(p, Cfg::kM, row_tiles, extra, err, err_len);
  if (rc != KDTREE_OK) return rc;
  const dim3 grid = verify_grid(p, row_tiles, extra);
  kKernels[p.batch == 1 ? 0 : 1]<<<grid, Cfg::kThreads, kSmemBytes, stream>>>(p);
  rc = g_kernels.launched(grid, err, err_len);
  if (rc != KDTREE_OK) return rc;
  return combine(p, row_tiles, extra, stream, err, err_len);
}

int probe(int device, char* msg, size_t msg_len) {
  cudaFuncAttributes attr;
  const int rc = g_kernels.probe(device, attr, msg, msg_len);
  if (rc != KDTREE_OK) return rc;
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, device);
  char ws_msg[320] = "";
  const bool ws = ws::probe(device, ws_msg, sizeof(ws_msg)) == KDTREE_OK;
  snprintf(msg, msg_len,
           "device %d (%s, compute capability %d.%d): runs the %s kernel; %s; tiled kernel: binary sm_%d, %d "
           "registers/thread, %d B static + %d B dynamic shared memory, %d local bytes",
           device, prop.name, prop.major, prop.minor, ws ? "warp-specialised" : "tiled", ws_msg, attr.binaryVersion,
           attr.numRegs,
           static_cast<int>(attr.sharedSizeBytes), kSmemBytes, static_cast<int>(attr.localSizeBytes));
  return KDTREE_OK;
}

}  // namespace portable
}  // namespace kdtree
