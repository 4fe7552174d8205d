#pragma once
//! \file
//! The split-K/V block forward for few query rows (decoding): a launch's unit is one key range
//! (a split) of one group's K/V segment for one kv head, and all query rows of the group that
//! share that kv head (new tokens x the GQA group, at most `decode_max_rows`), so each K/V byte
//! of the split is read once. The block is bound by reading K and V: everything serves keeping
//! the memory busy.
//!
//! `decode_split_kernel<T, HeadDim, RowTiles, KeyRows>`: 4 warps; the query rows padded to
//! `RowTiles` tiles of 16 (zero rows), and the warps laid out as RowTiles x (4 / RowTiles): a warp
//! takes one row tile and its share of each stage's keys. K and V stream through `decode_stages`
//! shared buffers of `decode_stage_keys` keys by cp.async (two stages in flight while one is
//! computed; keys past the split are zero-filled and masked; `KeyRows` says where a key row lives:
//! in place, or through a page table). Scores and P V on tensor cores (mma.sync m16n8k16, fp32
//! accumulation), an online softmax in base 2 per warp; the warps' states meet in shared memory,
//! and the split's unnormalised output, maximum (log2 units) and weight sum go to the scratch.
//! `decode_combine_kernel`: per row, the splits in order, then the block merges into the fp32 state
//! (core/state.cuh) as a `fresh` or a `merge` epilogue.

#include <ringattn/config.cuh>
#include <ringattn/core/block.cuh>
#include <ringattn/core/element.cuh>
#include <ringattn/core/state.cuh>
#include <ringattn/device/primitives.cuh>

#include <cstdint>
#include <type_traits>

namespace ringattn {

//! Query rows (new tokens x query heads per kv head) one unit of the split kernel takes.
inline constexpr int decode_max_rows = 64;
//! Keys of one pipeline stage of the split kernel, and its stages (buffers) in shared memory.
inline constexpr int decode_stage_keys = 64, decode_stages = 3;

//! One unit of the split kernel: keys [kv_lo, kv_hi) of group `group`'s segment; its partial
//! goes to scratch slot `slot` (x kv heads).
struct decode_item {
  std::int32_t group = 0;
  std::int32_t slot = 0;
  std::int64_t kv_lo = 0, kv_hi = 0;
};

//! Where the split kernel finds key row `L` of a group's segment (its `kv_begin` plus an offset):
//! row `L` of K and V themselves, a packed or slab cache.
struct packed_key_rows {
  static constexpr bool paged = false;
  __host__ __device__ std::int64_t operator()(std::int64_t at) const { return at; }
};
//! A paged cache: `L` counts through the step's page table (a group's `kv_begin` is its first
//! table entry times the page size), so row `L` sits in pool page `table[L >> shift]`, row
//! `L & (2^shift - 1)` of that page.
struct paged_key_rows {
  static constexpr bool paged = true;
  const std::int32_t* table = nullptr;
  int shift = 0;
  __host__ __device__ std::int64_t operator()(std::int64_t at) const {
    return (static_cast<std::int64_t>(table[at >> shift]) << shift) |
           (at & ((std::int64_t{1} << shift) - 1));
  }
};

//! Floats of one unit's partial for one kv head: per row (`rows` padded rows) an output of
//! `head_dim`, a maximum and a weight sum.
__host__ __device__ constexpr std::int64_t decode_partial_floats(int head_dim, int rows) {
  return static_cast<std::int64_t>(rows) * (head_dim + 2);
}

//! Shared memory of the split kernel: the K and V stages (the query tile borrows the last
//! stage's K buffer until the queries are in registers). 96 KiB at head_dim 128: within the
//! 99 KiB a thread block may take on every sm_80+ device.
template <class T>
constexpr int decode_smem_bytes(int head_dim) {
  return 2 * decode_stage_keys * decode_stages * head_dim * static_cast<int>(sizeof(T));
}

} // namespace ringattn

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

template <class T, int HeadDim, int RowTiles, class KeyRows>
__global__ void __launch_bounds__(128, 2)
    decode_split_kernel(const T* q, std::int64_t q_token_stride, std::int64_t q_head_stride,
                        const T* k, std::int64_t k_token_stride, std::int64_t k_head_stride,
                        const T* v, std::int64_t v_token_stride, std::int64_t v_head_stride,
                        KeyRows key_rows, const block_group* groups, const decode_item* items,
                        int group_size, float scale_log2, float* scratch) {
  static_assert(RowTiles == 1 || RowTiles == 2 || RowTiles == 4);
  static_assert(16 * RowTiles <= decode_stage_keys, "the query tile fits a stage's K buffer");
  constexpr int D = HeadDim, Rows = 16 * RowTiles, KeyWarps = 4 / RowTiles;
  constexpr int BK = decode_stage_keys, S = decode_stages;
  constexpr int KW = BK / KeyWarps; // keys of a stage one warp takes
  constexpr int NT = KW / 8;        // its score tiles of 8 keys
  constexpr int KSteps = D / 16, DTiles = D / 8, chunks = D / 8;
  constexpr std::uint32_t elem = sizeof(T);
  constexpr float neg_inf = -__builtin_huge_valf();
  extern __shared__ __align__(128) unsigned char decode_smem[];
  T* sK = reinterpret_cast<T*>(decode_smem);
  T* sV = sK + S * BK * D;
  T* sQ = sK + (S - 1) * BK * D; // the last stage's K buffer, first filled at t = 0

  const decode_item item = items[blockIdx.x];
  const block_group g = groups[item.group];
  const int kvh = static_cast<int>(blockIdx.y), kv_heads = static_cast<int>(gridDim.y);
  const int rows = static_cast<int>(g.q_count) * group_size;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int wr = warp % RowTiles, wk = warp / RowTiles;
  const std::int64_t keys = item.kv_hi - item.kv_lo;
  const int tiles = static_cast<int>((keys + BK - 1) / BK);
  const std::int64_t first = g.kv[0].kv_begin + item.kv_lo;
  auto load_stage = [&](int t) {
    const int buf = t % S;
    const std::int64_t at = first + static_cast<std::int64_t>(t) * BK,
                       left = keys - static_cast<std::int64_t>(t) * BK;
    const int valid = left < BK ? static_cast<int>(left) : BK;
    if constexpr (KeyRows::paged) {
      // Each 16-byte chunk's row through the page table (a row's K and V share the lookup).
      const T* k_head = k + kvh * k_head_stride;
      const T* v_head = v + kvh * v_head_stride;
#pragma unroll
      for (int c = static_cast<int>(threadIdx.x); c < BK * chunks; c += 128) {
        const int r = c / chunks, ch = c % chunks;
        const bool ok = r < valid;
        const std::int64_t row = ok ? key_rows(at + r) : 0;
        cp_async_16(sK + buf * BK * D + swizzle<D>(r, ch),
                    ok ? k_head + row * k_token_stride + ch * 8 : k, ok);
        cp_async_16(sV + buf * BK * D + swizzle<D>(r, ch),
                    ok ? v_head + row * v_token_stride + ch * 8 : v, ok);
      }
    } else {
      const std::int64_t row = key_rows(at);
      load_tile<BK, D, 128>(sK + buf * BK * D, k + kvh * k_head_stride + row * k_token_stride,
                            k_token_stride, valid);
      load_tile<BK, D, 128>(sV + buf * BK * D, v + kvh * v_head_stride + row * v_token_stride,
                            v_token_stride, valid);
    }
  };

  // The group's queries for this kv head, row r = token r / G, query head kvh * G + r % G (rows
  // past the group's zero-filled), with the first stages.
  for (int c = static_cast<int>(threadIdx.x); c < Rows * chunks; c += 128) {
    const int r = c / chunks, ch = c % chunks;
    const bool ok = r < rows;
    const T* src =
        ok ? q + (g.q_begin + r / group_size) * q_token_stride +
                 static_cast<std::int64_t>(kvh * group_size + r % group_size) * q_head_stride +
                 ch * 8
           : q;
    cp_async_16(sQ + swizzle<D>(r, ch), src, ok);
  }
#pragma unroll
  for (int t = 0; t < S - 1; ++t) {
    if (t < tiles) load_stage(t);
    cp_async_commit();
  }

  const std::uint32_t aQ = smem_address(sQ), aK = smem_address(sK), aV = smem_address(sV);
  std::uint32_t qf[KSteps][4];
  float acc[DTiles][4];
#pragma unroll
  for (int t = 0; t < DTiles; ++t)
    acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
  float m[2] = {neg_inf, neg_inf}, l[2] = {0.0f, 0.0f};

  for (int t = 0; t < tiles; ++t) {
    cp_async_wait<S - 2>();
    __syncthreads(); // stage t landed; every warp is done with the buffer refilled below
    if (t == 0) {
      // The queries to registers before stage S - 1 overwrites them.
#pragma unroll
      for (int kk = 0; kk < KSteps; ++kk)
        ldmatrix_x4(qf[kk], aQ + elem * swizzle<D>(wr * 16 + (lane & 15), kk * 2 + (lane >> 4)));
      __syncthreads();
    }
    if (t + S - 1 < tiles) load_stage(t + S - 1);
    cp_async_commit();
    const std::uint32_t cK = aK + (t % S) * (BK * D * elem);
    const std::uint32_t cV = aV + (t % S) * (BK * D * elem);

    // S = Q K^T for this warp's row tile and its KW keys of the stage.
    float s[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KSteps; ++kk)
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        std::uint32_t kb[4];
        const int krow = wk * KW + np * 16 + ((lane >> 4) << 3) + (lane & 7);
        ldmatrix_x4(kb, cK + elem * swizzle<D>(krow, kk * 2 + ((lane >> 3) & 1)));
        mma_16816<T>(s[2 * np], qf[kk], kb[0], kb[1]);
        mma_16816<T>(s[2 * np + 1], qf[kk], kb[2], kb[3]);
      }
    // Keys past the split (the last stage only) see nothing.
    const std::int64_t left = keys - static_cast<std::int64_t>(t) * BK;
    if (left < BK) {
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (wk * KW + n * 8 + 2 * (lane & 3) + (e & 1) >= left) s[n][e] = neg_inf;
    }

    // Online softmax in base 2 (NaN-aware maxima: a NaN score stays NaN in m, l and o); P is
    // packed to 16-bit pairs, two score tiles making one A fragment of P V.
    std::uint32_t pa[NT / 2][4];
    float mx[2] = {neg_inf, neg_inf};
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      mx[0] = nan_max(mx[0], nan_max(s[n][0], s[n][1]));
      mx[1] = nan_max(mx[1], nan_max(s[n][2], s[n][3]));
    }
    float corr[2], base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = nan_max(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = nan_max(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float now = nan_max(m[r], mx[r] * scale_log2);
      corr[r] = m[r] == neg_inf ? 0.0f : fast_exp2(m[r] - now);
      base[r] = now == neg_inf ? 0.0f : now; // nothing seen yet: every p is 0
      m[r] = now;
      l[r] *= corr[r];
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const float p0 = fast_exp2(fmaf(s[n][0], scale_log2, -base[0]));
      const float p1 = fast_exp2(fmaf(s[n][1], scale_log2, -base[0]));
      const float p2 = fast_exp2(fmaf(s[n][2], scale_log2, -base[1]));
      const float p3 = fast_exp2(fmaf(s[n][3], scale_log2, -base[1]));
      l[0] += p0 + p1;
      l[1] += p2 + p3;
      pa[n / 2][(n & 1) * 2] = pack2<T>(p0, p1);
      pa[n / 2][(n & 1) * 2 + 1] = pack2<T>(p2, p3);
    }
#pragma unroll
    for (int d = 0; d < DTiles; ++d) {
      acc[d][0] *= corr[0];
      acc[d][1] *= corr[0];
      acc[d][2] *= corr[1];
      acc[d][3] *= corr[1];
    }

    // O += P V over the warp's keys.
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk)
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        std::uint32_t vb[4];
        const int vrow = wk * KW + kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7);
        ldmatrix_x4_trans(vb, cV + elem * swizzle<D>(vrow, dp * 2 + (lane >> 4)));
        mma_16816<T>(acc[2 * dp], pa[kk], vb[0], vb[1]);
        mma_16816<T>(acc[2 * dp + 1], pa[kk], vb[2], vb[3]);
      }
  }
  cp_async_wait_all();
  __syncthreads(); // the stage buffers are free: the warps' states meet there

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  float* out = scratch + (static_cast<std::int64_t>(item.slot) * kv_heads + kvh) *
                             decode_partial_floats(D, Rows);
  if constexpr (KeyWarps == 1) {
    // One warp per row tile: its state is the split's.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wr * 16 + (lane >> 2) + r * 8;
      if (row >= rows) continue;
#pragma unroll
      for (int d = 0; d < DTiles; ++d)
        *reinterpret_cast<float2*>(out + row * D + d * 8 + 2 * (lane & 3)) =
            make_float2(acc[d][2 * r], acc[d][2 * r + 1]);
      if ((lane & 3) == 0) out[Rows * D + row] = m[r], out[Rows * (D + 1) + row] = l[r];
    }
  } else {
    float* o_s = reinterpret_cast<float*>(sK); // [KeyWarps][Rows][D]
    float* m_s = o_s + KeyWarps * Rows * D;    // [KeyWarps][Rows]
    float* l_s = m_s + KeyWarps * Rows;        // [KeyWarps][Rows]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wr * 16 + (lane >> 2) + r * 8;
#pragma unroll
      for (int d = 0; d < DTiles; ++d)
        *reinterpret_cast<float2*>(o_s + (wk * Rows + row) * D + d * 8 + 2 * (lane & 3)) =
            make_float2(acc[d][2 * r], acc[d][2 * r + 1]);
      if ((lane & 3) == 0) m_s[wk * Rows + row] = m[r], l_s[wk * Rows + row] = l[r];
    }
    __syncthreads();
    for (int i = static_cast<int>(threadIdx.x); i < rows * D; i += 128) {
      const int row = i / D, e = i % D;
      float top = neg_inf;
#pragma unroll
      for (int w = 0; w < KeyWarps; ++w)
        top = nan_max(top, m_s[w * Rows + row]);
      float o_sum = 0.0f, l_sum = 0.0f;
#pragma unroll
      for (int w = 0; w < KeyWarps; ++w) {
        const float mw = m_s[w * Rows + row];
        const float f = mw == neg_inf ? 0.0f : fast_exp2(mw - top);
        o_sum += o_s[(w * Rows + row) * D + e] * f;
        l_sum += l_s[w * Rows + row] * f;
      }
      out[row * D + e] = o_sum;
      if (e == 0) out[Rows * D + row] = top, out[Rows * (D + 1) + row] = l_sum;
    }
  }
}

//! One thread block per (group, kv head): the group's units in order (partials of `partial_rows`
//! rows), merged per (row, column), then into the state: `fresh` writes it, else the block merges
//! by `merge_into`. Each row's factors are decided once (phase 1) before any of its columns changes
//! (phase 2).
template <int HeadDim>
__global__ void __launch_bounds__(256)
    decode_combine_kernel(const block_group* groups, const std::int32_t* first_slot, int group_size,
                          int partial_rows, const float* scratch, float* o, float* lse, float* sum,
                          std::int64_t tokens, bool fresh) {
  constexpr float ln2 = 0.6931471805599453f, inf = __builtin_huge_valf();
  __shared__ float top_s[decode_max_rows], inv_s[decode_max_rows], old_s[decode_max_rows],
      block_s[decode_max_rows];
  const int gi = static_cast<int>(blockIdx.x), kvh = static_cast<int>(blockIdx.y);
  const int kv_heads = static_cast<int>(gridDim.y);
  const block_group g = groups[gi];
  const int rows = static_cast<int>(g.q_count) * group_size;
  const int s0 = first_slot[gi], s1 = first_slot[gi + 1];
  auto at = [&](int s) {
    return scratch + (static_cast<std::int64_t>(s) * kv_heads + kvh) *
                         decode_partial_floats(HeadDim, partial_rows);
  };
  auto state_row = [&](int r) {
    return static_cast<std::int64_t>(kvh * group_size + r % group_size) * tokens + g.q_begin +
           r / group_size;
  };
  if (static_cast<int>(threadIdx.x) < rows) {
    const int r = static_cast<int>(threadIdx.x);
    float top = -inf;
    for (int s = s0; s < s1; ++s)
      top = nan_max(top, at(s)[partial_rows * HeadDim + r]);
    float weight = 0.0f;
    if (top != -inf)
      for (int s = s0; s < s1; ++s) {
        const float mx = at(s)[partial_rows * HeadDim + r];
        weight += mx == -inf ? 0.0f : at(s)[partial_rows * (HeadDim + 1) + r] * fast_exp2(mx - top);
      }
    // The block's lse (natural log) for this row, and how it meets the state.
    const float block_lse = saw_key(weight) ? (top + log2f(weight)) * ln2 : -inf;
    const std::int64_t row = state_row(r);
    row_merge m{0.0f, saw_key(weight) ? 1.0f : 0.0f, block_lse, true};
    if (!fresh) m = merge_into(lse[row], block_lse);
    top_s[r] = top;
    inv_s[r] = inverse_sum(weight);
    old_s[r] = m.old;
    block_s[r] = m.block;
    lse[row] = m.new_ref;
    sum[row] = fresh ? m.block : sum[row] * m.old + m.block;
  }
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < rows * HeadDim; i += 256) {
    const int r = i / HeadDim, e = i % HeadDim;
    float acc = 0.0f;
    if (top_s[r] != -inf)
      for (int s = s0; s < s1; ++s) {
        const float* part = at(s);
        const float mx = part[partial_rows * HeadDim + r];
        acc += mx == -inf ? 0.0f : part[r * HeadDim + e] * fast_exp2(mx - top_s[r]);
      }
    float* orow = o + state_row(r) * HeadDim;
    const float block_o = acc * inv_s[r];
    orow[e] = fresh ? block_o : orow[e] * old_s[r] + block_o * block_s[r];
  }
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
