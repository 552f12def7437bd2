// Host side of the warp-specialised portable kernel (p16, kernel_ws.cuh): its launch and its probe.
// This translation unit is built for the arch-specific targets only (sm_90a, sm_100a, sm_120a: the
// kernel's setmaxnreg exists nowhere else) and embeds no PTX, so on any other GPU the kernel has no
// image, ws::available says so, and portable/launch.cu runs the tiled kernel instead.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>

#include "../common/launch.h"
#include "../common/launch_plan.h"
#include "kernel_ws.cuh"
#include "launch.h"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL) && !defined(__CUDA_ARCH_FEAT_SM100_ALL) && \
    !defined(__CUDA_ARCH_FEAT_SM120_ALL)
#error "portable/launch_ws.cu builds for sm_90a, sm_100a and sm_120a only (setmaxnreg); see build.py"
#endif

// The diagnostics build's per-tile stamps of this kernel (common/tile_stamps.cuh; nothing in a release build).
KDTREE_TILE_STAMPS_READER(kdtree_tile_stamps_copy)

namespace kdtree {
namespace portable {
namespace ws {
namespace {

using Kernel = void (*)(KdtreeVerifyParams);
// s1e: a launch of one request (no batch scan, no walk), and any batch (the last: the probe's).
const Kernel kKernels[] = {verify_ws_kernel<true>, verify_ws_kernel<false>};
KernelFamily<Kernel, 2> g_kernels("the portable verify kernel (warp-specialised)", "", WsLayout::kBytes, kKernels);

// Per device: 0 not asked yet, 1 cannot run, 2 can run.
std::atomic<int> g_available[kMaxDevices] = {};

}  // namespace

static_assert(kRowsPerTile == WsConfig::kM, "portable/launch.h and the warp-specialised kernel disagree on the row tile");

int probe(int device, char* msg, size_t msg_len) {
  cudaFuncAttributes attr;
  // The setmaxnreg plan holds only at its launch register count (WsConfig::kLaunchRegs): with fewer,
  // setmaxnreg.inc would wait forever. The build check refuses such a library; this refuses a binary
  // that got here anyway (another toolkit's ptxas, a JIT), and the tiled kernel runs instead.
  const int rc = g_kernels.probe(device, attr, msg, msg_len, [msg, msg_len](const cudaFuncAttributes& a) {
    if (a.numRegs == WsConfig::kLaunchRegs) return static_cast<int>(KDTREE_OK);
    return report(KDTREE_ERR_UNSUPPORTED, msg, msg_len,
                  "warp-specialised kernel refused: binary sm_%da launches at %d registers a thread, its setmaxnreg "
                  "plan needs %d (QK %d, PV %d); the tiled kernel runs",
                  a.binaryVersion, a.numRegs, WsConfig::kLaunchRegs, WsConfig::kQkRegs, WsConfig::kPvRegs);
  });
  if (rc != KDTREE_OK) return rc;
  snprintf(msg, msg_len,
           "warp-specialised kernel: binary sm_%da, %d registers/thread at launch, %d B static + %d B dynamic "
           "shared memory, %d local bytes",
           attr.binaryVersion, attr.numRegs, static_cast<int>(attr.sharedSizeBytes), WsLayout::kBytes,
           static_cast<int>(attr.localSizeBytes));
  return KDTREE_OK;
}

bool available(int device) {
  const bool known = device >= 0 && device < kMaxDevices;
  if (known) {
    const int v = g_available[device].load(std::memory_order_acquire);
    if (v) return v == 2;
  }
  char msg[320];
  const bool ok = probe(device, msg, sizeof(msg)) == KDTREE_OK;
  if (known) g_available[device].store(ok ? 2 : 1, std::memory_order_release);
  return ok;
}

int launch(const KdtreeVerifyParams& p, cudaStream_t stream, char* err, size_t err_len) {
  int row_tiles = 0, extra = 0;
  int rc = g_kernels.prepare(p, WsConfig::kM, row_tiles, extra, err, err_len);
  if (rc != KDTREE_OK) return rc;
  const dim3 grid = verify_grid(p, row_tiles, extra);  // one plan and one grid for both tilings
  // h47: a programmatic dependent of the previous kernel; the kernel waits for it before touching memory.
  const cudaError_t e =
      launch_programmatic(kKernels[p.batch == 1 ? 0 : 1], grid, dim3(WsConfig::kThreads), WsLayout::kBytes, stream, p);
  rc = g_kernels.launched(grid, err, err_len, e);
  if (rc != KDTREE_OK) return rc;
  return combine(p, row_tiles, extra, stream, err, err_len, /*pdl=*/true);  // s9: the kernel triggers it
}

}  // namespace ws
}  // namespace portable
}  // namespace kdtree
