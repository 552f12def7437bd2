// Diagnostic (sm_90a; journal m39), not part of the library: how fast can the warp-specialised
// portable kernel's mma phase run when nothing else is in its way? The kernel's own pieces do the
// work: `ws::qk_tile_mma` (a QK warp's 144 mma and 76 ldmatrix a 32-key tile, Q's nope k-steps in
// registers) and `ws::pv_tile_mma` (a PV warp's 64 mma and 16 ldmatrix), on the kernel's shared-memory
// layout (WsLayout: two padded K stages, q_rope, two P buffers), 12 warps with the kernel's setmaxnreg
// split (QK 184, PV 160), one CTA an SM. No K fill, no softmax, no mask, no P stores: the stages and
// P buffers hold fixed random bf16 written once. Journal m37 measured each of those costs as a
// ceiling (fill 4%, softmax 3%) and concluded that the period is the mma phase itself, at ~62% of
// the pipe's rate; this measures that phase alone, four ways:
//   qk       the 4 QK warps only (one a scheduler);
//   pv       the 8 PV warps only (two a scheduler);
//   both     both roles free-running (the PV warps loop until every QK warp is done; no hand-off);
//   coupled  the kernel's dependency chain without its barriers' other work: PV warp tile i waits
//            for every QK warp's tile i (the P hand-off), QK tile j for every PV warp's tile j - 2
//            (the stage it reads is refilled only after PV(j - 2)), by two mbarriers a parity.
// and at three distances of the QK warp's K-fragment ring (kAhead k-steps ahead, a __syncwarp
// every kPin k-steps; the kernel ships 2 / 3). Then (journal m39b) the shipped distance coupled with
// 400 cycles spun on the QK chain (its softmax and hand-off), and `pair_kernel`: the same four modes
// for one CTA of journal p46's pair-split design (8 QK warps over half the depth, 4 PV warps over
// half of O), coupled with 0, 400 and 1,500 cycles spun on each QK set's chain (see pair_kernel).
// Then (journal m44-m44d) `chain_kernel`: the chain model, the kernel's mix coupled through 2 or 3 K
// stages and 2 or 3 P buffers, with the chain's other links as timed waits (the QK warps' softmax and
// hand-off, the PV warps' refill, the stage's landing by an SM-clock stamp), and two variants of the
// roles' pieces: the QK warps with two accumulator sets (m44c), the PV warps throttled by nanosleep
// (m44d). Where to test a new role mix before it is built.
//
// Reported per variant and mode (median over CTAs): QK cycles a tile (its warps' clock64 span over
// the tiles), PV cycles a tile, PV tiles done per QK tile, and the tensor pipe's work a scheduler as
// HMMA per cycle over the QK span (both / coupled) against the registers-only rate of one m16n8k16
// every ~6.3 cycles a scheduler (bench/diag/mma_issue.cu, journal m13), and "work": SM-cycles for
// one tile of the kernel's work (the kernel's mix: its QK cycles a tile; a pair CTA's tile is half of
// one, so twice its cycles). The kernel at F = 1 runs a 32-key tile in ~3,256 cycles, its QK mma
// phase ~2,242 (m27b; B32 H8 n64 L8k).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v bench/diag/mma_phase.cu -o /tmp/mma_phase
//   /tmp/mma_phase [tiles=4000] [--json PATH]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

// The kernel's own mma phases, lane offsets, layout and barrier helpers.
#include "../../kdtree_backend/kernel/csrc/portable/kernel_ws.cuh"
#include "cuda_check.cuh"

// At -DKDTREE_PIPE_FACTOR=3 (sm_120's regime, journal m27) ptxas spills up to 100 B inside these
// loops (the extra mma's zero registers on top of the PV role's 160), which would time the spills.
#if KDTREE_PIPE_FACTOR != 1
#error "mma_phase.cu times the F = 1 pipe only: its loops spill at KDTREE_PIPE_FACTOR > 1"
#endif

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

namespace {

using kdtree::g_smem;
using kdtree::mbar_arrive;
using kdtree::mbar_init;
using kdtree::mbar_wait;
using kdtree::smem_addr;
using kdtree::thread_index_volatile;
using kdtree::WsConfig;
using kdtree::WsLayout;

enum Mode : int { kQk = 0, kPv = 1, kBoth = 2, kCoupled = 3 };
const char* const kModeNames[] = {"qk", "pv", "both", "coupled"};

constexpr int kThreads = WsConfig::kThreads;
constexpr int kWarps = kThreads / 32;
constexpr int kPBytes = WsConfig::kM * WsConfig::kPRowBytes;
// After the kernel's layout: the QK-done count (both), P-full[2] (4 QK arrivals) and K-free[2] (8 PV
// arrivals) mbarriers (coupled).
constexpr int kDone = WsLayout::kBytes;
constexpr int kBars = (kDone + 8 + 7) / 8 * 8;
constexpr int kSmemBytes = kBars + 4 * 8;
static_assert(kSmemBytes <= 227 * 1024, "fits the H200's shared memory");

// The QK warps' done count, read afresh on every iteration of the `both` mode's PV loop. A plain
// `ld.shared`, even from `asm volatile`, is an ordinary load to ptxas: with no barrier in the loop it
// may read it once before the loop, and did in pair_kernel<kBoth> (the PV warps never saw the count
// and the probe hung, session 43). `ld.volatile` is re-issued every time.
__device__ __forceinline__ int ld_volatile_shared_s32(uint32_t addr) {
  int v;
  asm volatile("ld.volatile.shared.s32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// Spins `cycles` SM cycles: what a role's chain does between its mma phases (the softmax and the
// P hand-off; in pair mode also the partial-score exchange), without the pipe's or shared memory's time.
__device__ __forceinline__ void spin(int cycles) {
  if (cycles <= 0) return;
  const long long s = clock64();
  while (clock64() - s < cycles) {
  }
}

// Fixed random bf16 in [-0.5, 0.5) over the first `bytes` of shared memory (K stages, q_rope, P
// buffers: what the mma phases read).
__device__ __forceinline__ void fill_random(int bytes) {
  for (int off = thread_index_volatile() * 4; off < bytes; off += kThreads * 4) {
    uint32_t h = static_cast<uint32_t>(off) * 2654435761u + blockIdx.x * 40503u;
    h ^= h >> 15;
    const float lo = static_cast<float>(h & 0xff) / 256.f - 0.5f, hi = static_cast<float>((h >> 8) & 0xff) / 256.f - 0.5f;
    *reinterpret_cast<__nv_bfloat162*>(g_smem + off) = __floats2bfloat162_rn(lo, hi);
  }
}

// Where a warp's results go, called after its loop: sink keeps every accumulator live, spans[cta][warp]
// = {clock64 span, tiles}. The pointers come by value (a reference to a kernel parameter puts it in
// local memory) and the thread index is read afresh.
__device__ __forceinline__ void record(float* sink, long long* spans, float acc, long long cycles, int done) {
  const int t = thread_index_volatile();
  sink[static_cast<long long>(blockIdx.x) * kThreads + t] = acc;
  if ((t & 31) == 0) {
    long long* span = spans + (static_cast<long long>(blockIdx.x) * kWarps + (t >> 5)) * 2;
    span[0] = cycles;
    span[1] = done;
  }
}

// A PV warp's accumulators (64 rows x its 64 columns): zeroed before its loop, summed into the sink after.
__device__ __forceinline__ void zero_o(float (&o)[4][8][4]) {
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int f = 0; f < 8; ++f) o[mt][f][0] = o[mt][f][1] = o[mt][f][2] = o[mt][f][3] = 0.f;
}
__device__ __forceinline__ float sum_o(const float (&o)[4][8][4]) {
  float acc = 0.f;
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int f = 0; f < 8; ++f) acc += o[mt][f][0] + o[mt][f][1] + o[mt][f][2] + o[mt][f][3];
  return acc;
}

// A QK warp of the kernel's mix (phase_kernel, chain_kernel): Q's nope fragments of its 16 rows into
// registers and its lanes' ldmatrix offsets, from the kernel's own helpers.
__device__ __forceinline__ void qk_warp_setup(uint32_t base, int g, int lane, uint32_t (&q)[WsConfig::kNopeSteps][4],
                                              uint32_t& rope, uint32_t& lo_qk) {
  kdtree::ws::load_q_nope(base, g, lane, q);
  rope = kdtree::ws::qk_lane_rope(base, g, lane);
  lo_qk = kdtree::ws::qk_lane_k(lane);
}

template <int kMode, int kAhead, int kPin>
__global__ void __launch_bounds__(kThreads, 1) phase_kernel(int tiles, int delay, float* sink, long long* spans) {
  const uint32_t base = smem_addr(g_smem);
  const int tid = threadIdx.x;
  fill_random(WsLayout::kPBuf + 2 * kPBytes);  // the stages, q_rope and the P buffers (the layout's front)
  if (tid == 0) {
    *reinterpret_cast<uint32_t*>(g_smem + kDone) = 0u;
    for (int s = 0; s < 2; ++s) {
      mbar_init(base + kBars + 8 * s, WsConfig::kQkWarps);      // P full of parity s
      mbar_init(base + kBars + 16 + 8 * s, WsConfig::kPvWarps);  // K free of parity s
    }
  }
  __syncthreads();

  if (tid >= WsConfig::kQkWarps * 32) {  // PV warps first, as the kernel (p34)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WsConfig::kPvRegs));
    if (kMode == kQk) return;
    const int lane = thread_index_volatile() & 31, c = (thread_index_volatile() >> 5) - WsConfig::kQkWarps;
    float o[4][8][4];
    zero_o(o);
    const uint32_t lo_pv = kdtree::ws::pv_lane_v(lane, c);
    // Tiles in pairs (stage and P buffer 0, then 1: compile-time offsets; with a run-time parity the
    // role's 160 registers spilled in the free-running mode).
    const uint32_t pv_p = base + WsLayout::kPBuf + kdtree::ws::pv_lane_p(lane);
    int i = 0;
    const long long t0 = clock64();
    for (;; i += 2) {
      if (kMode == kBoth ? ld_volatile_shared_s32(base + kDone) == WsConfig::kQkWarps : i == tiles) break;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (kMode == kCoupled) mbar_wait(base + kBars + 8 * h, (i >> 1) & 1);  // P(i + h) "full"
        kdtree::ws::pv_tile_mma(o, pv_p + h * kPBytes, base + h * WsConfig::kTileBytes, lo_pv);
        if (kMode == kCoupled) {
          __syncwarp();
          if (lane == 0) mbar_arrive(base + kBars + 16 + 8 * h);  // stage h "free"
        }
      }
    }
    const long long t1 = clock64();
    record(sink, spans, sum_o(o), t1 - t0, i);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WsConfig::kQkRegs));
    if (kMode == kPv) return;
    const int lane = thread_index_volatile() & 31, g = thread_index_volatile() >> 5;
    uint32_t q[WsConfig::kNopeSteps][4], rope, lo_qk;
    qk_warp_setup(base, g, lane, q, rope, lo_qk);
    float acc = 0.f;
    const long long t0 = clock64();
    for (int i = 0; i < tiles; ++i) {
      if (kMode == kCoupled && i >= 2) mbar_wait(base + kBars + 16 + 8 * (i & 1), ((i - 2) >> 1) & 1);  // PV(i - 2) done
      float s[WsConfig::kBN / 8][4];
      kdtree::ws::qk_tile_mma<kAhead, kPin>(base + (i & 1) * WsConfig::kTileBytes, lo_qk, rope, q, s);
#pragma unroll
      for (int f = 0; f < WsConfig::kBN / 8; ++f) acc += (s[f][0] + s[f][1]) + (s[f][2] + s[f][3]);
      if (kMode == kCoupled) {
        spin(delay);  // the softmax and hand-off's time on the chain
        __syncwarp();
        if (lane == 0) mbar_arrive(base + kBars + 8 * (i & 1));  // P(i) "full"
      }
    }
    const long long t1 = clock64();
    if (kMode == kBoth) {
      __syncwarp();
      if (lane == 0) atomicAdd(reinterpret_cast<unsigned*>(g_smem + kDone), 1u);
    }
    record(sink, spans, acc, t1 - t0, tiles);
  }
}

// ---------------------------------------------------------------------------------------------
// Pair mode (journal m39b): the instruction mix of one CTA of journal p46's pair-split design, where
// the two CTAs of a cluster each take half of QK^T's depth and half of O's columns, so each holds half
// of Q and half of O, and the freed registers carry two QK warp sets. Per CTA: 8 QK warps (two sets
// of 4 that take tiles by parity; warp g of a set owns rows 16g..16g+15, Q's first 18 nope k-steps in
// 72 registers: `qk_tile_mma<2, 3, 18, 0>`) and 4 PV warps (64 output columns each of the CTA's 256:
// the kernel's `pv_tile_mma`), three K stages, two P buffers. A CTA tile is half the work of a
// kernel tile (72 + 64 HMMA a scheduler against 144 + 128), with the same shared-memory bytes an
// HMMA; what differs is the mix: two QK warps and one PV warp a scheduler instead of one and two.
// No exchange, fill or softmax: `delay` spins on each QK set's chain where they would run (m38: the
// exchange ~1,110 cycles, the softmax and hand-off ~380). Registers: setmaxnreg QK 152, PV 200 (the
// launch's 168 a thread). Coupled protocol: QK tile j (set j & 1) waits for PV(j - 3)
// (its stage, j % 3), runs its mma, spins, waits for PV(j - 2) (its P buffer, j & 1) and arrives on
// P full(j); PV tile i waits for P full(i) and arrives on done(i % 3).
constexpr int kPairQkWarps = 8, kPairPvWarps = 4, kPairSteps = 18, kPairStages = 3;
constexpr int kPairSetWarps = kPairQkWarps / 2;  // two QK sets, by tile parity
static_assert(kPairSetWarps == 4, "pair_kernel splits a QK warp index into set (w >> 2) and warp (w & 3)");
constexpr int kPairP = kPairStages * WsConfig::kTileBytes;
constexpr int kPairDone = kPairP + 2 * kPBytes;
constexpr int kPairBars = (kPairDone + 8 + 7) / 8 * 8;  // P full[2] (4 QK arrivals), done[3] (4 PV arrivals)
constexpr int kPairSmemBytes = kPairBars + 5 * 8;
// setmaxnreg: the QK warps need ~130 (Q 72, scores 16, the K-fragment ring 24), the PV warps the
// kernel's PV loop (128 accumulators and its fragments); at the launch's 168 for all, the PV role
// spilled in the free-running mode.
constexpr int kPairQkRegs = 152, kPairPvRegs = 200;
static_assert(kPairQkWarps * kPairQkRegs + kPairPvWarps * kPairPvRegs == kWarps * WsConfig::kLaunchRegs, "setmaxnreg budget");
static_assert(kPairQkWarps + kPairPvWarps == kWarps, "pair mode runs the kernel's 12 warps");
static_assert(kPairSmemBytes <= 227 * 1024, "fits the H200's shared memory");

template <int kMode>
__global__ void __launch_bounds__(kThreads, 1) pair_kernel(int tiles, int delay, float* sink, long long* spans) {
  const uint32_t base = smem_addr(g_smem);
  fill_random(kPairDone);  // the three stages and the two P buffers
  if (thread_index_volatile() == 0) {
    *reinterpret_cast<uint32_t*>(g_smem + kPairDone) = 0u;
    for (int s = 0; s < 2; ++s) mbar_init(base + kPairBars + 8 * s, kPairSetWarps);  // P full of set s
    for (int r = 0; r < 3; ++r) mbar_init(base + kPairBars + 16 + 8 * r, kPairPvWarps);  // PV(i) done, i % 3 == r
  }
  __syncthreads();
  const uint32_t done_bar = base + kPairBars + 16;
  if (thread_index_volatile() >= kPairQkWarps * 32) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kPairPvRegs));
    if (kMode == kQk) return;
    const int lane = thread_index_volatile() & 31, c = (thread_index_volatile() >> 5) - kPairQkWarps;
    float o[4][8][4];
    zero_o(o);
    const uint32_t lo_pv = kdtree::ws::pv_lane_v(lane, c);
    const uint32_t pv_p = base + kPairP + kdtree::ws::pv_lane_p(lane);
    int i = 0;
    const long long t0 = clock64();
    for (;; ++i) {
      if (kMode == kBoth ? ld_volatile_shared_s32(base + kPairDone) == kPairQkWarps : i == tiles) break;
      const int r = i % kPairStages;
      if (kMode == kCoupled) mbar_wait(base + kPairBars + 8 * (i & 1), (i >> 1) & 1);  // P(i) full
      kdtree::ws::pv_tile_mma(o, pv_p + (i & 1) * kPBytes, base + r * WsConfig::kTileBytes, lo_pv);
      if (kMode == kCoupled) {
        __syncwarp();
        if (kdtree::lane_id_volatile() == 0) mbar_arrive(done_bar + 8 * r);  // PV(i) done: stage, P buffer free
      }
    }
    const long long t1 = clock64();
    record(sink, spans, sum_o(o), t1 - t0, i);
  } else {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kPairQkRegs));
    if (kMode == kPv) return;
    const int lane = thread_index_volatile() & 31, w = thread_index_volatile() >> 5;
    const int set = w >> 2, g = w & 3;  // kPairSetWarps = 4 warps a set
    uint32_t q[kPairSteps][4];
    kdtree::ws::load_q_nope<kPairSteps>(base, g, lane, q);
    const uint32_t lo_qk = kdtree::ws::qk_lane_k(lane);
    float acc = 0.f;
    const long long t0 = clock64();
    for (int k = 0; k < tiles / 2; ++k) {
      const int j = 2 * k + set;
      const int r = j % kPairStages;
      if (kMode == kCoupled && j >= kPairStages) mbar_wait(done_bar + 8 * r, ((j - kPairStages) / kPairStages) & 1);
      float s[WsConfig::kBN / 8][4];
      kdtree::ws::qk_tile_mma<WsConfig::kQkAhead, WsConfig::kQkPin, kPairSteps, 0>(base + r * WsConfig::kTileBytes, lo_qk, 0u,
                                                                                 q, s);
#pragma unroll
      for (int f = 0; f < WsConfig::kBN / 8; ++f) acc += (s[f][0] + s[f][1]) + (s[f][2] + s[f][3]);
      if (kMode == kCoupled) {
        spin(delay);  // the exchange, the softmax and the hand-off
        if (j >= 2) mbar_wait(done_bar + 8 * ((j - 2) % kPairStages), ((j - 2) / kPairStages) & 1);  // P buffer j & 1 free
        __syncwarp();
        if (lane == 0) mbar_arrive(base + kPairBars + 8 * set);  // P(j) full
      }
    }
    const long long t1 = clock64();
    if (kMode == kBoth) {
      __syncwarp();
      if (lane == 0) atomicAdd(reinterpret_cast<unsigned*>(g_smem + kPairDone), 1u);
    }
    record(sink, spans, acc, t1 - t0, tiles / 2);
  }
}

// ---------------------------------------------------------------------------------------------
// Chain mode (journal m44): the kernel's mix coupled through S K stages (2 = the kernel, 3 = what a
// third stage would buy if it fit sm_120's 99 KB; it fits the H200's 227 KB, where this probe runs),
// with the chain's non-mma links as timed waits instead of their work (m43b's stamps):
//   qk_spin   on the QK warps' path after their mma (mask, softmax, P stores, hand-off: ~400 cycles);
//   pv_spin   on the PV warps' path after their mma and the P-free arrival (the stage barrier and the
//             refill's ids work and copies: ~1,260 cycles; 0 = a producer refills, as p44);
//   landing   from the last PV warp's refill to the stage's K full for the QK warps (~1,190 cycles):
//             each PV warp's lane 0 raises the stage's clock64 stamp (atomicMax) before it arrives on
//             the stage's "free" mbarrier, and a QK warp that has waited that barrier spins until
//             clock64() >= stamp + landing (clock64 is the SM's, so the landing runs concurrently
//             with everything else, as the copy engine's does).
// QK tile j waits stage j % S (PV(j - S) and its landing), runs qk_tile_mma, spins qk_spin, waits P
// buffer j & 1 (PV(j - 2)'s P-free arrival) and arrives on P full(j & 1). PV tile i waits P full(i & 1),
// runs pv_tile_mma on stage i % S, arrives P free(i & 1), spins pv_spin, stamps and arrives on
// stage free(i % S). No barrier can be waited a phase late: QK j's waits are for tiles PV cannot pass
// without P(j), and PV i's for P(i), which QK cannot produce twice ahead of PV(i - 2).
struct ChainParams {
  int qk_spin, pv_spin, landing, pv_sleep_ns;
};
__constant__ ChainParams c_chain;

constexpr int kChainMaxStages = 3, kChainMaxPBufs = 3;
constexpr int kChainStage2 = (WsLayout::kBytes + 1023) / 1024 * 1024;  // the third stage after the layout
constexpr int kChainP2 = kChainStage2 + WsConfig::kTileBytes;          // the third P buffer after it
constexpr int kChainBars = kChainP2 + kPBytes;                         // P full[3], P free[3], free[3]
constexpr int kChainStamps = kChainBars + 9 * 8;                       // one u64 stamp a stage
constexpr int kChainSmemBytes = kChainStamps + kChainMaxStages * 8;
static_assert(kChainSmemBytes <= 227 * 1024, "fits the H200's shared memory");

__device__ __forceinline__ uint32_t chain_stage(uint32_t base, int s) {
  return s < 2 ? base + s * WsConfig::kTileBytes : base + kChainStage2;
}
__device__ __forceinline__ uint32_t chain_p(uint32_t base, int b) {
  return b < 2 ? base + WsLayout::kPBuf + b * kPBytes : base + kChainP2;
}

// m44c: ws::qk_tile_mma with the even and odd k-steps in two accumulator sets (8 chains of 18 HMMA
// a 32-key tile instead of 4 of 36), summed after the loop; the __syncwarp every kPin k-steps keeps
// ptxas from running one set's chain before the other's (p18's SASS did that without pins). The 16
// registers of the second set come from Q's last kQShared nope k-steps, read by ldmatrix from q_rope's
// rows instead of registers (p43's trade; the probe's data are random, so the address is q_rope's
// first k-steps), and K fragments one k-step ahead (the caller's kAhead = 1). A probe variant of the
// kernel's piece, not the piece itself: the kernel's QK role has no registers for it as it stands.
template <int kAhead, int kPin, int kQShared = 2>
__device__ __forceinline__ void qk_tile_mma_2set(uint32_t tile_base, uint32_t lo_qk, uint32_t rope,
                                                 const uint32_t (&q)[WsConfig::kNopeSteps][4], float (&s)[WsConfig::kBN / 8][4]) {
  constexpr int NT = WsConfig::kBN / 8, kNope = WsConfig::kNopeSteps, kSteps = kNope + WsConfig::kRopeSteps;
  float s1[NT][4];
#pragma unroll
  for (int f = 0; f < NT; ++f) s[f][0] = s[f][1] = s[f][2] = s[f][3] = s1[f][0] = s1[f][1] = s1[f][2] = s1[f][3] = 0.f;
  uint32_t kb[kAhead + 1][NT / 2][4];
  auto load_k = [&](int ks, uint32_t (&b)[NT / 2][4]) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np)
      kdtree::ldmatrix_x4(tile_base + lo_qk + ks * 32 + np * 16 * kdtree::kSmemRowBytes, b[np][0], b[np][1], b[np][2], b[np][3]);
  };
#pragma unroll
  for (int ks = 0; ks < kAhead; ++ks) load_k(ks, kb[ks]);
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    if (ks + kAhead < kSteps) load_k(ks + kAhead, kb[(ks + kAhead) % (kAhead + 1)]);
    if (ks % kPin == 0) __syncwarp();
    uint32_t a[4];
    if (ks < kNope - kQShared) {
      a[0] = q[ks][0];
      a[1] = q[ks][1];
      a[2] = q[ks][2];
      a[3] = q[ks][3];
    } else {
      kdtree::ldmatrix_x4(rope + ((ks - (kNope - kQShared)) % WsConfig::kRopeSteps) * 32, a[0], a[1], a[2], a[3]);
    }
    const uint32_t (&b)[NT / 2][4] = kb[ks % (kAhead + 1)];
    float (&acc)[NT][4] = (ks & 1) ? s1 : s;
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      kdtree::mma_bf16_16816(acc[2 * np], a, b[np][0], b[np][1]);
      kdtree::mma_bf16_16816(acc[2 * np + 1], a, b[np][2], b[np][3]);
    }
  }
#pragma unroll
  for (int f = 0; f < NT; ++f)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[f][e] += s1[f][e];
}

// m44d: ws::pv_tile_mma with the warp asleep for `sleep_ns` (nanosleep) after each of its 8 groups of
// 8 HMMA a tile, so the PV warps leave the tensor pipe to their scheduler's QK warp more often: the
// priority the scheduler does not give the critical warp, bought by throttling the others. sleep_ns 0
// runs the kernel's piece unchanged.
__device__ __forceinline__ void pv_tile_mma_throttled(float (&o)[4][8][4], uint32_t pb, uint32_t tile_base, uint32_t lo_pv,
                                                      int sleep_ns) {
  if (sleep_ns <= 0) {
    kdtree::ws::pv_tile_mma(o, pb, tile_base, lo_pv);
    return;
  }
#pragma unroll
  for (int kk = 0; kk < WsConfig::kBN / 16; ++kk) {
    uint32_t pa[4][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
      kdtree::ldmatrix_x4(pb + mt * 16 * WsConfig::kPRowBytes + kk * 32, pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3]);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t b0, b1, b2, b3;
      kdtree::ldmatrix_x4_trans(tile_base + lo_pv + j * 32 + kk * 16 * kdtree::kSmemRowBytes, b0, b1, b2, b3);
#pragma unroll
      for (int mt = 0; mt < 4; ++mt) {
        kdtree::mma_bf16_16816(o[mt][2 * j], pa[mt], b0, b1);
        kdtree::mma_bf16_16816(o[mt][2 * j + 1], pa[mt], b2, b3);
      }
      __nanosleep(static_cast<unsigned>(sleep_ns));
    }
  }
}

template <int kStages, int kPBufs, int kQkSets = 1>  // kQkSets: 1 the kernel's QK, 2 two accumulator sets (m44c)
__global__ void __launch_bounds__(kThreads, 1) chain_kernel(int tiles, int /*delay*/, float* sink, long long* spans) {
  static_assert(kStages >= 2 && kStages <= kChainMaxStages, "2 or 3 stages");
  static_assert(kPBufs >= 2 && kPBufs <= kChainMaxPBufs, "2 or 3 P buffers");
  const uint32_t base = smem_addr(g_smem);
  const uint32_t p_full = base + kChainBars, p_free = p_full + 24, free_bar = p_full + 48, stamps = base + kChainStamps;
  fill_random(WsLayout::kPBuf + 2 * kPBytes);
  // The third stage and P buffer: copies of the first ones' random bytes.
  for (int off = thread_index_volatile() * 4; off < WsConfig::kTileBytes + kPBytes; off += kThreads * 4)
    *reinterpret_cast<uint32_t*>(g_smem + kChainStage2 + off) =
        *reinterpret_cast<const uint32_t*>(g_smem + (off < WsConfig::kTileBytes ? off : WsLayout::kPBuf + off - WsConfig::kTileBytes));
  if (thread_index_volatile() == 0) {
    for (int b = 0; b < kPBufs; ++b) {
      mbar_init(p_full + 8 * b, WsConfig::kQkWarps);
      mbar_init(p_free + 8 * b, WsConfig::kPvWarps);
    }
    for (int s = 0; s < kStages; ++s) {
      mbar_init(free_bar + 8 * s, WsConfig::kPvWarps);
      *reinterpret_cast<unsigned long long*>(g_smem + kChainStamps + 8 * s) = 0ull;
    }
  }
  __syncthreads();
  const ChainParams cp = c_chain;
  if (thread_index_volatile() >= WsConfig::kQkWarps * 32) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WsConfig::kPvRegs));
    const int lane = thread_index_volatile() & 31, c = (thread_index_volatile() >> 5) - WsConfig::kQkWarps;
    float o[4][8][4];
    zero_o(o);
    const uint32_t lo_pv = kdtree::ws::pv_lane_v(lane, c);
    const uint32_t lane_p = kdtree::ws::pv_lane_p(lane);
    const long long t0 = clock64();
    for (int i = 0; i < tiles; ++i) {
      const int s = i % kStages, b = i % kPBufs;
      mbar_wait(p_full + 8 * b, (i / kPBufs) & 1);
      pv_tile_mma_throttled(o, chain_p(base, b) + lane_p, chain_stage(base, s), lo_pv, cp.pv_sleep_ns);
      __syncwarp();
      if (lane == 0) mbar_arrive(p_free + 8 * b);
      spin(cp.pv_spin);
      __syncwarp();
      if (lane == 0) {
        atomicMax(reinterpret_cast<unsigned long long*>(g_smem + kChainStamps + 8 * s), static_cast<unsigned long long>(clock64()));
        mbar_arrive(free_bar + 8 * s);
      }
    }
    const long long t1 = clock64();
    record(sink, spans, sum_o(o), t1 - t0, tiles);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WsConfig::kQkRegs));
    const int lane = thread_index_volatile() & 31, g = thread_index_volatile() >> 5;
    uint32_t q[WsConfig::kNopeSteps][4], rope, lo_qk;
    qk_warp_setup(base, g, lane, q, rope, lo_qk);
    float acc = 0.f;
    const long long t0 = clock64();
    for (int j = 0; j < tiles; ++j) {
      const int s = j % kStages;
      if (j >= kStages) {
        mbar_wait(free_bar + 8 * s, ((j - kStages) / kStages) & 1);  // PV(j - S) has refilled it
        const long long landed = kdtree::ld_shared_s64(stamps + 8 * s) + cp.landing;  // after the wait: its acquire orders it
        while (clock64() < landed) {
        }
      }
      float sc[WsConfig::kBN / 8][4];
      if (kQkSets == 2)
        qk_tile_mma_2set<1, WsConfig::kQkPin>(chain_stage(base, s), lo_qk, rope, q, sc);
      else
        kdtree::ws::qk_tile_mma<WsConfig::kQkAhead, WsConfig::kQkPin>(chain_stage(base, s), lo_qk, rope, q, sc);
#pragma unroll
      for (int f = 0; f < WsConfig::kBN / 8; ++f) acc += (sc[f][0] + sc[f][1]) + (sc[f][2] + sc[f][3]);
      spin(cp.qk_spin);
      const int b = j % kPBufs;
      if (j >= kPBufs) mbar_wait(p_free + 8 * b, ((j - kPBufs) / kPBufs) & 1);  // P buffer b read by PV(j - P)
      __syncwarp();
      if (lane == 0) mbar_arrive(p_full + 8 * b);
    }
    const long long t1 = clock64();
    record(sink, spans, acc, t1 - t0, tiles);
  }
}

struct Variant {
  const char* name;
  int ahead, pin;
  void (*kernels[4])(int, int, float*, long long*);
};

template <int kAhead, int kPin>
Variant make_variant(const char* name) {
  return {name,
          kAhead,
          kPin,
          {phase_kernel<kQk, kAhead, kPin>, phase_kernel<kPv, kAhead, kPin>, phase_kernel<kBoth, kAhead, kPin>,
           phase_kernel<kCoupled, kAhead, kPin>}};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// What one launch's spans mean: warps [0, qk_warps) are QK warps, the rest PV warps; a CTA tile is
// `qk_per_tile` QK warp-tiles (and `pv_per_tile` PV warp-tiles) of `qk_hmma` (`pv_hmma`) mma each,
// and `work` such CTA tiles make one tile of the kernel's work (1 for the kernel's mix, 2 for a pair).
struct Roles {
  int qk_warps, qk_per_tile, pv_per_tile, qk_hmma, pv_hmma, work;
};
constexpr Roles kKernelRoles{WsConfig::kQkWarps, WsConfig::kQkWarps, WsConfig::kPvWarps, 144, 64, 1};
constexpr Roles kPairRoles{kPairQkWarps, kPairSetWarps, kPairPvWarps, 4 * kPairSteps, 64, 2};

struct Row {
  double qk, pv, ratio, rate;  // cycles a CTA tile (QK, PV), PV tiles a QK tile, HMMA a cycle a scheduler
};

// Warm-up launch, timed launch, medians over CTAs. The rate counts the pipe's real work: each mma
// is KDTREE_PIPE_FACTOR mma in a --pipe-factor build.
Row measure(const char* label, void (*kernel)(int, int, float*, long long*), int smem, int mode, const Roles& roles,
            int sms, int tiles, int delay, float* sink, long long* spans, std::vector<long long>& h) {
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaMemset(spans, 0, sizeof(long long) * h.size()));
  kernel<<<sms, kThreads, smem>>>(tiles, delay, sink, spans);
  CHECK(cudaGetLastError());
  kernel<<<sms, kThreads, smem>>>(tiles, delay, sink, spans);
  CHECK(cudaGetLastError());
  // A tile takes a few thousand cycles: 4,000 tiles are ~10 ms a launch. 30 s means a hang.
  char what[160];
  snprintf(what, sizeof(what), "%s, mode %s, delay %d", label, kModeNames[mode], delay);
  FINISH_OR_EXIT(what, 30.0);
  CHECK(cudaMemcpy(h.data(), spans, sizeof(long long) * h.size(), cudaMemcpyDeviceToHost));
  std::vector<double> qk, pv, ratio, rate;
  for (int b = 0; b < sms; ++b) {
    const long long* s = h.data() + static_cast<size_t>(b) * kWarps * 2;
    double qk_span = 0, qk_wt = 0, pv_span = 0, pv_wt = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < roles.qk_warps) {
        qk_span = std::max(qk_span, static_cast<double>(s[2 * w]));
        qk_wt += static_cast<double>(s[2 * w + 1]);
      } else {
        pv_span = std::max(pv_span, static_cast<double>(s[2 * w]));
        pv_wt += static_cast<double>(s[2 * w + 1]);
      }
    }
    const double qk_tiles = qk_wt / roles.qk_per_tile, pv_tiles = pv_wt / roles.pv_per_tile;
    const double work = KDTREE_PIPE_FACTOR * (roles.qk_hmma * (mode == kPv ? 0.0 : qk_wt) + roles.pv_hmma * (mode == kQk ? 0.0 : pv_wt)) / 4.0;
    if (mode != kPv) qk.push_back(qk_span / qk_tiles);
    if (mode != kQk) pv.push_back(pv_span / pv_tiles);
    if (mode >= kBoth) ratio.push_back(pv_tiles / qk_tiles);
    rate.push_back(work / (mode == kPv ? pv_span : qk_span));
  }
  return {median(qk), median(pv), median(ratio), median(rate)};
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // rows reach the log as they are measured (the driver writes it to a file)
  int tiles = 4000;
  const char* json_path = nullptr;
  for (int a = 1; a < argc; ++a) {
    if (!strcmp(argv[a], "--json") && a + 1 < argc)
      json_path = argv[++a];
    else
      tiles = atoi(argv[a]);
  }
  int dev = 0, sms = 0, major = 0, minor = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, dev));
  if (tiles < 2 || tiles % 2 != 0) {
    fprintf(stderr, "mma_phase: tiles must be even and >= 2 (the PV warps and the pair's QK sets take them in pairs), got %d\n",
            tiles);
    return 2;
  }
  if (major != 9 || minor != 0) {
    fprintf(stderr, "mma_phase: needs compute capability 9.0 (this build is sm_90a), found %d.%d\n", major, minor);
    return 2;
  }
  const Variant variants[] = {make_variant<2, 3>("ahead2-pin3 (shipped)"), make_variant<1, 3>("ahead1-pin3"),
                              make_variant<3, 3>("ahead3-pin3"),
                              make_variant<2, 64>("ahead2-nopin")};
  float* sink = nullptr;
  long long* spans = nullptr;
  CHECK(cudaMalloc(&sink, sizeof(float) * sms * kThreads));
  CHECK(cudaMalloc(&spans, sizeof(long long) * sms * kWarps * 2));
  std::vector<long long> h(static_cast<size_t>(sms) * kWarps * 2);
  // Provenance: bench/device/run.py exports the checkout's commit; the date is the run's (UTC).
  const char* commit = getenv("KDTREE_COMMIT");
  char date[32];
  const time_t now = time(nullptr);
  strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
  std::string json = "{\"date\": \"" + std::string(date) + "\", \"commit\": \"" + std::string(commit ? commit : "unknown") +
                     "\", \"device\": \"" + std::string(prop.name) + "\", \"sms\": " + std::to_string(sms) +
                     ", \"tiles\": " + std::to_string(tiles) + ", \"pipe_factor\": " + std::to_string(KDTREE_PIPE_FACTOR) +
                     ", \"rows\": [";
  printf("%s, %d SMs, %d tiles a CTA, pipe factor %d; cycles a CTA tile (median over CTAs); HMMA/cycle a scheduler over the QK span;\n"
         "work cyc = SM-cycles for one tile of the kernel's work (the kernel's mix: its QK cycles; pair: 2 x its QK cycles)\n",
         prop.name, sms, tiles, KDTREE_PIPE_FACTOR);
  printf("%-24s %-8s %6s %9s %9s %13s %13s %9s\n", "variant", "mode", "delay", "qk cyc", "pv cyc", "pv tiles/qk", "hmma/cyc/sch",
         "work cyc");
  bool first_row = true;
  auto report = [&](const char* layout, const char* name, int ahead, int pin, int mode, int delay, const Roles& roles,
                    const Row& r) {
    const double work = mode == kPv ? r.pv * roles.work : r.qk * roles.work;
    printf("%-24s %-8s %6d %9.0f %9.0f %13.3f %13.4f %9.0f  (%.2f cycles an HMMA)\n", name, kModeNames[mode], delay, r.qk, r.pv,
           r.ratio, r.rate, work, 1.0 / r.rate);
    char row[640];
    snprintf(row, sizeof(row),
             "%s{\"layout\": \"%s\", \"variant\": \"%s\", \"ahead\": %d, \"pin\": %d, \"mode\": \"%s\", \"delay\": %d, "
             "\"qk_cycles_per_tile\": %.1f, \"pv_cycles_per_tile\": %.1f, \"pv_tiles_per_qk_tile\": %.4f, "
             "\"hmma_per_cycle_per_scheduler\": %.5f, \"sm_cycles_per_kernel_tile\": %.1f}",
             first_row ? "" : ", ", layout, name, ahead, pin, kModeNames[mode], delay, r.qk, r.pv, r.ratio, r.rate, work);
    json += row;
    first_row = false;
  };
  // m39: the kernel's mix, four distances, four modes (coupled without a delay, as predicted).
  for (const Variant& v : variants)
    for (int m = 0; m < 4; ++m)
      report("kernel", v.name, v.ahead, v.pin, m, 0,  kKernelRoles,
             measure(v.name, v.kernels[m], kSmemBytes, m, kKernelRoles, sms, tiles, 0, sink, spans, h));
  // m39b: the kernel's mix coupled with its softmax and hand-off's time on the QK chain (~400, m27b),
  // and the pair's mix: alone, free-running, and coupled with nothing, the softmax only, and the
  // exchange and softmax (~1,500, m38) on each QK set's chain.
  report("kernel", variants[0].name, 2, 3, kCoupled, 400, kKernelRoles,
         measure(variants[0].name, variants[0].kernels[kCoupled], kSmemBytes, kCoupled, kKernelRoles, sms, tiles, 400, sink,
                 spans, h));
  void (*const pair[4])(int, int, float*, long long*) = {pair_kernel<kQk>, pair_kernel<kPv>, pair_kernel<kBoth>,
                                                         pair_kernel<kCoupled>};
  for (int m = 0; m < 4; ++m)
    for (int delay : {0, 400, 1500}) {
      if (m != kCoupled && delay != 0) continue;
      report("pair", "pair (18 k-steps, 3 stages)", 2, 3, m, delay, kPairRoles,
             measure("pair", pair[m], kPairSmemBytes, m, kPairRoles, sms, tiles, delay, sink, spans, h));
    }
  // m44: the kernel's mix through S stages with the chain's other links as timed waits.
  // m44b: the P buffers' count too (QK runs up to P - 1 tiles ahead of PV when the stages allow it).
  // m44c: the QK warps with two accumulator sets; m44d: the PV warps throttled by nanosleep.
  struct ChainRow {
    int stages, pbufs, qk_sets, qk_spin, pv_spin, landing, pv_sleep_ns;
  };
  const ChainRow chain_rows[] = {
      {2, 2, 1, 0, 0, 0, 0},       {2, 2, 1, 400, 1260, 1190, 0}, {2, 2, 1, 400, 0, 1190, 0},  {2, 2, 1, 400, 1260, 0, 0},
      {3, 2, 1, 0, 0, 0, 0},       {3, 2, 1, 400, 1260, 1190, 0}, {3, 2, 1, 400, 0, 1190, 0},  {3, 2, 1, 400, 1260, 0, 0},
      {3, 3, 1, 0, 0, 0, 0},       {3, 3, 1, 400, 0, 0, 0},       {3, 3, 1, 400, 1260, 1190, 0}, {3, 3, 1, 400, 0, 1190, 0},
      {2, 3, 1, 400, 1260, 1190, 0},
      // m44c
      {2, 2, 2, 0, 0, 0, 0},       {2, 2, 2, 400, 1260, 1190, 0}, {3, 3, 2, 400, 1260, 1190, 0},
      // m44d
      {2, 2, 1, 400, 1260, 1190, 10}, {2, 2, 1, 400, 1260, 1190, 25}, {2, 2, 1, 400, 1260, 1190, 50},
      {2, 2, 1, 400, 1260, 1190, 100}, {2, 2, 1, 0, 0, 0, 25},        {2, 2, 2, 400, 1260, 1190, 25},
      {3, 3, 2, 400, 1260, 1190, 25}};
  // (m44e's rows, journal p17's QK mix, ran from this file at 87c5472: its variant spilled outside the
  // QK loop and was removed once the rule closed it.)
  void (*const chain[2][2][2])(int, int, float*, long long*) = {
      {{chain_kernel<2, 2, 1>, chain_kernel<2, 2, 2>}, {chain_kernel<2, 3, 1>, chain_kernel<2, 3, 2>}},
      {{chain_kernel<3, 2, 1>, chain_kernel<3, 2, 2>}, {chain_kernel<3, 3, 1>, chain_kernel<3, 3, 2>}}};
  for (const ChainRow& c : chain_rows) {
    const ChainParams cp{c.qk_spin, c.pv_spin, c.landing, c.pv_sleep_ns};
    CHECK(cudaMemcpyToSymbol(c_chain, &cp, sizeof(cp)));
    char name[112];
    snprintf(name, sizeof(name), "chain S%d P%d Q%d qk%d pv%d land%d sleep%d", c.stages, c.pbufs, c.qk_sets, c.qk_spin,
             c.pv_spin, c.landing, c.pv_sleep_ns);
    const Row r = measure(name, chain[c.stages - 2][c.pbufs - 2][c.qk_sets - 1], kChainSmemBytes, kCoupled, kKernelRoles, sms,
                          tiles, 0, sink, spans, h);
    report("chain", name, 2, 3, kCoupled, 0, kKernelRoles, r);
  }
  json += "]}\n";
  if (json_path != nullptr) {
    FILE* f = fopen(json_path, "w");
    if (f == nullptr) {
      fprintf(stderr, "mma_phase: cannot write %s\n", json_path);
      return 1;
    }
    fputs(json.c_str(), f);
    fclose(f);
  }
  CHECK(cudaFree(sink));
  CHECK(cudaFree(spans));
  return 0;
}
