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

}  // namespace kdtree
