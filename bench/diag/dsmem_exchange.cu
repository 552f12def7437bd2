// What does a partial-score exchange between the two CTAs of a cluster cost a tile? (issue 25, m38)
//
// The split design under study (journal m38): the two CTAs of a 2-CTA cluster work on the same 64
// query rows, each on half of QK^T's depth and half of PV's output columns, so each holds half of Q
// and half of O in registers (what frees the registers for a second QK issuer a scheduler). Each
// tile, each QK warp sends its 16 x 32 fp32 partial scores (2 KB) to its partner warp in the peer CTA
// and adds the partner's partial to its own before the softmax. This probe runs that hand-off and
// nothing else, so its cost can be read before the kernel is built:
//   - 4 warps a CTA (the QK warps), each with a partner warp (same index) in the peer CTA;
//   - tile i: the warp waits until its slot (parity i & 1) in the peer is free (the peer's remote
//     arrive, i >= 2), writes its 2 KB there by st.async (16-byte stores that complete_tx on the peer's
//     "full" mbarrier), waits for its own "full" barrier (the partner's 2 KB), reads and adds them,
//     frees the slot with a remote mbarrier arrive, then spins `delay` cycles (the softmax, PV and next
//     QK^T it would overlap);
//   - cycles a tile = the warp's clock64 span / tiles; with delay 0 that is the round trip itself,
//     with delay D the exchange's cost beyond D (what it would add to a tile's chain).
// Every value read is checked (errors counted), so a wrong protocol fails loudly.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a bench/diag/dsmem_exchange.cu -o /tmp/dx && /tmp/dx [tiles]
// (sm_120a builds the same source: -arch=sm_120a.)
#include <cuda_runtime.h>

// The kernels' own shared-address and mbarrier helpers (init, expect_tx arrival, the CTA-scope wait),
// so the probe synchronises as a kernel built on them would; only the cluster pieces are new here.
#include "../../kdtree_backend/kernel/csrc/common/mbarrier.cuh"
#include "../../kdtree_backend/kernel/csrc/common/ptx.cuh"
#include "cuda_check.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

using kdtree::mbar_arrive_expect_tx;
using kdtree::mbar_init;
using kdtree::smem_addr;

constexpr int kWarps = 4;
constexpr int kSlotBytes = 2048;  // 16 rows x 32 keys x fp32

struct __align__(16) Smem {
  float recv[2][kWarps][kSlotBytes / 4];  // what the partner wrote, by tile parity
  uint64_t full[2][kWarps];               // completes when the partner's 2 KB landed (tx) + our arrive
  uint64_t empty[2][kWarps];              // completes when the partner freed our slot in its CTA
};

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ uint32_t mapa(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// kClusterScope: the waits acquire and the remote arrive releases at cluster scope (ptxas: CCTL.IVALL
// after each wait, MEMBAR.ALL.GPU + CGAERRBAR before each arrive); otherwise the instructions' default
// (CTA-scope) semantics, as CUTLASS's ClusterBarrier uses them for TMA-multicast pipelines: the bytes
// are ordered by the mbarrier's complete_tx, the slot's reuse by the arrive.
template <bool kClusterScope>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (!kClusterScope) {
    kdtree::mbar_wait(bar, parity);
    return;
  }
  asm volatile(
      "{\n.reg .pred p;\nW: mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
template <bool kClusterScope>
__device__ __forceinline__ void mbar_arrive_remote(uint32_t remote_bar) {
  if (kClusterScope)
    asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(remote_bar) : "memory");
  else
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote_bar) : "memory");
}
__device__ __forceinline__ void st_async_v4(uint32_t remote, uint32_t remote_bar, float a, float b, float c, float d) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(remote),
               "f"(a), "f"(b), "f"(c), "f"(d), "r"(remote_bar)
               : "memory");
}

template <bool kClusterScope>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kWarps * 32, 1)
    exchange(int tiles, int delay, int* errors, long long* cycles, float* sink) {
  __shared__ Smem sm;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const uint32_t me = cluster_rank(), peer = me ^ 1u;
  if (threadIdx.x == 0) {
    for (int p = 0; p < 2; ++p)
      for (int k = 0; k < kWarps; ++k) {
        mbar_init(smem_addr(&sm.full[p][k]), 1);   // our lane 0's arrive.expect_tx; the bytes complete it
        mbar_init(smem_addr(&sm.empty[p][k]), 1);  // the partner's lane 0, remotely
      }
    kdtree::fence_mbarrier_init();
  }
  cluster_sync();  // both CTAs' barriers exist before anything remote touches them

  float acc = 0.f;
  const long long t0 = clock64();
  for (int i = 0; i < tiles; ++i) {
    const int p = i & 1;
    const uint32_t ph = (i >> 1) & 1;
    // The partial this warp computed (16 values a lane); distinct per tile, CTA, warp and lane.
    float v[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) v[e] = static_cast<float>(((i * 7 + e) & 1023) + 1024 * (me * 4 + w)) + lane * 0.25f;
    if (lane == 0) mbar_arrive_expect_tx(smem_addr(&sm.full[p][w]), kSlotBytes);
    if (i >= 2) mbar_wait<kClusterScope>(smem_addr(&sm.empty[p][w]), ((i >> 1) - 1) & 1);  // the partner freed slot p
    const uint32_t dst = mapa(smem_addr(&sm.recv[p][w][lane * 16]), peer);
    const uint32_t dst_bar = mapa(smem_addr(&sm.full[p][w]), peer);
#pragma unroll
    for (int q = 0; q < 4; ++q) st_async_v4(dst + q * 16, dst_bar, v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
    mbar_wait<kClusterScope>(smem_addr(&sm.full[p][w]), ph);  // the partner's 2 KB landed
    const float4* r = reinterpret_cast<const float4*>(&sm.recv[p][w][lane * 16]);
    int bad = 0;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float4 x = r[q];
      const float xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int k = 4 * q + e;
        const float want = static_cast<float>(((i * 7 + k) & 1023) + 1024 * (peer * 4 + w)) + lane * 0.25f;
        bad += xs[e] != want;
        acc += xs[e] + v[k];
      }
    }
    if (bad) atomicAdd(errors, bad);
    __syncwarp();
    if (lane == 0) mbar_arrive_remote<kClusterScope>(mapa(smem_addr(&sm.empty[p][w]), peer));  // our slot p is free again
    if (delay > 0) {
      const long long s = clock64();
      while (clock64() - s < delay) {
      }
    }
  }
  const long long t1 = clock64();
  cluster_sync();  // no CTA leaves while its partner may still write into it
  if (lane == 0) cycles[(blockIdx.x * kWarps + w)] = t1 - t0;
  if (acc == 12345.f) sink[0] = acc;
}

int main(int argc, char** argv) {
  const int tiles = argc > 1 ? std::atoi(argv[1]) : 2000;
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  const int blocks = sms - (sms & 1);  // one CTA an SM, in clusters of 2
  int *errors;
  long long* cycles;
  float* sink;
  CHECK(cudaMalloc(&errors, sizeof(int)));
  CHECK(cudaMalloc(&cycles, sizeof(long long) * blocks * kWarps));
  CHECK(cudaMalloc(&sink, sizeof(float)));
  std::printf("dsmem_exchange: %s (sm_%d%d), %d CTAs in clusters of 2, %d warps a CTA, %d B a warp a tile, %d tiles\n",
              prop.name, prop.major, prop.minor, blocks, kWarps, kSlotBytes, tiles);
  int total_errors = 0;
  for (int scope = 0; scope < 2; ++scope)
  for (int delay : {0, 500, 1000, 2000, 4000}) {
    CHECK(cudaMemset(errors, 0, sizeof(int)));
    if (scope) exchange<true><<<blocks, kWarps * 32>>>(tiles, delay, errors, cycles, sink);
    else exchange<false><<<blocks, kWarps * 32>>>(tiles, delay, errors, cycles, sink);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<long long> c(blocks * kWarps);
    int err = 0;
    CHECK(cudaMemcpy(c.data(), cycles, sizeof(long long) * c.size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(&err, errors, sizeof(int), cudaMemcpyDeviceToHost));
    std::sort(c.begin(), c.end());
    const double med = static_cast<double>(c[c.size() / 2]) / tiles, mx = static_cast<double>(c.back()) / tiles;
    std::printf("%s scope, delay %5d cycles: %8.1f cycles a tile (median warp), %8.1f (slowest); exchange beyond the delay %7.1f; errors %d\n",
                scope ? "cluster" : "cta", delay, med, mx, med - delay, err);
    total_errors += err;
  }
  std::printf("RESULT %s\n", total_errors == 0 ? "PASS" : "FAIL");
  return total_errors == 0 ? 0 : 2;
}
