// Host side of the Hopper configuration. This file is compiled for sm_90a only
// (-gencode=arch=compute_90a,code=sm_90a): wgmma exists on no other target, and a kernel that
// has no image for a GPU fails loudly at cudaFuncSetAttribute instead of running a stub.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdio>
#include <cstring>

#include "combine_kernel.cuh"
#include "hopper_kernel.cuh"
#include "hopper_launch.h"
#include "launch_plan.h"

namespace kdtree {
namespace hopper {
namespace {

constexpr int kMaxDevices = 64;

// Both instantiations (h13: scales folded or applied as given): each needs the shared-memory
// attribute and an image for the device. The folded one, last, is what SGLang's scales run.
void (*const kKernels[])(KdtreeVerifyParams) = {verify_attention_hopper_kernel<false>,
                                                verify_attention_hopper_kernel<true>};

int ensure_smem_attribute(int device, char* err, size_t err_len) {
  static std::atomic<bool> done[kMaxDevices];
  if (device >= 0 && device < kMaxDevices && done[device].load(std::memory_order_acquire)) return KDTREE_OK;
  cudaError_t e = cudaSuccess;
  for (auto kernel : kKernels) {
    if (e == cudaSuccess) e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, HopperConfig::kSmemBytes);
  }
  if (e != cudaSuccess) {
    snprintf(err, err_len,
             "the Hopper kernel cannot run on device %d: cudaFuncSetAttribute(%d bytes of shared memory) failed: %s "
             "(it is built for sm_90a only: H100/H200; set KDTREE_KERNEL=portable elsewhere)",
             device, HopperConfig::kSmemBytes, cudaGetErrorString(e));
    return status_of(e);
  }
  if (device >= 0 && device < kMaxDevices) done[device].store(true, std::memory_order_release);
  return KDTREE_OK;
}

// h13: the scales fold into the softmax's exp2 when they are positive and finite, with room for
// the products and reciprocals the folded kernel forms (SGLang's are ~0.05-1). Anything else
// (zero, negative, huge, NaN) runs the unfolded instantiation, which applies them as given.
bool fold_scales(const KdtreeVerifyParams& p) {
#ifdef KDTREE_NO_SCORE_FOLD  // A/B only: always the unfolded kernel (37272a0's)
  return false;
#else
  auto in_range = [](float x) { return x >= 1e-15f && x <= 1e15f; };  // false for NaN
  return in_range(p.sm_scale) && in_range(p.k_scale) && in_range(p.v_scale);
#endif
}

}  // namespace

static_assert(kRowsPerTile == HopperConfig::kM, "hopper_launch.h and the kernel disagree on the row tile");
static_assert(kMaxSplitsPlan == kMaxSplits, "launch_plan.h and combine_kernel.cuh disagree on the split limit");

int launch(const KdtreeVerifyParams& p, cudaStream_t stream, char* err, size_t err_len) {
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) {
    snprintf(err, err_len, "cudaGetDevice failed: %s", cudaGetErrorString(e));
    return KDTREE_ERR_CUDA;
  }
  int rc = ensure_smem_attribute(device, err, err_len);
  if (rc != KDTREE_OK) return rc;
  const int row_tiles = row_tiles_for(p.num_heads, p.max_qo_len, HopperConfig::kM);
  rc = check_workspace(p, row_tiles, HopperConfig::kM, err, err_len);
  if (rc != KDTREE_OK) return rc;
  if (row_tiles > 65535 * 64) {
    snprintf(err, err_len, "too many query rows per request");
    return KDTREE_ERR_UNSUPPORTED;
  }
  dim3 grid(row_tiles, p.num_splits, p.batch);
  if (fold_scales(p)) {
    verify_attention_hopper_kernel<true><<<grid, HopperConfig::kThreads, HopperConfig::kSmemBytes, stream>>>(p);
  } else {
    verify_attention_hopper_kernel<false><<<grid, HopperConfig::kThreads, HopperConfig::kSmemBytes, stream>>>(p);
  }
  e = cudaGetLastError();
  if (e != cudaSuccess) {
    snprintf(err, err_len, "launch of the Hopper verify kernel (grid %d x %d x %d) failed: %s", row_tiles,
             p.num_splits, p.batch, cudaGetErrorString(e));
    return status_of(e);
  }
  if (p.num_splits > 1) {
    launch_combine<HopperConfig>(p, row_tiles, stream);
    e = cudaGetLastError();
    if (e != cudaSuccess) {
      snprintf(err, err_len, "launch of the split-combine kernel (Hopper) failed: %s", cudaGetErrorString(e));
      return KDTREE_ERR_CUDA;
    }
  }
  return KDTREE_OK;
}

int probe(int device, char* msg, size_t msg_len) {
  cudaFuncAttributes attr;
  cudaError_t e = cudaSuccess;
  for (auto kernel : kKernels) {  // both must have images; attr ends as the folded kernel's
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, kernel);
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    snprintf(msg, msg_len, "no Hopper (sm_90a) kernel image for device %d: %s", device, cudaGetErrorString(e));
    return status_of(e);
  }
  int optin = 0;
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (optin < HopperConfig::kSmemBytes) {
    snprintf(msg, msg_len, "device %d allows %d bytes of shared memory per block; the Hopper kernel needs %d", device,
             optin, HopperConfig::kSmemBytes);
    return KDTREE_ERR_UNSUPPORTED;
  }
  snprintf(msg, msg_len, "Hopper kernel: sm_%d binary, %d registers/thread, %d B dynamic shared memory, %d local bytes",
           attr.binaryVersion, attr.numRegs, HopperConfig::kSmemBytes, static_cast<int>(attr.localSizeBytes));
  return KDTREE_OK;
}

}  // namespace hopper
}  // namespace kdtree

#ifdef KDTREE_TIMELINE
// Diagnostics build only: copies the Hopper kernel's per-CTA milestone stamps (bench/timeline.py).
extern "C" __attribute__((visibility("default"))) int kdtree_timeline_copy(void* host, size_t bytes) {
  return static_cast<int>(cudaMemcpyFromSymbol(host, kdtree::hopper::g_timeline, bytes));
}
#endif
