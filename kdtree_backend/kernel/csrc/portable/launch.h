// The portable (mma.sync) configuration's host entry points. Two tilings of one kernel design share
// its plan (64-row tiles, 32-key tiles, the same split rule) and its split combine:
//   * tiled (portable/launch.cu, kernel.cuh): 8 warps, each with its rows' S and a slice of O; built
//     for every arch the library ships (sm_90, sm_100, sm_120 SASS + the newest arch's PTX), so it runs
//     on every GPU the library supports, including ones only the PTX covers;
//   * warp-specialised (portable/launch_ws.cu, kernel_ws.cuh; p16): 4 QK warps and 8 PV warps with
//     setmaxnreg, which exists only on the arch-specific targets (sm_90a, sm_100a, sm_120a: compute
//     capability exactly 9.0, 10.0, 12.0, the RTX PRO 6000 included). That translation unit is built for
//     those targets only, with no PTX.
// KDTREE_CONFIG_PORTABLE runs the warp-specialised kernel on a device it has an image for (and enough
// shared memory), the tiled kernel elsewhere; KDTREE_CONFIG_PORTABLE_TILED always runs the tiled one.
#pragma once
#include <cuda_runtime.h>
#include <stddef.h>

#include "../kdtree_api.h"

namespace kdtree {
namespace portable {

constexpr int kRowsPerTile = 64;
// Each returns a KdtreeStatus; on failure `err` / `msg` holds the reason.
// `tiled_only`: KDTREE_CONFIG_PORTABLE_TILED (never the warp-specialised kernel).
int launch(const KdtreeVerifyParams& p, bool tiled_only, cudaStream_t stream, char* err, size_t err_len);
// Both tilings on `device`: fails only when the tiled kernel cannot run there; the message names the
// tiling KDTREE_CONFIG_PORTABLE runs.
int probe(int device, char* msg, size_t msg_len);
// The split combine after a launch of `row_tiles` row tiles and `extra` remainder CTAs (both tilings'
// launches use it; implemented with the tiled kernel, in portable/launch.cu).
int combine(const KdtreeVerifyParams& p, int row_tiles, int extra, cudaStream_t stream, char* err, size_t err_len,
            bool pdl = false);

namespace ws {
// portable/launch_ws.cu. Whether the warp-specialised kernel can run on `device`: an image for its
// compute capability and the shared memory it needs (asked of the CUDA runtime once per device).
bool available(int device);
int launch(const KdtreeVerifyParams& p, cudaStream_t stream, char* err, size_t err_len);
// On success `msg` describes the kernel on `device`; on failure, why it cannot run there.
int probe(int device, char* msg, size_t msg_len);
}  // namespace ws

}  // namespace portable
}  // namespace kdtree
