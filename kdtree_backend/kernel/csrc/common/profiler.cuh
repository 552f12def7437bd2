// Milestone stamps for the diagnostics build only (`python -m kdtree_backend.build --profiler`, which
// defines KDTREE_PROFILER; never in a release build). In the style of FlashInfer's profiler.cuh: the
// kernel marks its milestones with one-line macros that expand to nothing unless KDTREE_PROFILER is
// defined, so the release SASS does not depend on them:
//
//   KDTREE_PROFILER_INIT();                          // kernel entry: this thread's stamps
//   KDTREE_MILESTONE(Milestone::kTileLoopBegin);     // thread 0 of each warpgroup stamps %globaltimer
//   KDTREE_PROFILER_COMMIT(wg, num_tiles, barrier);  // each warpgroup at its end: the CTA's record
//
// The record (bench/diag/timeline.py reads it through kdtree_timeline_copy): kProfilerSlots uint64 per
// CTA, for the first kProfilerMaxCtas CTAs in launch order ((z * gridDim.y + y) * gridDim.x + x):
//   slots 0-8   %globaltimer at the milestones (slot = the Milestone's value); slots 2 and 8 are the
//               helper warpgroup's (thread 128), the others the math warpgroup's (thread 0);
//   slot 9      tiles | SM id << 32;
//   slots 10-11 clock64 at the tile loop's start and end (with slots 4 and 5: the SM clock it ran at).
// A printf instead would serialise every wgmma of the Hopper kernel (ptxas C7510).
//
// With KDTREE_PROFILER this header defines the stamp storage and the exported reader: include it from
// one translation unit only (the Hopper kernel's, hopper/launch.cu).
#pragma once
#include <stddef.h>
#include <stdint.h>

namespace kdtree {

enum class Milestone : int {
  kCtaStart = 0,              // kernel entry
  kRequestLoaded = 1,         // the CTA's work read from the request's indices
  kPrologueTilesIssued = 2,   // helper warpgroup: the prologue's K tile(s) issued
  kQVisible = 3,              // Q landed in shared memory, visible to both warpgroups
  kTileLoopBegin = 4,         // K tile 0 landed: the math warpgroup's loop starts (clock64 -> slot 10)
  kTileLoopEnd = 5,           // after the last tile (clock64 -> slot 11)
  kFinalBarrier = 6,          // both warpgroups done with the K stages
  kOutputStored = 7,          // math warpgroup: its output (and lse) stored
  kHelperOutputStored = 8,    // helper warpgroup: its output stored
};
constexpr int kProfilerMilestones = 9;
constexpr int kProfilerSlots = 12;
constexpr int kProfilerMaxCtas = 8192;

}  // namespace kdtree

#ifdef KDTREE_PROFILER
#include <cuda_runtime.h>

#include "../kdtree_api.h"  // KDTREE_API

namespace kdtree {

__device__ unsigned long long g_timeline[kProfilerMaxCtas * kProfilerSlots];

// One thread's stamps (registers; only threads 0 and 128 write them).
struct CtaTimeline {
  unsigned long long stamp[kProfilerMilestones];
  long long clock[2];

  __device__ __forceinline__ static unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }
  __device__ __forceinline__ static bool helper_slot(int slot) {
    return slot == static_cast<int>(Milestone::kPrologueTilesIssued) ||
           slot == static_cast<int>(Milestone::kHelperOutputStored);
  }
  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < kProfilerMilestones; ++i) stamp[i] = 0;
    clock[0] = clock[1] = 0;
  }
  __device__ __forceinline__ void mark(Milestone m) {
    if ((threadIdx.x & 127) != 0) return;
    stamp[static_cast<int>(m)] = now();
    if (m == Milestone::kTileLoopBegin) clock[0] = clock64();
    if (m == Milestone::kTileLoopEnd) clock[1] = clock64();
  }
  // Called by both warpgroups once their output is out (`barrier`: a named barrier id of their own):
  // the helper hands its stamps to thread 0 through shared memory, which writes the CTA's record.
  template <class Barrier>
  __device__ __forceinline__ void commit(int wg, int num_tiles, Barrier barrier) {
    __shared__ unsigned long long helper[kProfilerMilestones];
    if (wg == 1 && threadIdx.x == 128) {
#pragma unroll
      for (int i = 0; i < kProfilerMilestones; ++i)
        if (helper_slot(i)) helper[i] = stamp[i];
    }
    asm volatile("bar.sync %0, %1;\n" ::"r"(static_cast<int>(barrier)), "r"(256) : "memory");
    const int cta = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    if (wg != 0 || threadIdx.x != 0 || cta >= kProfilerMaxCtas) return;
    unsigned long long* r = g_timeline + cta * kProfilerSlots;
#pragma unroll
    for (int i = 0; i < kProfilerMilestones; ++i) r[i] = helper_slot(i) ? helper[i] : stamp[i];
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    r[9] = static_cast<unsigned long long>(num_tiles) | (static_cast<unsigned long long>(smid) << 32);
    r[10] = static_cast<unsigned long long>(clock[0]);
    r[11] = static_cast<unsigned long long>(clock[1]);
  }
};

}  // namespace kdtree

// The diagnostics library's reader: copies the stamps of the last launches (bench/diag/timeline.py).
extern "C" KDTREE_API int kdtree_timeline_copy(void* host, size_t bytes) {
  return static_cast<int>(cudaMemcpyFromSymbol(host, kdtree::g_timeline, bytes));
}

#define KDTREE_PROFILER_INIT()          \
  ::kdtree::CtaTimeline kdtree_timeline_; \
  kdtree_timeline_.init()
#define KDTREE_MILESTONE(m) kdtree_timeline_.mark(::kdtree::m)
#define KDTREE_PROFILER_COMMIT(wg, num_tiles, barrier) kdtree_timeline_.commit((wg), (num_tiles), (barrier))

#else  // release build: the markers compile to nothing

#define KDTREE_PROFILER_INIT() \
  do {                         \
  } while (0)
#define KDTREE_MILESTONE(m) \
  do {                      \
  } while (0)
#define KDTREE_PROFILER_COMMIT(wg, num_tiles, barrier) \
  do {                                                  \
  } while (0)

#endif  // KDTREE_PROFILER
