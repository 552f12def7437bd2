// Head geometry of absorbed MLA (Kimi K2.x, DeepSeek-V3): a K row is 512 latent + 64 rope bf16
// columns, V is its first 512 columns. Host and device constants, shared by every part.
#pragma once

namespace kdtree {

constexpr int kQkDim = 576;              // 512 latent + 64 rope
constexpr int kVDim = 512;               // V = the first 512 columns of the K row
constexpr int kRowBytes = kQkDim * 2;    // 1152 bytes per bf16 row
constexpr int kRowChunks = kRowBytes / 16;  // 72 chunks of 16 bytes

}  // namespace kdtree
