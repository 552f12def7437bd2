// Per-tile event stamps of the warp-specialised portable kernel, for the diagnostics build only
// (KDTREE_PROFILER; `python -m kdtree_backend.build --profiler`), read by bench/diag/ws_timeline.py.
// profiler.cuh stamps the Hopper kernel's milestones once a CTA; this one stamps each K tile's hand-offs
// in the two roles, which is what the portable kernel's critical-path questions need (journal m13,
// m15, p26): how long the QK warp's mma and softmax take, how long each role waits for the other, and
// how long a refill takes from its issue to the K tile's arrival.
//
//   KDTREE_TILE_STAMP(on, tile, kQkKFull);   // lane 0 of a warp with `on` writes clock64 for `tile`
//
// The record: kTileEvents int64 a tile, kTileStampTiles tiles a CTA (the CTA's first segment), for the
// first kTileStampCtas CTAs in launch order (y * gridDim.x + x); unwritten stamps stay 0. QK warp 0
// writes the kQk* events, PV warp 0 (warp 4) the kPv* ones; both run on the CTA's SM, one clock.
// In a release build the macro compiles to nothing, so the release SASS does not depend on it.
#pragma once
#include <stdint.h>

namespace kdtree {

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
};
constexpr int kTileEvents = 9;
constexpr int kTileStampTiles = 64;
constexpr int kTileStampCtas = 32;

}  // namespace kdtree

#ifdef KDTREE_PROFILER
#include <cuda_runtime.h>

#include "../kdtree_api.h"  // KDTREE_API

namespace kdtree {

__device__ long long g_tile_stamps[kTileStampCtas * kTileStampTiles * kTileEvents];

__device__ __forceinline__ void tile_stamp(bool on, int tile, TileEvent e) {
  if (!on || tile >= kTileStampTiles || (threadIdx.x & 31) != 0) return;
  const int cta = blockIdx.y * gridDim.x + blockIdx.x;
  if (cta >= kTileStampCtas) return;
  g_tile_stamps[(cta * kTileStampTiles + tile) * kTileEvents + static_cast<int>(e)] = clock64();
}

}  // namespace kdtree

// The diagnostics library's reader (bench/diag/ws_timeline.py): the stamps of the last launch.
extern "C" KDTREE_API int kdtree_tile_stamps_copy(void* host, size_t bytes) {
  return static_cast<int>(cudaMemcpyFromSymbol(host, kdtree::g_tile_stamps, bytes));
}

#define KDTREE_TILE_STAMP(on, tile, e) ::kdtree::tile_stamp((on), (tile), ::kdtree::TileEvent::e)

#else  // release build

#define KDTREE_TILE_STAMP(on, tile, e) \
  do {                                 \
  } while (0)

#endif  // KDTREE_PROFILER
