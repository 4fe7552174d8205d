#pragma once
//! \file
//! Tile shapes of the CUDA block-forward kernel, per head_dim, as constexpr aggregates.
//!
//! Each warp owns 16 query rows (one m16n8k16 row tile); a thread block of `warps` warps owns
//! `16 * warps` rows and walks the K/V block in tiles of `block_n` rows, double-buffered in shared
//! memory. `q_in_registers` keeps the Q fragments in registers for the whole tile (fewer shared
//! memory reads; needs head_dim / 4 registers).

#include <ringattn/config.cuh>

namespace ringattn {

struct forward_tuning {
  int warps;
  int block_n;
  bool q_in_registers;
  RINGATTN_HOST_DEVICE constexpr int block_m() const { return 16 * warps; }
  RINGATTN_HOST_DEVICE constexpr int threads() const { return 32 * warps; }
};

//! Shapes for sm_80 and sm_90 (the same mma.sync path runs on both).
//! head_dim 64/128: 8 warps (128 query rows) x 64 keys; Q in registers. Shared memory: Q tile plus
//! two K and two V tiles, 48 KB (d = 64) and 96 KB (d = 128); about 170 registers a thread, no
//! spills (ptxas report in docs/kernels.md). head_dim 256: 4 warps x 32 keys, Q read from shared
//! memory each step so the fp32 output tile (128 registers) fits.
template <int HeadDim>
inline constexpr forward_tuning forward_tuning_for =
    HeadDim <= 128 ? forward_tuning{8, 64, true} : forward_tuning{4, 32, false};

} // namespace ringattn
