// The portable kernel with warp-specialised roles (journal p14/p16; docs/kernel/portable.md). Built by
// portable/launch_ws.cu for the arch-specific targets only.
//
// 12 warps (384 threads), one row tile of 64 query rows x one part of the key tiles, 32-key tiles:
//   * QK warps 0-3 (warpgroup 0, one a scheduler): warp g owns query rows 16g..16g+15 over the whole
//     576 depth. Q's 512 "nope" columns live in its registers (128 a thread), the 64 rope columns in
//     shared memory (q_rope). It computes S = Q K^T, masks, runs the online softmax, and hands P
//     (bf16) and the rows' rescale factors to the PV warps through a double-buffered P buffer.
//   * PV warps 4-11 (warpgroups 1-2, two a scheduler): warp c owns output columns 64c..64c+63 of
//     all 64 rows (128 fp32 accumulators a thread) and accumulates O += P V from the same K stage
//     (V = K[:, :512]). They also gather the K tiles (16-byte cp.async, 9 a thread a tile, completed
//     on the stage's mbarrier with cp.async.mbarrier.arrive.noinc).
// The roles meet only at: K full (mbarrier per stage: 256 PV-thread arrivals a phase), P full (named
// barrier per P parity: QK arrive, PV sync), P free (named barrier per parity: PV arrive, QK sync)
// and, among the PV warps, one barrier before a stage is refilled. The QK warps run up to one tile
// ahead, so the tensor pipe has PV work while the QK warps run their softmax, and QK work while the
// PV warps wait for P.
//
// Registers: setmaxnreg (sm_90a / sm_100a / sm_120a only): QK 184, PV 160
// (4 x 32 x 184 + 8 x 32 x 160 = 384 x 168, the launch's allocation).
#pragma once
#include <cuda_bf16.h>
#include <math_constants.h>
#include <stdint.h>

#include "../common/draft_mask.cuh"
#include "../common/mbarrier.cuh"
#include "../common/ptx.cuh"
#include "../common/request.cuh"
#include "../common/tile_stamps.cuh"
#include "../kdtree_api.h"
#include "mma.cuh"
#include "softmax.cuh"
#include "traits.cuh"

namespace kdtree {

struct WsConfig {
  static constexpr int kM = 64;
  static constexpr int kBN = 32;
  static constexpr int kStages = 2;
  static constexpr int kQkWarps = 4;
  static constexpr int kPvWarps = 8;
  static constexpr int kThreads = (kQkWarps + kPvWarps) * 32;
  static constexpr int kPvThreads = kPvWarps * 32;
  static constexpr int kTileBytes = kBN * kSmemRowBytes;
  static constexpr int kNopeSteps = kVDim / 16;             // 32 k-steps of Q held in registers
  static constexpr int kRopeSteps = (kQkDim - kVDim) / 16;  // 4 k-steps read from q_rope
  static constexpr int kRopeRowBytes = (kQkDim - kVDim) * 2 + 16;  // 144: 8 rows hit 8 bank groups
  static constexpr int kPRowBytes = kBN * 2 + 16;                   // 80: conflict-free ldmatrix/stores
  static constexpr int kPvCols = kVDim / kPvWarps;                  // 64 output columns a PV warp
  static constexpr int kQkRegs = 184;
  static constexpr int kPvRegs = 160;
  // Registers a thread at launch: what the setmaxnreg plan redistributes (the PV warps release 8 a
  // thread, the QK warps take 16). Launched with fewer, the QK warps' setmaxnreg.inc would wait for
  // registers no warp releases, so both the build check (kernel/build.py) and the device probe
  // (portable/launch_ws.cu) refuse any other count.
  static constexpr int kLaunchRegs = 168;
  static constexpr int kQkAhead = 2;  // k-steps the QK warp's K fragments are loaded ahead (p33)
  static constexpr int kQkPin = 3;    // a __syncwarp every kQkPin k-steps keeps ptxas from sinking them (p34)
  static_assert(kStages * kTileBytes >= kM * kSmemRowBytes, "Q is staged in the K stages' space");
  static_assert(kQkWarps * kQkRegs + kPvWarps * kPvRegs == (kThreads / 32) * kLaunchRegs, "setmaxnreg budget");
};

struct WsShared {
  uint8_t stage[WsConfig::kStages * WsConfig::kTileBytes];  // Q staging, then the K stages
  uint8_t q_rope[WsConfig::kM * WsConfig::kRopeRowBytes];
  uint8_t p_buf[2][WsConfig::kM * WsConfig::kPRowBytes];
  float alpha[2][WsConfig::kM];
  uint32_t moved[2];  // a byte a QK warp: some row's max moved this tile
  float row_m[WsConfig::kM];
  float row_l[WsConfig::kM];
  alignas(8) uint64_t k_full[WsConfig::kStages];
  int64_t slot_ring[2][WsConfig::kBN];
  int64_t kv0;
  int64_t seg_q0;
  int seg_b;
  int seg_slot;
  int seg_direct;
  int seg_row_tile;
  int seg_prefix;  // the request's prefix length and draft count, read by the gather lanes where needed
  int seg_n;       // (held in registers across the PV loop, they spilled sm_120a's PV role; p24, p27)
  int seg_last;    // the part's last segment (s9: it triggers the combine; in a register it spilled too)
  ScheduleScratch sched;
};

struct WsLayout {
  static constexpr int kQRope = static_cast<int>(offsetof(WsShared, q_rope));
  static constexpr int kPBuf = static_cast<int>(offsetof(WsShared, p_buf));
  static constexpr int kAlpha = static_cast<int>(offsetof(WsShared, alpha));
  static constexpr int kMoved = static_cast<int>(offsetof(WsShared, moved));
  static constexpr int kRowM = static_cast<int>(offsetof(WsShared, row_m));
  static constexpr int kRowL = static_cast<int>(offsetof(WsShared, row_l));
  static constexpr int kKFull = static_cast<int>(offsetof(WsShared, k_full));
  static constexpr int kSlotRing = static_cast<int>(offsetof(WsShared, slot_ring));
  static constexpr int kKv0 = static_cast<int>(offsetof(WsShared, kv0));
  static constexpr int kSegQ0 = static_cast<int>(offsetof(WsShared, seg_q0));
  static constexpr int kSegB = static_cast<int>(offsetof(WsShared, seg_b));
  static constexpr int kSegSlot = static_cast<int>(offsetof(WsShared, seg_slot));
  static constexpr int kSegDirect = static_cast<int>(offsetof(WsShared, seg_direct));
  static constexpr int kSegRowTile = static_cast<int>(offsetof(WsShared, seg_row_tile));
  static constexpr int kSegPrefix = static_cast<int>(offsetof(WsShared, seg_prefix));
  static constexpr int kSegN = static_cast<int>(offsetof(WsShared, seg_n));
  static constexpr int kSegLast = static_cast<int>(offsetof(WsShared, seg_last));
  static constexpr int kSched = static_cast<int>(offsetof(WsShared, sched));
  static constexpr int kBytes = static_cast<int>(sizeof(WsShared));
};
static_assert(WsLayout::kBytes <= kSm120MaxSmemPerBlock, "the warp-specialised kernel must fit sm_120's 99 KB");

namespace ws {

// Named barriers (0 is __syncthreads).
enum Barrier : int { kPFull0 = 1, kPFull1 = 2, kPFree0 = 3, kPFree1 = 4, kPvStage = 5 };

__device__ __forceinline__ uint32_t k_full_bar(int stage) {
  return smem_addr(g_smem) + WsLayout::kKFull + 8 * stage;
}

// The prologue both roles run (every thread): the segment's values, the K barriers, Q into shared
// memory (nope columns into the stage area, rope columns into q_rope; zeros past the request) and
// the first two tiles' slot ids. Ends with a __syncthreads: Q and the ids are visible.
__device__ __forceinline__ void segment_prologue(const KdtreeVerifyParams& p, const CtaWork& cw, int row_tile, int tid,
                                                 bool first) {
  const RequestView& req = cw.req;
  const uint32_t base = smem_addr(g_smem);
  {
    constexpr int kTpr = WsConfig::kThreads / WsConfig::kM;  // 6 threads a row, 12 chunks each
    const int row = tid / kTpr;
    bool valid;
    const __nv_bfloat16* src = q_row_src(p, req, row_tile * WsConfig::kM + row, cw.rows, valid);
#pragma unroll
    for (int u = 0; u < kRowChunks / kTpr; ++u) {
      const int c = tid % kTpr + kTpr * u;
      const uint32_t dst = c < kVDim / 8 ? base + row_offset(row, c)
                                         : base + WsLayout::kQRope + row * WsConfig::kRopeRowBytes + (c - kVDim / 8) * 16;
      cp_async_16(dst, src + c * 8, valid);
    }
  }
  if (tid == 0) {
    *reinterpret_cast<int64_t*>(g_smem + WsLayout::kKv0) = req.kv0;
    *reinterpret_cast<int64_t*>(g_smem + WsLayout::kSegQ0) = req.q0;
    *reinterpret_cast<int*>(g_smem + WsLayout::kSegB) = cw.b;
    *reinterpret_cast<int*>(g_smem + WsLayout::kSegSlot) = cw.slot;
    *reinterpret_cast<int*>(g_smem + WsLayout::kSegDirect) = cw.direct ? 1 : 0;
    *reinterpret_cast<int*>(g_smem + WsLayout::kSegRowTile) = row_tile;
    *reinterpret_cast<int*>(g_smem + WsLayout::kSegPrefix) = req.prefix;
    *reinterpret_cast<int*>(g_smem + WsLayout::kSegN) = req.n;
    *reinterpret_cast<int*>(g_smem + WsLayout::kSegLast) = cw.last ? 1 : 0;
    for (int s = 0; s < WsConfig::kStages; ++s) {
      if (!first) mbar_inval(k_full_bar(s));
      mbar_init(k_full_bar(s), WsConfig::kPvWarps);  // each PV warp's arrive.expect_tx; the bytes end the phase
    }
  }
  // The first two tiles' slot ids (ring entries 0 and 1), by the PV threads that issue their rows.
  if (tid >= WsConfig::kQkWarps * 32) {
    const int pt = tid - WsConfig::kQkWarps * 32;
    constexpr int kTprK = WsConfig::kPvThreads / WsConfig::kBN;
    const int key = pt / kTprK;
    if (pt % kTprK == 0) {
      const int64_t* kv_indices = reinterpret_cast<const int64_t*>(p.kv_indices);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int tile = cw.t_begin + i;
        if (tile < cw.t_end && tile < cw.w.prefix_tiles) {
          const int j = tile * WsConfig::kBN + key;
          const bool in_prefix = j < req.prefix;
          cp_async_8(base + WsLayout::kSlotRing + (i * WsConfig::kBN + key) * 8, kv_indices + req.kv0 + (in_prefix ? j : 0),
                     in_prefix);
        }
      }
    }
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// QK role
struct QkState {
  uint32_t q[WsConfig::kNopeSteps][4];
  float m[2];
  float l[2];
};

// The lane's shared-memory offsets the tile pieces below take, and Q's nope fragments (ldmatrix
// from the staged Q): one definition for the kernel and bench/diag/mma_phase.cu.
// QK warp g: K fragments (`lo_qk`, relative to a stage), the rope columns' A fragments (absolute).
__device__ __forceinline__ uint32_t qk_lane_k(int lane) {
  return row_offset((lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
}
__device__ __forceinline__ uint32_t qk_lane_rope(uint32_t base, int g, int lane) {
  return base + WsLayout::kQRope + (g * 16 + (lane & 15)) * WsConfig::kRopeRowBytes + (lane >> 4) * 16;
}
// (kSteps: the first kSteps of the 32 nope k-steps; mma_phase.cu's pair mode holds 18.)
template <int kSteps = WsConfig::kNopeSteps>
__device__ __forceinline__ void load_q_nope(uint32_t base, int g, int lane, uint32_t (&q)[kSteps][4]) {
  const uint32_t qb = base + row_offset(g * 16 + (lane & 15), lane >> 4);
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) ldmatrix_x4(qb + ks * 32, q[ks][0], q[ks][1], q[ks][2], q[ks][3]);
}
// PV warp c: V fragments of its columns (`lo_pv`, relative to a stage), P's A fragments (`lo_p`,
// relative to a P buffer).
__device__ __forceinline__ uint32_t pv_lane_v(int lane, int c) {
  return row_offset((lane & 7) + (((lane >> 3) & 1) << 3), c * (WsConfig::kPvCols / 8) + (lane >> 4));
}
__device__ __forceinline__ uint32_t pv_lane_p(int lane) { return (lane & 15) * WsConfig::kPRowBytes + (lane >> 4) * 16; }

// The QK warp's mma phase for one 32-key tile: S = Q K^T for the warp's 16 rows over the 576 depth
// (Q's 32 nope k-steps from registers, the 4 rope k-steps from q_rope, K from the stage at
// `tile_base`; `lo_qk` and `rope` are the lane's ldmatrix offsets). The K fragments are loaded
// kAhead k-steps ahead of their mma (p33, p34): under the ldmatrix stream of all twelve warps one
// ldmatrix waits ~100-200 cycles (m18). Left alone, ptxas sinks them towards their use (sm_120a: 2-3
// mma ahead, m19); a __syncwarp every kPin k-steps holds them up: `tools/sass_schedule.py` shows >= 4
// mma ahead for ~93% of the loop's mma on sm_120a, >= 6 for ~90-95% on sm_90a / sm_100a, with no spill
// on sm_100a / sm_120a (3 and 2 k-steps ahead or a warp barrier every k-step spill one of them). The
// kernel uses WsConfig's distances; bench/diag/mma_phase.cu times this same code alone, beside the PV
// warps' `pv_tile_mma`, at other distances (journal m39), and over part of the depth (kNope k-steps
// from registers, kRope from q_rope: a depth-split QK warp's instruction mix, journal m39b).
template <int kAhead = WsConfig::kQkAhead, int kPin = WsConfig::kQkPin, int kNope = WsConfig::kNopeSteps,
          int kRope = WsConfig::kRopeSteps>
__device__ __forceinline__ void qk_tile_mma(uint32_t tile_base, uint32_t lo_qk, uint32_t rope, const uint32_t (&q)[kNope][4],
                                            float (&s)[WsConfig::kBN / 8][4]) {
  constexpr int NT = WsConfig::kBN / 8;
  constexpr int kSteps = kNope + kRope;
#pragma unroll
  for (int f = 0; f < NT; ++f) s[f][0] = s[f][1] = s[f][2] = s[f][3] = 0.f;
  uint32_t kb[kAhead + 1][NT / 2][4];
  auto load_k = [&](int ks, uint32_t (&b)[NT / 2][4]) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np)
      ldmatrix_x4(tile_base + lo_qk + ks * 32 + np * 16 * kSmemRowBytes, b[np][0], b[np][1], b[np][2], b[np][3]);
  };
#pragma unroll
  for (int ks = 0; ks < kAhead; ++ks) load_k(ks, kb[ks]);
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    if (ks + kAhead < kSteps) load_k(ks + kAhead, kb[(ks + kAhead) % (kAhead + 1)]);
    if (ks % kPin == 0) __syncwarp();  // ptxas does not move a shared load past it
    uint32_t a[4];
    if (ks < kNope) {
      a[0] = q[ks][0];
      a[1] = q[ks][1];
      a[2] = q[ks][2];
      a[3] = q[ks][3];
    } else {
      ldmatrix_x4(rope + (ks - kNope) * 32, a[0], a[1], a[2], a[3]);
    }
    const uint32_t (&b)[NT / 2][4] = kb[ks % (kAhead + 1)];
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      mma_bf16_16816(s[2 * np], a, b[np][0], b[np][1]);
      mma_bf16_16816(s[2 * np + 1], a, b[np][2], b[np][3]);
    }
  }
}

// Row group rr (fragment columns 2 rr, 2 rr + 1) of a draft tile's scores: scaled where `visible(f,
// c)` (key block f, column c of the lane's pair), -inf elsewhere; one loop for both ways of reading
// the mask.
template <int NT, class Visible>
__device__ __forceinline__ void mask_draft_row(float (&s)[NT][4], int rr, float scale, Visible visible) {
#pragma unroll
  for (int f = 0; f < NT; ++f)
#pragma unroll
    for (int e = 2 * rr; e < 2 * rr + 2; ++e) s[f][e] = visible(f, e & 1) ? s[f][e] * scale : -CUDART_INF_F;
}

__device__ __forceinline__ void qk_segment(const KdtreeVerifyParams& p, const CtaWork& cw, int row_tile, int tid,
                                           bool first) {
  const int lane = tid & 31;
  const int g = tid >> 5;
  segment_prologue(p, cw, row_tile, tid, first);
  const uint32_t base = smem_addr(g_smem);
  QkState st;
  load_q_nope(base, g, lane, st.q);
  st.m[0] = st.m[1] = -CUDART_INF_F;
  st.l[0] = st.l[1] = 0.f;
  __syncthreads();  // Q read: the stage area becomes the K pipeline

  const int T = cw.t_end - cw.t_begin;
  KDTREE_TILE_SEGMENT(tid == 0, T);
  const int prefix = cw.req.prefix, n = cw.req.n, prefix_tiles = cw.w.prefix_tiles;
  const uint32_t rope = qk_lane_rope(base, g, lane);
  const uint32_t lo_qk = qk_lane_k(lane);
  const int row0 = row_tile * WsConfig::kM + g * 16 + (lane >> 2);
  const int col_lane = 2 * (lane & 3);
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int NT = WsConfig::kBN / 8;

  for (int i = 0; i < T; ++i) {
    const int t = cw.t_begin + i;
    const int pp = i & 1;
    const uint32_t tile_base = base + (i & 1) * WsConfig::kTileBytes;
    mbar_wait(k_full_bar(i & 1), (i >> 1) & 1);
    KDTREE_TILE_STAMP(g == 0, i, TileEvent::kQkKFull);

    float s[NT][4];
    qk_tile_mma(tile_base, lo_qk, rope, st.q, s);

    // Scale into the log2 domain and mask (prefix keys past P; draft keys by the tree mask).
    const bool is_prefix = t < prefix_tiles;
    const int key_base = is_prefix ? t * WsConfig::kBN : (t - prefix_tiles) * WsConfig::kBN;
    if (is_prefix) {
#pragma unroll
      for (int f = 0; f < NT; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key_base + f * 8 + col_lane + (e & 1);
          s[f][e] = key < prefix ? s[f][e] * (p.sm_scale * p.k_scale * kLog2e) : -CUDART_INF_F;
        }
    } else {
      const uint8_t* mask = request_mask(p, ld_shared_s32(base + WsLayout::kSegB));
      if (mask != nullptr && warp_reads_group_mask(p.num_heads)) {  // the warp reads a group's bytes together (m32b)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const uint32_t v =
              static_cast<uint32_t>(group_draft_bits<32>(mask, p.num_heads, prefix, n, (row0 & ~7) + rr * 8, key_base, lane) >> col_lane);
          mask_draft_row<NT>(s, rr, p.sm_scale * kLog2e, [&](int f, int c) { return (v >> (f * 8 + c)) & 1u; });
        }
      } else {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const DraftRow d = draft_row(mask, p.num_heads, prefix, n, row0 + rr * 8);
          mask_draft_row<NT>(s, rr, p.sm_scale * kLog2e, [&](int f, int c) {
            return draft_key_visible(d.mask_row, n, d.valid, d.query, key_base + f * 8 + col_lane + c);
          });
        }
      }
    }

    // Online softmax with the lazily moved reference max (as the shipped kernel, kernel.cuh).
    float alpha[2], m_new[2];
    bool move[2];
    moved_reference_max(s, st, move, m_new);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      alpha[rr] = move[rr] ? fast_exp2(st.m[rr] - m_new[rr]) : 1.f;  // m = -inf -> 0 (l and O are 0)
      st.l[rr] *= alpha[rr];
      st.m[rr] = m_new[rr];
    }
    const bool any_move = __any_sync(0xffffffffu, move[0] || move[1]);
    KDTREE_TILE_STAMP(g == 0, i, TileEvent::kQkScores);
    exponentiate_scores<NT, QkState, true>(s, st);  // ex2.approx (p22)
    KDTREE_TILE_STAMP(g == 0, i, TileEvent::kQkSoftmax);

    // Hand P and the factors over: wait until the PV warps are done with this parity's buffer.
    if (i >= 2) named_barrier(kPFree0 + pp, WsConfig::kThreads);
    KDTREE_TILE_STAMP(g == 0, i, TileEvent::kQkPFree);
    const float ps = is_prefix ? p.v_scale : 1.f;
    const uint32_t pb = base + WsLayout::kPBuf + pp * (WsConfig::kM * WsConfig::kPRowBytes);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row = g * 16 + (lane >> 2) + rr * 8;
#pragma unroll
      for (int f = 0; f < NT; ++f) {
        const uint32_t v = pack_bf16x2(s[f][2 * rr] * ps, s[f][2 * rr + 1] * ps);
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(pb + row * WsConfig::kPRowBytes + (f * 8 + col_lane) * 2), "r"(v)
                     : "memory");
      }
      if ((lane & 3) == 0) {
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(base + WsLayout::kAlpha + (pp * WsConfig::kM + row) * 4),
                     "f"(alpha[rr])
                     : "memory");
      }
    }
    if (lane == 0) {
      asm volatile("st.shared.u8 [%0], %1;\n" ::"r"(base + WsLayout::kMoved + pp * 4 + g), "r"(any_move ? 1u : 0u)
                   : "memory");
    }
    named_arrive(kPFull0 + pp, WsConfig::kThreads);
    KDTREE_TILE_STAMP(g == 0, i, TileEvent::kQkPFull);
  }

  // The rows' final max and sum for the PV warps' epilogue.
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float l = st.l[rr];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if ((lane & 3) == 0) {
      const int row = g * 16 + (lane >> 2) + rr * 8;
      reinterpret_cast<float*>(g_smem + WsLayout::kRowM)[row] = st.m[rr];
      reinterpret_cast<float*>(g_smem + WsLayout::kRowL)[row] = l;
    }
  }
  __syncthreads();  // the epilogue's: row_m / row_l visible to the PV warps
}

// A PV warp's mma for one 32-key tile: O[:, its 64 columns] += P V, P (all 64 rows) from the P buffer
// at `pb` (the lane's offset included), V = the stage at `tile_base` (`lo_pv`: the lane's offset into
// the warp's columns). Also timed alone by bench/diag/mma_phase.cu (journal m39).
__device__ __forceinline__ void pv_tile_mma(float (&o)[4][8][4], uint32_t pb, uint32_t tile_base, uint32_t lo_pv) {
#pragma unroll
  for (int kk = 0; kk < WsConfig::kBN / 16; ++kk) {
    uint32_t pa[4][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
      ldmatrix_x4(pb + mt * 16 * WsConfig::kPRowBytes + kk * 32, pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t b0, b1, b2, b3;
      ldmatrix_x4_trans(tile_base + lo_pv + j * 32 + kk * 16 * kSmemRowBytes, b0, b1, b2, b3);
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        mma_bf16_16816(o[mt][2 * j], pa[mt], b0, b1);
        mma_bf16_16816(o[mt][2 * j + 1], pa[mt], b2, b3);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// PV role
__device__ __forceinline__ void pv_segment(const KdtreeVerifyParams& p, const CtaWork& cw, int row_tile, int tid,
                                           bool first) {
  const int lane = tid & 31;
  const int pt = tid - WsConfig::kQkWarps * 32;  // 0..255
  const int c = pt >> 5;                         // column slice
  segment_prologue(p, cw, row_tile, tid, first);
  const uint32_t base = smem_addr(g_smem);
  float o[4][8][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int f = 0; f < 8; ++f) o[mt][f][0] = o[mt][f][1] = o[mt][f][2] = o[mt][f][3] = 0.f;
  __syncthreads();  // the QK warps have read Q: the stage area becomes the K pipeline

  const int T = cw.t_end - cw.t_begin;
  const int t_begin = cw.t_begin, t_end = cw.t_end;
  const RequestView& req = cw.req;
  const int prefix_tiles = cw.w.prefix_tiles;

  // K-tile gather (p27): each PV warp copies 4 key rows (keys 4c..4c+3) with one cp.async.bulk a row
  // (1,152 bytes, lanes 0-3), completed on the stage's mbarrier, which the warp's lane 0 arms with its
  // rows' bytes (8 arrivals a phase). The copy engine moves the bytes: the PV warps issue 4 copies a
  // tile instead of 9 cp.async a thread (m16: 1,180 cycles of each PV warp's 3,620-cycle tile went to
  // the refill). A key past the prefix (in the last prefix tile) or past the drafts copies the tile's
  // first key instead (it is masked: its row only has to be finite); a slot id outside the cache reads
  // as zeros (the warp writes those rows itself, before its arrival).
  static_assert(WsConfig::kBN == 4 * WsConfig::kPvWarps, "4 key rows a PV warp");
  // The lane's key and role are derived from a fresh %laneid read where the gather uses them (held
  // across the PV loop they spilled sm_120a's PV role).
  auto my_key = [&] { return 4 * c + (lane_id_volatile() & 3); };
  auto row_lane = [&] { return lane_id_volatile() < 4; };
  const __nv_bfloat16* kd = reinterpret_cast<const __nv_bfloat16*>(p.k);
  const __nv_bfloat16* kv = reinterpret_cast<const __nv_bfloat16*>(p.kv_cache);
  const int64_t* kv_indices = reinterpret_cast<const int64_t*>(p.kv_indices);
  auto ring = [&](int tile) {
    return base + WsLayout::kSlotRing + (((tile - t_begin) & 1) * WsConfig::kBN + my_key()) * 8;
  };
  // The slot id of this lane's key of `tile` into its ring entry, in this lane's cp.async group: the
  // lane that copies the row reads it a refill later (cp.async.wait_group), so no barrier is needed.
  auto stage_ids = [&](int tile) {
    if (row_lane() && tile < t_end && tile < prefix_tiles) {
      const int j = tile * WsConfig::kBN + my_key();
      const int64_t kv0 = ld_shared_s64(base + WsLayout::kKv0);
      const int prefix = ld_shared_s32(base + WsLayout::kSegPrefix);
      cp_async_8(ring(tile), kv_indices + kv0 + (j < prefix ? j : tile * WsConfig::kBN), true);
    }
    cp_async_commit();
  };
  // loop_tile: the tile loop's i (the refill during PV(i)); -1 for the prologue's two tiles.
  auto issue = [&](int tile, int loop_tile) {
    const int par = (tile - t_begin) & 1;
    const uint32_t stage = base + par * WsConfig::kTileBytes;
    const uint32_t bar = k_full_bar(par);
    const __nv_bfloat16* src = kd;
    bool valid = true;
    if (row_lane()) {
      if (tile < prefix_tiles) {
        cp_async_wait<0>();
        const int64_t id = ld_shared_s64(ring(tile));
        valid = id >= 0 && id < p.kv_num_slots;
        src = kv + (valid ? id : 0) * p.kv_stride_slot;
      } else {
        const int c0 = (tile - prefix_tiles) * WsConfig::kBN;
        const int cc = c0 + my_key() < ld_shared_s32(base + WsLayout::kSegN) ? c0 + my_key() : c0;
        src = kd + (ld_shared_s64(base + WsLayout::kSegQ0) + cc) * p.k_stride_tok;
      }
    }
    const uint32_t zero_rows = __ballot_sync(0xffffffffu, row_lane() && !valid);
    if (zero_rows != 0) {  // hostile input only: a slot id outside the cache
      for (uint32_t z = zero_rows; z != 0; z &= z - 1) {
        const uint32_t zr = stage + row_offset(4 * c + __ffs(z) - 1, 0);
        for (int ch = lane; ch < kRowChunks; ch += 32)
          asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(zr + ch * 16), "r"(0u) : "memory");
      }
      __syncwarp();
    }
    // Cross-proxy order (p30). In the loop, the stage's earlier accesses are the QK and PV warps'
    // ldmatrix reads (generic proxy), ordered before this refill by the P full and refill barriers:
    // a write-after-read that needs no proxy fence (as CUTLASS's TMA pipelines release a stage by an
    // mbarrier arrival alone); the fence here was a MEMBAR.ALL.CTA on every PV warp's path to K(i + 2)
    // (m17). Fenced still: this warp's zero-filled rows (generic writes that a later copy overwrites)
    // and the prologue, whose stage area held Q's cp.async staging.
    if (zero_rows != 0 || loop_tile < 0) fence_proxy_async();
    KDTREE_TILE_STAMP(c == 0 && loop_tile >= 0, loop_tile, TileEvent::kPvFenced);
    if (lane == 0) mbar_arrive_expect_tx(bar, static_cast<uint32_t>(4 - __popc(zero_rows)) * kRowBytes);
    __syncwarp();
    if (row_lane() && valid) bulk_copy_g2s(stage + row_offset(my_key(), 0), src, kRowBytes, bar);
  };

  // Prologue: tiles 0 and 1 (their ids landed with Q), then tile 2's ids (each lane rewrites only its
  // own entries, after reading them).
  if (T > 0) issue(t_begin, -1);
  if (T > 1) issue(t_begin + 1, -1);
  stage_ids(t_begin + 2);

  const uint32_t lo_pv = pv_lane_v(lane, c);
  const uint32_t lo_p = pv_lane_p(lane);
  for (int i = 0; i < T; ++i) {
    const int pp = i & 1;
    const uint32_t tile_base = base + (i & 1) * WsConfig::kTileBytes;
    named_barrier(kPFull0 + pp, WsConfig::kThreads);  // P and the factors of tile i
    KDTREE_TILE_STAMP(c == 0, i, TileEvent::kPvPFull);
    mbar_wait(k_full_bar(i & 1), (i >> 1) & 1);        // tile i landed (complete already: the QK warps waited)
    if (ld_shared_s32(base + WsLayout::kMoved + pp * 4) != 0) {
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const float a = reinterpret_cast<const float*>(g_smem + WsLayout::kAlpha)[pp * WsConfig::kM + mt * 16 + (lane >> 2) + rr * 8];
#pragma unroll
          for (int f = 0; f < 8; ++f) {
            o[mt][f][2 * rr] *= a;
            o[mt][f][2 * rr + 1] *= a;
          }
        }
    }
    pv_tile_mma(o, base + WsLayout::kPBuf + pp * (WsConfig::kM * WsConfig::kPRowBytes) + lo_p, tile_base, lo_pv);
    KDTREE_TILE_STAMP(c == 0, i, TileEvent::kPvMmaIssued);
    if (i + 2 < T) {
      named_arrive(kPFree0 + pp, WsConfig::kThreads);  // this parity's P buffer is free again
      // Every PV warp is done with stage i & 1 (the QK warps were, before P full): refill it with
      // tile i + 2 (its ids were staged by the same lanes a refill ago).
      named_barrier(kPvStage, WsConfig::kPvThreads);
      KDTREE_TILE_STAMP(c == 0, i, TileEvent::kPvStage);
      issue(t_begin + i + 2, i);
      stage_ids(t_begin + i + 3);
      KDTREE_TILE_STAMP(c == 0, i, TileEvent::kPvRefill);
    }
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();  // the QK warps' row_m / row_l
  // s9 (h39b on the Hopper path): the split combine, a programmatic dependent, may start once every
  // CTA is here at its part's last segment; its blocks load their request's indices while these
  // stores drain, then wait for this grid to complete.
  if (c == 0 && lane == 0 && ld_shared_s32(base + WsLayout::kSegLast) != 0) pdl_launch_dependents();

  const bool direct = ld_shared_s32(base + WsLayout::kSegDirect) != 0;
  const int slot = ld_shared_s32(base + WsLayout::kSegSlot);
  RequestView req_out = req;
  req_out.q0 = ld_shared_s64(base + WsLayout::kSegQ0);
  const int rt = ld_shared_s32(base + WsLayout::kSegRowTile);
  const int rows = req_out.n * p.num_heads;
  const int col0 = c * WsConfig::kPvCols + 2 * (lane & 3);
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int row_local = mt * 16 + (lane >> 2) + rr * 8;
      const int r = rt * WsConfig::kM + row_local;
      if (r >= rows) continue;
      const float l = reinterpret_cast<const float*>(g_smem + WsLayout::kRowL)[row_local];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      if (direct) {
        __nv_bfloat16* dst = out_row(p, req_out, r) + col0;
#pragma unroll
        for (int f = 0; f < 8; ++f)
          *reinterpret_cast<uint32_t*>(dst + f * 8) = pack_bf16x2(o[mt][f][2 * rr] * inv, o[mt][f][2 * rr + 1] * inv);
      } else {
        const WorkspaceView wsv = launch_workspace<WsConfig>(p);
        const int64_t ws_row = static_cast<int64_t>(slot) * wsv.rows_per_slot + r;
        float* ws_o = wsv.o + ws_row * kVDim + col0;
#pragma unroll
        for (int f = 0; f < 8; ++f)
          *reinterpret_cast<float2*>(ws_o + f * 8) = make_float2(o[mt][f][2 * rr] * inv, o[mt][f][2 * rr + 1] * inv);
        if (c == 0 && (lane & 3) == 0) {
          const float m = reinterpret_cast<const float*>(g_smem + WsLayout::kRowM)[row_local];
          wsv.lse[ws_row] = l > 0.f ? m + log2f(l) : -CUDART_INF_F;
        }
      }
    }
}

}  // namespace ws

template <bool kSingle>
__global__ void __launch_bounds__(WsConfig::kThreads, 1) verify_ws_kernel(const KdtreeVerifyParams p) {
  ScheduleScratch& sched = *reinterpret_cast<ScheduleScratch*>(g_smem + WsLayout::kSched);
  const int tid = threadIdx.x;
  // h47: launched as a programmatic dependent (portable/launch_ws.cu), the CTA starts during the
  // previous kernel's tail and waits here for it before its first global memory access.
  pdl_wait_primary();
  // The PV role's branch comes first (p34): in that order sm_120a's ptxas gives the batch
  // instantiation's QK role the registers its setmaxnreg asks for (QK first: R165 of 184, m19).
  if (tid >= WsConfig::kQkWarps * 32) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WsConfig::kPvRegs));
    bool first = true;
    walk_part<WsConfig, kSingle, /*kCached=*/true>(p, sched, [] {}, [&](const CtaWork& cw) {
      ws::pv_segment(p, cw, cw.row_tile, tid, first);
      first = false;
    });
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WsConfig::kQkRegs));
    bool first = true;
    walk_part<WsConfig, kSingle, /*kCached=*/true>(p, sched, [] {}, [&](const CtaWork& cw) {
      ws::qk_segment(p, cw, cw.row_tile, tid, first);
      first = false;
    });
  }
}

}  // namespace kdtree
