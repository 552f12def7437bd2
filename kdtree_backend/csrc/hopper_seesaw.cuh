// h42 (experiment, -DKDTREE_HOPPER_SEESAW; never in a release build): the Hopper verify kernel with
// a seesaw schedule and a producer warpgroup. Same semantics, plan, workspace and epilogue as
// hopper_kernel.cuh, whose helpers it uses; docs/perf-notes.md h42 says why and what it measured.
//
// CTA = 64 query rows x one KV split, 384 threads:
//   WG0, WG1 (math, 232 registers each through setmaxnreg): key tiles go in pairs (a, b = a + 1);
//     WG0 owns tile a (K buffer 0), WG1 tile b (K buffer 1): each does its tile's QK^T and softmax,
//     and both do PV on their half of the output columns (WG0 columns 0-255, WG1 256-511) for both
//     tiles, their own P from registers and the other's through shared memory. One warpgroup's
//     softmax then runs while the other's wgmma are in the tensor pipe. The running max passes
//     WG0 -> WG1 -> WG0 through shared memory (s_m): WG1's softmax of b starts from the max after
//     a, and WG0 rescales P_a by WG1's factor before sharing it, so both halves of O and both row
//     sums stay relative to one max.
//   WG2 (producer, 40 registers): gathers every K tile (cp.async through kv_indices) in four
//     groups, each refilled as soon as the warpgroup that reads it last is done with it:
//       buffer 0: A0 = atoms 0-3 (V left: WG0's PV of P_a), B0 = atoms 4-8 (V right and P_a: WG1's PV)
//       buffer 1: A1 = atoms 0-3 and 8 (V left and P_b: WG0's PV), B1 = atoms 4-7 (V right: WG1's PV)
//     Each group has a "full" mbarrier (128 cp.async noinc arrivals) and an "empty" one (the 128
//     threads of the warpgroup that reads it last).
// P of a tile is kept in its K buffer's atom 8 (the rope columns, dead once its QK^T is done), so
// no shared memory is added: Q 72 KB + two K buffers 144 KB + row statistics.
#pragma once
#include "hopper_kernel.cuh"

namespace kdtree {
namespace hopper {

struct SeesawConfig : HopperConfig {
  static constexpr int kThreads = 384;
  static constexpr int kMathRegs = 224, kProducerRegs = 56;  // 2 x 224 + 56 = 3 x 168: the launch allocation
  static constexpr int kMOff = kKOff + kStages * kBlockBytes;  // float[64]: the running max (log2 domain)
  static constexpr int kScale0Off = kMOff + 64 * 4;            // float[64]: WG0's factor for tile a
  static constexpr int kScale1Off = kScale0Off + 64 * 4;       // float[64]: WG1's factor for tile b
  static constexpr int kL1Off = kScale1Off + 64 * 4;           // float[64]: WG1's row sums at the end
  static constexpr int kInvLOff = kL1Off + 64 * 4;             // float[64]: 1 / row sum at the end
  static constexpr int kLseOff = kInvLOff + 64 * 4;            // float[64]: log2-sum-exp at the end
  static constexpr int kFullOff = kLseOff + 64 * 4;            // uint64[4]: A0, B0, A1, B1 full
  static constexpr int kEmptyOff = kFullOff + 4 * 8;           // uint64[4]: the same groups empty
  static constexpr int kQBarOff = kEmptyOff + 4 * 8;           // uint64: Q landed (TMA)
  static constexpr int kSmemBytes = kQBarOff + 8;
};
static_assert(SeesawConfig::kSmemBytes <= 232448, "the seesaw kernel must fit 227 KB per block");
static_assert(SeesawConfig::kFullOff % 8 == 0, "mbarriers are 8-byte aligned");

// Named barriers of the seesaw (0: __syncthreads; kBarFinal / kBarStore as in hopper_kernel.cuh).
constexpr int kBarScale0 = 8;   // WG0 -> WG1: s_m and s_scale0 of tile a written
constexpr int kBarScale1 = 9;   // WG1 -> WG0: s_m and s_scale1 of tile b written
constexpr int kBarP0 = 10;      // WG0 -> WG1: P_a (rescaled to b's max) in buffer 0's atom 8
constexpr int kBarP1 = 11;      // WG1 -> WG0: P_b in buffer 1's atom 8, WG1's PVs issued
constexpr int kBarQMath = 12;   // the math warpgroups: Q copied by cp.async is visible
constexpr int kBarRowSums = 13; // WG1's row sums are in s_l1

// Group g of buffer b: bit a = atom a is in it (A0, B0, A1, B1 as above).
__host__ __device__ constexpr uint32_t group_atoms(int buf, int g) {
  return buf == 0 ? (g == 0 ? 0x00Fu : 0x1F0u) : (g == 0 ? 0x10Fu : 0x0F0u);
}

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// S (+)= Q K^T over the atoms in kMask (ascending), K from `desc_k`'s buffer. `zero`: the first
// step overwrites S. One commit group.
template <uint32_t kMask>
__device__ __forceinline__ void qk_atoms(float (&s)[32], uint64_t desc_q, uint64_t desc_k, bool zero) {
  wgmma_fence();
  bool first = zero;
#pragma unroll
  for (int a = 0; a < HopperConfig::kAtoms; ++a) {
    if (!((kMask >> a) & 1u)) continue;
#pragma unroll
    for (int kq = 0; kq < 4; ++kq) {
      const uint32_t off = (a * HopperConfig::kAtomBytes + kq * 32) >> 4;
      wgmma_m64n64k16_ss_kmajor(s, desc_q + off, desc_k + off, first ? 0 : 1);
      first = false;
    }
  }
  wgmma_commit();
}

// O (+)= P V over the tile's 64 keys, P (64 x 64, K-major, swizzled) from shared memory.
__device__ __forceinline__ void pv_smem(float (&o)[128], uint32_t p_smem, uint32_t v_smem) {
  wgmma_fence();
  const uint64_t desc_p = make_desc(p_smem, 16, 1024);
  const uint64_t desc_v = make_desc(v_smem, kVLeading, kVStride);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_ss_bmn(o, desc_p + kk * (32 >> 4), desc_v + kk * (2048 >> 4), 1);
  wgmma_commit();
}

// One warpgroup's row max of its own tile against the shared running max (h42b: the max alone, so
// the other warpgroup's softmax can start while this one computes its exp2s). s: masked scores (raw
// when kFold). Reads s_m (the max after the previous tile); writes the new max and this tile's O
// factor f (1 when the max did not move: the lazy rescale of hopper_kernel.cuh) for the other
// warpgroup; returns the new max in st.m (st.l is unused).
template <bool kFold>
__device__ __forceinline__ void seesaw_max(const float (&s)[32], float* s_m, float* s_scale, int row_lo, int lane,
                                           float scale, SoftmaxState& st, float (&f)[2]) {
  constexpr float kRescaleThreshold = 8.f;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const float m_old = s_m[row_lo + 8 * rr];
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) mx = fmaxf(mx, fmaxf(s[nb * 4 + 2 * rr], s[nb * 4 + 2 * rr + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    if (kFold) mx *= scale;
    const bool move = mx > m_old + kRescaleThreshold;
    st.m[rr] = move ? mx : m_old;
    f[rr] = move ? fast_exp2(m_old - st.m[rr]) : 1.f;
    st.l[rr] = 0.f;
  }
  __syncwarp();  // every lane of the quad has read s_m before lane 0 overwrites it
  if ((lane & 3) == 0) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      s_m[row_lo + 8 * rr] = st.m[rr];
      s_scale[row_lo + 8 * rr] = f[rr];
    }
  }
}

// P (fp32 in s) times `mul` per row -> bf16 A fragments (wgmma's register layout for m64k16).
__device__ __forceinline__ void pack_pa(const float (&s)[32], float mul0, float mul1, uint32_t (&pa)[4][4]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    pa[kk][0] = pack_bf16x2(s[8 * kk + 0] * mul0, s[8 * kk + 1] * mul0);
    pa[kk][1] = pack_bf16x2(s[8 * kk + 2] * mul1, s[8 * kk + 3] * mul1);
    pa[kk][2] = pack_bf16x2(s[8 * kk + 4] * mul0, s[8 * kk + 5] * mul0);
    pa[kk][3] = pack_bf16x2(s[8 * kk + 6] * mul1, s[8 * kk + 7] * mul1);
  }
}

// The same fragments stored K-major swizzled as a 64 x 64 atom at p_smem, for the other warpgroup.
__device__ __forceinline__ void store_pa(const uint32_t (&pa)[4][4], uint8_t* p_smem, int row_lo, int lane) {
  const int r_hi = row_lo + 8;
  const int byte = 4 * (lane & 3);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    *reinterpret_cast<uint32_t*>(p_smem + swizzled(row_lo, 2 * kk) + byte) = pa[kk][0];
    *reinterpret_cast<uint32_t*>(p_smem + swizzled(r_hi, 2 * kk) + byte) = pa[kk][1];
    *reinterpret_cast<uint32_t*>(p_smem + swizzled(row_lo, 2 * kk + 1) + byte) = pa[kk][2];
    *reinterpret_cast<uint32_t*>(p_smem + swizzled(r_hi, 2 * kk + 1) + byte) = pa[kk][3];
  }
}

// O (+)= P V over the tile's 64 keys, P from registers, V's 256 columns at v_smem. One commit group.
__device__ __forceinline__ void pv_regs(float (&o)[128], const uint32_t (&pa)[4][4], uint32_t v_smem) {
  wgmma_fence();
  const uint64_t desc_v = make_desc(v_smem, kVLeading, kVStride);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_rs_bmn(o, pa[kk], desc_v + kk * (2048 >> 4), 1);
  wgmma_commit();
}

__device__ __forceinline__ void rescale_if_moved(float (&o)[128], const float (&f)[2]) {
  if (__any_sync(0xffffffffu, f[0] != 1.f || f[1] != 1.f)) rescale(o, f);
}

template <bool kFold>
__global__ void __launch_bounds__(SeesawConfig::kThreads, 1)
    verify_attention_hopper_seesaw_kernel(const KdtreeVerifyParams p, const __grid_constant__ CUtensorMap q_map,
                                          const int q_tma) {
  using Cfg = SeesawConfig;
  const int row_tile = blockIdx.x;
  const int split = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int wg = static_cast<int>(__reduce_max_sync(0xffffffffu, static_cast<unsigned>(tid >> 7)));  // 0, 1 math; 2 producer
  const int warp_in_wg = (tid >> 5) & 3;

  if (q_tma && threadIdx.x == 0) prefetch_tensormap(&q_map);
  CtaWork cw;
  if (!cta_work<Cfg>(p, b, row_tile, split, cw)) return;
  const RequestView& req = cw.req;
  const SplitWork& w = cw.w;
  const int rows = cw.rows, t_begin = cw.t_begin, t_end = cw.t_end;
  const int num_tiles = t_end - t_begin;

  const uint32_t smem = smem_addr(g_hopper_smem);
  if ((smem & 1023) != 0) __trap();
  const uint32_t sQ = smem + Cfg::kQOff;
  const uint32_t sK = smem + Cfg::kKOff;
  float* s_m = reinterpret_cast<float*>(g_hopper_smem + Cfg::kMOff);
  float* s_scale0 = reinterpret_cast<float*>(g_hopper_smem + Cfg::kScale0Off);
  float* s_scale1 = reinterpret_cast<float*>(g_hopper_smem + Cfg::kScale1Off);
  float* s_l1 = reinterpret_cast<float*>(g_hopper_smem + Cfg::kL1Off);
  float* s_inv_l = reinterpret_cast<float*>(g_hopper_smem + Cfg::kInvLOff);
  float* s_lse = reinterpret_cast<float*>(g_hopper_smem + Cfg::kLseOff);
  const uint32_t bar_full = smem + Cfg::kFullOff;    // + 8 * (2 * buffer + group)
  const uint32_t bar_empty = smem + Cfg::kEmptyOff;  // + 8 * (2 * buffer + group)
  const uint32_t bar_q = smem + Cfg::kQBarOff;

  const bool tma_q = q_tma != 0 && (row_tile + 1) * Cfg::kM <= rows && req.q0 + req.n <= 0x7fffffff;
  if (tid == 0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      mbar_init(bar_full + 8 * i, 128);
      mbar_init(bar_empty + 8 * i, 128);
    }
    mbar_init(bar_q, 1);
    fence_mbarrier_init();
    if (tma_q) {
      const int r0 = row_tile * Cfg::kM;
      const int tok = static_cast<int>(req.q0) + r0 / p.num_heads, head = r0 % p.num_heads;
      mbar_arrive_expect_tx(bar_q, Cfg::kBlockBytes);
#pragma unroll
      for (int a = 0; a < Cfg::kAtoms; ++a) tma_load_3d(sQ + a * Cfg::kAtomBytes, &q_map, bar_q, a * 64, head, tok);
    }
  }
  if (tid < Cfg::kM) s_m[tid] = -CUDART_INF_F;
  __syncthreads();  // barriers initialised, s_m set

  if (wg == 2) {
    // =========================== producer warpgroup ===========================
    setmaxnreg_dec<Cfg::kProducerRegs>();
    const int j = tid & 127;
    const int chunk = j & 7;
    const int key0 = j >> 3;  // + 16u
    const __nv_bfloat16* kd = reinterpret_cast<const __nv_bfloat16*>(p.k);
    const __nv_bfloat16* kv = reinterpret_cast<const __nv_bfloat16*>(p.kv_cache);
    const int64_t* kv_indices = reinterpret_cast<const int64_t*>(p.kv_indices);
    auto fetch_slots = [&](int tile, int64_t (&slots)[4]) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        slots[u] = -1;
        if (tile < t_end && tile < w.prefix_tiles) {
          const int key = tile * Cfg::kBN + key0 + 16 * u;
          if (key < req.prefix) slots[u] = __ldg(kv_indices + req.kv0 + key);
        }
      }
    };
    // Group g of tile i (relative; buf = i & 1, given as a literal so the atom list folds), then
    // its full barrier's arrival.
    auto issue_group = [&](int i, int buf, int g, const int64_t (&slots)[4]) {
      const int tile = t_begin + i;
      const uint32_t atoms = group_atoms(buf, g);
      const uint32_t dst_base = sK + buf * Cfg::kBlockBytes;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int key_local = key0 + 16 * u;
        const __nv_bfloat16* src;
        bool valid;
        if (tile < w.prefix_tiles) {
          valid = slots[u] >= 0 && slots[u] < p.kv_num_slots;  // out of range reads as zeros
          src = kv + (valid ? slots[u] : 0) * p.kv_stride_slot;
        } else {
          const int c = (tile - w.prefix_tiles) * Cfg::kBN + key_local;
          valid = c < req.n;
          src = kd + (req.q0 + (valid ? c : 0)) * p.k_stride_tok;
        }
        const uint32_t dst = dst_base + swizzled(key_local, chunk);
#pragma unroll
        for (int a = 0; a < Cfg::kAtoms; ++a)
          if ((atoms >> a) & 1u) cp_async_16(dst + a * Cfg::kAtomBytes, src + a * 64 + chunk * 8, valid);
      }
      cp_async_mbar_arrive(bar_full + 8 * (2 * buf + g));
    };
    int64_t sa[4], sb[4];
    fetch_slots(t_begin, sa);
    fetch_slots(t_begin + 1, sb);
    issue_group(0, 0, 0, sa);
    issue_group(0, 0, 1, sa);
    if (num_tiles > 1) {
      issue_group(1, 1, 0, sb);
      issue_group(1, 1, 1, sb);
    }
    fetch_slots(t_begin + 2, sa);
    fetch_slots(t_begin + 3, sb);
    // Pair u (tiles 2u, 2u + 1) refills each group once its last reader of pair u - 1 is done, in
    // the order they free up: A0 (WG0's own PV), B1 (WG1's own PV), B0, A1 (the shared-P PVs).
    for (int i = 2; i < num_tiles; i += 2) {
      const uint32_t par = ((i >> 1) - 1) & 1;
      const bool has_b = i + 1 < num_tiles;
      mbar_wait(bar_empty + 8 * 0, par);
      issue_group(i, 0, 0, sa);
      if (has_b) {
        mbar_wait(bar_empty + 8 * 3, par);
        issue_group(i + 1, 1, 1, sb);
      }
      mbar_wait(bar_empty + 8 * 1, par);
      issue_group(i, 0, 1, sa);
      if (has_b) {
        mbar_wait(bar_empty + 8 * 2, par);
        issue_group(i + 1, 1, 0, sb);
      }
      fetch_slots(t_begin + i + 2, sa);
      fetch_slots(t_begin + i + 3, sb);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  // =========================== math warpgroups ===========================
  setmaxnreg_inc<Cfg::kMathRegs>();
  if (!tma_q) {
    // Q by cp.async (the 256 math threads; rows tid/8 and +32, chunk tid & 7 of each atom).
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
      const int row = (tid >> 3) + 32 * pass;
      bool valid;
      const __nv_bfloat16* src = q_row_src(p, req, row_tile * Cfg::kM + row, rows, valid);
#pragma unroll
      for (int a = 0; a < Cfg::kAtoms; ++a) {
        const int c = 8 * a + (tid & 7);
        cp_async_16(sQ + a * Cfg::kAtomBytes + swizzled(row, c), src + c * 8, valid);
      }
    }
    cp_async_commit();
  }
  const int row_in_tile0 = warp_in_wg * 16 + (lane >> 2);  // this thread's rows: + 0 and + 8
  const int row0 = row_tile * Cfg::kM + row_in_tile0;
  uint32_t first_bits[2] = {0u, 0u};
  if (kMaskPrefetch && t_begin <= w.prefix_tiles && w.prefix_tiles < t_end && ((w.prefix_tiles - t_begin) & 1) == wg)
    first_draft_tile_bits(p, req.prefix, req.n, row0, lane, first_bits);
  if (tma_q) {
    mbar_wait(bar_q, 0);
  } else {
    cp_async_wait<0>();
    fence_proxy_async();
    named_barrier(kBarQMath, 256);
  }

  constexpr float kLog2e = 1.4426950408889634f;
  const float prefix_scale = p.sm_scale * p.k_scale * kLog2e, draft_scale = p.sm_scale * kLog2e;
  const float log2_vs = kFold ? log2f(p.v_scale) : 0.f, inv_vs = kFold ? 1.f / p.v_scale : 1.f;
  // Tile t's scale, P scale (applied when packing, unfolded kernel) and row-sum factor.
  auto tile_scales = [&](int t, float& scale, float& log2_ps, float& ps, float& inv_ps) {
    const bool is_prefix = t < w.prefix_tiles;
    scale = is_prefix ? prefix_scale : draft_scale;
    log2_ps = is_prefix ? log2_vs : 0.f;
    ps = kFold ? 1.f : (is_prefix ? p.v_scale : 1.f);
    inv_ps = kFold && is_prefix ? inv_vs : 1.f;
  };
  auto mask_tile = [&](float (&s)[32], int t, float scale) {
    const bool is_prefix = t < w.prefix_tiles;
    const int key_base = is_prefix ? t * Cfg::kBN : (t - w.prefix_tiles) * Cfg::kBN;
    scale_and_mask<kFold>(s, p, is_prefix, scale, key_base, req.prefix, req.n, row0, lane, first_bits);
  };

  const uint32_t buf0 = sK, buf1 = sK + Cfg::kBlockBytes;
  uint8_t* p0_ptr = g_hopper_smem + Cfg::kKOff + 8 * Cfg::kAtomBytes;  // P_a: buffer 0's atom 8
  uint8_t* p1_ptr = p0_ptr + Cfg::kBlockBytes;                        // P_b: buffer 1's atom 8
  const uint64_t desc_q = make_desc(sQ, 16, 1024);
  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float l[2] = {0.f, 0.f};
  float s[32];

  if (wg == 0) {
    // =========================== WG0: tiles a = 0, 2, 4, ... ===========================
    const uint64_t desc_k0 = make_desc(buf0, 16, 1024);
    if (num_tiles > 0) {
      mbar_wait(bar_full + 8 * 0, 0);
      fence_proxy_async();
      qk_atoms<0x00Fu>(s, desc_q, desc_k0, true);
      mbar_wait(bar_full + 8 * 1, 0);
      fence_proxy_async();
      qk_atoms<0x1F0u>(s, desc_q, desc_k0, false);
      wgmma_wait<0>();
      wgmma_fence_operand(s);
    }
    for (int i = 0; i < num_tiles; i += 2) {
      const int t = t_begin + i;
      const bool has_b = i + 1 < num_tiles, has_a2 = i + 2 < num_tiles, has_b2 = i + 3 < num_tiles;
      float scale, log2_ps, ps, inv_ps;
      tile_scales(t, scale, log2_ps, ps, inv_ps);
      mask_tile(s, t, scale);
      SoftmaxState st;
      float f0[2], sum[2] = {0.f, 0.f};
      seesaw_max<kFold>(s, s_m, s_scale0, row_in_tile0, lane, scale, st, f0);
      named_arrive(kBarScale0, 256);  // WG1's softmax of b may start (h42b: before the exp2s)
      softmax_exp_range<kFold>(s, st, sum, scale, log2_ps, 0, 8);
      float f1[2] = {1.f, 1.f};
      if (has_b) {
        named_barrier(kBarScale1, 256);  // WG1's max of b: s_scale1 holds its factors
        f1[0] = s_scale1[row_in_tile0];
        f1[1] = s_scale1[row_in_tile0 + 8];
      }
      // O[:, 0:256] and the row sums straight to b's max: P_a scaled by f1 serves both PVs.
      const float f[2] = {f0[0] * f1[0], f0[1] * f1[1]};
      rescale_if_moved(o, f);
      l[0] = (l[0] * f0[0] + sum[0] * inv_ps) * f1[0];
      l[1] = (l[1] * f0[1] + sum[1] * inv_ps) * f1[1];
      uint32_t pa[4][4];
      pack_pa(s, ps * f1[0], ps * f1[1], pa);
      store_pa(pa, p0_ptr, row_in_tile0, lane);
      fence_proxy_async();
      named_arrive(kBarP0, 256);  // P_a is in buffer 0's atom 8
      wgmma_fence_operand(o);
      pv_regs(o, pa, buf0);  // O[:, 0:256] += P_a V_a[:, 0:256]
      if (has_b) {
        named_barrier(kBarP1, 256);  // P_b is in buffer 1's atom 8
        fence_proxy_async();
        pv_smem(o, buf1 + 8 * Cfg::kAtomBytes, buf1);  // O[:, 0:256] += P_b V_b[:, 0:256]
      }
      if (has_a2) {  // then has_b too
        const uint32_t par = ((i >> 1) + 1) & 1;
        wgmma_wait<1>();  // the PV of P_a: A0 (V_a's left half) may be refilled
        mbar_arrive(bar_empty + 8 * 0);
        mbar_wait(bar_full + 8 * 0, par);
        fence_proxy_async();
        wgmma_fence_operand(s);
        qk_atoms<0x00Fu>(s, desc_q, desc_k0, true);
        wgmma_wait<1>();  // the PV of P_b: A1 (V_b's left half and P_b) may be refilled
        wgmma_fence_operand(o);
        if (has_b2) mbar_arrive(bar_empty + 8 * 2);
        mbar_wait(bar_full + 8 * 1, par);
        fence_proxy_async();
        qk_atoms<0x1F0u>(s, desc_q, desc_k0, false);
        wgmma_wait<0>();
        wgmma_fence_operand(s);
      } else {
        wgmma_wait<0>();
        wgmma_fence_operand(o);
      }
    }
  } else {
    // =========================== WG1: tiles b = 1, 3, 5, ... ===========================
    const uint64_t desc_k1 = make_desc(buf1, 16, 1024);
    if (num_tiles > 1) {
      mbar_wait(bar_full + 8 * 2, 0);
      fence_proxy_async();
      qk_atoms<0x10Fu>(s, desc_q, desc_k1, true);
      mbar_wait(bar_full + 8 * 3, 0);
      fence_proxy_async();
      qk_atoms<0x0F0u>(s, desc_q, desc_k1, false);
      wgmma_wait<0>();
      wgmma_fence_operand(s);
    }
    for (int i = 0; i < num_tiles; i += 2) {
      const int t = t_begin + i + 1;
      const bool has_b = i + 1 < num_tiles, has_a2 = i + 2 < num_tiles, has_b2 = i + 3 < num_tiles;
      named_barrier(kBarScale0, 256);  // WG0's max of a: s_m and s_scale0 are written
      const float f0[2] = {s_scale0[row_in_tile0], s_scale0[row_in_tile0 + 8]};
      if (has_b) {
        float scale, log2_ps, ps, inv_ps;
        tile_scales(t, scale, log2_ps, ps, inv_ps);
        mask_tile(s, t, scale);
        SoftmaxState st;
        float f1[2], sum[2] = {0.f, 0.f};
        seesaw_max<kFold>(s, s_m, s_scale1, row_in_tile0, lane, scale, st, f1);
        named_arrive(kBarScale1, 256);
        softmax_exp_range<kFold>(s, st, sum, scale, log2_ps, 0, 8);
        const float f[2] = {f0[0] * f1[0], f0[1] * f1[1]};
        rescale_if_moved(o, f);
        l[0] = l[0] * f[0] + sum[0] * inv_ps;
        l[1] = l[1] * f[1] + sum[1] * inv_ps;
        uint32_t pa[4][4];
        pack_pa(s, ps, ps, pa);
        store_pa(pa, p1_ptr, row_in_tile0, lane);
        fence_proxy_async();
        named_arrive(kBarP1, 256);  // P_b is in buffer 1's atom 8
        wgmma_fence_operand(o);
        pv_regs(o, pa, buf1 + 4 * Cfg::kAtomBytes);  // O[:, 256:512] += P_b V_b[:, 256:512]
      } else {
        rescale_if_moved(o, f0);
        l[0] *= f0[0];
        l[1] *= f0[1];
      }
      named_barrier(kBarP0, 256);  // P_a is in buffer 0's atom 8
      fence_proxy_async();
      pv_smem(o, buf0 + 8 * Cfg::kAtomBytes, buf0 + 4 * Cfg::kAtomBytes);  // O[:, 256:512] += P_a V_a[:, 256:512]
      if (has_b) {
        wgmma_wait<1>();  // the PV of P_b: B1 (V_b's right half) may be refilled
        wgmma_fence_operand(o);
        if (has_b2) mbar_arrive(bar_empty + 8 * 3);
      }
      wgmma_wait<0>();  // the PV of P_a: B0 (V_a's right half and P_a) may be refilled
      wgmma_fence_operand(o);
      if (has_a2) mbar_arrive(bar_empty + 8 * 1);
      if (has_b2) {
        const uint32_t par = ((i >> 1) + 1) & 1;
        mbar_wait(bar_full + 8 * 2, par);
        fence_proxy_async();
        wgmma_fence_operand(s);
        qk_atoms<0x10Fu>(s, desc_q, desc_k1, true);
        mbar_wait(bar_full + 8 * 3, par);
        fence_proxy_async();
        qk_atoms<0x0F0u>(s, desc_q, desc_k1, false);
        wgmma_wait<0>();
        wgmma_fence_operand(s);
      }
    }
  }

  // Row sums: WG1's to shared memory, the total (relative to the final max in s_m) on WG0.
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
  }
  if (wg == 1 && (lane & 3) == 0) {
    s_l1[row_in_tile0] = l[0];
    s_l1[row_in_tile0 + 8] = l[1];
  }
  if (wg == 1) named_arrive(kBarRowSums, 256);  // s_l1 written
  if (wg == 0) {
    named_barrier(kBarRowSums, 256);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int r = row_in_tile0 + 8 * rr;
      const float lt = l[rr] + s_l1[r];
      const float inv = lt > 0.f ? 1.f / lt : 0.f;
      if ((lane & 3) == 0) {
        s_inv_l[r] = inv;
        s_lse[r] = lt > 0.f ? s_m[r] + log2f(lt) : -CUDART_INF_F;
      }
    }
  }
  named_barrier(kBarFinal, 256);  // also: both warpgroups are done with the K buffers
  if (kCombineAsDependent && tid == 0) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  const float inv_l[2] = {s_inv_l[row_in_tile0], s_inv_l[row_in_tile0 + 8]};
  const bool direct = w.active == 1;
  const int num_row_tiles = gridDim.x;
  const bool staged_store = direct && (reinterpret_cast<uintptr_t>(p.out) & 15) == 0 && (p.out_stride_tok & 7) == 0;
  if (staged_store) {
    store_half_staged(o, inv_l, p, req, row_tile, row_in_tile0, wg, lane, tid & 127, sK, g_hopper_smem + Cfg::kKOff);
  } else {
    store_half(o, inv_l, p, req, b, split, row_tile, num_row_tiles, row_in_tile0, wg, lane, direct);
  }
  if (wg == 0 && !direct && (lane & 3) == 0) {
    const int64_t lse_base = static_cast<int64_t>(p.batch) * p.num_splits * num_row_tiles * Cfg::kM * kVDim;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int r = row_tile * Cfg::kM + row_in_tile0 + 8 * rr;
      if (r < rows) {
        const int64_t ws_row = (static_cast<int64_t>(b) * p.num_splits + split) * (num_row_tiles * Cfg::kM) + r;
        reinterpret_cast<float*>(p.workspace)[lse_base + ws_row] = s_lse[row_in_tile0 + 8 * rr];
      }
    }
  }
}

}  // namespace hopper
}  // namespace kdtree
