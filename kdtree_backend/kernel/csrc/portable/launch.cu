// Host side of the portable configuration: the launch of the verify kernel (and of the split combine
// after a split plan) and the device probe. This translation unit holds the portable kernels; the
// library builds it for every arch it ships (sm_90 and sm_120).
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "../combine/launch.cuh"
#include "../common/launch.h"
#include "../common/launch_plan.h"
#include "kernel.cuh"
#include "kernel_ws.cuh"
#include "launch.h"

namespace kdtree {
namespace portable {
namespace {

using Kernel = void (*)(KdtreeVerifyParams);
// Two tilings of one family (docs/kernel/portable.md). The warp-specialised kernel (p16: QK and PV warps,
// setmaxnreg) exists as machine code for the arch-specific targets the library is built for (sm_90a,
// sm_100a, sm_120a: exactly compute capability 9.0, 10.0, 12.0); every other GPU JIT-compiles the
// embedded PTX, which holds the tiled kernel only (its warp-specialised body traps). s1e: a launch of
// one request (no batch scan, no walk), and any batch (the last: the probe's).
using Tiled = PortableConfig;
const Kernel kTiledKernels[] = {verify_attention_kernel<Tiled, true>, verify_attention_kernel<Tiled, false>};
KernelFamily<Kernel, 2> g_tiled("the portable verify kernel (tiled)", "", SmemLayout<Tiled>::kBytes, kTiledKernels);
const Kernel kWsKernels[] = {verify_ws_kernel<true>, verify_ws_kernel<false>};
KernelFamily<Kernel, 2> g_ws("the portable verify kernel (warp-specialised)", "", WsLayout::kBytes, kWsKernels);
static_assert(Tiled::kM == WsConfig::kM && Tiled::kBN == WsConfig::kBN, "one plan and one combine for both tilings");

// Whether `device` runs the warp-specialised kernel: its compute capability is one the library carries
// arch-specific machine code for (kdtree_built_archs(), e.g. "90,100,120"). Read once per device.
std::atomic<int> g_ws_of[kMaxDevices] = {};  // 0 unknown, 1 tiled, 2 warp-specialised
bool uses_ws(int device) {
  const bool known = device >= 0 && device < kMaxDevices;
  if (known) {
    const int v = g_ws_of[device].load(std::memory_order_acquire);
    if (v) return v == 2;
  }
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  const int cc = major * 10 + minor;
  bool ws = false;
  for (const char* a = kdtree_built_archs(); *a;) {
    char* end = nullptr;
    const long v = std::strtol(a, &end, 10);
    if (end == a) break;
    ws = ws || v == cc;
    a = *end == ',' ? end + 1 : end;
  }
  if (known) g_ws_of[device].store(ws ? 2 : 1, std::memory_order_release);
  return ws;
}

int current_device(int& device, char* err, size_t err_len) {
  const cudaError_t e = cudaGetDevice(&device);
  return e == cudaSuccess ? KDTREE_OK
                          : report(KDTREE_ERR_CUDA, err, err_len, "cudaGetDevice failed: %s", cudaGetErrorString(e));
}

}  // namespace

static_assert(kRowsPerTile == Tiled::kM, "portable/launch.h and the kernel disagree on the row tile");

int launch(const KdtreeVerifyParams& p, cudaStream_t stream, char* err, size_t err_len) {
  int device = 0;
  int rc = current_device(device, err, err_len);
  if (rc != KDTREE_OK) return rc;
  const bool ws = uses_ws(device);
  KernelFamily<Kernel, 2>& family = ws ? g_ws : g_tiled;
  const Kernel* kernels = ws ? kWsKernels : kTiledKernels;
  int row_tiles = 0, extra = 0;
  rc = family.prepare(p, Tiled::kM, row_tiles, extra, err, err_len);
  if (rc != KDTREE_OK) return rc;
  // A launch of one request: the 2-D grid (row tiles, parts); a batch: row tiles x parts main CTAs
  // (row tile fastest) and the extra CTAs of the wave's idle SMs (s3), in one dimension
  // (common/schedule.cuh).
  const dim3 grid = p.batch == 1 ? dim3(row_tiles, p.num_splits) : dim3(row_tiles * p.num_splits + extra);
  kernels[p.batch == 1 ? 0 : 1]<<<grid, ws ? WsConfig::kThreads : Tiled::kThreads, family.smem_bytes(), stream>>>(p);
  rc = family.launched(grid, err, err_len);
  if (rc != KDTREE_OK) return rc;
  if (split_launch(p.num_splits, extra)) {
    const cudaError_t e = launch_combine<Tiled>(p, row_tiles, extra, stream);
    if (e != cudaSuccess)
      return report(KDTREE_ERR_CUDA, err, err_len, "launch of the split-combine kernel failed: %s", cudaGetErrorString(e));
  }
  return KDTREE_OK;
}

int probe(int device, char* msg, size_t msg_len) {
  const bool ws = uses_ws(device);
  const KernelFamily<Kernel, 2>& family = ws ? g_ws : g_tiled;
  cudaFuncAttributes attr;
  const int rc = family.probe(device, attr, msg, msg_len);
  if (rc != KDTREE_OK) return rc;
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, device);
  snprintf(msg, msg_len,
           "device %d (%s, compute capability %d.%d): %s kernel, binary sm_%d%s, %d registers/thread, %d B static + %d B "
           "dynamic shared memory, %d local bytes",
           device, prop.name, prop.major, prop.minor, ws ? "warp-specialised" : "tiled", attr.binaryVersion,
           ws ? "a" : (attr.binaryVersion == attr.ptxVersion ? "" : " (PTX JIT)"), attr.numRegs,
           static_cast<int>(attr.sharedSizeBytes), family.smem_bytes(), static_cast<int>(attr.localSizeBytes));
  return KDTREE_OK;
}

}  // namespace portable
}  // namespace kdtree
