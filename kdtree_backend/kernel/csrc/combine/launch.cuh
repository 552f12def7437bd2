// Host side of the split combine: the launch of the merge after a split verify launch, in the layout
// its planned split count picks, as a programmatic dependent where that measured faster.
#pragma once
#include <cuda_runtime.h>

#include "../common/launch.h"
#include "../kdtree_api.h"
#include "kernel.cuh"

namespace kdtree {

template <class Cfg, class Lay, bool kPdl>
inline cudaError_t launch_combine_layout(const KdtreeVerifyParams& p, int row_tiles, int slot_parts,
                                         cudaStream_t stream) {
  const dim3 grid((row_tiles * Cfg::kM + Lay::kRowsPerBlock - 1) / Lay::kRowsPerBlock, p.batch);
  if constexpr (kPdl) {
    return launch_programmatic(combine_splits_kernel<Cfg, Lay, true>, grid, dim3(Lay::kThreads), 0, stream, p, row_tiles,
                               slot_parts);
  } else {
    combine_splits_kernel<Cfg, Lay, false><<<grid, Lay::kThreads, 0, stream>>>(p, row_tiles, slot_parts);
    return cudaGetLastError();
  }
}

// Launches the merge for a main-kernel launch of `row_tiles` row tiles of Cfg::kM rows and `extra`
// remainder CTAs (s3; both launchers), in the layout the expected pieces a request pick (the plan's
// parts over the batch: ceil(parts / batch); the layouts were measured by split count, when every
// request had the plan's count); returns the launch's error.
// kPdl: up to kCombinePdlMaxSplits pieces a request, the merge is launched as a programmatic dependent
// of the main kernel, which must trigger it (h39b). Measured against ordinary launches (journal h39,
// h39b): 2 and 4 splits 2-5.5% faster end to end; 8 splits 2-9% slower, and the quarter rows (B = 1
// plans of 17-128 splits) ~2% slower: there the device-side wait costs more than the kernel boundary.
constexpr int kCombinePdlMaxSplits = 4;
template <class Cfg, bool kPdl = false>
inline cudaError_t launch_combine(const KdtreeVerifyParams& p, int row_tiles, int extra, cudaStream_t stream) {
  const int pieces = (p.num_splits + p.batch - 1) / p.batch;
  const int sp = slot_parts(p.num_splits, row_tiles, extra);
  if (pieces >= kCombineQuarterMinSplits)
    return launch_combine_layout<Cfg, CombineQuarterRows, false>(p, row_tiles, sp, stream);
  if constexpr (kPdl) {
    if (pieces <= kCombinePdlMaxSplits) return launch_combine_layout<Cfg, CombineWholeRows, true>(p, row_tiles, sp, stream);
  }
  return launch_combine_layout<Cfg, CombineWholeRows, false>(p, row_tiles, sp, stream);
}

}  // namespace kdtree
