// What a CTA reads about its request before any tile: the request view (its query tokens, prefix and
// slot range from the index arrays), its split work, and where its query rows come from and its
// output rows go. Shared by the portable and Hopper kernels and the split combine, so they agree.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../kdtree_api.h"
#include "mla.h"
#include "ptx.cuh"
#include "split_rule.cuh"

namespace kdtree {

struct RequestView {
  int64_t q0;   // first query token of the request
  int n;        // draft tokens (query tokens) of the request
  int64_t kv0;  // first kv_indices entry of the request
  int prefix;   // committed prefix length
};

__device__ __forceinline__ RequestView load_request(const KdtreeVerifyParams& p, int b) {
  RequestView r;
  const bool qo64 = p.qo_indptr_is_int64 != 0;
  const bool kv64 = p.kv_indptr_is_int64 != 0;
  r.q0 = load_index(p.qo_indptr, b, qo64);
  int64_t n = load_index(p.qo_indptr, b + 1, qo64) - r.q0;
  // The grid covers max_qo_len rows per request; never index past what the grid was sized for.
  n = n < 0 ? 0 : (n > p.max_qo_len ? p.max_qo_len : n);
  r.n = static_cast<int>(n);
  r.kv0 = load_index(p.kv_indptr, b, kv64);
  const int64_t prefix = load_index(p.kv_indptr, b + 1, kv64) - r.kv0;
  r.prefix = prefix < 0 ? 0 : static_cast<int>(prefix);
  return r;
}

// How a request's keys are cut for configuration Cfg: the one place the verify kernels and the
// split combine compute it, so they always agree on a request's splits.
template <class Cfg>
__device__ __forceinline__ SplitWork request_split_work(const KdtreeVerifyParams& p, const RequestView& req) {
  return split_work<Cfg::kAutoSplitLength>(req.prefix, req.n, p.num_splits,
                                           min_tiles_per_split(p.min_keys_per_split, Cfg::kBN), Cfg::kBN);
}

// What one CTA (a row tile x one KV split of one request) works on. Both kernels start here: the
// grid is sized for the longest request and the most splits, and each CTA reads its real work
// on the device (CUDA-graph replays change the lengths). False: nothing to do, exit.
struct CtaWork {
  RequestView req;
  int rows;     // the request's query rows (n x H)
  SplitWork w;
  int t_begin;  // this split's key tiles: [t_begin, t_end)
  int t_end;
};

template <class Cfg>
__device__ __forceinline__ bool cta_work(const KdtreeVerifyParams& p, int b, int row_tile, int split, CtaWork& cw) {
  cw.req = load_request(p, b);
  cw.rows = cw.req.n * p.num_heads;
  if (row_tile * Cfg::kM >= cw.rows) return false;
  // The draft mask is addressed with 32-bit offsets within a request (draft_mask_row): a block of
  // 2 GiB or more (a prefix over 33M tokens at n = 64) stops the kernel instead of reading wrong.
  if (p.custom_mask != nullptr && static_cast<int64_t>(cw.req.n) * (cw.req.prefix + cw.req.n) > 0x7fffffffLL) __trap();
  cw.w = request_split_work<Cfg>(p, cw.req);
  cw.t_begin = split * cw.w.tiles_per_split;
  if (cw.t_begin >= cw.w.key_tiles) return false;
  cw.t_end = min(cw.w.key_tiles, cw.t_begin + cw.w.tiles_per_split);
  return true;
}

// Query row r of the request is (token r / H, head r % H). Rows past the request read row 0 and
// are copied as zeros (valid = false), so no garbage enters a matmul.
__device__ __forceinline__ const __nv_bfloat16* q_row_src(const KdtreeVerifyParams& p, const RequestView& req, int r,
                                                          int rows, bool& valid) {
  valid = r < rows;
  const int H = p.num_heads;
  const int tok = valid ? r / H : 0;
  const int head = valid ? r - tok * H : 0;
  return reinterpret_cast<const __nv_bfloat16*>(p.q) + (req.q0 + tok) * p.q_stride_tok +
         static_cast<int64_t>(head) * p.q_stride_head;
}

// Where query row r of the request (token r / H, head r % H) writes its 512 output columns (bf16),
// for every kernel that writes `out`: the portable and Hopper epilogues and the split combine.
__device__ __forceinline__ __nv_bfloat16* out_row(const KdtreeVerifyParams& p, const RequestView& req, int r) {
  const int H = p.num_heads;
  const int tok = r / H, head = r - (r / H) * H;
  return reinterpret_cast<__nv_bfloat16*>(p.out) + (req.q0 + tok) * p.out_stride_tok + static_cast<int64_t>(head) * kVDim;
}

}  // namespace kdtree
