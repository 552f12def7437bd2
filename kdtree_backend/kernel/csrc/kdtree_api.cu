// extern "C" surface of libkdtree_verify.so: argument checks, the launch plan, dispatch by `config`
// to the launchers (portable/launch.cu, hopper/launch.cu). No device code lives here.
#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "common/launch_plan.h"
#include "kdtree_api.h"
#include "portable/launch.h"
#ifdef KDTREE_WITH_HOPPER
#include "hopper/launch.h"
#endif

#ifndef KDTREE_BUILT_ARCHS
#error "build with -DKDTREE_BUILT_ARCHS=\"90,120\" (kdtree_backend/kernel/build.py does)"
#endif
#ifndef KDTREE_PTX_ARCH
#error "build with -DKDTREE_PTX_ARCH=120 (or 0 without PTX; kdtree_backend/kernel/build.py does)"
#endif
#ifndef KDTREE_LIBRARY_VERSION
#define KDTREE_LIBRARY_VERSION "unknown"
#endif

namespace {

thread_local char g_last_error[1024] = "no error";

int fail(int code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_last_error, sizeof(g_last_error), fmt, ap);
  va_end(ap);
  return code;
}

bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

// A launcher's status, its reason kept as the thread's last error.
int launched(int rc, const char* err) { return rc == KDTREE_OK ? rc : fail(rc, "%s", err); }

// abi.py mirrors these structs field by field; a size change means the mirror is stale.
static_assert(sizeof(KdtreeVerifyParams) == 184, "KdtreeVerifyParams changed: update abi.py and bump KDTREE_ABI_VERSION");
static_assert(sizeof(KdtreePlan) == 32, "KdtreePlan changed: update abi.py and bump KDTREE_ABI_VERSION");

}  // namespace

extern "C" {

int kdtree_abi_version(void) { return KDTREE_ABI_VERSION; }

const char* kdtree_built_archs(void) { return KDTREE_BUILT_ARCHS; }

int kdtree_ptx_arch(void) { return KDTREE_PTX_ARCH; }

const char* kdtree_library_version(void) { return KDTREE_LIBRARY_VERSION; }

const char* kdtree_error_string(int code) {
  if (code == KDTREE_OK) return "ok";
  return g_last_error;
}

int kdtree_probe_device(int device, char* msg, int msg_len) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    fail(KDTREE_ERR_CUDA, "device %d is not available (%d visible): %s", device, count,
         e != cudaSuccess ? cudaGetErrorString(e) : "index out of range");
    if (msg && msg_len > 0) snprintf(msg, msg_len, "%s", g_last_error);
    return KDTREE_ERR_CUDA;
  }
  int prev = 0;
  cudaGetDevice(&prev);
  if (prev != device) cudaSetDevice(device);
  char pmsg[1024] = "";
  int rc = kdtree::portable::probe(device, pmsg, sizeof(pmsg));
  if (rc != KDTREE_OK) fail(rc, "%s", pmsg);
  if (msg && msg_len > 0) snprintf(msg, msg_len, "%s", pmsg);
#ifdef KDTREE_WITH_HOPPER
  // On a Hopper GPU the Hopper kernel is the default: its image must load too.
  cudaDeviceProp prop;
  memset(&prop, 0, sizeof(prop));
  if (rc == KDTREE_OK && cudaGetDeviceProperties(&prop, device) == cudaSuccess && prop.major == 9 && prop.minor == 0) {
    char hmsg[256];
    const int hrc = kdtree::hopper::probe(device, hmsg, sizeof(hmsg));
    if (hrc != KDTREE_OK) {
      fail(hrc, "%s", hmsg);
      rc = hrc;
    }
    if (msg && msg_len > 0) {
      const size_t used = strlen(msg);
      if (hrc != KDTREE_OK) {
        snprintf(msg, msg_len, "%s", hmsg);
      } else if (used + 3 < static_cast<size_t>(msg_len)) {
        snprintf(msg + used, msg_len - used, "; %s", hmsg);
      }
    }
  }
#endif
  if (prev != device) cudaSetDevice(prev);
  return rc;
}

int kdtree_verify_plan(int batch, int num_heads, int max_qo_len, int num_sms, int config, KdtreePlan* plan) {
  if (plan == nullptr) return fail(KDTREE_ERR_INVALID_ARGUMENT, "plan is NULL");
  if (batch < 1 || batch > 65535) return fail(KDTREE_ERR_INVALID_ARGUMENT, "batch %d not in [1, 65535]", batch);
  if (num_heads < 1 || num_heads > 1024)
    return fail(KDTREE_ERR_INVALID_ARGUMENT, "num_heads %d not in [1, 1024]", num_heads);
  if (max_qo_len < 1 || max_qo_len > KDTREE_MAX_QO_LEN)
    return fail(KDTREE_ERR_INVALID_ARGUMENT, "max_qo_len %d not in [1, %d]", max_qo_len, KDTREE_MAX_QO_LEN);
  if (num_sms < 1) return fail(KDTREE_ERR_INVALID_ARGUMENT, "num_sms %d < 1", num_sms);
  if (plan->requested_splits < 0 || plan->requested_splits > kdtree::kMaxSplits)
    return fail(KDTREE_ERR_INVALID_ARGUMENT, "requested_splits %d not in [0, %d] (0: chosen by the plan)",
                plan->requested_splits, kdtree::kMaxSplits);
  if (plan->requested_min_keys_per_split < 0)
    return fail(KDTREE_ERR_INVALID_ARGUMENT, "requested_min_keys_per_split %d < 0 (0: the configuration's own)",
                plan->requested_min_keys_per_split);
  switch (config) {
    case KDTREE_CONFIG_PORTABLE:
    case KDTREE_CONFIG_PORTABLE_TILED:  // one plan for both tilings (portable/launch.h)
      kdtree::fill_plan(kdtree::portable::kRowsPerTile, kdtree::kDefaultMinKeysPerSplit, batch, num_heads, max_qo_len,
                        num_sms, plan);
      return KDTREE_OK;
    case KDTREE_CONFIG_HOPPER:
#ifdef KDTREE_WITH_HOPPER
      kdtree::fill_plan(kdtree::hopper::kRowsPerTile, kdtree::kHopperMinKeysPerSplit, batch, num_heads, max_qo_len, num_sms,
                        plan, kdtree::kHopperCapSplitsAtHalfSms);
      return KDTREE_OK;
#else
      return fail(KDTREE_ERR_UNSUPPORTED,
                  "this library was built without the Hopper kernel (sm_90a): rebuild with "
                  "`python -m kdtree_backend.build --arch 90` or set KDTREE_KERNEL=portable");
#endif
    default:
      return fail(KDTREE_ERR_INVALID_ARGUMENT, "unknown kernel configuration %d", config);
  }
}

int kdtree_verify_run(const KdtreeVerifyParams* params, void* stream) {
  if (params == nullptr) return fail(KDTREE_ERR_INVALID_ARGUMENT, "params is NULL");
  const KdtreeVerifyParams& p = *params;
  if (!p.q || !p.k || !p.kv_cache || !p.qo_indptr || !p.kv_indptr || !p.kv_indices || !p.out)
    return fail(KDTREE_ERR_INVALID_ARGUMENT, "a required pointer is NULL");
  if (p.custom_mask && !p.mask_indptr) return fail(KDTREE_ERR_INVALID_ARGUMENT, "custom_mask without mask_indptr");
  if (p.batch < 1 || p.batch > 65535 || p.num_heads < 1 || p.max_qo_len < 1 || p.num_splits < 1 ||
      p.num_splits > kdtree::kMaxSplits || p.min_keys_per_split < 0)
    return fail(KDTREE_ERR_INVALID_ARGUMENT, "batch=%d num_heads=%d max_qo_len=%d num_splits=%d min_keys_per_split=%d out of range",
                p.batch, p.num_heads, p.max_qo_len, p.num_splits, p.min_keys_per_split);
  // cp.async moves 16-byte chunks: every row start must be 16-byte aligned.
  if (!aligned(p.q, 16) || !aligned(p.k, 16) || !aligned(p.kv_cache, 16) || p.q_stride_tok % 8 ||
      p.q_stride_head % 8 || p.k_stride_tok % 8 || p.kv_stride_slot % 8)
    return fail(KDTREE_ERR_INVALID_ARGUMENT, "q/k/kv_cache rows must start on 16-byte boundaries");
  if (!aligned(p.out, 8) || p.out_stride_tok % 4)
    return fail(KDTREE_ERR_INVALID_ARGUMENT, "out rows must start on 8-byte boundaries");
  if (p.workspace && !aligned(p.workspace, 16))
    return fail(KDTREE_ERR_INVALID_ARGUMENT, "workspace must be 16-byte aligned");
  char err[512] = "";
  switch (p.config) {
    case KDTREE_CONFIG_PORTABLE:
    case KDTREE_CONFIG_PORTABLE_TILED:
      return launched(kdtree::portable::launch(p, p.config == KDTREE_CONFIG_PORTABLE_TILED,
                                               static_cast<cudaStream_t>(stream), err, sizeof(err)),
                      err);
    case KDTREE_CONFIG_HOPPER:
#ifdef KDTREE_WITH_HOPPER
      return launched(kdtree::hopper::launch(p, static_cast<cudaStream_t>(stream), err, sizeof(err)), err);
#else
      return fail(KDTREE_ERR_UNSUPPORTED, "this library was built without the Hopper kernel (sm_90a)");
#endif
    default:
      return fail(KDTREE_ERR_INVALID_ARGUMENT, "unknown kernel configuration %d", p.config);
  }
}

}  // extern "C"
