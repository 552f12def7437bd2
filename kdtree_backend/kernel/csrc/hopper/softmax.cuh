// The Hopper kernel's softmax on one 64 x 64 score tile in wgmma's accumulator layout: masking (the
// prefix bound, the draft block's mask), the online softmax with a lazily moved reference max, and
// O's rescale.
#pragma once
#include <math_constants.h>
#include <stdint.h>

#include "../common/draft_mask.cuh"
#include "../common/ptx.cuh"
#include "../kdtree_api.h"

namespace kdtree {
namespace hopper {

// WG0's online-softmax state for its two rows (lane/4 and lane/4 + 8 of its warp's 16).
struct SoftmaxState {
  float m[2];
  float l[2];
};

// The score tile the functions below mask and scale into the log2 domain: 64 x 64, in wgmma's
// accumulator layout, s[8*nb + e] is row (warp*16 + lane/4 + 8*(e>>1)), key (8*nb + 2*(lane&3) + (e&1)).

// A fragment row's 16 visibility bits (key block nb, column e of the lane's pair at bit 2 nb + e), as
// scale_and_mask reads them, from `visible(nb, e)`: one packing for both ways of reading the mask.
template <class Visible>
__device__ __forceinline__ uint32_t pack_draft_bits(Visible visible) {
  uint32_t bb = 0;
#pragma unroll
  for (int nb = 0; nb < 8; ++nb)
#pragma unroll
    for (int e = 0; e < 2; ++e) bb |= static_cast<uint32_t>(visible(nb, e)) << (nb * 2 + e);
  return bb;
}

// The visibility of a draft tile's keys [key_base, key_base + 64) for this thread's two rows, as
// bits (nb * 2 + (e & 1)) of bits[rr]. Where an 8-row group of a warp's rows spans at most two
// tokens (heads 4 or from 6 on) the warp reads their mask bytes in one round trip
// (group_draft_bits, journal m32b, s8); otherwise every lane reads its own bytes (draft_key_visible).
__device__ __forceinline__ void draft_tile_bits(const KdtreeVerifyParams& p, int b, int prefix, int n, int row0,
                                                int lane, int key_base, uint32_t (&bits)[2]) {
  const uint8_t* mask = request_mask(p, b);
  const int col_lane = 2 * (lane & 3);
  if (mask != nullptr && warp_reads_group_mask(p.num_heads)) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const uint64_t v = group_draft_bits<64>(mask, p.num_heads, prefix, n, (row0 & ~7) + rr * 8, key_base, lane) >> col_lane;
      bits[rr] = pack_draft_bits([&](int nb, int e) { return (v >> (nb * 8 + e)) & 1u; });
    }
    return;
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const DraftRow d = draft_row(mask, p.num_heads, prefix, n, row0 + rr * 8);
    bits[rr] = pack_draft_bits([&](int nb, int e) {
      return draft_key_visible(d.mask_row, n, d.valid, d.query, key_base + nb * 8 + col_lane + e);
    });
  }
}

// The first draft tile's bits are loaded in the prologue, where the mask's round trips (mask_indptr,
// then the bytes) hide behind the Q tile, instead of after the draft tile's QK^T, where nothing else
// runs (journal h11).
__device__ __forceinline__ void first_draft_tile_bits(const KdtreeVerifyParams& p, int b, int prefix, int n, int row0,
                                                      int lane, uint32_t (&bits)[2]) {
  draft_tile_bits(p, b, prefix, n, row0, lane, 0, bits);
}

// Scale into the log2 domain (`scale`: the tile's score scale, prefix or draft) and mask. kFold
// (h13): the scale is applied later, inside the exp2's FFMA (softmax_exp_range<true>), so this only masks.
template <bool kFold>
__device__ __forceinline__ void scale_and_mask(float (&s)[32], const KdtreeVerifyParams& p, bool is_prefix,
                                               float scale, int key_base, int b, int prefix, int n, int row0, int lane,
                                               const uint32_t (&first_bits)[2]) {
  const int col_lane = 2 * (lane & 3);
  if (is_prefix) {
    if (key_base + 64 <= prefix) {  // a full prefix tile: nothing to mask
      if (!kFold) {
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] *= scale;
      }
      return;
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int key = key_base + (i >> 2) * 8 + col_lane + (i & 1);
      s[i] = key < prefix ? (kFold ? s[i] : s[i] * scale) : -CUDART_INF_F;
    }
    return;
  }
  uint32_t bits[2] = {first_bits[0], first_bits[1]};  // the first draft tile's: loaded in the prologue
  if (key_base != 0) draft_tile_bits(p, b, prefix, n, row0, lane, key_base, bits);
#pragma unroll
  for (int nb = 0; nb < 8; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      s[nb * 4 + e] = (bits[e >> 1] >> (nb * 2 + (e & 1))) & 1u ? (kFold ? s[nb * 4 + e] : s[nb * 4 + e] * scale)
                                                                : -CUDART_INF_F;
}

// Online softmax on one tile (lazy reference max, as in the portable kernel), in two steps:
// softmax_rows returns each row's O rescale factor (1 when the max did not move) and updates the
// state; softmax_exp_range turns a range of s into unnormalised probabilities and adds up their rows.
// kFold (h13; only with positive, finite scales): s holds raw scores, `scale` is this tile's score
// scale (log2 domain) and `ps` its P scale (v_scale on prefix tiles, else 1), given as log2(ps) and
// 1/ps: the max is taken on raw scores and scaled once per row (scale > 0 keeps the order), and
// P' = exp2(s * scale - (m - log2 ps)) = ps * exp2(s * scale - m) comes out of one FFMA + MUFU; the
// row sum keeps sum(P') / ps. Without the fold s is already scaled and ps is applied when P is packed.
//
// h34: the two steps let WG0's PV of the tile's first 32 keys run on the tensor pipe while the
// exp2s of the last 32 are computed: the one overlap of tensor work with the softmax that does not
// keep a K stage longer (the PV still ends inside the tile). kPvGroups: WG0's PV commit groups a
// tile, each issued after its keys' exp2s (the last after P is shared with WG1). Measured
// 0.981-0.989 of the one-group time with 2, the same with 4 (journal h34, h34b).
constexpr int kPvGroups = 2;
static_assert(kPvGroups == 1 || kPvGroups == 2 || kPvGroups == 4, "PV groups of whole k16 steps");
template <bool kFold>
__device__ __forceinline__ void softmax_rows(const float (&s)[32], SoftmaxState& st, float (&alpha)[2],
                                             bool& any_move, float scale) {
  constexpr float kRescaleThreshold = 8.f;
  bool move[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) mx = fmaxf(mx, fmaxf(s[nb * 4 + 2 * rr], s[nb * 4 + 2 * rr + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    if (kFold) mx *= scale;  // -inf stays -inf (scale > 0)
    move[rr] = mx > st.m[rr] + kRescaleThreshold;  // also true the first time a row sees a key
    const float m_new = move[rr] ? mx : st.m[rr];
    alpha[rr] = move[rr] ? fast_exp2(st.m[rr] - m_new) : 1.f;  // m = -inf -> 0 (l and O are 0)
    st.l[rr] *= alpha[rr];
    st.m[rr] = m_new;
  }
  any_move = __any_sync(0xffffffffu, move[0] || move[1]);
}
template <bool kFold>
__device__ __forceinline__ void softmax_exp_range(float (&s)[32], const SoftmaxState& st, float (&sum)[2], float scale,
                                                  float log2_ps, int nb0, int nb1) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const float base = st.m[rr] == -CUDART_INF_F ? 0.f : st.m[rr];
    const float shift = log2_ps - base;
#pragma unroll
    for (int nb = nb0; nb < nb1; ++nb) {
      float& a = s[nb * 4 + 2 * rr];
      float& b = s[nb * 4 + 2 * rr + 1];
      a = fast_exp2(kFold ? fmaf(a, scale, shift) : a - base);
      b = fast_exp2(kFold ? fmaf(b, scale, shift) : b - base);
      sum[rr] += a + b;
    }
  }
}

// The tile loop is done: each row's 1 / sum (inv_l, also to SharedStorage::inv_l for WG1) and
// log2-sum-exp (to SharedStorage::lse, for the split combine); a row that saw nothing: 0 and -inf.
__device__ __forceinline__ void finish_rows(const SoftmaxState& st, float (&inv_l)[2], float* s_inv_l, float* s_lse,
                                            int row_in_tile0, int lane) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float l = st.l[rr];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv_l[rr] = l > 0.f ? 1.f / l : 0.f;
    if ((lane & 3) == 0) {
      s_inv_l[row_in_tile0 + 8 * rr] = inv_l[rr];
      s_lse[row_in_tile0 + 8 * rr] = l > 0.f ? st.m[rr] + log2f(l) : -CUDART_INF_F;
    }
  }
}

__device__ __forceinline__ void rescale(float (&o)[128], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1];
}

}  // namespace hopper
}  // namespace kdtree
