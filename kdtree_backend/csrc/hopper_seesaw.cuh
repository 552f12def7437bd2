// Hopper (sm_90a) verify kernel, "seesaw" schedule (docs/hopper-path.md, perf-notes h6): both
// warpgroups do tensor-core work all the time, so one warpgroup's softmax overlaps the other's
// matmuls. Same semantics, split plan, workspace and combine step as every other configuration.
//
// CTA = 64 query rows of one request x one KV split; 2 warpgroups (256 threads). O = [O_L | O_R]
// (64 x 256 fp32 each): O_L lives in WG0's registers, O_R in WG1's. Key tiles (64 keys) come in
// pairs (A = tile 2k in K buffer 0, B = tile 2k+1 in K buffer 1); per pair:
//   WG0: S_A = Q K_A^T (issued at the end of the previous pair); softmax with the running max m
//        -> m0, P_A; P_A and m0 to shared memory; O_L = O_L 2^(m - m0) + P_A V_A[:, :256]
//   WG1: O_R = O_R 2^(m - m0) + P_A V_A[:, 256:] (issued first, so that the tensor cores work
//        while WG1 runs the softmax of S_B = Q K_B^T with m0 -> m1, P_B); P_B and m1 to shared
//        memory; O_R = O_R 2^(m0 - m1) + P_B V_B[:, 256:]
//   WG0: O_L = O_L 2^(m0 - m1) + P_B V_B[:, :256]; then S_A' for the next pair.
// Each warpgroup keeps its own row sum (added at the end). Both hold the same running max.
//
// The K gather (page size 1: cp.async through kv_indices) is split by who reads a piece last:
// columns 0..255 (atoms 0-3) of either buffer are last read by WG0, which refills them; columns
// 256..575 (atoms 4-8) by WG1, which refills those. So no "buffer empty" barrier exists: each
// warpgroup reloads a piece right after its own last use of it, and the full barriers are one
// mbarrier per (buffer, half), completed by the 128 cp.async arrivals of the loading warpgroup.
//
// Shared memory (230,432 B of 232,448): Q atoms 0-7 (64 KB; Q's rope columns 512..575, atom 8, live
// in registers as wgmma A fragments, and its 8 KB slot holds P_B) | K buffers 0 and 1 (2 x 72 KB) |
// P_A (8 KB) | per-row m0, m1, l0, l1 | 4 mbarriers. Layout of every block: 64-column atoms of 64
// rows x 128 B with the 128-byte swizzle (hopper_kernel.cuh).
#pragma once
#include "hopper_kernel.cuh"

namespace kdtree {
namespace hopper {

struct SeesawConfig {
  static constexpr int kM = 64;
  static constexpr int kBN = 64;
  static constexpr int kThreads = 256;
  static constexpr int kAtomBytes = 64 * 128;
  static constexpr int kAtoms = kQkDim / 64;
  static constexpr int kBlockBytes = kAtoms * kAtomBytes;
  static constexpr int kQOff = 0;                          // Q atoms 0..7
  static constexpr int kPBOff = 8 * kAtomBytes;            // P_B, in Q's atom-8 slot
  static constexpr int kKOff = kBlockBytes;                // K buffer 0, then buffer 1
  static constexpr int kPAOff = kKOff + 2 * kBlockBytes;   // P_A
  static constexpr int kM0Off = kPAOff + kAtomBytes;       // float[64]: running max after tile A
  static constexpr int kM1Off = kM0Off + 64 * 4;           // float[64]: running max after tile B
  static constexpr int kL0Off = kM1Off + 64 * 4;           // float[64]: WG0's row sums at the end
  static constexpr int kL1Off = kL0Off + 64 * 4;           // float[64]: WG1's row sums at the end
  static constexpr int kBarOff = kL1Off + 64 * 4;          // uint64 full[buffer][half]
  static constexpr int kSmemBytes = kBarOff + 4 * 8;
};
static_assert(SeesawConfig::kSmemBytes <= 232448, "the Hopper kernel must fit the H100/H200's 227 KB per block");
static_assert(SeesawConfig::kKOff % 1024 == 0 && SeesawConfig::kPAOff % 1024 == 0 && SeesawConfig::kPBOff % 1024 == 0,
              "128-byte swizzle atoms must start on 1024-byte boundaries");

// Named barriers (0 is __syncthreads). Each is used once per tile pair, one warpgroup arriving and
// the other syncing. They alternate strictly: WG0 arrives on PA(k+1) only after syncing PB(k),
// which WG1 arrives on only after syncing PA(k); so no barrier ever collects two uses' arrivals.
constexpr int kBarPA = 1;   // WG0 -> WG1: P_A and m0 written
constexpr int kBarPB = 2;   // WG1 -> WG0: P_B and m1 written, WG1's P_A V_A finished (pairs with a tile B only)
constexpr int kBarEnd = 3;  // both: row sums written

// The two halves of a K tile: atoms 0..3 (V columns 0..255, loaded by WG0) and 4..8 (WG1).
template <int kA0, int kNA>
struct GatherHalf {
  static constexpr int A0 = kA0;
  static constexpr int NA = kNA;
};
using HalfL = GatherHalf<0, 4>;
using HalfR = GatherHalf<4, 5>;

// Where a tile's rows come from; everything a gathering thread needs besides the kernel params.
// (The cache, draft-K and index pointers are read from the kernel parameters, which stay in the
// constant bank, so they take no registers.)
struct TileSource {
  int64_t kv0;
  int64_t q0;
  int prefix;
  int n;
  int prefix_tiles;
  int t_end;
  int chunk;  // this thread's 16-byte chunk of each atom (thread j: j & 7)
  int key0;   // its first key in the tile (j >> 3); it also copies key0 + 16, + 32, + 48
};

// Slot ids are fetched one tile ahead and range-checked when used (a check right after the load
// stalls the warp on it: perf-notes h1).
__device__ __forceinline__ void fetch_slots(const TileSource& src, const KdtreeVerifyParams& p, int tile,
                                            int64_t (&slots)[4]) {
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    slots[u] = -1;
    if (tile < src.t_end && tile < src.prefix_tiles) {
      const int key = tile * 64 + src.key0 + 16 * u;
      if (key < src.prefix) slots[u] = __ldg(reinterpret_cast<const int64_t*>(p.kv_indices) + src.kv0 + key);
    }
  }
}

// Copies this thread's chunks of one half of `tile` into the buffer at `dst_base` and arrives on
// the half's full barrier when they have landed.
template <class Half>
__device__ __forceinline__ void gather_half(const TileSource& src, const KdtreeVerifyParams& p, int tile,
                                            const int64_t (&slots)[4], uint32_t dst_base, uint32_t bar) {
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const int key_local = src.key0 + 16 * u;
    const __nv_bfloat16* row;
    bool valid;
    if (tile < src.prefix_tiles) {
      valid = slots[u] >= 0 && slots[u] < p.kv_num_slots;  // out of range reads as zeros
      row = reinterpret_cast<const __nv_bfloat16*>(p.kv_cache) + (valid ? slots[u] : 0) * p.kv_stride_slot;
    } else {
      const int c = (tile - src.prefix_tiles) * 64 + key_local;
      valid = c < src.n;
      row = reinterpret_cast<const __nv_bfloat16*>(p.k) + (src.q0 + (valid ? c : 0)) * p.k_stride_tok;
    }
    const uint32_t dst = dst_base + swizzled(key_local, src.chunk);
#pragma unroll
    for (int a = Half::A0; a < Half::A0 + Half::NA; ++a) {
      cp_async_16(dst + a * SeesawConfig::kAtomBytes, row + a * 64 + src.chunk * 8, valid);
    }
  }
  cp_async_mbar_arrive(bar);
}

// S (+)= Q[:, atoms kA0..kA1) K[:, same]^T; atom 8 of Q comes from registers (rq8).
// Descriptors as two 32-bit halves: the start address lives in the low word and every address
// here is below 256 KB, so advancing a descriptor is one 32-bit add to the low word (a 64-bit add
// costs two dependent uniform-datapath ops per wgmma). `opaque` keeps the compiler from hoisting
// all 36 x 2 of them out of the pair loop into registers (that spilled).
__device__ __forceinline__ uint32_t opaque(uint32_t v) {
  asm volatile("" : "+r"(v));
  return v;
}
__device__ __forceinline__ uint64_t desc_from(uint32_t lo, uint32_t hi) {
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

template <int kA0, int kA1, bool kZeroFirst>
__device__ __forceinline__ void qk_atoms(float (&s)[32], uint32_t sQ, uint32_t sK, const uint32_t (&rq8)[4][4]) {
  const uint64_t dq = make_desc(sQ, 16, 1024), dk = make_desc(sK, 16, 1024);
  const uint32_t q_lo = opaque(static_cast<uint32_t>(dq)), k_lo = opaque(static_cast<uint32_t>(dk));
  const uint32_t hi = static_cast<uint32_t>(dk >> 32);  // same swizzle and stride for Q and K
#pragma unroll
  for (int a = kA0; a < kA1; ++a) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const uint32_t off = (a * SeesawConfig::kAtomBytes + ks * 32) >> 4;
      const int acc = (kZeroFirst && a == kA0 && ks == 0) ? 0 : 1;
      if (a < 8) {
        wgmma_m64n64k16_ss_kmajor(s, desc_from(q_lo + off, hi), desc_from(k_lo + off, hi), acc);
      } else {
        wgmma_m64n64k16_rs_kmajor(s, rq8[ks], desc_from(k_lo + off, hi), acc);
      }
    }
  }
}

// Row maxima of a masked score tile (quad-reduced: the 4 lanes of a row agree).
__device__ __forceinline__ void row_max(const float (&s)[32], float (&mx)[2]) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float v = -CUDART_INF_F;
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) v = fmaxf(v, fmaxf(s[nb * 4 + 2 * rr], s[nb * 4 + 2 * rr + 1]));
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    mx[rr] = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
  }
}

// Lazy running max (as in the portable kernel): the reference only moves when a row's max exceeds
// it by more than 8 (log2 units), so p <= 256 and most tiles rescale nothing.
__device__ __forceinline__ float moved_max(float mx, float m) { return mx > m + 8.f ? mx : m; }
// 2^(from - to) for to >= from; exactly 1 when the reference did not move (also -inf -> -inf).
__device__ __forceinline__ float rescale_factor(float from, float to) { return to == from ? 1.f : fast_exp2(from - to); }

// s <- 2^(s - m) (m = -inf: nothing visible yet, all s are -inf too); returns this thread's sums.
__device__ __forceinline__ void exp_and_sum(float (&s)[32], const float (&m)[2], float (&sum)[2]) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const float base = m[rr] == -CUDART_INF_F ? 0.f : m[rr];
    float acc = 0.f;
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
      s[nb * 4 + 2 * rr] = fast_exp2(s[nb * 4 + 2 * rr] - base);
      s[nb * 4 + 2 * rr + 1] = fast_exp2(s[nb * 4 + 2 * rr + 1] - base);
      acc += s[nb * 4 + 2 * rr] + s[nb * 4 + 2 * rr + 1];
    }
    sum[rr] = acc;
  }
}

// P (fp32 accumulator layout) x per-row factor -> bf16 A fragments (one per k16 step).
__device__ __forceinline__ void to_a_fragments(const float (&s)[32], const float (&f)[2], uint32_t (&pa)[4][4]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    pa[kk][0] = pack_bf16x2(s[8 * kk + 0] * f[0], s[8 * kk + 1] * f[0]);
    pa[kk][1] = pack_bf16x2(s[8 * kk + 2] * f[1], s[8 * kk + 3] * f[1]);
    pa[kk][2] = pack_bf16x2(s[8 * kk + 4] * f[0], s[8 * kk + 5] * f[0]);
    pa[kk][3] = pack_bf16x2(s[8 * kk + 6] * f[1], s[8 * kk + 7] * f[1]);
  }
}

// A fragments -> a 64 x 64 bf16 K-major swizzled atom (the A operand of the other warpgroup's PV).
__device__ __forceinline__ void store_p(uint8_t* atom, const uint32_t (&pa)[4][4], int row_lo, int lane) {
  const int r_hi = row_lo + 8;
  const int byte = 4 * (lane & 3);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    *reinterpret_cast<uint32_t*>(atom + swizzled(row_lo, 2 * kk) + byte) = pa[kk][0];
    *reinterpret_cast<uint32_t*>(atom + swizzled(r_hi, 2 * kk) + byte) = pa[kk][1];
    *reinterpret_cast<uint32_t*>(atom + swizzled(row_lo, 2 * kk + 1) + byte) = pa[kk][2];
    *reinterpret_cast<uint32_t*>(atom + swizzled(r_hi, 2 * kk + 1) + byte) = pa[kk][3];
  }
}

__device__ __forceinline__ bool any_not_one(const float (&f)[2]) {
  return __any_sync(0xffffffffu, f[0] != 1.f || f[1] != 1.f);
}

__device__ __forceinline__ void pv_rs(float (&o)[128], const uint32_t (&pa)[4][4], uint64_t desc_v) {
  const uint32_t v_lo = opaque(static_cast<uint32_t>(desc_v)), v_hi = static_cast<uint32_t>(desc_v >> 32);
  wgmma_fence_operand(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_rs_bmn(o, pa[kk], desc_from(v_lo + kk * (2048 >> 4), v_hi), 1);
  wgmma_commit();
}

__device__ __forceinline__ void pv_ss(float (&o)[128], uint64_t desc_p, uint64_t desc_v) {
  const uint32_t p_lo = opaque(static_cast<uint32_t>(desc_p)), p_hi = static_cast<uint32_t>(desc_p >> 32);
  const uint32_t v_lo = opaque(static_cast<uint32_t>(desc_v)), v_hi = static_cast<uint32_t>(desc_v >> 32);
  wgmma_fence_operand(o);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    wgmma_m64n256k16_ss_bmn(o, desc_from(p_lo + kk * (32 >> 4), p_hi), desc_from(v_lo + kk * (2048 >> 4), v_hi), 1);
  }
  wgmma_commit();
}

__global__ void __launch_bounds__(SeesawConfig::kThreads, 1) verify_attention_seesaw_kernel(const KdtreeVerifyParams p) {
  using Cfg = SeesawConfig;
  const int row_tile = blockIdx.x;
  const int split = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int wg = tid >> 7;
  const int warp_in_wg = (tid >> 5) & 3;

  const RequestView req = load_request(p, b);
  const int H = p.num_heads;
  const int rows = req.n * H;
  if (row_tile * Cfg::kM >= rows) return;
  const SplitWork w = split_work(req.prefix, req.n, p.num_splits,
                                 min_tiles_per_split(p.min_keys_per_split, Cfg::kBN), Cfg::kBN);
  const int t_begin = split * w.tiles_per_split;
  if (t_begin >= w.key_tiles) return;
  const int t_end = min(w.key_tiles, t_begin + w.tiles_per_split);
  const int num_tiles = t_end - t_begin;

  const uint32_t smem = smem_addr(g_hopper_smem);
  if ((smem & 1023) != 0) __trap();  // the swizzle pattern is tied to 1024-byte-aligned atoms
  const uint32_t sQ = smem + Cfg::kQOff;
  const uint32_t sK0 = smem + Cfg::kKOff;
  const uint32_t sK1 = sK0 + Cfg::kBlockBytes;
  float* s_m0 = reinterpret_cast<float*>(g_hopper_smem + Cfg::kM0Off);
  float* s_m1 = reinterpret_cast<float*>(g_hopper_smem + Cfg::kM1Off);
  float* s_l0 = reinterpret_cast<float*>(g_hopper_smem + Cfg::kL0Off);
  float* s_l1 = reinterpret_cast<float*>(g_hopper_smem + Cfg::kL1Off);
  // full[buffer][half] at kBarOff + 8 * (2 * buffer + half)
  const uint32_t bar = smem + Cfg::kBarOff;
  auto full = [&](int buffer, int half) { return bar + 8 * (2 * buffer + half); };

  TileSource src;
  src.kv0 = req.kv0;
  src.q0 = req.q0;
  src.prefix = req.prefix;
  src.n = req.n;
  src.prefix_tiles = w.prefix_tiles;
  src.t_end = t_end;
  src.chunk = tid & 7;
  src.key0 = (tid & 127) >> 3;

  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) mbar_init(bar + 8 * i, 128);
  }
  int64_t slots[4];
  fetch_slots(src, p, t_begin, slots);
  __syncthreads();  // mbarrier initialisation visible before any cp.async arrives on them

  // ---- Q atoms 0..8 (zeros past the request) -> swizzled shared memory, its own cp.async group.
  {
    const __nv_bfloat16* q = reinterpret_cast<const __nv_bfloat16*>(p.q);
    const int row = tid >> 2;
    const int r = row_tile * Cfg::kM + row;
    const bool valid = r < rows;
    const int tok = valid ? r / H : 0;
    const int head = valid ? r - tok * H : 0;
    const __nv_bfloat16* qrow = q + (req.q0 + tok) * p.q_stride_tok + static_cast<int64_t>(head) * p.q_stride_head;
#pragma unroll
    for (int u = 0; u < kRowChunks / 4; ++u) {
      const int c = (tid & 3) + 4 * u;
      cp_async_16(sQ + (c >> 3) * Cfg::kAtomBytes + swizzled(row, c), qrow + c * 8, valid);
    }
    cp_async_commit();
  }
  // ---- The first two tiles, each warpgroup its half (tracked by the full barriers only).
  for (int i = 0; i < 2 && i < num_tiles; ++i) {
    const uint32_t dst = i == 0 ? sK0 : sK1;
    if (wg == 0) {
      gather_half<HalfL>(src, p, t_begin + i, slots, dst, full(i, 0));
    } else {
      gather_half<HalfR>(src, p, t_begin + i, slots, dst, full(i, 1));
    }
    fetch_slots(src, p, t_begin + i + 1, slots);
  }
  cp_async_wait<0>();  // this thread's Q group
  fence_proxy_async();
  __syncthreads();  // Q visible to everyone

  // Q's atom 8 (rope columns) -> registers, as the A operand of the last 4 QK^T steps. Its shared
  // memory slot becomes P_B's, first written by WG1 after WG0 has arrived on kBarPA, which WG0
  // does after this load.
  uint32_t rq8[4][4];
  {
    const int row = warp_in_wg * 16 + (lane & 15);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      ldmatrix_x4(sQ + 8 * Cfg::kAtomBytes + swizzled(row, 2 * ks + (lane >> 4)), rq8[ks][0], rq8[ks][1], rq8[ks][2],
                  rq8[ks][3]);
    }
  }

  const int row_lo = warp_in_wg * 16 + (lane >> 2);  // this thread's rows in the tile: + 0 and + 8
  const int row0 = row_tile * Cfg::kM + row_lo;
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m[2] = {-CUDART_INF_F, -CUDART_INF_F};  // the running max, identical in both warpgroups
  float l[2] = {0.f, 0.f};                      // this warpgroup's share of the row sums
  float s[32];
  const int num_pairs = (num_tiles + 1) >> 1;
  auto is_prefix = [&](int t) { return t < w.prefix_tiles; };
  auto key_base = [&](int t) { return t < w.prefix_tiles ? t * Cfg::kBN : (t - w.prefix_tiles) * Cfg::kBN; };

  if (wg == 0) {
    // =========================== WG0: tiles A, O_L ===========================
    mbar_wait(full(0, 0), 0);
    mbar_wait(full(0, 1), 0);
    fence_proxy_async();
    wgmma_fence_operand(s);
    wgmma_fence();
    qk_atoms<0, 9, true>(s, sQ, sK0, rq8);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(s);
    for (int k = 0; k < num_pairs; ++k) {
      const int tA = t_begin + 2 * k;
      const bool has_b = 2 * k + 1 < num_tiles;
      const bool next = 2 * k + 2 < num_tiles;
      // Softmax of tile A against the running max -> m0; P_A (relative to m0) to registers and,
      // with m0, to shared memory for WG1 at once.
      scale_and_mask(s, p, is_prefix(tA), key_base(tA), req.prefix, req.n, row0, lane);
      float mx[2], m0[2], a0[2], sum[2];
      row_max(s, mx);
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        m0[rr] = moved_max(mx[rr], m[rr]);
        a0[rr] = rescale_factor(m[rr], m0[rr]);
        m[rr] = m0[rr];
      }
      exp_and_sum(s, m0, sum);
      uint32_t pa[4][4];
      {
        const float psA = is_prefix(tA) ? p.v_scale : 1.f;
        const float f[2] = {psA, psA};
        to_a_fragments(s, f, pa);
      }
      store_p(g_hopper_smem + Cfg::kPAOff, pa, row_lo, lane);
      if ((lane & 3) == 0) {
        s_m0[row_lo] = m0[0];
        s_m0[row_lo + 8] = m0[1];
      }
      fence_proxy_async();
      named_arrive(kBarPA, 256);
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) l[rr] = l[rr] * a0[rr] + sum[rr];
      if (any_not_one(a0)) rescale(o, a0);
      // O_L += P_A V_A[:, 0:256]
      pv_rs(o, pa, make_desc(sK0, kVLeading, kVStride));
      wgmma_wait<0>();
      wgmma_fence_operand(o);
      // Atoms 0..3 of buffer 0 are free (this warpgroup was their last reader): load tile A'.
      if (next) {
        gather_half<HalfL>(src, p, tA + 2, slots, sK0, full(0, 0));
        fetch_slots(src, p, tA + 3, slots);
      }
      if (has_b) {
        // m1 and P_B (relative to m1) from WG1: O_L = O_L 2^(m0 - m1) + P_B V_B[:, 0:256]
        mbar_wait(full(1, 0), k & 1);  // visibility of buffer 1's atoms 0..3 to this warpgroup
        named_barrier(kBarPB, 256);
        fence_proxy_async();
        float a1[2];
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const float m1 = s_m1[row_lo + 8 * rr];
          a1[rr] = rescale_factor(m0[rr], m1);
          m[rr] = m1;
          l[rr] *= a1[rr];
        }
        if (any_not_one(a1)) rescale(o, a1);
        pv_ss(o, make_desc(smem + Cfg::kPBOff, 16, 1024), make_desc(sK1, kVLeading, kVStride));
      }
      if (next) {
        // S = Q K_A'^T: atoms 0..3 (loaded above) while P_B V_B runs, then 4..8 (WG1 loaded them
        // right after its P_A V_A).
        mbar_wait(full(0, 0), (k + 1) & 1);
        fence_proxy_async();
        wgmma_fence_operand(s);
        wgmma_fence();
        qk_atoms<0, 4, true>(s, sQ, sK0, rq8);
        wgmma_commit();
        if (has_b) {
          wgmma_wait<1>();  // P_B V_B done: buffer 1's atoms 0..3 are free
          wgmma_fence_operand(o);
          if (2 * k + 3 < num_tiles) {
            gather_half<HalfL>(src, p, tA + 3, slots, sK1, full(1, 0));
            fetch_slots(src, p, tA + 4, slots);
          }
        }
        mbar_wait(full(0, 1), (k + 1) & 1);
        fence_proxy_async();
        wgmma_fence();
        qk_atoms<4, 9, false>(s, sQ, sK0, rq8);
        wgmma_commit();
      }
      wgmma_wait<0>();
      wgmma_fence_operand(s);
      wgmma_fence_operand(o);
    }
  } else {
    // =========================== WG1: tiles B, O_R ===========================
    if (num_tiles > 1) {
      mbar_wait(full(1, 1), 0);
      mbar_wait(full(1, 0), 0);
      fence_proxy_async();
      wgmma_fence_operand(s);
      wgmma_fence();
      qk_atoms<4, 9, true>(s, sQ, sK1, rq8);
      qk_atoms<0, 4, false>(s, sQ, sK1, rq8);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operand(s);
    }
    for (int k = 0; k < num_pairs; ++k) {
      const int tB = t_begin + 2 * k + 1;
      const bool has_b = 2 * k + 1 < num_tiles;
      const bool next = 2 * k + 2 < num_tiles;
      // m0 and P_A from WG0: O_R = O_R 2^(m - m0) + P_A V_A[:, 256:512], issued before this
      // warpgroup's own softmax so that the softmax runs while the tensor cores work.
      mbar_wait(full(0, 1), k & 1);  // visibility of buffer 0's atoms 4..8 to this warpgroup
      named_barrier(kBarPA, 256);
      fence_proxy_async();
      float m0[2], a0[2];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        m0[rr] = s_m0[row_lo + 8 * rr];
        a0[rr] = rescale_factor(m[rr], m0[rr]);
        m[rr] = m0[rr];
        l[rr] *= a0[rr];
      }
      if (any_not_one(a0)) rescale(o, a0);
      pv_ss(o, make_desc(smem + Cfg::kPAOff, 16, 1024), make_desc(sK0 + 4 * Cfg::kAtomBytes, kVLeading, kVStride));
      uint32_t pb[4][4];
      float a1[2] = {1.f, 1.f};
      if (has_b) {
        // Softmax of tile B against m0 -> m1, P_B (relative to m1).
        scale_and_mask(s, p, is_prefix(tB), key_base(tB), req.prefix, req.n, row0, lane);
        float mx[2], m1[2], sum[2];
        row_max(s, mx);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          m1[rr] = moved_max(mx[rr], m0[rr]);
          a1[rr] = rescale_factor(m0[rr], m1[rr]);
          m[rr] = m1[rr];
        }
        exp_and_sum(s, m1, sum);
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) l[rr] = l[rr] * a1[rr] + sum[rr];
        const float psB = is_prefix(tB) ? p.v_scale : 1.f;
        const float f[2] = {psB, psB};
        to_a_fragments(s, f, pb);
        wgmma_wait<0>();  // P_A V_A done: P_A's buffer and buffer 0's atoms 4..8 are free
        wgmma_fence_operand(o);
        store_p(g_hopper_smem + Cfg::kPBOff, pb, row_lo, lane);
        if ((lane & 3) == 0) {
          s_m1[row_lo] = m1[0];
          s_m1[row_lo + 8] = m1[1];
        }
        fence_proxy_async();
        named_arrive(kBarPB, 256);
      } else {
        wgmma_wait<0>();
        wgmma_fence_operand(o);
      }
      if (next) {
        gather_half<HalfR>(src, p, tB + 1, slots, sK0, full(0, 1));
        fetch_slots(src, p, tB + 2, slots);
      }
      if (has_b) {
        // O_R = O_R 2^(m0 - m1) + P_B V_B[:, 256:512] (P_B in registers)
        if (any_not_one(a1)) rescale(o, a1);
        pv_rs(o, pb, make_desc(sK1 + 4 * Cfg::kAtomBytes, kVLeading, kVStride));
        wgmma_wait<0>();
        wgmma_fence_operand(o);
      }
      if (2 * k + 3 < num_tiles) {
        gather_half<HalfR>(src, p, tB + 2, slots, sK1, full(1, 1));
        fetch_slots(src, p, tB + 3, slots);
        // S = Q K_B'^T: this warpgroup's atoms 4..8 first, then WG0's 0..3.
        mbar_wait(full(1, 1), (k + 1) & 1);
        fence_proxy_async();
        wgmma_fence_operand(s);
        wgmma_fence();
        qk_atoms<4, 9, true>(s, sQ, sK1, rq8);
        wgmma_commit();
        mbar_wait(full(1, 0), (k + 1) & 1);
        fence_proxy_async();
        wgmma_fence();
        qk_atoms<0, 4, false>(s, sQ, sK1, rq8);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(s);
      }
    }
  }

  // ---- Row sums of both warpgroups (same reference max m) -> 1/l, lse; each stores its half.
  {
    float* s_l = wg == 0 ? s_l0 : s_l1;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      float v = l[rr];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if ((lane & 3) == 0) s_l[row_lo + 8 * rr] = v;
    }
  }
  named_barrier(kBarEnd, 256);
  float inv_l[2], lse[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const float lt = s_l0[row_lo + 8 * rr] + s_l1[row_lo + 8 * rr];
    inv_l[rr] = lt > 0.f ? 1.f / lt : 0.f;
    lse[rr] = lt > 0.f ? m[rr] + log2f(lt) : -CUDART_INF_F;
  }
  const bool direct = w.active == 1;
  const int num_row_tiles = gridDim.x;
  store_half(o, inv_l, p, req, b, split, row_tile, num_row_tiles, row_lo, wg, lane, direct);
  if (!direct && wg == 0 && (lane & 3) == 0) {
    const int64_t lse_base = static_cast<int64_t>(p.batch) * p.num_splits * num_row_tiles * Cfg::kM * kVDim;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int r = row_tile * Cfg::kM + row_lo + 8 * rr;
      if (r < rows) {
        const int64_t ws_row = (static_cast<int64_t>(b) * p.num_splits + split) * (num_row_tiles * Cfg::kM) + r;
        reinterpret_cast<float*>(p.workspace)[lse_base + ws_row] = lse[rr];
      }
    }
  }
}

}  // namespace hopper
}  // namespace kdtree
