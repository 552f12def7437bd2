// Per-tile event stamps of the kernels' tile loops, for the diagnostics build only (KDTREE_PROFILER;
// `python -m kdtree_backend.build --profiler`), read by bench/diag/tile_timeline.py. profiler.cuh stamps
// the Hopper kernel's milestones once a CTA; this one stamps each K tile's hand-offs between the roles,
// which is what the tile's critical path needs (journal m13, m16): how long each role's work takes,
// how long it waits for the other, and how long a refill takes from its issue to the K tile's arrival.
//
//   KDTREE_TILE_SEGMENT(on, tiles);                     // a thread with `on`: this segment's tile count
//   KDTREE_TILE_STAMP(on, tile, TileEvent::kQkKFull);   // lane 0 of a warp with `on`: clock64 for `tile`
//   KDTREE_TILE_STAMPS_READER(name)                     // in the kernel's .cu: the exported reader
//
// The record, per CTA (the first kTileStampCtas in launch order, y * gridDim.x + x): one int64, the
// stamped segment's tile count, then kTileEvents int64 a tile for its first kTileStampTiles tiles.
// Every segment stamps over the previous one: the record holds the CTA's last segment (its tile count
// says how many tiles are its own). Each translation unit that includes this header has its own
// record (a static device array) and exports its own reader: the warp-specialised portable kernel's
// `kdtree_tile_stamps_copy` (TileEvent), the Hopper kernel's `kdtree_hopper_tile_stamps_copy`
// (HopperTileEvent). Both roles of a CTA run on its SM: one clock. In a release build every macro
// compiles to nothing, so the release SASS does not depend on them.
#pragma once
#include <stdint.h>

namespace kdtree {

// The warp-specialised portable kernel (portable/kernel_ws.cuh): QK warp 0 and PV warp 0 (warp 4).
enum class TileEvent : int {
  kQkKFull = 0,      // QK warp: K tile landed (its mbarrier wait returned)
  kQkScores = 1,     // QK warp: scores complete (the vote on the rows' moved maxima issued)
  kQkSoftmax = 2,    // QK warp: probabilities and row sums done
  kQkPFree = 3,      // QK warp: the P buffer of this parity is free (the PV warps' tile i - 2)
  kQkPFull = 4,      // QK warp: P and the factors handed over (bar.arrive issued)
  kPvPFull = 5,      // PV warp: P of this tile received (bar.sync returned)
  kPvMmaIssued = 6,  // PV warp: its last P.V mma of the tile issued
  kPvStage = 7,      // PV warp: every PV warp done with the stage (the refill barrier returned)
  kPvRefill = 8,     // PV warp: tile + 2's copies issued and its arrival on the stage barrier made
  kPvFenced = 9,     // PV warp: in that refill, the slot ids read (and a proxy fence after zero-filled rows)
};

// The Hopper kernel (hopper/kernel.cuh): thread 0 (WG0, math) and thread 128 (WG1, helper).
enum class HopperTileEvent : int {
  kWg0KFull = 0,    // WG0: K tile landed (full barrier waited)
  kWg0Scores = 1,   // WG0: S = Q K^T complete (its wgmmas waited)
  kWg0Softmax = 2,  // WG0: mask, row max, exp2s and P packed (its first PV group issued)
  kWg0PFree = 3,    // WG0: the helper is done with the previous tile's P
  kWg0PFull = 4,    // WG0: P and the factors shared (bar.arrive issued)
  kWg0PvDone = 5,   // WG0: its PV of the tile complete (the stage's empty arrival follows)
  kWg1PFull = 6,    // WG1: P received
  kWg1PvDone = 7,   // WG1: its PV of the tile complete
  kWg1Empty = 8,    // WG1: WG0 done with the stage (empty barrier waited)
  kWg1Refill = 9,   // WG1: tile + 2's copies issued and tile + 3's slot ids requested
};

constexpr int kTileEvents = 10;
constexpr int kTileStampTiles = 64;
constexpr int kTileStampCtas = 32;
constexpr int kTileRecord = 1 + kTileStampTiles * kTileEvents;  // int64 a CTA

}  // namespace kdtree

#ifdef KDTREE_PROFILER
#include <cuda_runtime.h>

#include "../kdtree_api.h"  // KDTREE_API

namespace kdtree {

static __device__ long long g_tile_stamps[kTileStampCtas * kTileRecord];

__device__ __forceinline__ int tile_stamp_cta() { return blockIdx.y * gridDim.x + blockIdx.x; }

__device__ __forceinline__ void tile_segment(bool on, int tiles) {
  const int cta = tile_stamp_cta();
  if (on && cta < kTileStampCtas) g_tile_stamps[cta * kTileRecord] = tiles;
}

template <class Event>
__device__ __forceinline__ void tile_stamp(bool on, int tile, Event e) {
  if (!on || tile >= kTileStampTiles || (threadIdx.x & 31) != 0) return;
  const int cta = tile_stamp_cta();
  if (cta >= kTileStampCtas) return;
  g_tile_stamps[cta * kTileRecord + 1 + tile * kTileEvents + static_cast<int>(e)] = clock64();
}

}  // namespace kdtree

#define KDTREE_TILE_SEGMENT(on, tiles) ::kdtree::tile_segment((on), (tiles))
#define KDTREE_TILE_STAMP(on, tile, e) ::kdtree::tile_stamp((on), (tile), (e))
// The diagnostics library's reader of this translation unit's record (the last launch's stamps).
#define KDTREE_TILE_STAMPS_READER(name)                                             \
  extern "C" KDTREE_API int name(void* host, size_t bytes) {                        \
    return static_cast<int>(cudaMemcpyFromSymbol(host, ::kdtree::g_tile_stamps, bytes)); \
  }

#else  // release build

#define KDTREE_TILE_SEGMENT(on, tiles) \
  do {                                 \
  } while (0)
#define KDTREE_TILE_STAMP(on, tile, e) \
  do {                                 \
  } while (0)
#define KDTREE_TILE_STAMPS_READER(name)

#endif  // KDTREE_PROFILER
