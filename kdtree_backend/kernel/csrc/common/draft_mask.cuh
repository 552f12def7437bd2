// The draft block's visibility (SGLang's FULL_MASK layout, or causal without a mask): which draft
// keys a draft query row sees. The prefix is always visible and its mask columns are never read.
#pragma once
#include <stdint.h>

#include "../kdtree_api.h"
#include "ptx.cuh"

namespace kdtree {

// The request's FULL_MASK block (row stride prefix + n; its prefix columns are never read), or
// null when the draft block is causal.
__device__ __forceinline__ const uint8_t* request_mask(const KdtreeVerifyParams& p, int b) {
  if (p.custom_mask == nullptr) return nullptr;
  // load_index's coherent load: for a launch of one request b is 0 and the address known at entry.
  return reinterpret_cast<const uint8_t*>(p.custom_mask) + load_index<true>(p.mask_indptr, b);
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

// The draft keys [key_base, key_base + kKeys) that each of kTokens draft tokens sees, as bits (bit k:
// key key_base + k), read by the whole warp in one round trip (journal m32b): lane j reads each
// token's mask bytes key_base + j, key_base + 32 + j, ... (every load issued before any is used) and
// the warp's ballots gather them. Keys past the drafts, and a null row, read nothing and are
// invisible. Per key, draft_key_visible makes every lane read its own bytes, and ptxas orders those
// loads one after another (each behind a branch on the key): ~5,400 cycles a 64-key draft tile on
// the Hopper path, ~3,000 a 32-key tile on the portable kernel (m32b).
template <int kKeys, int kTokens>
__device__ __forceinline__ void warp_draft_bits(const uint8_t* const (&rows)[kTokens], int n, int key_base, int lane,
                                                uint64_t (&bits)[kTokens]) {
  static_assert(kKeys == 32 || kKeys == 64, "a draft tile of 32 or 64 keys");
  constexpr int kLoads = kKeys / 32;
  uint32_t v[kTokens][kLoads];
#pragma unroll
  for (int t = 0; t < kTokens; ++t)
#pragma unroll
    for (int h = 0; h < kLoads; ++h) {
      const int key = key_base + 32 * h + lane;
      v[t][h] = rows[t] != nullptr && key < n ? __ldg(rows[t] + key) : 0u;
    }
#pragma unroll
  for (int t = 0; t < kTokens; ++t) {
    bits[t] = 0;
#pragma unroll
    for (int h = 0; h < kLoads; ++h)
      bits[t] |= static_cast<uint64_t>(__ballot_sync(0xffffffffu, v[t][h] != 0u)) << (32 * h);
  }
}

// Whether the warp reads the mask of its mma fragment's 8-row groups together (group_draft_bits):
// rows are token * heads + head and a group starts at a multiple of 8, so it spans at most two
// tokens when heads > 7 - gcd(8, heads): heads 4 (two whole tokens; Kimi K2 at TP16) and every
// count from 6 on (one token's rows when heads is a multiple of 8). Heads 1, 2, 3 and 5 read a byte
// a lane (draft_key_visible).
__host__ __device__ __forceinline__ bool warp_reads_group_mask(int heads) { return heads == 4 || heads >= 6; }

// The draft keys [key_base, key_base + kKeys) that this lane's row (r8 + lane / 4) sees, as bits
// (bit k: key key_base + k), for the 8-row group starting at row r8 (a multiple of 8) of a request
// with a FULL_MASK block (`mask`, request_mask) and warp_reads_group_mask(heads): the warp reads the
// group's one or two tokens in one round trip. Rows past the request (padding) see key 0 only, as
// draft_key_visible has it. Warp-uniform: every lane of the warp must call it.
template <int kKeys>
__device__ __forceinline__ uint64_t group_draft_bits(const uint8_t* mask, int heads, int prefix, int n, int r8,
                                                     int key_base, int lane) {
  const uint64_t padding = key_base == 0 ? 1u : 0u;
  const int t0 = r8 / heads, t1 = (r8 + 7) / heads;  // the group's first and last token: t1 <= t0 + 1
  if (t0 >= n) return padding;
  if (t1 == t0) {  // one token's rows (always, with heads a multiple of 8)
    const uint8_t* const rows[1] = {draft_mask_row(mask, prefix, n, t0)};
    uint64_t bits[1];
    warp_draft_bits<kKeys, 1>(rows, n, key_base, lane, bits);
    return bits[0];
  }
  const uint8_t* const rows[2] = {draft_mask_row(mask, prefix, n, t0), t1 < n ? draft_mask_row(mask, prefix, n, t1) : nullptr};
  uint64_t bits[2];
  warp_draft_bits<kKeys, 2>(rows, n, key_base, lane, bits);
  if ((r8 + (lane >> 2)) / heads == t0) return bits[0];
  return t1 < n ? bits[1] : padding;
}

}  // namespace kdtree
