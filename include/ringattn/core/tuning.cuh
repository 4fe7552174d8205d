#pragma once
//! \file
//! The kernels' tuning, per architecture, as constexpr aggregates: the mma.sync block forward
//! (sm_80 and newer: `forward_tuning_for`), the Hopper block forward (`sm90_forward_tuning_for`)
//! and the block backward on tensor cores (`backward_tuning_tuned`). Plain data for host and
//! device code; what each was measured against is in docs/kernels.md.
//!
//! mma.sync forward: each warp owns `m_tiles` x 16 query rows (m16n8k16 row tiles); a thread block
//! of `warps` warps owns `16 * m_tiles * warps` rows and walks the K/V block in tiles of `block_n`
//! rows, double-buffered in shared memory. Every K and V fragment a warp reads from shared memory
//! feeds `m_tiles` matrix instructions, so two row tiles per warp halve the shared-memory traffic
//! per FLOP. `q_in_registers` keeps the Q fragments in registers for the whole tile instead of
//! re-reading them from shared memory each K/V tile (needs m_tiles * head_dim / 4 registers).

#include <ringattn/config.cuh>

namespace ringattn {

//! Which CUDA implementation of the block forward runs.
//! - `mma_sync`: the FlashAttention-2 style kernel (mma.sync m16n8k16; sm_80 and newer; head_dim
//!   64, 128, 256 with V as wide), shapes from `forward_tuning_for`.
//! - `wgmma`: the Hopper kernel (warpgroup MMA; needs code built for sm_90a running on a compute
//!   capability 9.0 device; head_dim 64 and 128, and Q/K 192 with V 128).
//! - `automatic`: `wgmma` where it can run, else `mma_sync`. Resolved once, when a
//!   `device_block_schedule` is made.
enum class forward_path { automatic, mma_sync, wgmma };

inline const char* to_string(forward_path p) {
  return p == forward_path::automatic  ? "automatic"
         : p == forward_path::mma_sync ? "mma_sync"
                                       : "wgmma";
}

//! How a merging call of the Hopper kernel adds its block to the state (state.cuh).
//! - `rewrite`: each thread block reads the rows' old o (staged through shared memory while the
//!   last K/V tiles are in flight), adds, and writes them back. The mma.sync kernel, a ring's
//!   first and last steps, and rows whose reference moves always merge this way.
//! - `reduce`: no read on the SM; each consumer warpgroup scales its rows, writes them to shared
//!   memory and adds them to the state with one `cp.reduce.async.bulk` (the L2 reads, adds and
//!   writes). Cheaper where a launch's thread blocks end at different times (banded masks);
//!   dearer where they all end together (full masks), as the reductions then queue at the L2.
//! - `automatic`: `reduce` at head_dim 128 when some block of the call is banded (a causal
//!   diagonal, a round-robin shard pair), else `rewrite` (docs/kernels.md, the merge's cost).
enum class merge_path { automatic, rewrite, reduce };

inline const char* to_string(merge_path p) {
  return p == merge_path::automatic ? "automatic" : p == merge_path::rewrite ? "rewrite" : "reduce";
}

//! A shape of the mma.sync block forward (the file notes say how the fields combine).
struct forward_tuning {
  int warps;           //!< warps a thread block (two thread blocks share an SM)
  int m_tiles;         //!< 16-row tiles a warp
  int block_n;         //!< keys a K/V tile
  bool q_in_registers; //!< Q fragments held in registers (else read from shared memory each tile)
  RINGATTN_HOST_DEVICE constexpr int block_m() const { return 16 * m_tiles * warps; }
  RINGATTN_HOST_DEVICE constexpr int threads() const { return 32 * warps; }
};

//! Shapes of the mma.sync kernel (block/kernel/forward_sm80.cuh: sm_80 builds, head_dim 256, and
//! `forward_path::mma_sync`; Hopper builds otherwise run the wgmma kernel below), Q read from
//! shared memory at every width:
//! - head_dim 64: 4 warps x 2 row tiles x 128 keys;
//! - head_dim 128: 4 warps x 2 row tiles x 48 keys (254 registers, no spills);
//! - head_dim 256: 4 warps x 1 row tile x 32 keys (the fp32 output tile takes 128 registers).
//! The alternatives measured against these are in docs/kernels.md.
template <int HeadDim>
inline constexpr forward_tuning forward_tuning_for =
    HeadDim == 64    ? forward_tuning{4, 2, 128, false}
    : HeadDim == 128 ? forward_tuning{4, 2, 48, false}
                     : forward_tuning{4, 1, 32, false};

//! Shapes of the Hopper (sm_90a) block-forward kernel (block/kernel/forward_sm90.cuh): a producer
//! warpgroup and two consumer warpgroups of 64 query rows each, K/V tiles of `block_n` keys in
//! `stages` shared-memory stages. Tuned on an H200 at head_dim 64 and 128 (docs/kernels.md);
//! Q/K 192 with V 128 (multi-head latent attention) fits two stages next to its 48 KB of Q.
struct sm90_forward_tuning {
  int block_m;   //!< query rows a thread block
  int block_n;   //!< keys a K/V tile
  int threads;   //!< three warpgroups
  int registers; //!< a thread at launch: 65536 / threads, rounded down to a multiple of 8; the
                 //!< setmaxnreg hand-over (producer 24, consumers 240) balances for exactly this
  int stages;    //!< K/V stages: as many as fit next to Q in 227 KB of shared memory
  //! A merge stages the old state in two halves (consumer 0's rows as soon as the K half of
  //! their stage frees): at head_dim 128, where the whole state arrives late; not at head_dim 64,
  //! whose five stages leave the whole copy time enough (docs/kernels.md).
  bool split_state;
};
template <int HeadDim>
inline constexpr sm90_forward_tuning sm90_forward_tuning_for{
    128, 128, 384, 168, HeadDim == 64 ? 5 : HeadDim == 128 ? 3 : 2, HeadDim == 128};

//! Shapes of the block backward on tensor cores (block/kernel/backward_sm80.cuh,
//! backward_sm90.cuh): 64 key columns (dK/dV) or query rows (dQ) a mma.sync thread block of 4
//! warps, and the warpgroups of a Hopper thread block (3: a producer and two consumers of 64 each).
struct backward_tuning {
  int rows;
  int threads;
  int sm90_warpgroups;
};
inline constexpr backward_tuning backward_tuning_tuned{64, 128, 3};

} // namespace ringattn
