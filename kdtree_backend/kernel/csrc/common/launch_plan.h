// Host-side launch planning shared by every kernel configuration (portable and Hopper): row tiles,
// the split count, the workspace layout and its check, the CUDA-error -> status mapping. No CUDA
// calls, so the C API (kdtree_api.cu) and both launchers (portable/, hopper/launch.cu) agree by construction.
#pragma once
#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>

#include "../kdtree_api.h"
#include "mla.h"
#include "split_rule.cuh"

namespace kdtree {

// Measured on the H200 (docs/kernel/journal.md). Portable: 32-128 tie for long prefixes, 64 is best
// at L=1k, 512+ starves small batches of CTAs.
constexpr int kDefaultMinKeysPerSplit = 64;
// Hopper (h29): the split length is left to the device (0: split_work's round(sqrt(key tiles) / 3)
// tiles), because the best length grows with the prefix, which a plan fixed at CUDA-graph capture
// cannot see. It replaces h4's rule (batches of <= 2 row tiles over half the SMs), which was right
// at L = 8k and cost 18% at L = 32k (journal "The split count on small batches").
constexpr int kHopperMinKeysPerSplit = 0;
// Hopper: at most half the SMs' worth of splits are planned. A single-row-tile batch (B1 H8 n8) is
// best at 66 splits at every prefix and loses 4% at 128 (journal h11 / "The split count on small
// batches"); the cap binds only for batches of 1-2 row tiles (h29b; one wave for every batch, h29's
// first plan, measured slower there).
constexpr bool kHopperCapSplitsAtHalfSms = true;

// The split count is fixed per (batch, row tiles) at plan time because the prefix lengths are
// unknown then (CUDA-graph capture sees dummy ones). The main kernels run one CTA per SM
// (launch bounds + their shared memory), so pick the count that minimises waves / splits, with a
// small charge for splitting at all (combine pass, Q re-loads). Short prefixes use fewer splits
// on the device (min_keys_per_split).
inline int choose_splits(int64_t base_ctas, int num_sms) {
  if (base_ctas >= num_sms) {
    // Already a full wave: split only if it evens out a ragged last wave.
    double best_cost = 1e30;
    int best = 1;
    for (int s = 1; s <= 4; ++s) {
      const int64_t waves = (base_ctas * s + num_sms - 1) / num_sms;
      const double cost = static_cast<double>(waves) / s + (s > 1 ? 0.05 * waves / s + 0.02 : 0.0);
      if (cost < best_cost - 1e-9) {
        best_cost = cost;
        best = s;
      }
    }
    return best;
  }
  int s = static_cast<int>(num_sms / base_ctas);
  return s < 1 ? 1 : (s > kMaxSplits ? kMaxSplits : s);
}

inline int row_tiles_for(int num_heads, int max_qo_len, int rows_per_tile) {
  const int64_t rows = static_cast<int64_t>(num_heads) * max_qo_len;
  return static_cast<int>((rows + rows_per_tile - 1) / rows_per_tile);
}

// A missing image for this GPU is its own status (the loader and doctor name the rebuild).
inline int status_of(cudaError_t e) {
  return (e == cudaErrorInvalidDeviceFunction || e == cudaErrorNoKernelImageForDevice) ? KDTREE_ERR_NO_KERNEL_IMAGE
                                                                                       : KDTREE_ERR_CUDA;
}

// Split partials: per (request, split, row) 512 fp32 values, then one fp32 log2-sum-exp per row.
inline int64_t workspace_bytes(int batch, int splits, int row_tiles, int rows_per_tile) {
  return splits > 1 ? static_cast<int64_t>(batch) * splits * row_tiles * rows_per_tile * (kVDim + 1) * 4 : 0;
}

// KDTREE_OK, or KDTREE_ERR_WORKSPACE with the reason in `err` when a split launch lacks room.
inline int check_workspace(const KdtreeVerifyParams& p, int row_tiles, int rows_per_tile, char* err, size_t err_len) {
  if (p.num_splits <= 1) return KDTREE_OK;
  const int64_t need = workspace_bytes(p.batch, p.num_splits, row_tiles, rows_per_tile);
  if (p.workspace != nullptr && p.workspace_bytes >= need) return KDTREE_OK;
  snprintf(err, err_len, "workspace of %lld bytes is too small: %lld needed for %d splits",
           static_cast<long long>(p.workspace_bytes), static_cast<long long>(need), p.num_splits);
  return KDTREE_ERR_WORKSPACE;
}

// The plan's outputs from its inputs (requested_splits / requested_min_keys_per_split, 0 = choose; the
// caller has range-checked them): the one place the split count and the workspace size are decided.
inline void fill_plan(int rows_per_tile, int min_keys_per_split, int batch, int num_heads, int max_qo_len, int num_sms,
                      KdtreePlan* plan, bool cap_at_half_sms = false) {
  const int row_tiles = row_tiles_for(num_heads, max_qo_len, rows_per_tile);
  const int64_t base_ctas = static_cast<int64_t>(batch) * row_tiles;
  int splits = choose_splits(base_ctas, num_sms);
  if (cap_at_half_sms && num_sms >= 2 && splits > num_sms / 2) splits = num_sms / 2;
  if (plan->requested_splits > 0) splits = plan->requested_splits;
  plan->num_splits = splits;
  plan->row_tiles = row_tiles;
  plan->rows_per_tile = rows_per_tile;
  plan->min_keys_per_split = plan->requested_min_keys_per_split > 0 ? plan->requested_min_keys_per_split
                                                                     : min_keys_per_split;
  plan->workspace_bytes = workspace_bytes(batch, splits, row_tiles, rows_per_tile);
}

}  // namespace kdtree
