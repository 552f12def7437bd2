// The split rule: how a request's keys (prefix tiles, then draft tiles) are cut into KV splits, from
// its lengths and the plan's split count. Host and device arithmetic (no CUDA call): the verify
// kernels and the split combine compute it on the device, tests/kernel/test_split_rule_cpu.py on
// the host.
#pragma once
#include <math.h>
#include <stdint.h>

namespace kdtree {

// The most KV splits a plan may have: the split combine holds one weight per split in shared memory
// and reads kMaxSplits / 32 lse values a lane; kdtree_verify_plan and kdtree_verify_run refuse more.
constexpr int kMaxSplits = 128;

// How one request's keys (prefix tiles, then draft tiles) are cut into KV splits. Computed on the
// device from the request's lengths, so a graph captured with dummy lengths replays correctly.
struct SplitWork {
  int prefix_tiles;
  int key_tiles;
  int tiles_per_split;
  int active;  // splits that own at least one tile
};

// h29: the split length the Hopper plan leaves to the device (min_keys_per_split = 0):
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

// kAuto: the configuration may be handed min_tiles = 0 (the Hopper plan) and then cuts by
// auto_split_tiles; otherwise a split is at least one tile, and the rule's code is not compiled in.
template <bool kAuto>
__host__ __device__ __forceinline__ SplitWork split_work(int prefix_len, int qo_len, int num_splits,
                                                         int min_tiles, int bn) {
  SplitWork w;
  w.prefix_tiles = (prefix_len + bn - 1) / bn;
  w.key_tiles = w.prefix_tiles + (qo_len + bn - 1) / bn;
  if (w.key_tiles <= 0) {
    w.tiles_per_split = 1;
    w.active = 0;
    return w;
  }
  if (min_tiles <= 0) min_tiles = kAuto ? auto_split_tiles(w.key_tiles) : 1;  // 0: the device's choice (h29)
  int s = (w.key_tiles + min_tiles - 1) / min_tiles;
  s = s < num_splits ? s : num_splits;
  s = s < 1 ? 1 : s;
  w.tiles_per_split = (w.key_tiles + s - 1) / s;
  w.active = (w.key_tiles + w.tiles_per_split - 1) / w.tiles_per_split;
  return w;
}

// The plan's smallest split in tiles; 0 (min_keys_per_split = 0, the Hopper plan) lets split_work
// choose from the request's length (h29).
__host__ __device__ __forceinline__ int min_tiles_per_split(int min_keys, int bn) {
  if (min_keys == 0) return 0;
  const int t = min_keys / bn;
  return t < 1 ? 1 : t;
}

}  // namespace kdtree
