// Host-side launch planning shared by every kernel configuration (portable and Hopper): row tiles,
// the part count, the workspace layout and its check, the CUDA-error -> status mapping. No CUDA
// calls, so the C API (kdtree_api.cu) and both launchers (portable/, hopper/launch.cu) agree by construction.
#pragma once
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>

#include "../kdtree_api.h"
#include "mla.h"
#include "schedule.cuh"

namespace kdtree {

// The smallest part, in keys (the plan's min_keys_per_split). Portable: 64 (measured on the H200:
// 32-128 tie for long prefixes, 64 is best at L = 1k). Hopper (h29): 0, the device's choice from the
// batch's longest request (common/schedule.cuh, min_part_tiles), because the best length grows with
// the prefix, which a plan fixed at CUDA-graph capture cannot see.
constexpr int kDefaultMinKeysPerSplit = 64;
constexpr int kHopperMinKeysPerSplit = 0;
// Hopper: a launch of one or two row tiles in all (B1 H8 n8) is best at half the SMs' worth of parts:
// 66 beat 128 by 4% at every prefix (journal h11, h29b).
constexpr bool kHopperCapSplitsAtHalfSms = true;

// The part count (s1). Every row tile has `parts` CTAs, each over an equal share of the whole batch's
// key tiles (common/schedule.cuh), so the grid is row_tiles x parts CTAs of equal work, one CTA per
// SM at a time (launch bounds + shared memory): as many parts as fill the fewest waves. (s1 also
// tried more waves when they were fuller, 0.04 charged a wave: B1 H8 n129 L8k, 17 row tiles x 15
// parts in 2 waves, measured 35% slower than 7 parts in one; a CTA's start costs ~6 tiles.) The
// batch and the prefixes do not enter: the device cuts the batch's real lengths into the planned
// parts at every replay.
inline int choose_parts(int row_tiles, int num_sms) {
  const int64_t waves = (static_cast<int64_t>(row_tiles) + num_sms - 1) / num_sms;
  const int64_t p = waves * num_sms / row_tiles;
  return p < 1 ? 1 : (p > kMaxSplits ? kMaxSplits : static_cast<int>(p));
}

// A missing image for this GPU is its own status (the loader and doctor name the rebuild).
inline int status_of(cudaError_t e) {
  return (e == cudaErrorInvalidDeviceFunction || e == cudaErrorNoKernelImageForDevice) ? KDTREE_ERR_NO_KERNEL_IMAGE
                                                                                       : KDTREE_ERR_CUDA;
}

// KDTREE_OK, or KDTREE_ERR_WORKSPACE with the reason in `err` when the launch lacks room for its
// workspace (common/schedule.cuh, launch_workspace_bytes: the split region when the rows are cut into
// parts, the schedule cache of a batch launch).
inline int check_workspace(const KdtreeVerifyParams& p, int row_tiles, int rows_per_tile, int extra, char* err,
                           size_t err_len) {
  const int64_t need = launch_workspace_bytes(p.batch, p.num_splits, row_tiles, rows_per_tile, extra);
  if (need == 0 || (p.workspace != nullptr && p.workspace_bytes >= need)) return KDTREE_OK;
  snprintf(err, err_len,
           "workspace of %lld bytes is too small: %lld needed for %d requests, %d parts and %d extra CTAs (plan it "
           "with this GPU's SM count; a batch launch keeps its schedule there)",
           static_cast<long long>(p.workspace_bytes), static_cast<long long>(need), p.batch, p.num_splits, extra);
  return KDTREE_ERR_WORKSPACE;
}

// The plan's outputs from its inputs (requested_splits / requested_min_keys_per_split, 0 = choose; the
// caller has range-checked them): the one place the part count and the workspace size are decided.
inline void fill_plan(int rows_per_tile, int min_keys_per_split, int batch, int num_heads, int max_qo_len, int num_sms,
                      KdtreePlan* plan, bool cap_at_half_sms = false) {
  const int row_tiles = row_tiles_of(num_heads, max_qo_len, rows_per_tile);
  int parts = choose_parts(row_tiles, num_sms);
  if (cap_at_half_sms && static_cast<int64_t>(batch) * row_tiles <= 2 && num_sms >= 2 && parts > num_sms / 2)
    parts = num_sms / 2;
  if (plan->requested_splits > 0) parts = plan->requested_splits;
  plan->num_splits = parts;
  plan->row_tiles = row_tiles;
  plan->rows_per_tile = rows_per_tile;
  plan->min_keys_per_split = plan->requested_min_keys_per_split > 0 ? plan->requested_min_keys_per_split
                                                                     : min_keys_per_split;
  // s3: a batch launch gives the wave's idle SMs the row tiles' remainders (common/schedule.cuh);
  // the launcher derives the same count from the device's SM count.
  plan->workspace_bytes = launch_workspace_bytes(batch, parts, row_tiles, rows_per_tile, extra_ctas(batch, row_tiles, parts, num_sms));
}

}  // namespace kdtree
