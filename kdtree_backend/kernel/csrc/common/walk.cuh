// The CTA's walk over its part (s1), for both kernels, and the merge that follows it on plans that
// merge in the kernel (s2, common/merge.cuh).
#pragma once
#include "../kdtree_api.h"
#include "merge.cuh"
#include "request.cuh"
#include "schedule.cuh"

namespace kdtree {

// part_begin, then one segment at a time. Thread 0 finds the next segment (so next_segment exists
// once in the binary), a __syncthreads publishes it and ends the previous segment (its copies landed,
// its stores read their shared memory), every thread copies it and runs it: `between()` before each
// segment but the first, then `run(cw)`. When the kernel merges (merge_in_kernel), every segment ends
// in merge_arrive (a barrier; a piece arrives: the segment is read back from shared memory, so
// nothing of it stays live in registers over run's tile loop) and the CTA merges the row tiles its
// pieces completed at the end.
// kSingle (a launch of one request): the one segment of single_request_segment, no walk (a batch of
// one keeps the combine).
template <class Cfg, bool kSingle, class Between, class Run>
__device__ __forceinline__ void walk_part(const KdtreeVerifyParams& p, int part, int row_tile, ScheduleScratch& sc,
                                          Between between, Run run) {
  if constexpr (kSingle) {
    CtaWork cw;
    if (single_request_segment<Cfg>(p, part, row_tile, cw)) run(cw);
    return;
  } else {
    if (!part_begin<Cfg>(p, part, sc)) return;
    if (threadIdx.x == 0) sc.merges.count = 0;  // part_begin's last barrier ended the scan's reads
    for (bool first = true;; first = false) {
      if (threadIdx.x == 0) next_segment<Cfg>(p, block_idx_x(), sc);  // the row tile, read here (block_idx_x)
      __syncthreads();
      if (!sc.more) break;
      const CtaWork cw = sc.seg;
      if (!first) between();
      run(cw);
      if (merge_in_kernel(p.batch, p.num_splits)) merge_arrive<Cfg>(p, sc);
    }
    if (merge_in_kernel(p.batch, p.num_splits)) merge_pending<Cfg>(p, sc);
  }
}

}  // namespace kdtree
