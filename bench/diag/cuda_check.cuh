// The standalone device diagnostics' error check (gather_probe.cu, dsmem_exchange.cu, mma_phase.cu):
// a failed CUDA runtime call prints the file, line, call and error, and exits 1. FINISH_OR_EXIT waits
// for the device like cudaDeviceSynchronize, but a kernel that has not finished after `seconds` is
// named on stderr and the process exits 3: a hung probe kernel (a wait that is never satisfied) ends
// with its name, not as a driver timeout with an empty log.
#pragma once
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#define CHECK(x)                                                                                 \
  do {                                                                                           \
    cudaError_t e_ = (x);                                                                        \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));  \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

inline void finish_or_exit(const char* what, double seconds, const char* file, int line) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(nullptr);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      std::fprintf(stderr, "%s:%d: %s: %s\n", file, line, what, cudaGetErrorString(e));
      std::exit(1);
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > seconds) {
      std::fprintf(stderr, "%s:%d: %s: not finished after %.0f s (a hang: a wait nothing satisfies); exiting\n", file, line,
                   what, seconds);
      std::fflush(stderr);
      std::exit(3);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}
#define FINISH_OR_EXIT(what, seconds) finish_or_exit((what), (seconds), __FILE__, __LINE__)
