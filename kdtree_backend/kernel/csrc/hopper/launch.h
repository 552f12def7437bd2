// The Hopper (sm_90a, wgmma) configuration's host entry points. Implemented in hopper/launch.cu,
// a translation unit compiled only for sm_90a; kdtree_api.cu calls these when the library was
// built with it (-DKDTREE_WITH_HOPPER) and the caller selects KDTREE_CONFIG_HOPPER.
#pragma once
#include <cuda_runtime.h>
#include <stddef.h>

#include "../kdtree_api.h"

namespace kdtree {
namespace hopper {

constexpr int kRowsPerTile = 64;
// Each returns a KdtreeStatus; on failure `err` holds the reason.
int launch(const KdtreeVerifyParams& p, cudaStream_t stream, char* err, size_t err_len);
int probe(int device, char* msg, size_t msg_len);

}  // namespace hopper
}  // namespace kdtree
