// Host side of the Hopper configuration. This file is compiled for sm_90a only
// (-gencode=arch=compute_90a,code=sm_90a): wgmma exists on no other target, and a kernel that
// has no image for a GPU fails loudly at cudaFuncSetAttribute instead of running a stub.
#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "../combine/launch.cuh"
#include "../common/launch.h"
#include "../common/launch_plan.h"
#include "kernel.cuh"
#include "launch.h"

// The diagnostics build's per-tile stamps of the Hopper kernel (common/tile_stamps.cuh; nothing in a
// release build).
KDTREE_TILE_STAMPS_READER(kdtree_hopper_tile_stamps_copy)

namespace kdtree {
namespace hopper {
namespace {

// Every instantiation (h13: scales folded or applied as given; s1e: a launch of one request, or any
// batch): each needs the shared-memory attribute and an image for the device. The folded batch one,
// last, is what SGLang's scales run most (the probe reports its attributes).
using Kernel = void (*)(KdtreeVerifyParams, CUtensorMap, int);
const Kernel kKernels[] = {verify_attention_hopper_kernel<false, true>, verify_attention_hopper_kernel<false, false>,
                           verify_attention_hopper_kernel<true, true>, verify_attention_hopper_kernel<true, false>};
KernelFamily<Kernel, 4> g_kernels("the Hopper verify kernel",
                                  "; it is built for sm_90a only (H100/H200): set KDTREE_KERNEL=portable elsewhere",
                                  SmemLayout::kBytes, kKernels);

// h13: the scales fold into the softmax's exp2 when they are positive and finite, with room for
// the products and reciprocals the folded kernel forms (SGLang's are ~0.05-1). Anything else
// (zero, negative, huge, NaN) runs the unfolded instantiation, which applies them as given.
bool fold_scales(const KdtreeVerifyParams& p) {
  auto in_range = [](float x) { return x >= 1e-15f && x <= 1e15f; };  // false for NaN
  return in_range(p.sm_scale) && in_range(p.k_scale) && in_range(p.v_scale);
}

// h23: Q's tensor map. The driver's encoder is resolved once through the runtime (no libcuda link);
// the probe fails the start-up when it is missing, so a launch never runs without it unnoticed.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static std::atomic<PFN_cuTensorMapEncodeTiled_v12000> fn{nullptr};
  PFN_cuTensorMapEncodeTiled_v12000 f = fn.load(std::memory_order_acquire);
  if (f == nullptr) {
    void* sym = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &sym, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess && sym != nullptr) {
      f = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(sym);
      fn.store(f, std::memory_order_release);
    } else {
      cudaGetLastError();
    }
  }
  return f;
}

// q [T, H, 576] as a 3-d map {576 columns, H heads, tokens} with q's strides, box {64 columns, bh
// heads, bt tokens} = one row tile's 64 rows of one 64-column atom (128-byte swizzle). The token
// extent is the int32 coordinate range: the kernel only asks for rows of tiles wholly inside their
// request, which q holds. false (the cp.async path) when H neither divides nor is a multiple of 64,
// or when the encoder refuses q's layout.
bool encode_q_map(const KdtreeVerifyParams& p, CUtensorMap* map) {
  const int H = p.num_heads;
  cuuint32_t bh, bt;
  if (H <= HopperConfig::kM && HopperConfig::kM % H == 0) {
    bh = static_cast<cuuint32_t>(H);
    bt = static_cast<cuuint32_t>(HopperConfig::kM / H);
  } else if (H % HopperConfig::kM == 0) {
    bh = HopperConfig::kM;
    bt = 1;
  } else {
    return false;
  }
  PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(kQkDim), static_cast<cuuint64_t>(H), 0x7fffffffull};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(p.q_stride_head) * 2, static_cast<cuuint64_t>(p.q_stride_tok) * 2};
  const cuuint32_t box[3] = {64, bh, bt};
  const cuuint32_t elem[3] = {1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(p.q), dims, strides, box, elem,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The probe's check that the driver encodes Q's tensor map for SGLang's layout (q [T, 16, 576]
// contiguous). The encoder reads no memory, so an aligned dummy address stands in for q.
bool encodes_sglang_q_layout() {
  KdtreeVerifyParams sample;
  memset(&sample, 0, sizeof(sample));
  sample.q = reinterpret_cast<const void*>(static_cast<uintptr_t>(1) << 20);
  sample.num_heads = 16;
  sample.q_stride_head = kQkDim;
  sample.q_stride_tok = 16 * kQkDim;
  CUtensorMap map;
  return encode_q_map(sample, &map);
}

}  // namespace

static_assert(kRowsPerTile == HopperConfig::kM, "hopper/launch.h and the kernel disagree on the row tile");

int launch(const KdtreeVerifyParams& p, cudaStream_t stream, char* err, size_t err_len) {
  int row_tiles = 0, extra = 0;
  int rc = g_kernels.prepare(p, HopperConfig::kM, row_tiles, extra, err, err_len);
  if (rc != KDTREE_OK) return rc;
  const dim3 grid = verify_grid(p, row_tiles, extra);
  CUtensorMap q_map;
  memset(&q_map, 0, sizeof(q_map));
  const int q_tma = encode_q_map(p, &q_map) ? 1 : 0;
  // s1e: a batch of one request runs the instantiation without the batch scan and the walk.
  const Kernel kernel = kKernels[(fold_scales(p) ? 2 : 0) + (p.batch == 1 ? 0 : 1)];
  // h47: a programmatic dependent of the previous kernel (as FlashMLA's decode kernel launches): the
  // CTAs' start overlaps that kernel's tail, and the kernel waits for it before touching memory.
  const cudaError_t launch_error = launch_programmatic(kernel, grid, dim3(HopperConfig::kThreads), SmemLayout::kBytes,
                                                       stream, p, q_map, q_tma);
  rc = g_kernels.launched(grid, err, err_len, launch_error);
  if (rc != KDTREE_OK) return rc;
  if (split_launch(p.num_splits, extra)) {
    const cudaError_t e = launch_combine<HopperConfig, /*kPdl=*/true>(p, row_tiles, extra, stream);  // h39: PDL
    if (e != cudaSuccess)
      return report(KDTREE_ERR_CUDA, err, err_len, "launch of the split-combine kernel failed: %s", cudaGetErrorString(e));
  }
  return KDTREE_OK;
}

int probe(int device, char* msg, size_t msg_len) {
  cudaFuncAttributes attr;  // the folded kernel's (the last one probed)
  const int rc = g_kernels.probe(device, attr, msg, msg_len);
  if (rc != KDTREE_OK) return rc;
  if (!encodes_sglang_q_layout()) {
    return report(KDTREE_ERR_UNSUPPORTED, msg, msg_len,
                  "the CUDA driver cannot encode the Hopper kernel's Q tensor map (cuTensorMapEncodeTiled %s): update the "
                  "NVIDIA driver to one that supports CUDA 12.0 or later, or set KDTREE_KERNEL=portable",
                  tensor_map_encoder() == nullptr ? "not found" : "refused a [T, 16, 576] bf16 layout");
  }
  snprintf(msg, msg_len, "Hopper kernel: sm_%d binary, %d registers/thread, %d B dynamic shared memory, %d local bytes, %s",
           attr.binaryVersion, attr.numRegs, SmemLayout::kBytes, static_cast<int>(attr.localSizeBytes), "Q by TMA");
  return KDTREE_OK;
}

}  // namespace hopper
}  // namespace kdtree
