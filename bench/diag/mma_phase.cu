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
// every kPin k-steps; the kernel ships 2 / 3).
//
// Reported per variant and mode (median over CTAs): QK cycles a tile (its warps' clock64 span over
// the tiles), PV cycles a tile, PV tiles done per QK tile, and the tensor pipe's work a scheduler as
// HMMA per cycle over the QK span (both / coupled) against the registers-only rate of one m16n8k16
// every ~6.3 cycles a scheduler (bench/diag/mma_issue.cu, journal m13). The kernel at F = 1 runs a
// 32-key tile in ~3,256 cycles, its QK mma phase ~2,242 (m27b; B32 H8 n64 L8k).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v bench/diag/mma_phase.cu -o /tmp/mma_phase
//   /tmp/mma_phase [tiles=4000] [--json PATH]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

// The kernel's own mma phases, lane offsets, layout and barrier helpers.
#include "../../kdtree_backend/kernel/csrc/portable/kernel_ws.cuh"
#include "cuda_check.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

using kdtree::g_smem;
using kdtree::ld_shared_s32;
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

// spans[cta][warp] = {clock64 span, tiles}; sink keeps every accumulator live.
template <int kMode, int kAhead, int kPin>
__global__ void __launch_bounds__(kThreads, 1) phase_kernel(int tiles, float* sink, long long* spans) {
  const uint32_t base = smem_addr(g_smem);
  const int tid = threadIdx.x;
  // Fixed random bf16 in [-0.5, 0.5) over the stages, q_rope and the P buffers (the layout's front).
  for (int off = tid * 4; off < WsLayout::kPBuf + 2 * kPBytes; off += kThreads * 4) {
    uint32_t h = static_cast<uint32_t>(off) * 2654435761u + blockIdx.x * 40503u;
    h ^= h >> 15;
    const float lo = static_cast<float>(h & 0xff) / 256.f - 0.5f, hi = static_cast<float>((h >> 8) & 0xff) / 256.f - 0.5f;
    *reinterpret_cast<__nv_bfloat162*>(g_smem + off) = __floats2bfloat162_rn(lo, hi);
  }
  if (tid == 0) {
    *reinterpret_cast<uint32_t*>(g_smem + kDone) = 0u;
    for (int s = 0; s < 2; ++s) {
      mbar_init(base + kBars + 8 * s, WsConfig::kQkWarps);      // P full of parity s
      mbar_init(base + kBars + 16 + 8 * s, WsConfig::kPvWarps);  // K free of parity s
    }
  }
  __syncthreads();
  // Where a warp's results go, computed after its loop (by value: a reference to a kernel parameter
  // puts it in local memory).
  auto record = [sink, spans](float acc, long long cycles, int done) {
    const int t = thread_index_volatile();
    sink[static_cast<long long>(blockIdx.x) * kThreads + t] = acc;
    if ((t & 31) == 0) {
      long long* span = spans + (static_cast<long long>(blockIdx.x) * kWarps + (t >> 5)) * 2;
      span[0] = cycles;
      span[1] = done;
    }
  };

  if (tid >= WsConfig::kQkWarps * 32) {  // PV warps first, as the kernel (p34)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WsConfig::kPvRegs));
    if (kMode == kQk) return;
    const int lane = thread_index_volatile() & 31, c = (thread_index_volatile() >> 5) - WsConfig::kQkWarps;
    float o[4][8][4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int f = 0; f < 8; ++f) o[mt][f][0] = o[mt][f][1] = o[mt][f][2] = o[mt][f][3] = 0.f;
    const uint32_t lo_pv = kdtree::ws::pv_lane_v(lane, c);
    // Tiles in pairs (stage and P buffer 0, then 1: compile-time offsets; with a run-time parity the
    // role's 160 registers spilled in the free-running mode).
    const uint32_t pv_p = base + WsLayout::kPBuf + kdtree::ws::pv_lane_p(lane);
    int i = 0;
    const long long t0 = clock64();
    for (;; i += 2) {
      if (kMode == kBoth ? ld_shared_s32(base + kDone) == WsConfig::kQkWarps : i == tiles) break;
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
    float acc = 0.f;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int f = 0; f < 8; ++f) acc += o[mt][f][0] + o[mt][f][1] + o[mt][f][2] + o[mt][f][3];
    record(acc, t1 - t0, i);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WsConfig::kQkRegs));
    if (kMode == kPv) return;
    const int lane = thread_index_volatile() & 31, g = thread_index_volatile() >> 5;
    uint32_t q[WsConfig::kNopeSteps][4];
    kdtree::ws::load_q_nope(base, g, lane, q);
    const uint32_t rope = kdtree::ws::qk_lane_rope(base, g, lane);
    const uint32_t lo_qk = kdtree::ws::qk_lane_k(lane);
    float acc = 0.f;
    const long long t0 = clock64();
    for (int i = 0; i < tiles; ++i) {
      if (kMode == kCoupled && i >= 2) mbar_wait(base + kBars + 16 + 8 * (i & 1), ((i - 2) >> 1) & 1);  // PV(i - 2) done
      float s[WsConfig::kBN / 8][4];
      kdtree::ws::qk_tile_mma<kAhead, kPin>(base + (i & 1) * WsConfig::kTileBytes, lo_qk, rope, q, s);
#pragma unroll
      for (int f = 0; f < WsConfig::kBN / 8; ++f) acc += (s[f][0] + s[f][1]) + (s[f][2] + s[f][3]);
      if (kMode == kCoupled) {
        __syncwarp();
        if (lane == 0) mbar_arrive(base + kBars + 8 * (i & 1));  // P(i) "full"
      }
    }
    const long long t1 = clock64();
    if (kMode == kBoth) {
      __syncwarp();
      if (lane == 0) atomicAdd(reinterpret_cast<unsigned*>(g_smem + kDone), 1u);
    }
    record(acc, t1 - t0, tiles);
  }
}

struct Variant {
  const char* name;
  int ahead, pin;
  void (*kernels[4])(int, float*, long long*);
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

}  // namespace

int main(int argc, char** argv) {
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
    fprintf(stderr, "mma_phase: tiles must be even and >= 2 (the PV warps run them in pairs), got %d\n", tiles);
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
  std::string json = "{\"device\": \"" + std::string(prop.name) + "\", \"sms\": " + std::to_string(sms) +
                     ", \"tiles\": " + std::to_string(tiles) + ", \"rows\": [";
  printf("%s, %d SMs, %d tiles a CTA; cycles a 32-key tile (median over CTAs); HMMA/cycle a scheduler over the QK span\n",
         prop.name, sms, tiles);
  printf("%-24s %-8s %9s %9s %13s %13s\n", "variant", "mode", "qk cyc", "pv cyc", "pv tiles/qk", "hmma/cyc/sch");
  bool first_row = true;
  for (const Variant& v : variants) {
    for (int m = 0; m < 4; ++m) {
      CHECK(cudaFuncSetAttribute(v.kernels[m], cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
      CHECK(cudaMemset(spans, 0, sizeof(long long) * sms * kWarps * 2));
      v.kernels[m]<<<sms, kThreads, kSmemBytes>>>(tiles, sink, spans);  // warm-up, then the timed launch
      CHECK(cudaGetLastError());
      v.kernels[m]<<<sms, kThreads, kSmemBytes>>>(tiles, sink, spans);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaMemcpy(h.data(), spans, sizeof(long long) * h.size(), cudaMemcpyDeviceToHost));
      std::vector<double> qk, pv, ratio, rate;
      for (int b = 0; b < sms; ++b) {
        const long long* s = h.data() + static_cast<size_t>(b) * kWarps * 2;
        double qk_span = 0, qk_tiles = 0, pv_span = 0, pv_tiles = 0;
        for (int w = 0; w < WsConfig::kQkWarps; ++w) {
          qk_span = std::max(qk_span, static_cast<double>(s[2 * w]));
          qk_tiles += static_cast<double>(s[2 * w + 1]);
        }
        for (int w = WsConfig::kQkWarps; w < kWarps; ++w) {
          pv_span = std::max(pv_span, static_cast<double>(s[2 * w]));
          pv_tiles += static_cast<double>(s[2 * w + 1]);
        }
        qk_tiles /= WsConfig::kQkWarps;
        pv_tiles /= WsConfig::kPvWarps;
        if (m != kPv) qk.push_back(qk_span / qk_tiles);
        if (m != kQk) pv.push_back(pv_span / pv_tiles);
        if (m >= kBoth) {
          ratio.push_back(pv_tiles / qk_tiles);
          // a scheduler's work over the QK span: one QK warp's 144 mma a tile, two PV warps' 64
          rate.push_back((144.0 * qk_tiles + 2 * 64.0 * pv_tiles) / qk_span);
        } else if (m == kQk) {
          rate.push_back(144.0 * qk_tiles / qk_span);
        } else {
          rate.push_back(2 * 64.0 * pv_tiles / pv_span);
        }
      }
      const double q = median(qk), p = median(pv), r = median(ratio), hr = median(rate);
      printf("%-24s %-8s %9.0f %9.0f %13.3f %13.4f  (%.2f cycles an HMMA)\n", v.name, kModeNames[m], q, p, r, hr, 1.0 / hr);
      char row[512];
      snprintf(row, sizeof(row),
               "%s{\"variant\": \"%s\", \"ahead\": %d, \"pin\": %d, \"mode\": \"%s\", \"qk_cycles_per_tile\": %.1f, "
               "\"pv_cycles_per_tile\": %.1f, \"pv_tiles_per_qk_tile\": %.4f, \"hmma_per_cycle_per_scheduler\": %.5f}",
               first_row ? "" : ", ", v.name, v.ahead, v.pin, kModeNames[m], q, p, r, hr);
      json += row;
      first_row = false;
    }
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
