// The online softmax's steps shared by both portable tilings (kernel.cuh, kernel_ws.cuh), on a
// warp's m16 x (8 NT) score fragments (fp32, log2 units), the lane's two rows g and g + 8.
#pragma once
#include <math_constants.h>

#include "../common/ptx.cuh"

namespace kdtree {

// The rows' reference max, lazily moved: m only moves when a row's max exceeds it by more than
// kRescaleThreshold (log2 units), so p <= 2^threshold (exact in the math, fine in bf16/fp32) and the
// O rescale runs on few tiles. A row with nothing visible so far keeps m = -inf and l = 0.
// `st`: anything with float m[2]; move[rr] says whether row rr's reference moves to m_new[rr].
template <int NT, class RowState>
__device__ __forceinline__ void moved_reference_max(const float (&s)[NT][4], const RowState& st, bool (&move)[2],
                                                    float (&m_new)[2]) {
  constexpr float kRescaleThreshold = 8.f;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int f = 0; f < NT; ++f) mx = fmaxf(mx, fmaxf(s[f][2 * rr], s[f][2 * rr + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    move[rr] = mx > st.m[rr] + kRescaleThreshold;  // also true the first time a row sees a key
    m_new[rr] = move[rr] ? mx : st.m[rr];
  }
}

// exp2(s - m) against the rows' reference maxima (0 for a row that has seen no key yet: its scores
// are all -inf); their sums are added to l. `st`: anything with float m[2], l[2].

// kApproxExp2: one ex2.approx.ftz a score (common/ptx.cuh fast_exp2) instead of exp2f's range fix-up
// (the warp-specialised kernel, journal p22; the tiled kernel keeps exp2f, h7).
template <int NT, class RowState, bool kApproxExp2 = false>
__device__ __forceinline__ void exponentiate_scores(float (&s)[NT][4], RowState& st) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const float base = st.m[rr] == -CUDART_INF_F ? 0.f : st.m[rr];
    float sum = 0.f;
#pragma unroll
    for (int f = 0; f < NT; ++f) {
      s[f][2 * rr] = kApproxExp2 ? fast_exp2(s[f][2 * rr] - base) : exp2f(s[f][2 * rr] - base);
      s[f][2 * rr + 1] = kApproxExp2 ? fast_exp2(s[f][2 * rr + 1] - base) : exp2f(s[f][2 * rr + 1] - base);
      sum += s[f][2 * rr] + s[f][2 * rr + 1];
    }
    st.l[rr] += sum;
  }
}

}  // namespace kdtree
