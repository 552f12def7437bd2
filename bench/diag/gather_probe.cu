// Diagnostic (H100/H200, sm_90a), not part of the library: how fast can one SM gather SGLang's
// page-size-1 K rows (1,152 bytes each, scattered by slot id) into the 128-byte-swizzled layout
// wgmma reads? It answers the question docs/kernel/hopper.md "Limits" ends on: the HBM-bound
// tiles wait on a gather that goes through the LSU (cp.async), and the alternative, per-row TMA
// boxes (576 a 64-key tile), has an unknown rate. Three producers, same consumer, same data:
//   cpasync  128 threads, 36 x 16-byte cp.async each a tile: the Hopper kernel's gather;
//   tma32    one warp issues the 576 boxes of a tile (18 a lane), 64 columns x 1 row each;
//   tma64    two warps, one key per thread, 9 boxes each.
// Every CTA (one per SM) streams `tiles` 64-key tiles through two 72 KB stages; the consumer
// warpgroup only waits for a stage and frees it (no math), so the time is the gather's own. Slots:
// "hbm" = random over 1M slots (1.2 GB, every row from HBM), "l2" = random over 8K slots (9.4 MB).
// The last tile of every CTA is copied out and checked byte for byte against the cache through the
// kernel's swizzle (row r of an atom at r*128 B, 16-byte chunk c at (c ^ (r & 7)) * 16): this is
// also the check that a one-row TMA box lands swizzled by its shared-memory address.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/diag/gather_probe.cu -o /tmp/gather_probe
//   /tmp/gather_probe [tiles=256] [--json PATH]
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

// The kernel's own barrier, copy and swizzle helpers, so the probe moves bytes exactly as it does.
#include "../../kdtree_backend/kernel/csrc/common/ptx.cuh"
#include "../../kdtree_backend/kernel/csrc/hopper/async_copy.cuh"
#include "../../kdtree_backend/kernel/csrc/hopper/wgmma.cuh"
#include "cuda_check.cuh"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using kdtree::cp_async_16;
using kdtree::cp_async_mbar_arrive;
using kdtree::fence_mbarrier_init;
using kdtree::mbar_arrive;
using kdtree::mbar_arrive_expect_tx;
using kdtree::mbar_init;
using kdtree::mbar_wait;
using kdtree::hopper::swizzled;

constexpr int kKeys = 64, kAtoms = 9, kRowBytes = 1152, kAtomBytes = 8192, kStageBytes = kAtoms * kAtomBytes;
constexpr int kStages = 2, kThreads = 256;
constexpr int kSmemBytes = kStages * kStageBytes + 1024 + 64;  // stages, alignment slack, 4 mbarriers

enum Mode { kCpAsync = 0, kTma32 = 1, kTma64 = 2 };
const char* const kModeNames[] = {"cpasync", "tma32", "tma64"};

__device__ __forceinline__ void tma_row(uint32_t dst, const CUtensorMap* map, uint32_t bar, int col, int slot) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(slot), "r"(bar)
      : "memory");
}

template <int kMode>
__global__ void __launch_bounds__(kThreads, 1)
    gather_kernel(const __nv_bfloat16* cache, const int64_t* slots, int tiles, uint8_t* last_tile,
                  const __grid_constant__ CUtensorMap map) {
  extern __shared__ uint8_t raw[];
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  const uint32_t sK = kdtree::smem_addr(base);
  const uint32_t bar_full = kdtree::smem_addr(base + kStages * kStageBytes);  // + 8 * stage
  const uint32_t bar_empty = bar_full + 16;                          // + 8 * stage
  const int tid = threadIdx.x, wg = tid >> 7, j = tid & 127;
  const int64_t* my_slots = slots + static_cast<int64_t>(blockIdx.x) * tiles * kKeys;
  // cp.async: 128 producer threads arrive (noinc); TMA: one expect_tx arrival per issuing thread.
  constexpr int kIssuers = kMode == kCpAsync ? 128 : (kMode == kTma32 ? 32 : 64);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_full + 8 * s, kIssuers);
      mbar_init(bar_empty + 8 * s, 128);
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  // This thread's keys of a tile (cp.async: (j >> 3) + 16u, u < 4; TMA: j + kIssuers * k).
  constexpr int kMyKeys = kMode == kCpAsync ? 4 : kKeys / kIssuers;
  auto my_key = [&](int k) { return kMode == kCpAsync ? (j >> 3) + 16 * k : j + kIssuers * k; };
  // Slot ids are loaded a tile ahead, as the Hopper kernel does, so issuing never waits on them.
  auto fetch = [&](int t, int64_t (&sl)[4]) {
#pragma unroll
    for (int k = 0; k < kMyKeys; ++k)
      sl[k] = t < tiles && (kMode == kCpAsync || j < kIssuers) ? my_slots[static_cast<int64_t>(t) * kKeys + my_key(k)] : 0;
  };
  auto issue = [&](int t, const int64_t (&sl)[4]) {
    const int s = t & 1;
    const uint32_t stage = sK + s * kStageBytes, full = bar_full + 8 * s;
    if (kMode == kCpAsync) {
      const int chunk = j & 7;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const __nv_bfloat16* src = cache + sl[k] * (kRowBytes / 2) + chunk * 8;
        const uint32_t dst = stage + swizzled(my_key(k), chunk);
#pragma unroll
        for (int a = 0; a < kAtoms; ++a) cp_async_16(dst + a * kAtomBytes, src + a * 64, true);
      }
      cp_async_mbar_arrive(full);
    } else if (j < kIssuers) {
      mbar_arrive_expect_tx(full, kMyKeys * kRowBytes);
#pragma unroll
      for (int k = 0; k < kMyKeys; ++k)
#pragma unroll
        for (int a = 0; a < kAtoms; ++a)
          tma_row(stage + a * kAtomBytes + my_key(k) * 128, &map, full, a * 64, static_cast<int>(sl[k]));
    }
  };

  if (wg == 1) {  // producer
    int64_t sl[4], next[4];
    fetch(0, sl);
    fetch(1, next);
    issue(0, sl);
    for (int t = 1; t < tiles; ++t) {
#pragma unroll
      for (int k = 0; k < 4; ++k) sl[k] = next[k];
      fetch(t + 1, next);
      if (t >= 2) mbar_wait(bar_empty + 8 * (t & 1), ((t >> 1) - 1) & 1);  // use t-2 of this stage is done
      issue(t, sl);
    }
  } else {  // consumer: wait for the stage, free it (the last one is kept for the check)
    for (int t = 0; t < tiles; ++t) {
      mbar_wait(bar_full + 8 * (t & 1), (t >> 1) & 1);
      if (t + 2 < tiles) mbar_arrive(bar_empty + 8 * (t & 1));
    }
    const uint8_t* last = base + ((tiles - 1) & 1) * kStageBytes;
    uint8_t* out = last_tile + static_cast<int64_t>(blockIdx.x) * kStageBytes;
    for (int i = tid * 16; i < kStageBytes; i += 128 * 16)
      *reinterpret_cast<uint4*>(out + i) = *reinterpret_cast<const uint4*>(last + i);
  }
}

template <int kMode>
float run_mode(const __nv_bfloat16* cache, const int64_t* slots, int ctas, int tiles, uint8_t* last,
               const CUtensorMap& map) {
  CHECK(cudaFuncSetAttribute(gather_kernel<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  gather_kernel<kMode><<<ctas, kThreads, kSmemBytes>>>(cache, slots, tiles, last, map);  // warm-up
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK(cudaEventRecord(a));
    gather_kernel<kMode><<<ctas, kThreads, kSmemBytes>>>(cache, slots, tiles, last, map);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    best = ms < best ? ms : best;
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return best;
}

// The last tile of every CTA against the cache, through the swizzle.
long long mismatches(const std::vector<uint16_t>& cache, const std::vector<int64_t>& slots,
                     const std::vector<uint8_t>& last, int ctas, int tiles) {
  long long bad = 0;
  for (int c = 0; c < ctas; ++c) {
    const int64_t* ts = slots.data() + (static_cast<int64_t>(c) * tiles + tiles - 1) * kKeys;
    const uint8_t* got = last.data() + static_cast<int64_t>(c) * kStageBytes;
    for (int key = 0; key < kKeys; ++key)
      for (int a = 0; a < kAtoms; ++a)
        for (int chunk = 0; chunk < 8; ++chunk) {
          const uint8_t* want = reinterpret_cast<const uint8_t*>(cache.data() + ts[key] * (kRowBytes / 2)) +
                                a * 128 + chunk * 16;
          const uint8_t* have = got + a * kAtomBytes + key * 128 + (((chunk ^ (key & 7)) & 7) << 4);
          bad += memcmp(want, have, 16) != 0;
        }
  }
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  int tiles = 256;
  const char* json = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--json") && i + 1 < argc) {
      json = argv[++i];
    } else {
      tiles = atoi(argv[i]);
    }
  }
  if (tiles < 3) {
    fprintf(stderr, "usage: gather_probe [tiles >= 3] [--json PATH]\n");
    return 2;
  }
  int dev = 0, sms = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));
  if (prop.major != 9) {
    fprintf(stderr, "gather_probe needs an sm_90 GPU (TMA + this binary's sm_90a image); this is %s (%d.%d)\n",
            prop.name, prop.major, prop.minor);
    return 2;
  }
  const int64_t kSlots = 1 << 20;
  std::mt19937_64 rng(7);
  std::vector<uint16_t> h_cache(static_cast<size_t>(kSlots) * (kRowBytes / 2));
  for (auto& x : h_cache) x = static_cast<uint16_t>(rng());
  __nv_bfloat16* d_cache = nullptr;
  CHECK(cudaMalloc(&d_cache, h_cache.size() * 2));
  CHECK(cudaMemcpy(d_cache, h_cache.data(), h_cache.size() * 2, cudaMemcpyHostToDevice));

  PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  cudaDriverEntryPointQueryResult q;
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                         cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess || !encode) {
    fprintf(stderr, "cuTensorMapEncodeTiled not found in the driver\n");
    return 1;
  }
  CUtensorMap map;
  const cuuint64_t dims[2] = {576, static_cast<cuuint64_t>(kSlots)};
  const cuuint64_t strides[1] = {kRowBytes};
  const cuuint32_t box[2] = {64, 1}, elem[2] = {1, 1};
  if (encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, d_cache, dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) !=
      CUDA_SUCCESS) {
    fprintf(stderr, "cuTensorMapEncodeTiled refused the cache map\n");
    return 1;
  }

  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  const int ctas = sms;
  uint8_t* d_last = nullptr;
  CHECK(cudaMalloc(&d_last, static_cast<size_t>(ctas) * kStageBytes));
  int64_t* d_slots = nullptr;
  const size_t n_slots = static_cast<size_t>(ctas) * tiles * kKeys;
  CHECK(cudaMalloc(&d_slots, n_slots * 8));
  std::vector<int64_t> h_slots(n_slots);
  std::vector<uint8_t> h_last(static_cast<size_t>(ctas) * kStageBytes);

  std::string rows;
  bool all_ok = true;
  const struct { const char* name; int64_t range; } patterns[] = {{"hbm", kSlots}, {"l2", 8192}};
  printf("%d CTAs (one per SM), %d tiles of 64 keys x 1,152 B each\n", ctas, tiles);
  for (const auto& pat : patterns) {
    for (auto& s : h_slots) s = static_cast<int64_t>(rng() % static_cast<uint64_t>(pat.range));
    CHECK(cudaMemcpy(d_slots, h_slots.data(), n_slots * 8, cudaMemcpyHostToDevice));
    for (int mode = 0; mode < 3; ++mode) {
      CHECK(cudaMemset(d_last, 0, h_last.size()));
      const float ms = mode == kCpAsync ? run_mode<kCpAsync>(d_cache, d_slots, ctas, tiles, d_last, map)
                       : mode == kTma32 ? run_mode<kTma32>(d_cache, d_slots, ctas, tiles, d_last, map)
                                        : run_mode<kTma64>(d_cache, d_slots, ctas, tiles, d_last, map);
      CHECK(cudaMemcpy(h_last.data(), d_last, h_last.size(), cudaMemcpyDeviceToHost));
      const long long bad = mismatches(h_cache, h_slots, h_last, ctas, tiles);
      all_ok = all_ok && bad == 0;
      const double us_tile = ms * 1e3 / tiles;
      const double tbps = static_cast<double>(ctas) * tiles * kStageBytes / (ms * 1e-3) / 1e12;
      const double cycles = us_tile * clock_khz * 1e-3;  // at the maximum SM clock
      printf("%-4s %-8s %8.3f ms  %6.3f us/tile  ~%5.0f cycles/tile  %5.2f TB/s into smem  %s\n", pat.name,
             kModeNames[mode], ms, us_tile, cycles, tbps, bad ? "WRONG LAYOUT" : "layout ok");
      char buf[320];
      snprintf(buf, sizeof(buf),
               "%s{\"slots\": \"%s\", \"producer\": \"%s\", \"ms\": %.4f, \"us_per_tile\": %.4f, \"tbps_into_smem\": %.4f, "
               "\"mismatched_chunks\": %lld}",
               rows.empty() ? "" : ", ", pat.name, kModeNames[mode], ms, us_tile, tbps, bad);
      rows += buf;
    }
  }
  if (json) {
    FILE* f = fopen(json, "w");
    if (!f) {
      fprintf(stderr, "cannot write %s\n", json);
      return 1;
    }
    fprintf(f, "{\"gpu\": \"%s\", \"sms\": %d, \"tiles_per_cta\": %d, \"rows\": [%s]}\n", prop.name, sms, tiles,
            rows.c_str());
    fclose(f);
  }
  cudaFree(d_cache);
  cudaFree(d_slots);
  cudaFree(d_last);
  return all_ok ? 0 : 3;
}
