// The online softmax's exponentiation, shared by both portable tilings (kernel.cuh, kernel_ws.cuh):
// a warp's m16 x (8 NT) score fragments become exp2(s - m) against its two rows' running maxima
// (0 for a row that has seen no key yet: its scores are all -inf), and their sums are added to l.
#pragma once
#include <math_constants.h>

namespace kdtree {

// `st`: anything with float m[2], l[2] (the rows g and g + 8 of the lane's fragments).
template <int NT, class RowState>
__device__ __forceinline__ void exponentiate_scores(float (&s)[NT][4], RowState& st) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const float base = st.m[rr] == -CUDART_INF_F ? 0.f : st.m[rr];
    float sum = 0.f;
#pragma unroll
    for (int f = 0; f < NT; ++f) {
      s[f][2 * rr] = exp2f(s[f][2 * rr] - base);
      s[f][2 * rr + 1] = exp2f(s[f][2 * rr + 1] - base);
      sum += s[f][2 * rr] + s[f][2 * rr + 1];
    }
    st.l[rr] += sum;
  }
}

}  // namespace kdtree
