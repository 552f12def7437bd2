// mbarriers (sm_90 and later: the Hopper kernel, and the portable kernel's tile pipeline on sm_90,
// sm_100 and sm_120): init and invalidation, arrivals (plain, with bytes the copy engine will complete,
// after a thread's cp.async), the parity wait, and the 1-D bulk copy global -> shared that completes
// bytes on one.
#pragma once
#include <stdint.h>

namespace kdtree {

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Ends an mbarrier whose phases are all complete, before its word is initialised again (the next
// segment of a part, common/schedule.cuh): the PTX ISA requires it before the memory is reused.
__device__ __forceinline__ void mbar_inval(uint32_t bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
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
// Arms the barrier's phase with `bytes` more to expect from the copy engine and arrives.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One contiguous run global -> shared by the copy engine (16-byte aligned, a multiple of 16 bytes),
// its bytes completed on `bar` (armed before with mbar_arrive_expect_tx). The CTA-local destination
// form (PTX 8.6+): with the shared::cluster one, sm_120a's ptxas treats the copy as an extern call and
// drops the portable kernel's setmaxnreg (C7506; journal p24).
__device__ __forceinline__ void bulk_copy_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

}  // namespace kdtree
