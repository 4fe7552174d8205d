#pragma once
//! \file
//! The split-K/V block forward for few query rows (decoding): a launch's unit is one key range
//! (a split) of one group's K/V segment for one kv head, and all query rows of the group that
//! share that kv head (new tokens x the GQA group: at most `decode_max_rows`). CUDA cores in
//! fp32: the block is bound by reading K and V, and tensor-core tiles of 64 or 128 query rows
//! would compute mostly padding.
//!
//! `decode_split_kernel`: each of the 4 warps walks tiles of 32 keys of its split. Scores: lane l
//! takes key l of the tile and dots it with every row's query (fp32, in shared memory, read as
//! broadcasts); one warp maximum per row per tile keeps an online softmax. Values: lane l owns
//! `HeadDim / 32` output columns and adds every key's value row, the key's weights passed round
//! by shuffles. The warps' states meet in shared memory and the split's unnormalised output,
//! maximum (log2 units) and weight sum go to the scratch. `decode_combine_kernel`: per row, the
//! splits in order, then the block merges into the fp32 state (core/state.cuh) as a `fresh` or
//! a `merge` epilogue.

#include <ringattn/config.cuh>
#include <ringattn/core/block.cuh>
#include <ringattn/core/element.cuh>
#include <ringattn/core/state.cuh>
#include <ringattn/device/primitives.cuh>

#include <cstdint>
#include <type_traits>

namespace ringattn {

//! Query rows (new tokens x query heads per kv head) one unit of the split kernel takes.
inline constexpr int decode_max_rows = 16;

//! One unit of the split kernel: keys [kv_lo, kv_hi) of group `group`'s segment; its partial
//! goes to scratch slot `slot` (x kv heads).
struct decode_item {
  std::int32_t group = 0;
  std::int32_t slot = 0;
  std::int64_t kv_lo = 0, kv_hi = 0;
};

} // namespace ringattn

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

//! `N` consecutive elements (N = 2, 4 or 8; 4, 8 or 16 bytes, aligned to that) as floats.
template <int N, class T>
__device__ __forceinline__ void load_as_float(const T* p, float (&out)[N]) {
  static_assert(N == 2 || N == 4 || N == 8);
  using word = std::conditional_t<N == 2, std::uint32_t, std::conditional_t<N == 4, uint2, uint4>>;
  const word w = *reinterpret_cast<const word*>(p);
  const T* x = reinterpret_cast<const T*>(&w);
#pragma unroll
  for (int i = 0; i < N; ++i)
    out[i] = to_float(x[i]);
}

//! Floats of one unit's partial for one kv head: per row an output of `head_dim`, a maximum and a
//! weight sum.
__host__ __device__ constexpr std::int64_t decode_partial_floats(int head_dim) {
  return static_cast<std::int64_t>(decode_max_rows) * (head_dim + 2);
}

template <class T, int HeadDim, int Rows>
__global__ void __launch_bounds__(128)
    decode_split_kernel(const T* q, std::int64_t q_token_stride, std::int64_t q_head_stride,
                        const T* k, std::int64_t k_token_stride, std::int64_t k_head_stride,
                        const T* v, std::int64_t v_token_stride, std::int64_t v_head_stride,
                        const block_group* groups, const decode_item* items, int group_size,
                        float scale_log2, float* scratch) {
  constexpr int warps = 4, per_lane = HeadDim / 32, chunk = 8;
  __shared__ float q_s[Rows][HeadDim];
  __shared__ float o_s[warps][Rows][HeadDim];
  __shared__ float m_s[warps][Rows], l_s[warps][Rows];
  const decode_item item = items[blockIdx.x];
  const block_group g = groups[item.group];
  const int kvh = static_cast<int>(blockIdx.y), kv_heads = static_cast<int>(gridDim.y);
  const int rows = static_cast<int>(g.q_count) * group_size;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  // The group's queries for this kv head: row r = token r / G, query head kvh * G + r % G.
  for (int i = static_cast<int>(threadIdx.x); i < rows * HeadDim; i += 128) {
    const int r = i / HeadDim, e = i % HeadDim;
    const T* row = q + (g.q_begin + r / group_size) * q_token_stride +
                   static_cast<std::int64_t>(kvh * group_size + r % group_size) * q_head_stride;
    q_s[r][e] = to_float(row[e]) * scale_log2;
  }
  __syncthreads();
  const std::int64_t base = g.kv[0].kv_begin;
  const T* k_head = k + kvh * k_head_stride;
  const T* v_head = v + kvh * v_head_stride;
  float m[Rows], l[Rows], o[Rows][per_lane];
#pragma unroll
  for (int r = 0; r < Rows; ++r) {
    m[r] = -__builtin_huge_valf(), l[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < per_lane; ++c)
      o[r][c] = 0.0f;
  }
  for (std::int64_t tile = item.kv_lo + warp * 32; tile < item.kv_hi; tile += warps * 32) {
    const std::int64_t key = tile + lane;
    const bool valid = key < item.kv_hi;
    float s[Rows];
#pragma unroll
    for (int r = 0; r < Rows; ++r)
      s[r] = 0.0f;
    if (valid) {
      const T* kr = k_head + (base + key) * k_token_stride;
#pragma unroll 8
      for (int e = 0; e < HeadDim; e += chunk) {
        float kf[chunk];
        load_as_float<chunk>(kr + e, kf);
#pragma unroll
        for (int r = 0; r < Rows; ++r)
          if (r < rows) {
            const float4 a = *reinterpret_cast<const float4*>(&q_s[r][e]);
            const float4 b = *reinterpret_cast<const float4*>(&q_s[r][e + 4]);
            s[r] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] + b.x * kf[4] +
                    b.y * kf[5] + b.z * kf[6] + b.w * kf[7];
          }
      }
    }
    const int keys = static_cast<int>(item.kv_hi - tile < 32 ? item.kv_hi - tile : 32);
    float p[Rows];
#pragma unroll
    for (int r = 0; r < Rows; ++r) {
      if (r >= rows) break;
      float tile_max = valid ? s[r] : -__builtin_huge_valf();
#pragma unroll
      for (int off = 16; off > 0; off /= 2)
        tile_max = nan_max(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
      const float now = nan_max(m[r], tile_max);
      const float correction = fast_exp2(m[r] - now); // m = -inf at first: exp2(-inf) = 0
      p[r] = valid ? fast_exp2(s[r] - now) : 0.0f;
      l[r] = l[r] * correction + p[r];
#pragma unroll
      for (int c = 0; c < per_lane; ++c)
        o[r][c] *= correction;
      m[r] = now;
    }
    // Eight value rows in flight at a time (their loads do not wait on the adds).
    for (int j0 = 0; j0 < keys; j0 += 8) {
      float vf[8][per_lane];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        if (j0 + u < keys)
          load_as_float<per_lane>(
              v_head + (base + tile + j0 + u) * v_token_stride + lane * per_lane, vf[u]);
        else
#pragma unroll
          for (int c = 0; c < per_lane; ++c)
            vf[u][c] = 0.0f;
      }
#pragma unroll
      for (int u = 0; u < 8; ++u)
#pragma unroll
        for (int r = 0; r < Rows; ++r)
          if (r < rows) {
            const float pj = __shfl_sync(0xffffffffu, p[r], (j0 + u) & 31);
#pragma unroll
            for (int c = 0; c < per_lane; ++c)
              o[r][c] += pj * vf[u][c];
          }
    }
  }
  // Each warp's state into shared memory (its weight sums reduced over the lanes), then one
  // merge over the warps per (row, column).
#pragma unroll
  for (int r = 0; r < Rows; ++r) {
    if (r >= rows) break;
    float sum = l[r];
#pragma unroll
    for (int off = 16; off > 0; off /= 2)
      sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) m_s[warp][r] = m[r], l_s[warp][r] = sum;
#pragma unroll
    for (int c = 0; c < per_lane; ++c)
      o_s[warp][r][lane * per_lane + c] = o[r][c];
  }
  __syncthreads();
  float* out = scratch + (static_cast<std::int64_t>(item.slot) * kv_heads + kvh) *
                             decode_partial_floats(HeadDim);
  for (int i = static_cast<int>(threadIdx.x); i < rows * HeadDim; i += 128) {
    const int r = i / HeadDim, e = i % HeadDim;
    float top = -__builtin_huge_valf();
#pragma unroll
    for (int w = 0; w < warps; ++w)
      top = nan_max(top, m_s[w][r]);
    float acc = 0.0f, sum = 0.0f;
#pragma unroll
    for (int w = 0; w < warps; ++w) {
      const float f = m_s[w][r] == -__builtin_huge_valf() ? 0.0f : fast_exp2(m_s[w][r] - top);
      acc += o_s[w][r][e] * f;
      sum += l_s[w][r] * f;
    }
    out[r * HeadDim + e] = acc;
    if (e == 0) {
      out[decode_max_rows * HeadDim + r] = top;
      out[decode_max_rows * (HeadDim + 1) + r] = sum;
    }
  }
}

//! One thread block per (group, kv head): the group's units in order, merged per (row, column),
//! then into the state: `fresh` writes it, else the block merges by `merge_into`. Each row's
//! factors are decided once (phase 1) before any of its columns changes (phase 2).
template <int HeadDim>
__global__ void __launch_bounds__(256)
    decode_combine_kernel(const block_group* groups, const std::int32_t* first_slot, int group_size,
                          const float* scratch, float* o, float* lse, float* sum,
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
    return scratch +
           (static_cast<std::int64_t>(s) * kv_heads + kvh) * decode_partial_floats(HeadDim);
  };
  auto state_row = [&](int r) {
    return static_cast<std::int64_t>(kvh * group_size + r % group_size) * tokens + g.q_begin +
           r / group_size;
  };
  if (static_cast<int>(threadIdx.x) < rows) {
    const int r = static_cast<int>(threadIdx.x);
    float top = -inf;
    for (int s = s0; s < s1; ++s)
      top = nan_max(top, at(s)[decode_max_rows * HeadDim + r]);
    float weight = 0.0f;
    if (top != -inf)
      for (int s = s0; s < s1; ++s) {
        const float mx = at(s)[decode_max_rows * HeadDim + r];
        weight +=
            mx == -inf ? 0.0f : at(s)[decode_max_rows * (HeadDim + 1) + r] * fast_exp2(mx - top);
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
        const float mx = part[decode_max_rows * HeadDim + r];
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
