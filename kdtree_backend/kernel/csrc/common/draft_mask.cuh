// The draft block's visibility (SGLang's FULL_MASK layout, or causal without a mask): which draft
// keys a draft query row sees. The prefix is always visible and its mask columns are never read.
#pragma once
#include <stdint.h>

#include "../kdtree_api.h"

namespace kdtree {

// The request's FULL_MASK block (row stride prefix + n; its prefix columns are never read), or
// null when the draft block is causal.
__device__ __forceinline__ const uint8_t* request_mask(const KdtreeVerifyParams& p, int b) {
  if (p.custom_mask == nullptr) return nullptr;
  return reinterpret_cast<const uint8_t*>(p.custom_mask) + __ldg(reinterpret_cast<const int64_t*>(p.mask_indptr) + b);
}

// The mask row of draft token `query` from its draft columns on (null when causal). The offset
// is 32-bit: the request's mask block (n x (prefix + n) bytes) stays below 2 GiB (next_segment stops
// the kernel otherwise: a prefix over 33M tokens at n = 64); 64-bit math here costs the portable
// kernel 20 B of spills on sm_120.
__device__ __forceinline__ const uint8_t* draft_mask_row(const uint8_t* mask, int prefix, int n, int query) {
  return mask == nullptr ? nullptr : mask + (query * (prefix + n) + prefix);
}

// May draft token `query` see draft key `key` (0-based within the draft block)? Rows past the
// request (row_valid false) see key 0 only: finite and never stored.
__device__ __forceinline__ bool draft_key_visible(const uint8_t* mask_row, int n, bool row_valid, int query, int key) {
  if (!row_valid) return key == 0;
  if (key >= n) return false;
  if (mask_row != nullptr) return mask_row[key] != 0;
  return key <= query;
}

// Query row r of the tile's draft block: which draft token it is and where its mask row starts.
struct DraftRow {
  bool valid;  // r is one of the request's rows (padding rows see key 0 only)
  int query;
  const uint8_t* mask_row;
};
__device__ __forceinline__ DraftRow draft_row(const uint8_t* mask, int heads, int prefix, int n, int r) {
  DraftRow d;
  d.valid = r < n * heads;
  d.query = d.valid ? r / heads : 0;
  d.mask_row = draft_mask_row(mask, prefix, n, d.query);
  return d;
}

// The draft keys [key_base, key_base + kKeys) that one draft token sees, as bits (bit k: key
// key_base + k), read by the whole warp in one round trip (journal m32b): lane j reads the token's
// mask bytes key_base + j, key_base + 32 + j, ... (every load issued before any is used) and the
// warp's ballots gather them. Keys past the drafts read nothing and are invisible. For a warp whose
// 8 rows of an mma fragment (lane / 4) are one draft token: heads a multiple of 8
// (warp_rows_one_token). Per key, draft_key_visible makes every lane read its own bytes, and ptxas
// orders those loads one after another (each behind a branch on the key): ~5,400 cycles a 64-key draft
// tile on the Hopper path, ~3,000 a 32-key tile on the portable kernel (m32b).
template <int kKeys>
__device__ __forceinline__ uint64_t warp_draft_bits(const uint8_t* mask_row, int n, int key_base, int lane) {
  static_assert(kKeys == 32 || kKeys == 64, "a draft tile of 32 or 64 keys");
  constexpr int kLoads = kKeys / 32;
  uint32_t v[kLoads];
#pragma unroll
  for (int h = 0; h < kLoads; ++h) {
    const int key = key_base + 32 * h + lane;
    v[h] = key < n ? __ldg(mask_row + key) : 0u;
  }
  uint64_t bits = 0;
#pragma unroll
  for (int h = 0; h < kLoads; ++h) bits |= static_cast<uint64_t>(__ballot_sync(0xffffffffu, v[h] != 0u)) << (32 * h);
  return bits;
}

// Whether each 8-row group of a warp's mma fragment rows (row0 + 8 rr, row0 a multiple of 8 plus
// lane / 4) lies in one draft token: rows are token * heads + head, so heads a multiple of 8.
__device__ __forceinline__ bool warp_rows_one_token(int heads) { return (heads & 7) == 0; }

// The draft row of the 8-row group starting at row `r8` (a multiple of 8) when it is one token
// (warp_rows_one_token): its mask row, or null when the group is padding rows (all of them, since
// n x heads is then a multiple of 8).
__device__ __forceinline__ const uint8_t* group_mask_row(const uint8_t* mask, int heads, int prefix, int n, int r8) {
  return r8 < n * heads ? draft_mask_row(mask, prefix, n, r8 / heads) : nullptr;
}

}  // namespace kdtree
