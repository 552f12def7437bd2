// Hopper (sm_90a) verify kernel: the same semantics, split plan, workspace and combine step as the
// portable kernel (verify_kernel.cuh), with wgmma tensor cores and 64-key tiles.
//
// CTA = 64 query rows of one request x one KV split; 2 warpgroups (256 threads):
//   WG0 "math":   S = Q K^T over the full 576 depth (36 x wgmma m64n64k16, Q and K from shared
//                 memory), mask, online softmax (owns the running max / sum), P (bf16) kept in
//                 registers for its own PV and written to shared memory for WG1, then
//                 O[:, 0:256] += P V[:, 0:256] (4 x wgmma m64n256k16, P from registers).
//   WG1 "helper": gathers the K tiles (16-byte cp.async through kv_indices into the 128-byte
//                 swizzled layout wgmma reads), then O[:, 256:512] += P V[:, 256:512] with P from
//                 shared memory. Its PV of tile t runs while WG0 computes QK^T of tile t+1.
// Each K tile is gathered once and feeds QK^T (all 576 columns, K-major) and PV (first 512
// columns, read N-major through the descriptor's transpose bit): V = K[:, :512].
//
// Shared memory (230,176 B of the H200's 232,448 per block):
//   Q 64 x 576 bf16 (72 KB) | 2 K stages of 64 x 576 (144 KB) | P 64 x 64 bf16 (8 KB) | row stats.
// Every 576-wide block is stored as 9 column atoms of 64 columns (8 KB each): row r of an atom at
// r * 128 B, its 16-byte chunk c at ((c ^ (r & 7)) * 16): the canonical 128-byte swizzle.
//
// Synchronisation: K stage full = mbarrier completed by WG1's cp.async (noinc arrivals); K stage
// empty = mbarrier WG0's threads arrive on after their PV of the stage; P full / P free = named
// barriers between the two warpgroups, in strict alternation (docs/hopper-path.md).
#pragma once
#include <cuda.h>  // CUtensorMap (the type only: the map is encoded on the host, hopper_launch.cu)
#include <cuda_bf16.h>
#include <math_constants.h>
#include <stdint.h>

#include "kdtree_api.h"
#include "mma_utils.cuh"
#include "verify_kernel.cuh"
#include "wgmma_ops.cuh"

namespace kdtree {
namespace hopper {

struct HopperConfig {
  static constexpr int kM = 64;        // query rows per CTA (one wgmma M)
  static constexpr int kBN = 64;       // keys per tile
  static constexpr int kThreads = 256;
  static constexpr bool kAutoSplitLength = true;  // the Hopper plan leaves the split length to the device (h29)
  static constexpr int kAtomBytes = 64 * 128;              // 64 rows x 64 bf16 columns
  static constexpr int kAtoms = kQkDim / 64;               // 9 column atoms per 576-wide block
  static constexpr int kBlockBytes = kAtoms * kAtomBytes;  // 73,728
  static constexpr int kQOff = 0;
  static constexpr int kKOff = kBlockBytes;
  static constexpr int kStages = 2;
  static constexpr int kPOff = kKOff + kStages * kBlockBytes;
  static constexpr int kAlphaOff = kPOff + kAtomBytes;  // float[64]: this tile's O rescale factors
  static constexpr int kInvLOff = kAlphaOff + 64 * 4;   // float[64]: 1 / row sum at the end
  static constexpr int kLseOff = kInvLOff + 64 * 4;     // float[64]: log2-sum-exp at the end
  static constexpr int kBarOff = kLseOff + 64 * 4;      // uint64[2]: K stage full mbarriers
  static constexpr int kEmptyBarOff = kBarOff + kStages * 8;  // uint64[2]: K stage empty (WG0 done)
  static constexpr int kQBarOff = kEmptyBarOff + kStages * 8;  // uint64: Q landed (TMA, h23)
  static constexpr int kSmemBytes = kQBarOff + 8;
};
static_assert(HopperConfig::kSmemBytes <= 232448, "the Hopper kernel must fit the H100/H200's 227 KB per block");
static_assert(HopperConfig::kKOff % 1024 == 0 && HopperConfig::kPOff % 1024 == 0,
              "128-byte swizzle atoms must start on 1024-byte boundaries");

// h39: the split combine runs as a programmatic dependent launch (PDL) of this kernel, triggered by
// every CTA once its tile loop is done. A/B: -DKDTREE_NO_COMBINE_PDL (an ordinary launch, as before).
#ifdef KDTREE_NO_COMBINE_PDL
constexpr bool kCombineAsDependent = false;
#else
constexpr bool kCombineAsDependent = true;
#endif

// Named barrier ids (0 is __syncthreads; the portable kernel's ids are not shared with this one).
constexpr int kBarPFull = 1;
constexpr int kBarPFree = 2;
constexpr int kBarFinal = 4;
constexpr int kBarStore = 5;  // + column half: one warpgroup's staged output rows are complete

// WG1 rescales its half of O only when a row of its warp moved its max, as WG0 does (h15): 128
// FMULs a tile fewer on the schedulers WG0's softmax issues on. A/B: -DKDTREE_WG1_ALWAYS_RESCALE.
#ifdef KDTREE_WG1_ALWAYS_RESCALE
constexpr bool kWg1SkipRescale = false;
#else
constexpr bool kWg1SkipRescale = true;
#endif

extern __shared__ __align__(1024) uint8_t g_hopper_smem[];

// V (N-major) descriptor offsets: 64-column atoms kAtomBytes apart (leading), 8-key groups 1024 B
// apart (stride). Checked on the H200 against the float64 reference (docs/perf-notes.md, h1).
constexpr uint32_t kVLeading = HopperConfig::kAtomBytes, kVStride = 1024;

// wgmma shared-memory descriptor, 128-byte swizzle. Start address, leading and stride byte
// offsets are stored >> 4; bits 62-63 = 1 selects the 128-byte swizzle.
//   K-major (Q, K, P): rows of 128 B, 8-row groups 1024 B apart (stride offset); the leading
//     offset is unused because one k16 step stays inside a 128-byte row.
//   N-major (V): 64-column atoms 8192 B apart (leading offset), 8-key groups 1024 B apart.
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4);  // 14 bits: addresses below 256 KB
  d |= static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32;
  d |= static_cast<uint64_t>(1) << 62;
  return d;
}

__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + (((chunk & 7) ^ (row & 7)) << 4));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Arrives on `bar` when all of this thread's earlier cp.async have landed (count set at init).
__device__ __forceinline__ void cp_async_mbar_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
// h23: Q by the tensor copy engine. One thread arms the barrier with the bytes to expect and issues
// the boxes; everyone waits on its phase 0. The map (a __grid_constant__ parameter) is addressed
// generically, as the PTX ISA allows for kernel parameters.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// WG0's online-softmax state for its two rows (lane/4 and lane/4 + 8 of its warp's 16).
struct SoftmaxState {
  float m[2];
  float l[2];
};

// Scale into the log2 domain and mask one 64 x 64 score tile held in wgmma's accumulator layout:
// s[8*nb + e] is row (warp*16 + lane/4 + 8*(e>>1)), key (8*nb + 2*(lane&3) + (e&1)).
// The visibility of the first draft tile's keys for this thread's two rows, as bits
// (nb * 2 + (e & 1)) of bits[rr]: loaded in the prologue, where the mask's two dependent round
// trips (mask_indptr, then the bytes) hide behind the Q tile, instead of after the draft tile's
// QK^T, where nothing else runs (perf-notes h11).
#ifdef KDTREE_NO_MASK_PREFETCH  // A/B only: every draft tile reads the mask after its QK^T (before h11)
constexpr bool kMaskPrefetch = false;
#else
constexpr bool kMaskPrefetch = true;
#endif
__device__ __forceinline__ void first_draft_tile_bits(const KdtreeVerifyParams& p, int prefix, int n, int row0,
                                                      int lane, uint32_t (&bits)[2]) {
  const uint8_t* mask = request_mask(p, blockIdx.z);
  const int col_lane = 2 * (lane & 3);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const DraftRow d = draft_row(mask, p.num_heads, prefix, n, row0 + rr * 8);
    uint32_t b = 0;
#pragma unroll
    for (int nb = 0; nb < 8; ++nb)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        b |= static_cast<uint32_t>(draft_key_visible(d.mask_row, n, d.valid, d.query, nb * 8 + col_lane + e)) << (nb * 2 + e);
    bits[rr] = b;
  }
}

// Scale into the log2 domain (`scale`: the tile's score scale, prefix or draft) and mask. kFold
// (h13): the scale is applied later, inside the exp2's FFMA (softmax_exp_range<true>), so this only masks.
template <bool kFold>
__device__ __forceinline__ void scale_and_mask(float (&s)[32], const KdtreeVerifyParams& p, bool is_prefix,
                                               float scale, int key_base, int prefix, int n, int row0, int lane,
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
  if (kMaskPrefetch && key_base == 0) {  // the first draft tile: its bits were loaded in the prologue
#pragma unroll
    for (int nb = 0; nb < 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[nb * 4 + e] = (first_bits[e >> 1] >> (nb * 2 + (e & 1))) & 1u ? (kFold ? s[nb * 4 + e] : s[nb * 4 + e] * scale)
                                                                        : -CUDART_INF_F;
    return;
  }
  const uint8_t* mask = request_mask(p, blockIdx.z);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const DraftRow d = draft_row(mask, p.num_heads, prefix, n, row0 + rr * 8);
#pragma unroll
    for (int nb = 0; nb < 8; ++nb)
#pragma unroll
      for (int e = 2 * rr; e < 2 * rr + 2; ++e) {
        const int key = key_base + nb * 8 + col_lane + (e & 1);
        s[nb * 4 + e] = draft_key_visible(d.mask_row, n, d.valid, d.query, key) ? (kFold ? s[nb * 4 + e] : s[nb * 4 + e] * scale)
                                                                                : -CUDART_INF_F;
      }
  }
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
// 0.981-0.989 of the one-group time with 2, the same with 4 (perf-notes h34, h34b).
// A/B: -DKDTREE_PV_SPLIT=1 rebuilds the one-group form (all exp2s, P shared, then the PV).
#ifdef KDTREE_PV_SPLIT
constexpr int kPvGroups = KDTREE_PV_SPLIT;
#else
constexpr int kPvGroups = 2;
#endif
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

__device__ __forceinline__ void rescale(float (&o)[128], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1];
}

// Writes this thread's 2 rows x 256 columns of O (already normalised by 1/l) to `out` (bf16) or to
// the split workspace (fp32).
__device__ __forceinline__ void store_half(const float (&o)[128], const float (&inv_l)[2], const KdtreeVerifyParams& p,
                                           const RequestView& req, int b, int split, int row_tile, int num_row_tiles,
                                           int row_in_tile0, int col_half, int lane, bool direct) {
  const int H = p.num_heads;
  const int rows = req.n * H;
  const int col_lane = col_half * 256 + 2 * (lane & 3);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = row_tile * HopperConfig::kM + row_in_tile0 + rr * 8;
    if (r >= rows) continue;
    if (direct) {
      __nv_bfloat16* dst = out_row(p, req, r) + col_lane;
#pragma unroll
      for (int nb = 0; nb < 32; ++nb) {
        *reinterpret_cast<uint32_t*>(dst + nb * 8) =
            pack_bf16x2(o[nb * 4 + 2 * rr] * inv_l[rr], o[nb * 4 + 2 * rr + 1] * inv_l[rr]);
      }
    } else {
      const int64_t ws_row = (static_cast<int64_t>(b) * p.num_splits + split) * (num_row_tiles * HopperConfig::kM) + r;
      float* ws_o = reinterpret_cast<float*>(p.workspace) + ws_row * kVDim + col_lane;
#pragma unroll
      for (int nb = 0; nb < 32; ++nb) {
        *reinterpret_cast<float2*>(ws_o + nb * 8) =
            make_float2(o[nb * 4 + 2 * rr] * inv_l[rr], o[nb * 4 + 2 * rr + 1] * inv_l[rr]);
      }
    }
  }
}

// The same output through shared memory (h9), for the direct (bf16) path: the warpgroup writes its
// normalised 64 x 256 half of O into the idle K stages (rows padded by 16 B: conflict-free), then
// one thread per row hands its 512 bytes to the copy engine (cp.async.bulk). The register path
// above issues 64 four-byte stores per thread, each writing 8 half-used sectors; at L = 1k they
// held ~18% of the kernel's warp time (LSU throttle, then the drain at exit). Measured: one-wave
// shapes 9-22% faster. The fp32 partials keep the register path: their 8-byte stores fill whole
// sectors, and staging them measured 4-11% slower (perf-notes h9).
// Requires the K stages to be idle (after kBarFinal) and 16-byte aligned output rows.
__device__ __forceinline__ void store_half_staged(const float (&o)[128], const float (&inv_l)[2],
                                                  const KdtreeVerifyParams& p, const RequestView& req, int row_tile,
                                                  int row_in_tile0, int col_half, int lane, int thread_in_wg,
                                                  uint32_t stage_smem, uint8_t* stage_ptr) {
  constexpr int kPitch = 256 * 2 + 16;
  const int col_lane = 2 * (lane & 3);
  uint8_t* base = stage_ptr + col_half * HopperConfig::kM * kPitch;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    uint8_t* row = base + (row_in_tile0 + 8 * rr) * kPitch;
#pragma unroll
    for (int nb = 0; nb < 32; ++nb) {
      *reinterpret_cast<uint32_t*>(row + (nb * 8 + col_lane) * 2) =
          pack_bf16x2(o[nb * 4 + 2 * rr] * inv_l[rr], o[nb * 4 + 2 * rr + 1] * inv_l[rr]);
    }
  }
  fence_proxy_async();  // the rows, written by the generic proxy, are read by the copy engine
  named_barrier(kBarStore + col_half, 128);
  const int j = thread_in_wg;
  const int r = row_tile * HopperConfig::kM + j;
  if (j < HopperConfig::kM && r < req.n * p.num_heads) {
    __nv_bfloat16* dst = out_row(p, req, r) + col_half * 256;
    bulk_store_s2g(dst, stage_smem + col_half * HopperConfig::kM * kPitch + j * kPitch, 512);
    bulk_commit();
    bulk_wait_read();  // the shared memory must outlive the copy's reads (the CTA exits next)
  }
}

// Diagnostics only (-DKDTREE_TIMELINE, never in a release build): threads 0 and 128 stamp
// %globaltimer at the CTA's milestones into g_timeline (read by kdtree_timeline_copy), to see
// where a short kernel's fixed time goes. A printf here would serialise every wgmma (C7510).
#ifdef KDTREE_TIMELINE
// Slots 0-8: %globaltimer at the milestones; 9: tiles | SM id << 32; 10, 11: clock64 at the tile
// loop's start and end (with slots 4 and 5 they give the SM clock the loop ran at).
constexpr int kTimelineSlots = 12;
constexpr int kTimelineCtas = 8192;
__device__ unsigned long long g_timeline[kTimelineCtas * kTimelineSlots];
__device__ __forceinline__ unsigned long long timeline_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define KDTREE_TL(k)                                 \
  do {                                               \
    if ((threadIdx.x & 127) == 0) tl[k] = timeline_now(); \
  } while (0)
#else
#define KDTREE_TL(k) \
  do {                 \
  } while (0)
#endif

// kFold (h13): the score and P scales are folded into the softmax's exp2 (positive, finite scales
// only: the launcher picks the instantiation, so the hot loop has one softmax body either way).
// q_map / q_tma (h23): when the launcher could encode q as a {576, H, tokens} tensor map whose
// 64-column x 64-row box is one row tile (H divides 64, or 64 divides H), q_tma is 1 and every row
// tile wholly inside its request loads Q with nine TMA boxes; otherwise (and for a tile with
// padding rows) Q comes through cp.async, which zero-fills the padding rows.
template <bool kFold>
__global__ void __launch_bounds__(HopperConfig::kThreads, 1)
    verify_attention_hopper_kernel(const KdtreeVerifyParams p, const __grid_constant__ CUtensorMap q_map, const int q_tma) {
  using Cfg = HopperConfig;
  const int row_tile = blockIdx.x;
  const int split = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  // The warpgroup index through a warp reduction (REDUX writes a uniform register): ptxas then
  // knows the role branches below are warp-uniform, and the K-stage descriptor inside WG0's loop
  // stays in uniform registers (2-3 uniform instructions per QK^T wgmma instead of ~7.5 with two
  // R2UR), and 30 registers fewer are live (perf-notes h18).
  const int wg = static_cast<int>(__reduce_max_sync(0xffffffffu, static_cast<unsigned>(tid >> 7)));  // 0: math, 1: helper
  const int warp_in_wg = (tid >> 5) & 3;

#ifdef KDTREE_TIMELINE
  __shared__ unsigned long long tl_wg1[2];
  unsigned long long tl[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  long long tl_clk[2] = {0, 0};
#endif
  KDTREE_TL(0);
  if (q_tma && threadIdx.x == 0) prefetch_tensormap(&q_map);  // its descriptor fetch, off the request's path
  CtaWork cw;
  if (!cta_work<Cfg>(p, b, row_tile, split, cw)) return;
  KDTREE_TL(1);
  const RequestView& req = cw.req;
  const SplitWork& w = cw.w;
  const int rows = cw.rows, t_begin = cw.t_begin, t_end = cw.t_end;
  const int num_tiles = t_end - t_begin;

  const uint32_t smem = smem_addr(g_hopper_smem);
  if ((smem & 1023) != 0) __trap();  // the swizzle pattern is tied to 1024-byte-aligned atoms
  const uint32_t sQ = smem + Cfg::kQOff;
  const uint32_t sK = smem + Cfg::kKOff;
  const uint32_t sP = smem + Cfg::kPOff;
  float* s_alpha = reinterpret_cast<float*>(g_hopper_smem + Cfg::kAlphaOff);
  float* s_inv_l = reinterpret_cast<float*>(g_hopper_smem + Cfg::kInvLOff);
  float* s_lse = reinterpret_cast<float*>(g_hopper_smem + Cfg::kLseOff);
  const uint32_t bar_full = smem + Cfg::kBarOff;        // + 8 * stage
  const uint32_t bar_empty = smem + Cfg::kEmptyBarOff;  // + 8 * stage

  const __nv_bfloat16* kd = reinterpret_cast<const __nv_bfloat16*>(p.k);
  const __nv_bfloat16* kv = reinterpret_cast<const __nv_bfloat16*>(p.kv_cache);
  const int64_t* kv_indices = reinterpret_cast<const int64_t*>(p.kv_indices);

  const uint32_t bar_q = smem + Cfg::kQBarOff;
  // A tile wholly inside the request: its 64 rows are 64 / H whole tokens from token row0 / H (H
  // divides 64), or heads row0 % H .. + 63 of one token (64 divides H), so one box of the map is
  // the tile's 64 rows of one 64-column atom, in the swizzled layout wgmma reads.
  const bool tma_q = q_tma != 0 && (row_tile + 1) * Cfg::kM <= rows && req.q0 + req.n <= 0x7fffffff;  // int32 coordinates
  if (tid == 0) {
    mbar_init(bar_full, 128);
    mbar_init(bar_full + 8, 128);
    mbar_init(bar_empty, 128);
    mbar_init(bar_empty + 8, 128);
    mbar_init(bar_q, 1);
    fence_mbarrier_init();  // the copy engine sees the initialised barrier
    if (tma_q) {
      const int r0 = row_tile * Cfg::kM;
      const int tok = static_cast<int>(req.q0) + r0 / p.num_heads, head = r0 % p.num_heads;
      mbar_arrive_expect_tx(bar_q, Cfg::kBlockBytes);
#pragma unroll
      for (int a = 0; a < Cfg::kAtoms; ++a) tma_load_3d(sQ + a * Cfg::kAtomBytes, &q_map, bar_q, a * 64, head, tok);
    }
  }
  // ---- Q tile (zeros past the request) -> swizzled shared memory, by all 256 threads.
  // h21c: a warp instruction copies 4 whole 128-byte lines (rows tid/8 and +32, chunk tid & 7 of each
  // atom), as the gather does; 8 rows x 64 bytes before (-DKDTREE_Q_HALF_LINES).
  auto load_q = [&]() {
#ifndef KDTREE_Q_HALF_LINES
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
#else
    const int row = tid >> 2;
    bool valid;
    const __nv_bfloat16* src = q_row_src(p, req, row_tile * Cfg::kM + row, rows, valid);
#pragma unroll
    for (int u = 0; u < kRowChunks / 4; ++u) {
      const int c = (tid & 3) + 4 * u;
      cp_async_16(sQ + (c >> 3) * Cfg::kAtomBytes + swizzled(row, c), src + c * 8, valid);
    }
#endif
    cp_async_commit();
  };

  // ---- The helper's K gather: thread j of WG1 copies 16-byte chunk (j & 7) of each 64-column atom
  // for keys 16u + j/8 (u = 0..3): a warp reads 4 whole 128-byte segments per instruction.
  const int j = tid & 127;
  const int gather_chunk = j & 7;
  const int gather_key0 = j >> 3;  // + 16u
  // Slot ids are fetched a tile ahead and range-checked only when the copy is issued, so the
  // index load's latency hides behind the next PV (checking at once stalled WG1: perf-notes h1).
  auto fetch_slots = [&](int tile, int64_t (&slots)[4]) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      slots[u] = -1;
      if (tile < t_end && tile < w.prefix_tiles) {
        const int key = tile * Cfg::kBN + gather_key0 + 16 * u;
        if (key < req.prefix) slots[u] = __ldg(kv_indices + req.kv0 + key);
      }
    }
  };
  auto issue_tile = [&](int tile, const int64_t (&slots)[4]) {
    const uint32_t dst_base = sK + ((tile - t_begin) & 1) * Cfg::kBlockBytes;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int key_local = gather_key0 + 16 * u;
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
      const uint32_t dst = dst_base + swizzled(key_local, gather_chunk);
#pragma unroll
      for (int a = 0; a < Cfg::kAtoms; ++a) cp_async_16(dst + a * Cfg::kAtomBytes, src + a * 64 + gather_chunk * 8, valid);
    }
    cp_async_mbar_arrive(bar_full + 8 * ((tile - t_begin) & 1));
  };

  // Prologue: barriers initialised and visible, then Q (its own cp.async group) and, without
  // waiting for Q, K tile 0 (tracked by its mbarrier only). Tile 1 follows once Q has landed
  // (h21b): every CTA of a wave pulls Q and its first tiles at once, and a first burst of Q +
  // one tile lands ~1 µs sooner than Q + two (-DKDTREE_PROLOGUE_TWO_TILES: both at once, as before).
  int64_t slots[4];
  if (wg == 1) fetch_slots(t_begin, slots);
  __syncthreads();  // mbarrier initialisation visible before any cp.async arrives on them
  if (!tma_q) load_q();
  const int row_in_tile0 = warp_in_wg * 16 + (lane >> 2);  // this thread's rows: + 0 and + 8
  uint32_t first_bits[2] = {0u, 0u};
  if (kMaskPrefetch && wg == 0 && t_begin <= w.prefix_tiles && w.prefix_tiles < t_end)  // owns the first draft tile
    first_draft_tile_bits(p, req.prefix, req.n, row_tile * Cfg::kM + row_in_tile0, lane, first_bits);
  if (wg == 1) {
    issue_tile(t_begin, slots);
#ifndef KDTREE_PROLOGUE_TWO_TILES  // h21b: tile 1 is issued once Q has landed (a smaller first burst)
    fetch_slots(t_begin + 1, slots);
#else
    if (t_begin + 1 < t_end) {
      fetch_slots(t_begin + 1, slots);
      issue_tile(t_begin + 1, slots);
    }
    fetch_slots(t_begin + 2, slots);
#endif
    KDTREE_TL(2);  // WG1: the prologue's tiles issued
  }
  if (tma_q) {
    mbar_wait(bar_q, 0);  // the copy engine's writes are visible to wgmma once the phase completes
  } else {
    cp_async_wait<0>();  // this thread's Q group (the tiles' copies belong to no group)
    fence_proxy_async();
  }
  __syncthreads();  // Q visible to everyone
  KDTREE_TL(3);

  float o[128];
  const bool direct = w.active == 1;
  const int num_row_tiles = gridDim.x;
  // The direct output goes through shared memory and bulk copies when its rows are 16-byte aligned
  // (always, for a torch-allocated tensor; an 8-byte aligned `out` view takes the register path).
#ifdef KDTREE_REGISTER_EPILOGUE
  const bool staged_store = false;
#else
  const bool staged_store = direct && (reinterpret_cast<uintptr_t>(p.out) & 15) == 0 && (p.out_stride_tok & 7) == 0;
#endif

  if (wg == 0) {
    // =========================== math warpgroup ===========================
    SoftmaxState st;
    st.m[0] = st.m[1] = -CUDART_INF_F;
    st.l[0] = st.l[1] = 0.f;
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    const int row0 = row_tile * Cfg::kM + row_in_tile0;
    constexpr float kLog2e = 1.4426950408889634f;
    const float prefix_scale = p.sm_scale * p.k_scale * kLog2e, draft_scale = p.sm_scale * kLog2e;
    const float log2_vs = kFold ? log2f(p.v_scale) : 0.f, inv_vs = kFold ? 1.f / p.v_scale : 1.f;
    for (int i = 0; i < num_tiles; ++i) {
      const int t = t_begin + i;
      const uint32_t stage = sK + (i & 1) * Cfg::kBlockBytes;
      mbar_wait(bar_full + 8 * (i & 1), (i >> 1) & 1);
      if (i == 0) {
        KDTREE_TL(4);
#ifdef KDTREE_TIMELINE
        tl_clk[0] = clock64();
#endif
      }
      fence_proxy_async();

      // S = Q K^T over 36 k16 steps (4 per 64-column atom).
      // Descriptors advance by adding (byte offset >> 4) to the start-address field: every
      // address stays below 256 KB, so the 14-bit field never carries.
      float s[32];
      const uint64_t desc_q = make_desc(sQ, 16, 1024);
      const uint64_t desc_k = make_desc(stage, 16, 1024);
      wgmma_fence_operand(s);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < 36; ++ks) {
        const uint32_t off = ((ks >> 2) * Cfg::kAtomBytes + (ks & 3) * 32) >> 4;
        wgmma_m64n64k16_ss_kmajor(s, desc_q + off, desc_k + off, ks > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operand(s);

      const bool is_prefix = t < w.prefix_tiles;
      const int key_base = is_prefix ? t * Cfg::kBN : (t - w.prefix_tiles) * Cfg::kBN;
      const float tile_scale = is_prefix ? prefix_scale : draft_scale;
      scale_and_mask<kFold>(s, p, is_prefix, tile_scale, key_base, req.prefix, req.n, row0, lane, first_bits);
      float alpha[2];
      bool any_move;
      softmax_rows<kFold>(s, st, alpha, any_move, tile_scale);
      if (any_move) rescale(o, alpha);  // before any of this tile's PV (the previous one has completed)

      // P (bf16): registers for this warpgroup's PV; shared memory for the helper's. The exp2s go
      // in kPvGroups key ranges, each range's PV k16 steps issued before the next range's exp2s
      // (h34); the last range's after P is shared, so the helper's PV starts as early as before.
      const float ps = kFold ? 1.f : (is_prefix ? p.v_scale : 1.f);
      uint32_t pa[4][4];
      auto pack_p = [&](int kk) {
        pa[kk][0] = pack_bf16x2(s[8 * kk + 0] * ps, s[8 * kk + 1] * ps);
        pa[kk][1] = pack_bf16x2(s[8 * kk + 2] * ps, s[8 * kk + 3] * ps);
        pa[kk][2] = pack_bf16x2(s[8 * kk + 4] * ps, s[8 * kk + 5] * ps);
        pa[kk][3] = pack_bf16x2(s[8 * kk + 6] * ps, s[8 * kk + 7] * ps);
      };
      // O[:, 0:256] += P V[:, 0:256] for k16 steps [kk0, kk1) (16 keys each), one commit group.
      const uint64_t desc_v = make_desc(stage, kVLeading, kVStride);
      auto issue_pv = [&](int kk0, int kk1) {
        wgmma_fence();  // orders the pa registers just written (and O's rescale) before the wgmmas
#pragma unroll
        for (int kk = kk0; kk < kk1; ++kk) wgmma_m64n256k16_rs_bmn(o, pa[kk], desc_v + kk * (2048 >> 4), 1);
        wgmma_commit();
      };
      constexpr int kSteps = 4 / kPvGroups;  // k16 steps a group
      float sum[2] = {0.f, 0.f};
      wgmma_fence_operand(o);
#pragma unroll
      for (int g = 0; g < kPvGroups; ++g) {
        softmax_exp_range<kFold>(s, st, sum, tile_scale, is_prefix ? log2_vs : 0.f, 2 * kSteps * g, 2 * kSteps * (g + 1));
#pragma unroll
        for (int kk = kSteps * g; kk < kSteps * (g + 1); ++kk) pack_p(kk);
        if (g + 1 < kPvGroups) issue_pv(kSteps * g, kSteps * (g + 1));
      }
      const float inv_ps = kFold && is_prefix ? inv_vs : 1.f;  // the row sum keeps sum(P') / ps (kFold)
      st.l[0] += sum[0] * inv_ps;
      st.l[1] += sum[1] * inv_ps;

      if (i > 0) named_barrier(kBarPFree, 256);  // the helper is done with P and alpha of tile t-1
      {
        uint8_t* p_smem = g_hopper_smem + Cfg::kPOff;
        const int r_lo = row_in_tile0, r_hi = row_in_tile0 + 8;
        const int byte = 4 * (lane & 3);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          *reinterpret_cast<uint32_t*>(p_smem + swizzled(r_lo, 2 * kk) + byte) = pa[kk][0];
          *reinterpret_cast<uint32_t*>(p_smem + swizzled(r_hi, 2 * kk) + byte) = pa[kk][1];
          *reinterpret_cast<uint32_t*>(p_smem + swizzled(r_lo, 2 * kk + 1) + byte) = pa[kk][2];
          *reinterpret_cast<uint32_t*>(p_smem + swizzled(r_hi, 2 * kk + 1) + byte) = pa[kk][3];
        }
        if ((lane & 3) == 0) {
          s_alpha[r_lo] = alpha[0];
          s_alpha[r_hi] = alpha[1];
        }
      }
      fence_proxy_async();
      named_arrive(kBarPFull, 256);
      issue_pv(4 - kSteps, 4);
      wgmma_wait<0>();
      wgmma_fence_operand(o);
      if (i + 2 < num_tiles) mbar_arrive(bar_empty + 8 * (i & 1));  // the helper may refill this stage
    }
    KDTREE_TL(5);
#ifdef KDTREE_TIMELINE
    tl_clk[1] = clock64();
#endif
    // Row statistics for the helper and for the split combine.
    float inv_l[2];
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
    named_barrier(kBarFinal, 256);  // also: both warpgroups are done with the K stages
    KDTREE_TL(6);
    // h39: the split combine (a programmatic dependent) may start once every CTA is here: its blocks
    // load the request's indices while the output stores drain, then wait for this grid to finish.
    if (kCombineAsDependent && tid == 0) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    if (staged_store) {
      store_half_staged(o, inv_l, p, req, row_tile, row_in_tile0, 0, lane, tid & 127, sK, g_hopper_smem + Cfg::kKOff);
    } else {
      store_half(o, inv_l, p, req, b, split, row_tile, num_row_tiles, row_in_tile0, 0, lane, direct);
    }
    if (!direct && (lane & 3) == 0) {
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
#ifdef KDTREE_TIMELINE
    KDTREE_TL(7);
    named_barrier(kBarStore + 2, 256);  // WG1's stamps are in shared memory
    const int cta = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    if (tid == 0 && cta < kTimelineCtas) {
      unsigned long long* r = g_timeline + cta * kTimelineSlots;
      r[0] = tl[0];
      r[1] = tl[1];
      r[2] = tl_wg1[0];
      r[3] = tl[3];
      r[4] = tl[4];
      r[5] = tl[5];
      r[6] = tl[6];
      r[7] = tl[7];
      r[8] = tl_wg1[1];
      unsigned smid;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
      r[9] = static_cast<unsigned long long>(num_tiles) | (static_cast<unsigned long long>(smid) << 32);
      r[10] = static_cast<unsigned long long>(tl_clk[0]);
      r[11] = static_cast<unsigned long long>(tl_clk[1]);
    }
#endif
  } else {
    // =========================== helper warpgroup ===========================
#ifndef KDTREE_PROLOGUE_TWO_TILES  // tile 1, now that Q has landed
    if (t_begin + 1 < t_end) issue_tile(t_begin + 1, slots);
    fetch_slots(t_begin + 2, slots);
#endif
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    for (int i = 0; i < num_tiles; ++i) {
      const uint32_t stage = sK + (i & 1) * Cfg::kBlockBytes;
      mbar_wait(bar_full + 8 * (i & 1), (i >> 1) & 1);  // already complete: WG0 waited first
      named_barrier(kBarPFull, 256);
      fence_proxy_async();
      const float alpha[2] = {s_alpha[row_in_tile0], s_alpha[row_in_tile0 + 8]};
      if (!kWg1SkipRescale || __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) rescale(o, alpha);
      wgmma_fence_operand(o);
      wgmma_fence();
      const uint64_t desc_p = make_desc(sP, 16, 1024);
      const uint64_t desc_v = make_desc(stage + 4 * Cfg::kAtomBytes, kVLeading, kVStride);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_m64n256k16_ss_bmn(o, desc_p + kk * (32 >> 4), desc_v + kk * (2048 >> 4), 1);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operand(o);
      if (i + 1 < num_tiles) named_arrive(kBarPFree, 256);  // WG0 may write P of tile t+1
      if (i + 2 < num_tiles) {
        // Refill this stage with tile t+2 once WG0's PV of tile t is done too. WG0 cannot arrive
        // on this stage's empty barrier again before tile t+2 has landed: phases never run ahead.
        mbar_wait(bar_empty + 8 * (i & 1), (i >> 1) & 1);
        issue_tile(t_begin + i + 2, slots);
        fetch_slots(t_begin + i + 3, slots);
      }
    }
    named_barrier(kBarFinal, 256);
    const float inv_l[2] = {s_inv_l[row_in_tile0], s_inv_l[row_in_tile0 + 8]};
    if (staged_store) {
      store_half_staged(o, inv_l, p, req, row_tile, row_in_tile0, 1, lane, tid & 127, sK, g_hopper_smem + Cfg::kKOff);
    } else {
      store_half(o, inv_l, p, req, b, split, row_tile, num_row_tiles, row_in_tile0, 1, lane, direct);
    }
#ifdef KDTREE_TIMELINE
    if (tid == 128) {
      tl_wg1[0] = tl[2];
      tl_wg1[1] = timeline_now();
    }
    named_barrier(kBarStore + 2, 256);
#endif
  }
}

}  // namespace hopper
}  // namespace kdtree
