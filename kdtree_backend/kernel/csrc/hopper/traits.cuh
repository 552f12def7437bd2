// The Hopper kernel's configuration: the tile shape, the shared-memory layout (SharedStorage) and the
// named barrier ids (NamedBarrier).
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "../common/mla.h"
#include "../common/ptx.cuh"
#include "../common/request.cuh"

namespace kdtree {
namespace hopper {

struct HopperConfig {
  static constexpr int kM = 64;        // query rows per CTA (one wgmma M)
  static constexpr int kBN = 64;       // keys per tile
  static constexpr int kThreads = 256;
  static constexpr int kAtomBytes = 64 * 128;              // 64 rows x 64 bf16 columns
  static constexpr int kAtoms = kQkDim / 64;               // 9 column atoms per 576-wide block
  static constexpr int kBlockBytes = kAtoms * kAtomBytes;  // 73,728
  static constexpr int kStages = 2;
};

// The dynamic shared memory. Every 576-wide block is 9 column atoms of 64 columns x 64 rows (8 KB):
// row r of an atom at r * 128 B, its 16-byte chunk c at ((c ^ (r & 7)) * 16), the 128-byte swizzle
// wgmma reads, which ties each atom to a 1024-byte boundary (the base is; the offsets are checked below).
struct SharedStorage {
  uint8_t q[HopperConfig::kBlockBytes];                         // Q, loaded once
  uint8_t k[HopperConfig::kStages][HopperConfig::kBlockBytes];  // the K stages; at the end the output's
                                                                // staging area (h9)
  uint8_t p[HopperConfig::kAtomBytes];  // P (bf16) of the tile, WG0 -> WG1
  float alpha[HopperConfig::kM];        // this tile's O rescale factors, WG0 -> WG1
  float inv_l[HopperConfig::kM];        // 1 / row sum at the end, WG0 -> WG1
  float lse[HopperConfig::kM];          // log2-sum-exp at the end, for the split partials
  uint64_t k_full[HopperConfig::kStages];   // mbarriers: K stage landed (WG1's cp.async, 128 arrivals)
  uint64_t k_empty[HopperConfig::kStages];  // mbarriers: K stage consumed (WG0's PV done, 128 arrivals)
  uint64_t q_full;                          // mbarrier: Q landed (TMA, h23)
  ScheduleScratch sched;                    // the part schedule's start (common/request.cuh)
};

// Byte offsets of SharedStorage's members from g_hopper_smem, and its size.
struct SmemLayout {
  static constexpr int kQ = static_cast<int>(offsetof(SharedStorage, q));
  static constexpr int kK = static_cast<int>(offsetof(SharedStorage, k));
  static constexpr int kP = static_cast<int>(offsetof(SharedStorage, p));
  static constexpr int kAlpha = static_cast<int>(offsetof(SharedStorage, alpha));
  static constexpr int kInvL = static_cast<int>(offsetof(SharedStorage, inv_l));
  static constexpr int kLse = static_cast<int>(offsetof(SharedStorage, lse));
  static constexpr int kKFull = static_cast<int>(offsetof(SharedStorage, k_full));    // + 8 * stage
  static constexpr int kKEmpty = static_cast<int>(offsetof(SharedStorage, k_empty));  // + 8 * stage
  static constexpr int kQFull = static_cast<int>(offsetof(SharedStorage, q_full));
  static constexpr int kSched = static_cast<int>(offsetof(SharedStorage, sched));
  static constexpr int kBytes = static_cast<int>(sizeof(SharedStorage));
};
static_assert(SmemLayout::kBytes == 230832 && SmemLayout::kBytes <= 232448,
              "the Hopper kernel takes 230,832 B of the H100/H200's 227 KB per block");
static_assert(SmemLayout::kQ % 1024 == 0 && SmemLayout::kK % 1024 == 0 && SmemLayout::kP % 1024 == 0,
              "128-byte swizzle atoms must start on 1024-byte boundaries");

extern __shared__ __align__(1024) uint8_t g_hopper_smem[];

// Named barrier ids (0 is __syncthreads; the portable kernel's ids are not shared with this one).
enum class NamedBarrier : int {
  kPFull = 1,      // WG0 arrives, WG1 syncs: P and alpha of the tile are in shared memory
  kPFree = 2,      // WG1 arrives, WG0 syncs: WG1's PV has read them; WG0 may write the next tile's
  kFinal = 4,      // both: the tile loop is done (row statistics shared, K stages idle)
  kStoreWg0 = 5,   // one warpgroup (128 threads): its staged output rows are complete;
  kStoreWg1 = 6,   //   kStoreWg0 + column half
  kProfiler = 7,   // diagnostics build only (common/profiler.cuh)
};
__device__ __forceinline__ void named_barrier(NamedBarrier id, int count) {
  ::kdtree::named_barrier(static_cast<int>(id), count);
}
__device__ __forceinline__ void named_arrive(NamedBarrier id, int count) {
  ::kdtree::named_arrive(static_cast<int>(id), count);
}
// The barrier that warpgroup `col_half` (0: WG0, 1: WG1) syncs on once its output rows are staged.
__device__ __forceinline__ NamedBarrier store_barrier(int col_half) {
  return static_cast<NamedBarrier>(static_cast<int>(NamedBarrier::kStoreWg0) + col_half);
}

}  // namespace hopper
}  // namespace kdtree
