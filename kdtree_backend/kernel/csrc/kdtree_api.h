// C ABI of libkdtree_verify.so: the only surface the Python side (kdtree_backend/kernel/abi.py) sees.
// Change a struct or a signature -> bump KDTREE_ABI_VERSION here AND abi.ABI_VERSION, update the
// size static_asserts (kdtree_api.cu), the ctypes mirror, tests/fixtures/fake_kdtree_lib.c when a
// symbol changes, and docs/interfaces.md.
#pragma once
#include <stdint.h>

#define KDTREE_ABI_VERSION 2

// The largest draft count (query tokens per request, `max_qo_len`) the kernels take: kdtree_verify_plan
// refuses more. Mirrored as abi.MAX_QO_LEN (SGLang-side eligibility reads it there).
#define KDTREE_MAX_QO_LEN 4096

// The library is built with -fvisibility=hidden; only these functions are exported.
#define KDTREE_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

// One TARGET_VERIFY attention call (absorbed MLA: 576-dim K rows, V = first 512 columns).
// All pointers are device addresses; strides are in elements; last dims are contiguous.
typedef struct KdtreeVerifyParams {
  const void* q;               // bf16 [T, H, 576]
  int64_t q_stride_tok;
  int64_t q_stride_head;
  const void* k;               // bf16 [T, 576]: draft K; draft V = its first 512 columns
  int64_t k_stride_tok;
  const void* kv_cache;        // bf16 [N, 576]: the paged latent cache (page size 1 slots)
  int64_t kv_stride_slot;
  int64_t kv_num_slots;        // rows in kv_cache; a slot id outside [0, N) reads as zeros
  const void* qo_indptr;       // int32 or int64 [B+1]
  const void* kv_indptr;       // int32 or int64 [B+1]: committed prefix only
  const void* kv_indices;      // int64 slot ids, read only within kv_indptr ranges
  const void* custom_mask;     // uint8/bool FULL_MASK or NULL (causal draft block)
  const void* mask_indptr;     // int64 [B+1]; ignored when custom_mask is NULL
  void* out;                   // bf16 [T, H*512]
  int64_t out_stride_tok;
  void* workspace;             // plan.workspace_bytes, zero-filled once when allocated, then reused: split
                               // partials + log-sum-exp, and a batch launch's schedule cache (m35)
  int64_t workspace_bytes;
  int32_t batch;
  int32_t num_heads;
  int32_t max_qo_len;          // the largest draft count; the grid is sized from it
  int32_t num_splits;          // from the plan: parts per row tile (the batch-wide schedule, common/schedule.cuh)
  int32_t qo_indptr_is_int64;
  int32_t kv_indptr_is_int64;
  int32_t min_keys_per_split;  // from the plan: the smallest part; 0: the kernel picks it from the lengths (h29)
  int32_t config;              // kernel configuration id (0 = portable)
  float sm_scale;
  float k_scale;               // multiplies prefix scores (SGLang's k_scale_float)
  float v_scale;               // multiplies prefix values (SGLang's v_scale_float)
  float reserved;
} KdtreeVerifyParams;

// The launch shape for one (batch, heads, max draft count) on one GPU. Fixed at CUDA-graph
// capture; how the batch's real lengths are cut into the planned parts is decided on the device.
// The caller zero-fills it and may set the two inputs (benchmark overrides; 0 = the library chooses);
// kdtree_verify_plan fills the rest. The workspace size is computed here and nowhere else: pass
// num_splits, min_keys_per_split and a workspace of workspace_bytes to kdtree_verify_run.
typedef struct KdtreePlan {
  // inputs
  int32_t requested_splits;            // 1..128 forces the part count (KDTREE_NUM_SPLITS); 0: chosen
  int32_t requested_min_keys_per_split;  // >= 1 forces the smallest split (KDTREE_MIN_KEYS_PER_SPLIT); 0: the
                                         // configuration's own (64 keys portable, device-chosen Hopper)
  // outputs
  int32_t num_splits;
  int32_t row_tiles;
  int32_t rows_per_tile;
  int32_t min_keys_per_split;  // 0 (Hopper): each request's split length is chosen on the device
  int64_t workspace_bytes;     // 0 only for one request in one part
} KdtreePlan;

// Kernel configurations (KdtreeVerifyParams.config, kdtree_verify_plan's `config`).
enum KdtreeConfig {
  KDTREE_CONFIG_PORTABLE = 0,  // mma.sync, every arch: what the RTX PRO 6000 runs. The warp-specialised
                               // tiling on compute capability 9.0, 10.0, 12.0 (sm_90a/100a/120a code),
                               // the tiled one elsewhere (portable/launch.h)
  KDTREE_CONFIG_RESERVED_1 = 1,  // was rows32 (an experimental portable variant, rejected); never reuse
  KDTREE_CONFIG_HOPPER = 2,    // wgmma, sm_90a only (H100/H200); unsupported if built without it
  KDTREE_CONFIG_PORTABLE_TILED = 3,  // the portable kernel's tiled form on every GPU: the fallback, the
                                     // rollback (KDTREE_KERNEL=portable-tiled) and its tests. Added
                                     // within ABI 2: an older library answers "unknown configuration"
};

enum KdtreeStatus {
  KDTREE_OK = 0,
  KDTREE_ERR_INVALID_ARGUMENT = 1,
  KDTREE_ERR_CUDA = 2,
  KDTREE_ERR_NO_KERNEL_IMAGE = 3,
  KDTREE_ERR_WORKSPACE = 4,
  KDTREE_ERR_UNSUPPORTED = 5,
};

KDTREE_API int kdtree_abi_version(void);
// Comma-separated compute capabilities (major*10+minor) with SASS in this binary, e.g. "90,120".
KDTREE_API const char* kdtree_built_archs(void);
// The compute capability (major*10+minor) whose PTX of the portable kernels this binary embeds, for
// the CUDA driver to JIT-compile on a GPU of that capability or newer that no SASS arch covers;
// 0 when it embeds none. (Added within ABI 2: a loader treats a library without it as "none".)
KDTREE_API int kdtree_ptx_arch(void);
KDTREE_API const char* kdtree_library_version(void);
// The calling thread's last error, with detail (CUDA's message, the bad argument).
KDTREE_API const char* kdtree_error_string(int code);
// Checks that `device` can run the kernels (an image for its arch, enough shared memory).
// Creates the primary context: call it only after the process has chosen its GPU.
KDTREE_API int kdtree_probe_device(int device, char* msg, int msg_len);
// Host arithmetic only (no CUDA call): the plan for `config` on a GPU of `num_sms` SMs, batch in
// [1, 65535], num_heads in [1, 1024], max_qo_len in [1, KDTREE_MAX_QO_LEN]; reads plan's inputs, writes
// its outputs. KDTREE_ERR_UNSUPPORTED for KDTREE_CONFIG_HOPPER in a library built without it.
KDTREE_API int kdtree_verify_plan(int batch, int num_heads, int max_qo_len, int num_sms, int config,
                                  KdtreePlan* plan);
// Asynchronous on `stream`; no host synchronisation; capturable in a CUDA graph.
KDTREE_API int kdtree_verify_run(const KdtreeVerifyParams* params, void* stream);

#ifdef __cplusplus
}
#endif
