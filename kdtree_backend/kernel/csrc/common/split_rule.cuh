// The split length rule (h29) and the bound on a request's pieces. Host and device arithmetic (no
// CUDA call); the batch-wide part schedule that uses them is common/schedule.cuh
// (tests/kernel/test_schedule_cpu.py checks both on the host).
#pragma once
#include <math.h>
#include <stdint.h>

namespace kdtree {

// The most parts a plan may have (so the most pieces a request is cut into): the split combine holds
// one weight per piece in shared memory and reads kMaxSplits / 32 lse values a lane;
// kdtree_verify_plan and kdtree_verify_run refuse more.
constexpr int kMaxSplits = 128;

// h29: the smallest part the Hopper plan leaves to the device (min_keys_per_split = 0), from the
// batch's longest request:
// round(sqrt(key tiles) / 3) tiles, at least 1 (17 -> 1, 129 -> 4, 513 -> 8), the best length of the
// split-count sweep at every prefix (journal "The split count on small batches"): a split's tile
// time against the fp32 partials it writes and the combine re-reads. It sits on every CTA's
// prologue chain (request -> split -> first K tile), so it is a float estimate plus an exact
// integer correction: the result is the largest m >= 1 with 3m - 1.5 <= sqrt(key_tiles), i.e.
// (6m - 3)^2 <= 4 key_tiles, whatever the sqrt's rounding, so the verify kernel and the combine
// agree. (An integer binary search here cost the split shapes ~1-2%: journal h29.)
__host__ __device__ __forceinline__ int auto_split_tiles(int key_tiles) {
  const int64_t k4 = 4 * static_cast<int64_t>(key_tiles);
  int m = static_cast<int>(sqrtf(static_cast<float>(key_tiles)) * (1.f / 3.f) + 0.5f);
  m = m < 1 ? 1 : m;
  const int64_t up = 6 * static_cast<int64_t>(m) + 3, down = 6 * static_cast<int64_t>(m) - 3;
  if (up * up <= k4) return m + 1;              // the estimate rounded down
  if (m > 1 && down * down > k4) return m - 1;  // the estimate rounded up
  return m;
}

}  // namespace kdtree
