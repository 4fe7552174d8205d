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

#include <ringattn/block/kernel/epilogue.cuh>
#include <ringattn/block/kernel/mask.cuh>
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

//! `E` says what the epilogue writes (forward_params.cuh). `Reduce` (with `epilogue::merge` only):
//! merge_path::reduce, the block's rows added
//! to the state through the L2 with no old state read (tuning.cuh). Q and K are `D` wide, V and
//! the output `DV` (equal, or 192 and 128).
template <class T, int D, int DV, int BN, epilogue E, bool Reduce>
__global__ void __launch_bounds__(sm90_threads, 1) block_forward_sm90_kernel(forward_params<T> p) {
#if RINGATTN_WGMMA_ENABLED
  static_assert(!Reduce || E == epilogue::merge, "only a plain merge adds through the L2");
  // Merge: the epilogue reads the rows' old state (staged by the producer) before writing.
  constexpr bool Merge = E == epilogue::merge || E == epilogue::merge_out;
  constexpr int BM = sm90_block_m, Stages = sm90_stages<D>;
  constexpr int NTiles = BN / 8; // 8-column tiles of S (4 accumulators a thread each)
  constexpr int DTiles = DV / 8; // 8-column tiles of O
  constexpr float neg_inf = -__builtin_huge_valf();
  static_assert(sizeof(T) == 2 && (BN == 64 || BN == 128));
  static_assert(((D == 64 || D == 128) && DV == D) || (D == 192 && DV == 128));
  // A stage holds a K tile, then a V tile.
  constexpr std::uint32_t q_bytes = BM * D * 2, k_bytes = BN * D * 2, v_bytes = BN * DV * 2,
                          stage_bytes = k_bytes + v_bytes;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  // full[Stages], empty[Stages], then a merge's two: k_free (the consumers are done with the K
  // half of the stage the old state takes) and k_full (its first half landed).
  __shared__ alignas(8) std::uint64_t bars[2 * Stages + 2];
  // A merge's old reference lse and sum (its old o: a K/V stage).
  __shared__ float lse_stage[Merge ? BM : 1], sum_stage[Merge ? BM : 1];
  __shared__ float wait_sink; // written by no thread (wgmma_wait_after)
  const std::uint32_t raw = smem_address(smem_raw);
  const std::uint32_t pad = (1024u - (raw & 1023u)) & 1023u; // swizzle atoms start 1 KB aligned
  const std::uint32_t aQ = raw + pad; // stage s: K at aQ + q_bytes + s * stage_bytes, then V
  const std::uint32_t full0 = smem_address(&bars[0]), empty0 = smem_address(&bars[Stages]);
  const std::uint32_t k_free = smem_address(&bars[2 * Stages]), k_full = k_free + 8;

  const work_tile tile = p.tiles[blockIdx.x];
  const block_group g = p.groups[tile.group];
  const int h = blockIdx.y, kvh = h / p.group_size;
  // Broadcast from lane 0: the compiler then knows it is warp-uniform and keeps everything derived
  // from it (descriptors, barrier ids) in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
  const std::int64_t row0 = tile.row_begin;
  const int rows_valid = static_cast<int>(g.q_count - row0 < BM ? g.q_count - row0 : BM);

  const kv_walk<BN> walk(g, row0, rows_valid);
  const int total = walk.total;

  if (threadIdx.x == 0) {
    for (int s = 0; s < Stages; ++s) {
      mbarrier_init(full0 + 8 * s, 128);  // every producer thread's copies
      mbarrier_init(empty0 + 8 * s, 256); // every consumer thread
    }
    mbarrier_init(k_free, 256);
    mbarrier_init(k_full, 128);
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer: Q, then K/V tile t into stage t % Stages once tile t - Stages is released.
    setmaxnreg_dec<24>();
    if (total > 0) {
      const int tid = static_cast<int>(threadIdx.x);
      produce_panels<BM, D>(aQ, p.q + (g.q_begin + row0) * p.q_token_stride + h * p.q_head_stride,
                            p.q_token_stride, rows_valid, tid);
      for (int t = 0; t < total; ++t) {
        const int stage = t % Stages;
        if (t >= Stages) mbarrier_wait(empty0 + 8 * stage, ((t / Stages) - 1) & 1);
        bool b;
        std::int64_t j;
        walk.tile(t, b, j);
        const std::int64_t start = walk.begin(b) + j * BN;
        const int valid = walk.valid(b, j);
        const std::uint32_t k = aQ + q_bytes + stage * stage_bytes;
        produce_panels<BN, D>(k, p.k + start * p.k_token_stride + kvh * p.k_head_stride,
                              p.k_token_stride, valid, tid);
        produce_panels<BN, DV>(k + k_bytes, p.v + start * p.v_token_stride + kvh * p.v_head_stride,
                               p.v_token_stride, valid, tid);
        cp_async_mbarrier_arrive(full0 + 8 * stage);
      }
    }
    if constexpr (Merge && !Reduce) {
      // A merge reads the rows' old state (o and lse) in its epilogue. Copy it into shared
      // memory as if it were K/V tile `total`, into the stage that tile would take (at once in a
      // block of fewer than `Stages` tiles). At head_dim 128 in two halves (`sm90_split_state`):
      // consumer 0's rows and every lse into the stage's K half as soon as the consumers' S of
      // the last tile there is done, consumer 1's rows into its V half once that tile's P V is
      // done too (an iteration and a half later). No K/V copy waits for either. Loading the rows
      // from global memory in the epilogue instead left every block of a wave waiting for them at
      // the same moment; they are one contiguous range of the head-major state (docs/kernels.md,
      // the merge's cost).
      {
        const int tid = static_cast<int>(threadIdx.x);
        const int stage = total % Stages;
        const std::uint32_t s_o = aQ + q_bytes + stage * stage_bytes;
        const std::int64_t row = g.q_begin + row0;
        const float* o = p.state.o_row(row, h);
        const float* lse = p.state.lse + h * p.state.tokens + row;
        const float* sum = p.state.sum + h * p.state.tokens + row;
        auto free_stage = [&] {
          if (total >= Stages) mbarrier_wait(empty0 + 8 * stage, ((total / Stages) - 1) & 1);
        };
        if constexpr (sm90_split_state<D> && DV == D) {
          constexpr int half = BM / 2;
          static_assert(half * D * 4 == k_bytes, "a consumer's old o fills one K or V tile");
          if (total >= Stages) mbarrier_wait(k_free, 0);
          stage_rows<half, D>(s_o, o, rows_valid, tid);
          stage_lse(smem_address(lse_stage), lse, rows_valid, tid);
          stage_lse(smem_address(sum_stage), sum, rows_valid, tid);
          cp_async_mbarrier_arrive(k_full);
          free_stage();
          stage_rows<half, D>(s_o + k_bytes, o + half * D, rows_valid - half, tid);
        } else {
          free_stage();
          stage_rows<BM, DV>(s_o, o, rows_valid, tid);
          stage_lse(smem_address(lse_stage), lse, rows_valid, tid);
          stage_lse(smem_address(sum_stage), sum, rows_valid, tid);
        }
        cp_async_mbarrier_arrive(full0 + 8 * stage);
      }
    }
    cp_async_wait_all();
    return;
  }

  // ---- consumers
  setmaxnreg_inc<240>();
  const int cw = wg - 1;                               // consumer warpgroup 0 or 1
  const int ctid = threadIdx.x - 128;                  // 0..255
  const int lane = ctid & 31, wrow = (ctid >> 5) * 16; // first row of this warp in the tile
  // merge_path::reduce: the rows' references, wanted only at the end (loaded now, to be there).
  float ref[2] = {neg_inf, neg_inf};
  if constexpr (Reduce) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int local = wrow + (lane >> 2) + r * 8;
      if (local < rows_valid) ref[r] = p.state.lse[h * p.state.tokens + g.q_begin + row0 + local];
    }
  }

  // Descriptors. Q: this warpgroup's 64 rows of panel kk / 4, k-step kk % 4 (32 bytes) within
  // it. K: all BN rows, the same k-steps. V: k-step kk is 16 rows (2 KB) down; N = DV spans the
  // panels, BN * 128 bytes apart.
  // A descriptor's address field is bits 0-13 of (address >> 4); every operand lies below 256 KB,
  // so stepping a base descriptor by (bytes >> 4) never carries out of the field.
  const std::uint64_t q_base = sw128_descriptor(aQ + cw * (64 * 128), 16);
  const std::uint64_t kv_base = sw128_descriptor(aQ + q_bytes, 16);
  const std::uint64_t v_lbo = sw128_descriptor(0, BN * 128) - sw128_descriptor(0, 16);
  auto q_desc = [&](int kk) { return q_base + (((kk >> 2) * (BM * 128) + (kk & 3) * 32) >> 4); };
  auto k_desc = [&](int stage, int kk) {
    return kv_base + ((stage * stage_bytes + (kk >> 2) * (BN * 128) + (kk & 3) * 32) >> 4);
  };
  auto v_desc = [&](int stage, int kk) {
    return kv_base + v_lbo + ((stage * stage_bytes + k_bytes + kk * (16 * 128)) >> 4);
  };

  float o[DV / 2];
#pragma unroll
  for (int i = 0; i < DV / 2; ++i)
    o[i] = 0.0f;
  float m[2] = {neg_inf, neg_inf}, l[2] = {0.0f, 0.0f};
  float s[BN / 2];
  std::uint32_t pa[BN / 16][4];

  // Scores of K/V tile `it` (in s) -> masked online softmax, in place: s becomes P (fp32), and
  // `corr` the correction of the previous rows' o. Runs while P V of the previous tile may still
  // be in flight, so it writes nothing a wgmma in flight reads: P is packed to 16 bits (`pack`)
  // only after that product is waited for.
  auto softmax = [&](int it, float(&corr)[2]) {
    bool b;
    std::int64_t j;
    walk.tile(it, b, j);
    if (walk.needs_mask(b, j))
      mask_fragment<NTiles>([&](int t, int e) -> float& { return s[4 * t + e]; }, walk.mask(b),
                            row0 + wrow, j * BN, walk.count(b), lane);
    float mx[2] = {neg_inf, neg_inf};
#pragma unroll
    for (int t = 0; t < NTiles; ++t) {
      mx[0] = fmaxf(mx[0], fmaxf(s[4 * t], s[4 * t + 1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[4 * t + 2], s[4 * t + 3]));
    }
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float mnew = fmaxf(m[r], mx[r] * p.scale_log2);
      corr[r] = m[r] == neg_inf ? 0.0f : fast_exp2(m[r] - mnew);
      base[r] = mnew == neg_inf ? 0.0f : mnew; // a row with nothing visible yet: p = 0
      m[r] = mnew;
      l[r] *= corr[r];
    }
#pragma unroll
    for (int t = 0; t < NTiles; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[4 * t + e] = fast_exp2(fmaf(s[4 * t + e], p.scale_log2, -base[e >> 1]));
      l[0] += s[4 * t] + s[4 * t + 1];
      l[1] += s[4 * t + 2] + s[4 * t + 3];
    }
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
  // half may go there (the producer's merge branch). A predicated arrive, so that the loop body
  // stays one block of straight-line code for the scheduler.
  auto k_read = [&](int it) {
    if constexpr (Merge && !Reduce && sm90_split_state<D> && DV == D)
      mbarrier_arrive_if(k_free, it == total - Stages);
  };
  auto wait_full = [&](int t) {
    mbarrier_wait(full0 + 8 * (t % Stages), (t / Stages) & 1);
    fence_proxy_async(); // the tile's cp.async writes before this thread's wgmma reads
  };

  if (total > 0) {
    if (cw == 1) your_turn();
    wait_full(0);
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
    wait_full(it);
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
    wgmma_wait_after<0>(l[0] + l[1], smem_address(&wait_sink));
    fence_operands(o);
    fence_operands(pa);
#pragma unroll
    for (int t = 0; t < DTiles; ++t) {
      o[4 * t] *= corr[0];
      o[4 * t + 1] *= corr[0];
      o[4 * t + 2] *= corr[1];
      o[4 * t + 3] *= corr[1];
    }
    pack();
    mbarrier_arrive(empty0 + 8 * ((it - 1) % Stages)); // tile it - 1 fully read
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
  if (p.state.max_logit != nullptr) { // asked for: the warp's rows' largest logit, one atomic
    const float x0 = row_max_logit(wrow + (lane >> 2) < rows_valid, m[0], l[0]);
    const float x1 = row_max_logit(wrow + (lane >> 2) + 8 < rows_valid, m[1], l[1]);
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
      float sum = l[r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const float lse_b = saw_key(sum) ? (m[r] + __log2f(sum)) * ln2 : neg_inf;
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
        finish_row<T, DV, epilogue::merge>(p, h, g.q_begin + row0 + local, local < rows_valid, m[r],
                                           l[r], lane,
                                           [&](int t, int x) { return o[4 * t + 2 * r + x]; });
      }
      return;
    }
    const int stage = total % Stages;
    if (total >= Stages) mbarrier_wait(empty0 + 8 * stage, ((total / Stages) - 1) & 1);
    constexpr std::uint32_t rows_bytes = 64 * DV * 4; // a consumer's rows, dense fp32
    static_assert(2 * rows_bytes <= stage_bytes, "both consumers' rows fit in one stage");
    const std::uint32_t rows_at = aQ + q_bytes + stage * stage_bytes + cw * rows_bytes;
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
        atomicAdd(&p.state.sum[h * p.state.tokens + g.q_begin + row0 + local], weight[r]);
    }
    fence_proxy_async(); // the rows, written through the generic proxy, before the bulk read
    named_barrier_sync<128>(3 + cw);
    if ((ctid & 127) == 0) {
      const int rows = rows_valid - cw * 64 < 64 ? rows_valid - cw * 64 : 64;
      if (rows > 0) {
        bulk_reduce_add_f32(p.state.o_row(g.q_begin + row0 + cw * 64, h), rows_at, rows * DV * 4);
        bulk_wait_read();
      }
    }
    return;
  }

  // The rows' old state, staged by the producer in the stage of "tile total", into s (dead since
  // the last P was packed) in the accumulators' layout: element (t, x) of row r at
  // s[4 t + 2 r + x]. (Read after the last P V: reading while it runs makes ptxas insert a wait
  // for it anyway, C7517; and reading before it, while waiting for the turn to issue it, made
  // the merge dearer: docs/kernels.md.)
  float lse_old[2] = {neg_inf, neg_inf}, sum_old[2] = {0.0f, 0.0f};
  if constexpr (Merge) {
    {
      static_assert(BM * DV * 4 <= stage_bytes, "the old o must fit in one K/V stage");
      if (sm90_split_state<D> && DV == D && cw == 0)
        mbarrier_wait(k_full, 0); // this warpgroup's rows, in the stage's K half
      else
        wait_full(total);
      const std::uint32_t s_o = aQ + q_bytes + (total % Stages) * stage_bytes;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int local = wrow + (lane >> 2) + r * 8;
        if (local < rows_valid) {
          lse_old[r] = lse_stage[local];
          sum_old[r] = sum_stage[local];
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
  }

  // The block's (o, lse) per row, then merge into the state (or write it plainly): the same
  // epilogue as the mma.sync kernel with one 16-row tile per warp.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int local = wrow + (lane >> 2) + r * 8;
    finish_row<T, DV, E>(
        p, h, g.q_begin + row0 + local, local < rows_valid, m[r], l[r], lane,
        [&](int t, int x) { return o[4 * t + 2 * r + x]; },
        [&](int t, int x) { return s[4 * t + 2 * r + x]; }, lse_old[r], sum_old[r]);
  }
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
