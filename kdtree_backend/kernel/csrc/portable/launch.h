// The portable (mma.sync) configuration's host entry points, implemented in portable/launch.cu, the
// translation unit that holds the portable kernels (sm_90 and sm_120 SASS). kdtree_api.cu calls
// them for KDTREE_CONFIG_PORTABLE.
#pragma once
#include <cuda_runtime.h>
#include <stddef.h>

#include "../kdtree_api.h"

namespace kdtree {
namespace portable {

constexpr int kRowsPerTile = 64;
// Each returns a KdtreeStatus; on failure `err` / `msg` holds the reason.
int launch(const KdtreeVerifyParams& p, cudaStream_t stream, char* err, size_t err_len);
int probe(int device, char* msg, size_t msg_len);

}  // namespace portable
}  // namespace kdtree
