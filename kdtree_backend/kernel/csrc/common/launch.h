// The launch helper both launchers use (portable/launch.cu, hopper/launch.cu): what every launch does
// before and after its kernel (the device's shared-memory attribute, set once per device; the
// workspace and grid checks; the launch's error) and the device probe (an image for the device, the
// shared memory it allows), with one way of formatting their failures. Host code only.
#pragma once
#include <cuda_runtime.h>
#include <stddef.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "../kdtree_api.h"
#include "launch_plan.h"

namespace kdtree {

constexpr int kMaxDevices = 64;  // devices whose shared-memory attribute is remembered as set

// Launches `kernel` as a programmatic dependent (PDL) of the work before it in the stream: its CTAs
// may start once the previous kernel's CTAs have triggered (griddepcontrol.launch_dependents) or
// exited, before that grid has completed. The kernel must call pdl_wait_primary() (common/ptx.cuh)
// before its first global memory access; what comes before it overlaps the previous kernel's tail.
template <class... Params, class... Args>
inline cudaError_t launch_programmatic(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                                       cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute pdl;
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &pdl;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Args&&>(args)...);
}

// Formats a failure's reason into err (a caller's buffer) and returns its KdtreeStatus.
inline int report(int code, char* err, size_t err_len, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, err_len, fmt, ap);
  va_end(ap);
  return code;
}

// The calling thread's current device, as a KdtreeStatus with the reason in err.
inline int current_device(int& device, char* err, size_t err_len) {
  const cudaError_t e = cudaGetDevice(&device);
  return e == cudaSuccess ? KDTREE_OK
                          : report(KDTREE_ERR_CUDA, err, err_len, "cudaGetDevice failed: %s", cudaGetErrorString(e));
}

// The grid of every verify launch (both portable tilings and the Hopper kernel): a launch of one
// request, the 2-D grid (row tiles, parts); a batch, row tiles x parts main CTAs (row tile fastest)
// and the extra CTAs of the wave's idle SMs (s3), in one dimension (common/schedule.cuh).
inline dim3 verify_grid(const KdtreeVerifyParams& p, int row_tiles, int extra) {
  return p.batch == 1 ? dim3(row_tiles, p.num_splits) : dim3(row_tiles * p.num_splits + extra);
}

// Every instantiation one launcher may launch, the dynamic shared memory they take, and how its
// messages name them. `Kernel` is the kernels' function-pointer type.
template <class Kernel, int N>
class KernelFamily {
 public:
  // name: "the portable verify kernel"; hint: appended to an image failure (may be "").
  KernelFamily(const char* name, const char* hint, int smem_bytes, const Kernel (&kernels)[N])
      : name_(name), hint_(hint), smem_bytes_(smem_bytes) {
    for (int i = 0; i < N; ++i) kernels_[i] = kernels[i];
  }

  int smem_bytes() const { return smem_bytes_; }

  // Before a launch of `p` in tiles of `rows_per_tile` rows: the current device's shared-memory
  // attribute (set once per device), the workspace, the grid's row-tile limit. Fills row_tiles and
  // extra (s3: the remainder CTAs of a batch launch, from the device's SM count as the plan had it).
  int prepare(const KdtreeVerifyParams& p, int rows_per_tile, int& row_tiles, int& extra, char* err, size_t err_len) {
    int device = 0;
    int rc = current_device(device, err, err_len);
    if (rc != KDTREE_OK) return rc;
    rc = ensure_smem_attribute(device, err, err_len);
    if (rc != KDTREE_OK) return rc;
    int sms = 0;
    rc = device_sms(device, sms, err, err_len);
    if (rc != KDTREE_OK) return rc;
    row_tiles = row_tiles_of(p.num_heads, p.max_qo_len, rows_per_tile);
    extra = extra_ctas(p.batch, row_tiles, p.num_splits, sms);
    rc = check_workspace(p, row_tiles, rows_per_tile, extra, err, err_len);
    if (rc != KDTREE_OK) return rc;
    if (row_tiles > 65535 * 64) return report(KDTREE_ERR_UNSUPPORTED, err, err_len, "too many query rows per request");
    return KDTREE_OK;
  }

  // Right after the kernel's launch: its error, if any, as a status (`returned`: what a launch call
  // that returns its error gave; the sticky last error is read and cleared either way).
  int launched(const dim3& grid, char* err, size_t err_len, cudaError_t returned = cudaSuccess) const {
    const cudaError_t last = cudaGetLastError();
    const cudaError_t e = returned != cudaSuccess ? returned : last;
    if (e == cudaSuccess) return KDTREE_OK;
    return report(status_of(e), err, err_len, "launch of %s (grid %d x %d x %d) failed: %s", name_, grid.x, grid.y,
                  grid.z, cudaGetErrorString(e));
  }

  // Every kernel has an image for `device` (the current one), the device allows their shared memory,
  // and each kernel's attributes pass `check` (KDTREE_OK, or a status with its line in msg: a family's
  // own condition, e.g. the warp-specialised kernel's launch register count); attr: the last kernel's
  // attributes, for the caller's report.
  template <class Check>
  int probe(int device, cudaFuncAttributes& attr, char* msg, size_t msg_len, Check check) const {
    cudaFuncAttributes attrs[N];
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < N && e == cudaSuccess; ++i) e = cudaFuncGetAttributes(&attrs[i], kernels_[i]);
    cudaDeviceProp prop;
    memset(&prop, 0, sizeof(prop));
    cudaGetDeviceProperties(&prop, device);
    if (e != cudaSuccess) {
      cudaGetLastError();
      return report(status_of(e), msg, msg_len,
                    "no usable image of %s for device %d (%s, compute capability %d.%d): %s; library built for "
                    "compute capabilities %s%s",
                    name_, device, prop.name, prop.major, prop.minor, cudaGetErrorString(e), kdtree_built_archs(), hint_);
    }
    int optin = 0;
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (optin < smem_bytes_) {
      return report(KDTREE_ERR_UNSUPPORTED, msg, msg_len,
                    "device %d (%s) allows %d bytes of shared memory per block; %s needs %d", device, prop.name, optin,
                    name_, smem_bytes_);
    }
    for (int i = 0; i < N; ++i) {
      const int rc = check(attrs[i]);
      if (rc != KDTREE_OK) return rc;
    }
    attr = attrs[N - 1];
    return KDTREE_OK;
  }
  int probe(int device, cudaFuncAttributes& attr, char* msg, size_t msg_len) const {
    return probe(device, attr, msg, msg_len, [](const cudaFuncAttributes&) { return static_cast<int>(KDTREE_OK); });
  }

 private:
  // The device's SM count, read once per device.
  int device_sms(int device, int& sms, char* err, size_t err_len) {
    const bool known = device >= 0 && device < kMaxDevices;
    if (known) {
      sms = sms_[device].load(std::memory_order_acquire);
      if (sms > 0) return KDTREE_OK;
    }
    const cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess || sms < 1)
      return report(KDTREE_ERR_CUDA, err, err_len, "cannot read device %d's SM count: %s", device, cudaGetErrorString(e));
    if (known) sms_[device].store(sms, std::memory_order_release);
    return KDTREE_OK;
  }

  int ensure_smem_attribute(int device, char* err, size_t err_len) {
    const bool known = device >= 0 && device < kMaxDevices;
    if (known && smem_set_[device].load(std::memory_order_acquire)) return KDTREE_OK;
    cudaError_t e = cudaSuccess;
    for (int i = 0; i < N && e == cudaSuccess; ++i)
      e = cudaFuncSetAttribute(kernels_[i], cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes_);
    if (e != cudaSuccess) {
      return report(status_of(e), err, err_len,
                    "%s cannot run on device %d: cudaFuncSetAttribute(%d bytes of shared memory) failed: %s (library "
                    "built for compute capabilities %s%s)",
                    name_, device, smem_bytes_, cudaGetErrorString(e), kdtree_built_archs(), hint_);
    }
    if (known) smem_set_[device].store(true, std::memory_order_release);
    return KDTREE_OK;
  }

  const char* name_;
  const char* hint_;
  int smem_bytes_;
  Kernel kernels_[N];
  std::atomic<bool> smem_set_[kMaxDevices] = {};
  std::atomic<int> sms_[kMaxDevices] = {};
};

}  // namespace kdtree
