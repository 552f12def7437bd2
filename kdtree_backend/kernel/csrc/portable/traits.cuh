// The portable kernel's configuration, VerifyConfig<row groups, column slices, keys a tile, stages>
// (PortableConfig is the one shipped), and its shared-memory layout, SharedStorage<Cfg>.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "../common/mla.h"
#include "../common/request.cuh"
#include "mma.cuh"

namespace kdtree {

// The kernel's dynamic shared memory (a SharedStorage<Cfg>). A namespace-scope symbol so device
// functions can address its members as symbol + constant (no pointer held in registers).
extern __shared__ __align__(128) uint8_t g_smem[];

template <int RG, int CS, int BN, int ST>
struct VerifyConfig {
  static constexpr int kRG = RG;      // row groups of 16 query rows
  static constexpr int kCS = CS;      // depth (QK) / column (PV) partitions
  static constexpr int kBN = BN;      // keys per tile
  static constexpr int kStages = ST;  // cp.async pipeline depth
  static constexpr int kWarps = RG * CS;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kM = RG * 16;  // query rows per CTA
  static constexpr int kQkSlice = kQkDim / CS;    // depth per warp
  static constexpr int kKSteps = kQkSlice / 16;   // mma k-steps per warp for QK^T
  static constexpr int kVSlice = kVDim / CS;      // output columns per warp
  static constexpr int kVTiles = kVSlice / 8;     // n8 accumulator tiles per warp
  static constexpr int kNTiles = BN / 8;          // n8 score tiles per key tile
  static constexpr int kTileBytes = BN * kSmemRowBytes;
  static constexpr int kQBytes = kM * kSmemRowBytes;
  static constexpr int kKvBytes = ST * kTileBytes;
  static constexpr int kStageBytes = kKvBytes > kQBytes ? kKvBytes : kQBytes;  // Q is staged here first
  static constexpr int kExchangeFloats = CS * kM * BN;  // one partial score a row, key and column slice

  static_assert(CS > 1, "the score exchange sums the depth slices of at least two warps");
  static_assert(kQkSlice % 16 == 0, "each warp's QK depth slice must be whole mma k-steps");
  static_assert(kVSlice % 16 == 0, "each warp's output slice must be whole ldmatrix.x4 pairs");
  static_assert(BN % 16 == 0, "key tiles are whole mma k-steps for PV");
  static_assert(kThreads % BN == 0 && kThreads % kM == 0, "load mapping: whole threads per row");
  static_assert(ST == 2, "the slot-id ring assumes double buffering: ids staged with tile t land by tile t+1's issue");
  static_assert(RG + 1 <= 16, "named barrier ids 1..RG");
};

// The dynamic shared memory of configuration Cfg.
template <class Cfg>
struct SharedStorage {
  // Q is staged here (padded rows, kSmemRowBytes each) on its way to registers; then the K tiles,
  // kStages of kTileBytes.
  uint8_t stage[Cfg::kStageBytes];
  // The QK^T partial scores of each column slice, summed by the warps of a row group.
  float exchange[Cfg::kExchangeFloats];
  // The slot ids of the next two tiles, staged by cp.async with the K rows (entry (tile - t_begin) & 1).
  int64_t slot_ring[2][Cfg::kBN];
  // The segment's values that the tile loop does not need in registers (holding them there spilled
  // on sm_120): the request's first kv_indices entry, the request (its draft mask), and where the
  // output goes, and its row tile (common/request.cuh, CtaWork).
  alignas(16) int64_t kv0;
  int64_t seg_q0;  // the request's first query token
  int seg_b;
  int seg_slot;
  int seg_direct;
  int seg_row_tile;
  // The part schedule's start (common/request.cuh).
  ScheduleScratch sched;
};

// Byte offsets of SharedStorage<Cfg>'s members from g_smem, and its size.
template <class Cfg>
struct SmemLayout {
  static constexpr int kExchange = static_cast<int>(offsetof(SharedStorage<Cfg>, exchange));
  static constexpr int kSlotRing = static_cast<int>(offsetof(SharedStorage<Cfg>, slot_ring));
  static constexpr int kKv0 = static_cast<int>(offsetof(SharedStorage<Cfg>, kv0));
  static constexpr int kSegQ0 = static_cast<int>(offsetof(SharedStorage<Cfg>, seg_q0));
  static constexpr int kSegB = static_cast<int>(offsetof(SharedStorage<Cfg>, seg_b));
  static constexpr int kSegSlot = static_cast<int>(offsetof(SharedStorage<Cfg>, seg_slot));
  static constexpr int kSegDirect = static_cast<int>(offsetof(SharedStorage<Cfg>, seg_direct));
  static constexpr int kSegRowTile = static_cast<int>(offsetof(SharedStorage<Cfg>, seg_row_tile));
  static constexpr int kSched = static_cast<int>(offsetof(SharedStorage<Cfg>, sched));
  static constexpr int kBytes = static_cast<int>(sizeof(SharedStorage<Cfg>));
};

// The portable configuration: what sm_120 (RTX PRO 6000 Blackwell) runs and what the H200 tests
// select. 64 query rows x 32-key tiles, double-buffered: 2 x 37,376 B of K tiles + 16,384 B of
// score exchange + 512 B of staged slot ids + 32 B of segment values + 656 B of schedule state = 92,336 B of
// shared memory. ptxas:
// 0 spills on sm_120 and sm_90 (32-key tiles: 25-35% faster than 16-key tiles on the H200, journal v2).
using PortableConfig = VerifyConfig<4, 2, 32, 2>;
constexpr int kSm120MaxSmemPerBlock = 101376;
static_assert(SmemLayout<PortableConfig>::kBytes == 92336, "the portable kernel's shared memory is 92,336 B");
static_assert(SmemLayout<PortableConfig>::kBytes <= kSm120MaxSmemPerBlock,
              "the portable configuration must fit sm_120's 99 KB of shared memory per block");

}  // namespace kdtree
