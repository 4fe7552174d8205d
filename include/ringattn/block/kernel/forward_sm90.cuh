#pragma once
//! \file
//! The Hopper (sm_90a) block-forward kernel: the same contract and epilogue as the mma.sync
//! kernel in forward_sm80.cuh, with both matrix products on warpgroup MMA (wgmma.mma_async).
//!
//! A thread block is three warpgroups (FlashAttention-3's structure, with cp.async instead of TMA):
//! - a producer warpgroup (24 registers a thread) copies Q once and then each K/V tile into one
//!   of `sm90_stages` shared stages; `full[stage]` (an mbarrier its cp.async completions arrive
//!   on) says a tile landed, `empty[stage]` (the consumers arrive) that it may be overwritten;
//! - two consumer warpgroups (240 registers) own 64 query rows each (128 a block: the work tiles
//!   of the mma.sync kernel). Per K/V tile of `BN` keys:
//!   S = Q K^T with A (Q) and B (K) from shared memory, D/16 instructions m64nBNk16;
//!   O += P V with A (P) in registers — the scores packed to 16 bits are exactly wgmma's A
//!   fragment — and B (V) read N-major from shared memory, BN/16 instructions m64nDk16.
//! Overlap: the two consumer warpgroups issue their products in turn (ping-pong through named
//! barriers), so one warpgroup's softmax (ALU and MUFU) runs while the other's products are on
//! the tensor cores. Within a warpgroup, S_j and P_{j-1} V_{j-1} are issued together, only S_j
//! is waited for, and the softmax of S_j runs while P V is on the tensor cores (the wait for it
//! held after the exponentials: `wgmma_wait_after`). P is packed to 16 bits only after P V is
//! waited for (packing earlier lets the register allocator reuse P's registers while the product
//! still reads them, and ptxas then serialises every wgmma). Shared tiles are 64-column panels in
//! the 128-byte swizzled layout wgmma reads.
//!
//! The producer bounds it (ncu, H200), so `produce_tile` keeps a copy to 3 instructions: rows
//! walked with constant shared offsets and a pointer increment for the source (docs/kernels.md).
//!
//! The kernel is written in the parts FlashAttention-3 names (namespace `sm90_forward`): `cta`
//! (shared memory, barriers and work tile), `load` (the producer), `compute` (a consumer's main
//! loop; the softmax is online_softmax.cuh's, shared with the mma.sync and decode kernels) and
//! `store` (a consumer's epilogue).

#include <ringattn/block/kernel/epilogue.cuh>
#include <ringattn/block/kernel/mask.cuh>
#include <ringattn/block/kernel/online_softmax.cuh>
#include <ringattn/block/kernel/primitives.cuh>
#include <ringattn/block/kernel/wgmma.cuh>
#include <ringattn/core/tuning.cuh>

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

//! Copies the old o of rows [0, Rows) of a thread block (Rows x D fp32, dense: the state is
//! head-major) into shared memory with the 128 producer threads; rows >= valid are skipped. Row r
//! is stored densely with its 16-byte chunk c at chunk (c & ~7) | ((c ^ r) & 7), so that the
//! consumers' reads (8 rows, the same two chunks each) hit every bank group. (Rows a multiple of 8
//! from the block's first: copying rows [64, 128) as rows [0, 64) of `s_o + 64 * D * 4` gives the
//! same layout.)
template <int Rows, int D>
__device__ __forceinline__ void stage_rows(std::uint32_t s_o, const float* o, int valid, int tid) {
  constexpr int chunks = D / 4, step = 128 / chunks;
  static_assert(step * chunks == 128 && Rows % step == 0);
  const int c = tid % chunks, r0 = tid / chunks;
#pragma unroll 4
  for (int k = 0; k < Rows / step; ++k) {
    const int r = r0 + k * step;
    if (r < valid) {
      const std::uint32_t dst = s_o + (r * chunks + ((c & ~7) | ((c ^ r) & 7))) * 16;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst),
                   "l"(o + r * D + c * 4));
    }
  }
}

//! Copies one float a row (the old reference lse or sum) of a thread block's `valid` rows (at most
//! 128) into shared memory.
__device__ __forceinline__ void stage_lse(std::uint32_t s_lse, const float* lse, int valid,
                                          int tid) {
  if (tid < valid)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s_lse + 4 * tid),
                 "l"(lse + tid));
}

// The kernel's shape (core/tuning.cuh), by the names the kernel uses.
inline constexpr int sm90_block_m = sm90_forward_tuning_for<128>.block_m;
inline constexpr int sm90_threads = sm90_forward_tuning_for<128>.threads;
inline constexpr int sm90_registers = sm90_forward_tuning_for<128>.registers;
template <int D>
inline constexpr int sm90_stages = sm90_forward_tuning_for<D>.stages;
template <int D>
inline constexpr bool sm90_split_state = sm90_forward_tuning_for<D>.split_state;
template <int D>
inline constexpr int sm90_block_n = sm90_forward_tuning_for<D>.block_n;

//! Dynamic shared memory of one thread block: Q and `sm90_stages` K and V tiles (K `D` wide, V
//! `DV`), plus 1 KB to align the base for the swizzle pattern.
template <class T, int D, int DV = D>
constexpr int sm90_smem_bytes() {
  return (sm90_block_m * D + sm90_stages<D> * sm90_block_n<D> * (D + DV)) *
             static_cast<int>(sizeof(T)) +
         1024;
}

namespace sm90_forward {

//! One thread block's shared memory (Q, then `Stages` stages of a K tile and a V tile; a merge's
//! old lse and sum), its mbarriers, and its work tile: what the load, compute and store parts
//! share. Every thread of the block makes it (thread 0 initialises the barriers, then a block
//! barrier).
template <class T, int D, int DV, int BN, bool Merge>
struct cta {
  static constexpr int BM = sm90_block_m, Stages = sm90_stages<D>;
  // A stage holds a K tile, then a V tile.
  static constexpr std::uint32_t q_bytes = BM * D * 2, k_bytes = BN * D * 2, v_bytes = BN * DV * 2,
                                 stage_bytes = k_bytes + v_bytes;
  static_assert(sizeof(T) == 2 && (BN == 64 || BN == 128));
  static_assert(((D == 64 || D == 128) && DV == D) || (D == 192 && DV == 128));

  std::uint32_t aQ;             // stage s: K at aQ + q_bytes + s * stage_bytes, then V
  std::uint32_t full0, empty0;  // full[Stages], empty[Stages]
  std::uint32_t k_free, k_full; // a merge's: the consumers are done with the K half of the stage
                                // the old state takes; its first half landed
  float *lse_stage, *sum_stage; // a merge's old reference lse and sum (its old o: a K/V stage)
  std::uint32_t wait_sink;      // a float written by no thread (wgmma_wait_after)
  block_group g;
  int h, kvh;
  std::int64_t row0; // the tile's first row within its group
  int rows_valid;
  kv_walk<BN> walk;

  __device__ __forceinline__ cta(const forward_params<T>& p, const work_tile& tile)
      : g(p.groups[tile.group]), h(static_cast<int>(blockIdx.y)), kvh(h / p.group_size),
        row0(tile.row_begin),
        rows_valid(static_cast<int>(g.q_count - row0 < BM ? g.q_count - row0 : BM)),
        walk(g, row0, rows_valid) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    __shared__ alignas(8) std::uint64_t bars[2 * Stages + 2];
    __shared__ float lse_s[Merge ? BM : 1], sum_s[Merge ? BM : 1];
    __shared__ float sink;
    const std::uint32_t raw = smem_address(smem_raw);
    aQ = raw + ((1024u - (raw & 1023u)) & 1023u); // swizzle atoms start 1 KB aligned
    full0 = smem_address(&bars[0]), empty0 = smem_address(&bars[Stages]);
    k_free = smem_address(&bars[2 * Stages]), k_full = k_free + 8;
    lse_stage = lse_s, sum_stage = sum_s, wait_sink = smem_address(&sink);
    if (threadIdx.x == 0) {
      for (int s = 0; s < Stages; ++s) {
        mbarrier_init(full0 + 8 * s, 128);  // every producer thread's copies
        mbarrier_init(empty0 + 8 * s, 256); // every consumer thread
      }
      mbarrier_init(k_free, 256);
      mbarrier_init(k_full, 128);
    }
    __syncthreads();
  }
  __device__ __forceinline__ int total() const { return walk.total; }
  __device__ __forceinline__ std::uint32_t stage(int s) const {
    return aQ + q_bytes + s * stage_bytes;
  }
  // Producer: before filling tile t's stage, wait until tile t - Stages released it.
  __device__ __forceinline__ void wait_empty(int t) const {
    if (t >= Stages) mbarrier_wait(empty0 + 8 * (t % Stages), ((t / Stages) - 1) & 1);
  }
  // Consumer: wait for tile t (and make its cp.async writes visible to wgmma).
  __device__ __forceinline__ void wait_full(int t) const {
    mbarrier_wait(full0 + 8 * (t % Stages), (t / Stages) & 1);
    fence_proxy_async();
  }
};

//! The load part (the producer warpgroup, 24 registers a thread): Q, then K/V tile t into stage
//! t % Stages once tile t - Stages is released; for a merge, the rows' old state after them.
template <class T, int D, int DV, int BN, bool Merge, bool Reduce>
__device__ __forceinline__ void load(const forward_params<T>& p,
                                     const cta<T, D, DV, BN, Merge>& bk) {
  using B = cta<T, D, DV, BN, Merge>;
  constexpr int BM = B::BM, Stages = B::Stages;
  const int tid = static_cast<int>(threadIdx.x);
  const int total = bk.total();
  const block_group& g = bk.g;
  if (total > 0) {
    produce_panels<BM, D>(bk.aQ,
                          p.q + (g.q_begin + bk.row0) * p.q_token_stride + bk.h * p.q_head_stride,
                          p.q_token_stride, bk.rows_valid, tid);
    for (int t = 0; t < total; ++t) {
      bk.wait_empty(t);
      bool b;
      std::int64_t j;
      bk.walk.tile(t, b, j);
      const std::int64_t start = bk.walk.begin(b) + j * BN;
      const int valid = bk.walk.valid(b, j);
      const std::uint32_t k = bk.stage(t % Stages);
      produce_panels<BN, D>(k, p.k + start * p.k_token_stride + bk.kvh * p.k_head_stride,
                            p.k_token_stride, valid, tid);
      produce_panels<BN, DV>(k + B::k_bytes,
                             p.v + start * p.v_token_stride + bk.kvh * p.v_head_stride,
                             p.v_token_stride, valid, tid);
      cp_async_mbarrier_arrive(bk.full0 + 8 * (t % Stages));
    }
  }
  if constexpr (Merge && !Reduce) {
    // A merge reads the rows' old state (o and lse) in its epilogue. Copy it into shared memory
    // as if it were K/V tile `total`, into the stage that tile would take (at once in a block of
    // fewer than `Stages` tiles). At head_dim 128 in two halves (`sm90_split_state`): consumer
    // 0's rows and every lse into the stage's K half as soon as the consumers' S of the last
    // tile there is done, consumer 1's rows into its V half once that tile's P V is done too (an
    // iteration and a half later). No K/V copy waits for either. Loading the rows from global
    // memory in the epilogue instead left every block of a wave waiting for them at the same
    // moment; they are one contiguous range of the head-major state (docs/kernels.md, the
    // merge's cost).
    const int stage = total % Stages;
    const std::uint32_t s_o = bk.stage(stage);
    const std::int64_t row = g.q_begin + bk.row0;
    const float* o = p.state.o_row(row, bk.h);
    const float* lse = p.state.lse + bk.h * p.state.tokens + row;
    const float* sum = p.state.sum + bk.h * p.state.tokens + row;
    if constexpr (sm90_split_state<D> && DV == D) {
      constexpr int half = BM / 2;
      static_assert(half * D * 4 == B::k_bytes, "a consumer's old o fills one K or V tile");
      if (total >= Stages) mbarrier_wait(bk.k_free, 0);
      stage_rows<half, D>(s_o, o, bk.rows_valid, tid);
      stage_lse(smem_address(bk.lse_stage), lse, bk.rows_valid, tid);
      stage_lse(smem_address(bk.sum_stage), sum, bk.rows_valid, tid);
      cp_async_mbarrier_arrive(bk.k_full);
      bk.wait_empty(total);
      stage_rows<half, D>(s_o + B::k_bytes, o + half * D, bk.rows_valid - half, tid);
    } else {
      bk.wait_empty(total);
      stage_rows<BM, DV>(s_o, o, bk.rows_valid, tid);
      stage_lse(smem_address(bk.lse_stage), lse, bk.rows_valid, tid);
      stage_lse(smem_address(bk.sum_stage), sum, bk.rows_valid, tid);
    }
    cp_async_mbarrier_arrive(bk.full0 + 8 * stage);
  }
  cp_async_wait_all();
}

//! The compute part (a consumer warpgroup `cw`, 240 registers a thread): its 64 rows' o (the
//! accumulators, unnormalised) and softmax state over every K/V tile of the block. Returns with
//! every product done; `s` is free.
template <class T, int D, int DV, int BN, bool Merge, bool Reduce>
__device__ __forceinline__ void
compute(const forward_params<T>& p, const cta<T, D, DV, BN, Merge>& bk, int cw, int lane, int wrow,
        float (&o)[DV / 2], online_softmax<>& sm, float (&s)[BN / 2]) {
  using B = cta<T, D, DV, BN, Merge>;
  constexpr int BM = B::BM, Stages = B::Stages;
  constexpr int NTiles = BN / 8; // 8-column tiles of S (4 accumulators a thread each)
  constexpr int DTiles = DV / 8; // 8-column tiles of O
  constexpr std::uint32_t q_bytes = B::q_bytes, k_bytes = B::k_bytes, stage_bytes = B::stage_bytes;
  const int total = bk.total();

  // Descriptors. Q: this warpgroup's 64 rows of panel kk / 4, k-step kk % 4 (32 bytes) within
  // it. K: all BN rows, the same k-steps. V: k-step kk is 16 rows (2 KB) down; N = DV spans the
  // panels, BN * 128 bytes apart.
  // A descriptor's address field is bits 0-13 of (address >> 4); every operand lies below 256 KB,
  // so stepping a base descriptor by (bytes >> 4) never carries out of the field.
  const std::uint64_t q_base = sw128_descriptor(bk.aQ + cw * (64 * 128), 16);
  const std::uint64_t kv_base = sw128_descriptor(bk.aQ + q_bytes, 16);
  const std::uint64_t v_lbo = sw128_descriptor(0, BN * 128) - sw128_descriptor(0, 16);
  auto q_desc = [&](int kk) { return q_base + (((kk >> 2) * (BM * 128) + (kk & 3) * 32) >> 4); };
  auto k_desc = [&](int stage, int kk) {
    return kv_base + ((stage * stage_bytes + (kk >> 2) * (BN * 128) + (kk & 3) * 32) >> 4);
  };
  auto v_desc = [&](int stage, int kk) {
    return kv_base + v_lbo + ((stage * stage_bytes + k_bytes + kk * (16 * 128)) >> 4);
  };

#pragma unroll
  for (int i = 0; i < DV / 2; ++i)
    o[i] = 0.0f;
  std::uint32_t pa[BN / 16][4];

  // Scores of K/V tile `it` (in s) -> masked online softmax, in place: s becomes P (fp32), and
  // `corr` the correction of the previous rows' o. Runs while P V of the previous tile may still
  // be in flight, so it writes nothing a wgmma in flight reads: P is packed to 16 bits (`pack`)
  // only after that product is waited for.
  auto softmax = [&](int it, float(&corr)[2]) {
    bool b;
    std::int64_t j;
    bk.walk.tile(it, b, j);
    auto at = [&](int t, int e) -> float& { return s[4 * t + e]; };
    if (bk.walk.needs_mask(b, j))
      mask_fragment<NTiles>(at, bk.walk.mask(b), bk.row0 + wrow, j * BN, bk.walk.count(b), lane);
    sm.template update<NTiles>(at, p.scale_log2, corr,
                               [&](int t, float p0, float p1, float p2, float p3) {
                                 s[4 * t] = p0, s[4 * t + 1] = p1;
                                 s[4 * t + 2] = p2, s[4 * t + 3] = p3;
                               });
  };
  // P as the A fragments of the P V k-steps: two 8-column tiles of S per 16-key step.
  auto pack = [&] {
#pragma unroll
    for (int t = 0; t < NTiles; ++t) {
      pa[t / 2][(t & 1) * 2] = pack2<T>(s[4 * t], s[4 * t + 1]);
      pa[t / 2][(t & 1) * 2 + 1] = pack2<T>(s[4 * t + 2], s[4 * t + 3]);
    }
  };
  auto issue_s = [&](int stage) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, 0>(s, q_desc(kk), k_desc(stage, kk), kk > 0);
    wgmma_commit();
  };
  auto issue_pv = [&](int stage) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk)
      wgmma_rs<T, 1>(o, pa[kk], v_desc(stage, kk), 1);
    wgmma_commit();
  };
  // Ping-pong: consumer c issues its products after `named_barrier_sync(1 + c)` and then lets
  // the other one go. Both walk the same tiles, so both take total + 1 turns; consumer 1 opens
  // with an extra arrive for consumer 0's first turn and skips its arrive after its last turn.
  auto my_turn = [&] { named_barrier_sync<256>(1 + cw); };
  auto your_turn = [&] { named_barrier_arrive<256>(2 - cw); };
  // The K half of tile total - Stages's stage is free once its S is done: the old state's first
  // half may go there (the load part's merge branch). A predicated arrive, so that the loop body
  // stays one block of straight-line code for the scheduler.
  auto k_read = [&](int it) {
    if constexpr (Merge && !Reduce && sm90_split_state<D> && DV == D)
      mbarrier_arrive_if(bk.k_free, it == total - Stages);
  };

  if (total > 0) {
    if (cw == 1) your_turn();
    bk.wait_full(0);
    my_turn();
    wgmma_fence();
    issue_s(0);
    your_turn();
    wgmma_wait<0>();
    fence_operands(s);
    k_read(0);
    float corr[2];
    softmax(0, corr);
    pack();
  }
  for (int it = 1; it < total; ++it) {
    bk.wait_full(it);
    my_turn();
    fence_operands(o);
    fence_operands(pa);
    wgmma_fence();
    issue_s(it % Stages);
    issue_pv((it - 1) % Stages);
    your_turn();
    wgmma_wait<1>(); // S_it is done; P V_{it-1} may still run
    fence_operands(s);
    k_read(it);
    float corr[2];
    softmax(it, corr);
    // The softmax runs while P V_{it-1} is on the tensor cores: the wait for it is held after
    // the row sums, which need every exponential.
    fence_operands(s);
    fence_operands(corr);
    wgmma_wait_after<0>(sm.l[0] + sm.l[1], bk.wait_sink);
    fence_operands(o);
    fence_operands(pa);
    scale_rows<DTiles>([&](int t, int e) -> float& { return o[4 * t + e]; }, corr);
    pack();
    mbarrier_arrive(bk.empty0 + 8 * ((it - 1) % Stages)); // tile it - 1 fully read
  }
  if (total > 0) {
    my_turn();
    fence_operands(o);
    fence_operands(pa);
    wgmma_fence();
    issue_pv((total - 1) % Stages);
    if (cw == 0) your_turn();
    wgmma_wait<0>();
    fence_operands(o);
  }
}

//! merge_path::reduce's references of a consumer thread's two rows, wanted only by the store
//! part (loaded before the compute part, to be there); -inf otherwise.
template <class T, int D, int DV, int BN, bool Merge, bool Reduce>
__device__ __forceinline__ void load_references(const forward_params<T>& p,
                                                const cta<T, D, DV, BN, Merge>& bk, int lane,
                                                int wrow, float (&ref)[2]) {
  ref[0] = ref[1] = -__builtin_huge_valf();
  if constexpr (Reduce) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int local = wrow + (lane >> 2) + r * 8;
      if (local < bk.rows_valid)
        ref[r] = p.state.lse[bk.h * p.state.tokens + bk.g.q_begin + bk.row0 + local];
    }
  }
}

//! The store part (a consumer warpgroup, after its compute part): the rows' largest logits if
//! asked for, then the epilogue `E` (forward_params.cuh): with `Reduce`, the rows added to the
//! state through the L2; with a merge, the old state (staged by the load part) read and merged;
//! else the plain output.
template <class T, int D, int DV, int BN, epilogue E, bool Merge, bool Reduce>
__device__ __forceinline__ void
store(const forward_params<T>& p, const cta<T, D, DV, BN, Merge>& bk, int cw, int lane, int wrow,
      const float (&o)[DV / 2], const online_softmax<>& sm, float (&s)[BN / 2],
      const float (&ref)[2]) {
  using B = cta<T, D, DV, BN, Merge>;
  constexpr int Stages = B::Stages;
  constexpr int DTiles = DV / 8;
  constexpr float neg_inf = -__builtin_huge_valf();
  const int total = bk.total(), rows_valid = bk.rows_valid, h = bk.h;
  const std::int64_t first = bk.g.q_begin + bk.row0; // the tile's first row in the state
  if (p.state.max_logit != nullptr) { // asked for: the warp's rows' largest logit, one atomic
    const float x0 = row_max_logit(wrow + (lane >> 2) < rows_valid, sm.m[0], sm.l[0]);
    const float x1 = row_max_logit(wrow + (lane >> 2) + 8 < rows_valid, sm.m[1], sm.l[1]);
    add_max_logit(p, h, lane, nan_max(x0, x1));
  }
  if constexpr (Reduce) {
    // merge_path::reduce. Each consumer writes its rows' share, o_b * exp(lse_b - ref) (rounded
    // as finish_row rounds it), into its half of the free stage of "tile total" as dense fp32
    // rows, and one of its threads adds the whole to the state with one bulk reduction; the
    // rows' sums get their weights with one reduction a row, and the reference stays. A
    // warpgroup with a row whose reference moves (state.cuh) merges all its rows by reading and
    // rewriting them instead (finish_row), as no bulk addition can rescale.
    constexpr float ln2 = 0.6931471805599453f;
    bool moves = false;
    float k[2], weight[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = sm.l[r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float lse_b = saw_key(sum) ? (sm.m[r] + __log2f(sum)) * ln2 : neg_inf;
      const row_merge w = merge_into(ref[r], lse_b);
      const int local = wrow + (lane >> 2) + r * 8;
      moves = moves || (local < rows_valid && w.moves);
      k[r] = inverse_sum(sum) * w.block;
      weight[r] = w.block;
    }
    if (warpgroup_any(moves, 3 + cw)) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int local = wrow + (lane >> 2) + r * 8;
        finish_row<T, DV, epilogue::merge>(p, h, first + local, local < rows_valid, sm.m[r],
                                           sm.l[r], lane,
                                           [&](int t, int x) { return o[4 * t + 2 * r + x]; });
      }
      return;
    }
    const int stage = total % Stages;
    bk.wait_empty(total);
    constexpr std::uint32_t rows_bytes = 64 * DV * 4; // a consumer's rows, dense fp32
    static_assert(2 * rows_bytes <= B::stage_bytes, "both consumers' rows fit in one stage");
    const std::uint32_t rows_at = bk.stage(stage) + cw * rows_bytes;
    // Row-major and dense, as in the state; the 8-column pieces a thread writes in turn are
    // permuted by (row % 4) XOR, so that a warp's eight rows hit four bank groups at a time.
    const int x4 = (lane >> 2) & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int local = wrow + (lane >> 2) + r * 8;
      const std::uint32_t row_at = rows_at + (local - cw * 64) * (DV * 4) + (lane & 3) * 8;
#pragma unroll
      for (int t = 0; t < DTiles; ++t) {
        float v[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float a0 = o[4 * t + 2 * r + e], a1 = o[4 * (t ^ 1) + 2 * r + e],
                      a2 = o[4 * (t ^ 2) + 2 * r + e], a3 = o[4 * (t ^ 3) + 2 * r + e];
          v[e] = __fmul_rn(x4 == 0 ? a0 : x4 == 1 ? a1 : x4 == 2 ? a2 : a3, k[r]);
        }
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(row_at + ((t ^ x4) << 5)),
                     "f"(v[0]), "f"(v[1]));
      }
      if ((lane & 3) == 0 && local < rows_valid && weight[r] != 0.0f)
        atomicAdd(&p.state.sum[h * p.state.tokens + first + local], weight[r]);
    }
    fence_proxy_async(); // the rows, written through the generic proxy, before the bulk read
    named_barrier_sync<128>(3 + cw);
    if ((threadIdx.x & 127) == 0) {
      const int rows = rows_valid - cw * 64 < 64 ? rows_valid - cw * 64 : 64;
      if (rows > 0) {
        bulk_reduce_add_f32(p.state.o_row(first + cw * 64, h), rows_at, rows * DV * 4);
        bulk_wait_read();
      }
    }
    return;
  }

  // The rows' old state, staged by the load part in the stage of "tile total", into s (dead
  // since the last P was packed) in the accumulators' layout: element (t, x) of row r at
  // s[4 t + 2 r + x]. (Read after the last P V: reading while it runs makes ptxas insert a wait
  // for it anyway, C7517; and reading before it, while waiting for the turn to issue it, made
  // the merge dearer: docs/kernels.md.)
  float lse_old[2] = {neg_inf, neg_inf}, sum_old[2] = {0.0f, 0.0f};
  if constexpr (Merge) {
    static_assert(B::BM * DV * 4 <= B::stage_bytes, "the old o must fit in one K/V stage");
    if (sm90_split_state<D> && DV == D && cw == 0)
      mbarrier_wait(bk.k_full, 0); // this warpgroup's rows, in the stage's K half
    else
      bk.wait_full(total);
    const std::uint32_t s_o = bk.stage(total % Stages);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int local = wrow + (lane >> 2) + r * 8;
      if (local < rows_valid) {
        lse_old[r] = bk.lse_stage[local];
        sum_old[r] = bk.sum_stage[local];
        const std::uint32_t row_base = s_o + local * (DV * 4) + (lane & 1) * 8;
#pragma unroll
        for (int t = 0; t < DTiles; ++t) {
          const int c = 2 * t + ((lane & 3) >> 1);
          float2 v;
          asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n"
                       : "=f"(v.x), "=f"(v.y)
                       : "r"(row_base + (((c & ~7) | ((c ^ local) & 7)) << 4)));
          s[4 * t + 2 * r] = v.x;
          s[4 * t + 2 * r + 1] = v.y;
        }
      }
    }
  }

  // The block's (o, lse) per row, then merge into the state (or write it plainly): the same
  // epilogue as the mma.sync kernel with one 16-row tile per warp.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int local = wrow + (lane >> 2) + r * 8;
    finish_row<T, DV, E>(
        p, h, first + local, local < rows_valid, sm.m[r], sm.l[r], lane,
        [&](int t, int x) { return o[4 * t + 2 * r + x]; },
        [&](int t, int x) { return s[4 * t + 2 * r + x]; }, lse_old[r], sum_old[r]);
  }
}

} // namespace sm90_forward

//! `E` says what the epilogue writes (forward_params.cuh). `Reduce` (with `epilogue::merge` only):
//! merge_path::reduce, the block's rows added to the state through the L2 with no old state read
//! (tuning.cuh). Q and K are `D` wide, V and the output `DV` (equal, or 192 and 128). The block's
//! warpgroup 0 runs the load part, warpgroups 1 and 2 the compute and store parts
//! (namespace sm90_forward).
template <class T, int D, int DV, int BN, epilogue E, bool Reduce>
__global__ void __launch_bounds__(sm90_threads, 1) block_forward_sm90_kernel(forward_params<T> p) {
#if RINGATTN_WGMMA_ENABLED
  static_assert(!Reduce || E == epilogue::merge, "only a plain merge adds through the L2");
  // Merge: the epilogue reads the rows' old state (staged by the producer) before writing.
  constexpr bool Merge = E == epilogue::merge || E == epilogue::merge_out;
  const sm90_forward::cta<T, D, DV, BN, Merge> bk(p, p.tiles[blockIdx.x]);
  // Broadcast from lane 0: the compiler then knows it is warp-uniform and keeps everything derived
  // from it (descriptors, barrier ids) in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
  if (wg == 0) {
    setmaxnreg_dec<24>();
    sm90_forward::load<T, D, DV, BN, Merge, Reduce>(p, bk);
    return;
  }
  setmaxnreg_inc<240>();
  const int cw = wg - 1;                                // consumer warpgroup 0 or 1
  const int ctid = static_cast<int>(threadIdx.x) - 128; // 0..255
  const int lane = ctid & 31, wrow = (ctid >> 5) * 16;  // first row of this warp in the tile
  float ref[2];
  sm90_forward::load_references<T, D, DV, BN, Merge, Reduce>(p, bk, lane, wrow, ref);
  float o[DV / 2], s[BN / 2];
  online_softmax<> sm;
  sm90_forward::compute<T, D, DV, BN, Merge, Reduce>(p, bk, cw, lane, wrow, o, sm, s);
  sm90_forward::store<T, D, DV, BN, E, Merge, Reduce>(p, bk, cw, lane, wrow, o, sm, s, ref);
#else
  __trap(); // launched only where kernels::wgmma_available() said yes
#endif
}

//! Writes 1 to `*flag` if this translation unit's code for the running device has the wgmma
//! kernels (an sm_90a build on a compute capability 9.0 device), 0 otherwise.
//! (A template only so that every translation unit may define it.)
template <int Unused = 0>
__global__ void sm90_probe_kernel(int* flag) {
  *flag = RINGATTN_WGMMA_ENABLED;
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
