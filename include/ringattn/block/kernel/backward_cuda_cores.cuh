#pragma once
//! \file
//! CUDA kernels of the block backward (block/device/backward.cuh): deterministic, no atomics. One
//! warp computes one output row — a (key column, kv head) of dK/dV, or a (query row, query head) of
//! dQ — looping over everything that row depends on in a fixed order, with the head_dim spread
//! over the lanes (head_dim / 32 elements each) and dot products reduced by shuffles. fp32
//! throughout; P is recomputed from the forward's final LSE.
//!
//! This is the correctness-first version: plain fp32 arithmetic on the CUDA cores, each K/V (or
//! Q/dO) row read once per pair it takes part in. Tensor-core kernels (tiles of Q, K, V, dO in
//! shared memory, S, dP, dS on mma/wgmma) replace these with the same contract and the same
//! determinism (docs/kernels.md).

#include <ringattn/block/kernel/elementwise.cuh>
#include <ringattn/config.cuh>
#include <ringattn/core/block.cuh>
#include <ringattn/core/element.cuh>

#include <cstdint>

RINGATTN_ABI_BEGIN
namespace kernels {

//! A run of key columns of a K/V block that the same (group, key segment) pairs cover.
struct key_interval {
  std::int64_t begin = 0, end = 0; //!< columns [begin, end) of the K/V block
  std::int64_t first_item = 0;     //!< index of its first column among all intervals' columns
  std::int32_t cover_begin = 0, cover_count = 0; //!< entries of `covers`
};
//! One (group, key segment) that covers a key interval.
struct key_cover {
  std::int32_t group = 0, segment = 0;
};
//! One key tile of the tensor-core dK/dV kernel: columns [begin, begin + 64) of interval
//! `interval` (fewer at the interval's end).
struct key_tile {
  std::int32_t interval = 0;
  std::int64_t begin = 0;
};
//! One query row of a group: (group, row within the group).
struct query_row {
  std::int32_t group = 0, row = 0;
};

template <class T>
struct backward_params {
  const T* q;
  const T* k;
  const T* v;
  const T* dout;
  std::int64_t q_token_stride, q_head_stride, k_token_stride, k_head_stride;
  std::int64_t v_token_stride, v_head_stride, do_token_stride, do_head_stride;
  const float* lse;   // [q_heads, q_tokens]
  const float* delta; // [q_heads, q_tokens]
  float* dq;          // dense [q_tokens, q_heads, d]
  float* dk;          // dense [kv_tokens, kv_heads, d]
  float* dv;
  const block_group* groups;
  const key_interval* intervals;
  const key_cover* covers;
  const query_row* rows;
  std::int64_t key_items; // columns of all intervals
  std::int32_t interval_count;
  std::int64_t row_items; // query rows of all groups
  std::int64_t q_tokens;
  std::int32_t q_heads, kv_heads, group_size;
  float scale;
};

} // namespace kernels
RINGATTN_ABI_END

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

//! dK, dV of one (key column, kv head) per warp, added to the fp32 accumulators.
template <class T, int D>
__global__ void dkdv_kernel(backward_params<T> p) {
  const std::int64_t w = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / 32;
  if (w >= p.key_items * p.kv_heads) return;
  const std::int64_t item = w / p.kv_heads;
  const int kvh = static_cast<int>(w % p.kv_heads);
  // The interval holding column `item` (intervals are few: a linear search).
  int iv = 0;
  while (iv + 1 < p.interval_count && p.intervals[iv + 1].first_item <= item)
    ++iv;
  const key_interval in = p.intervals[iv];
  const std::int64_t j = in.begin + (item - in.first_item);
  float k[D / 32], v[D / 32], dk[D / 32] = {}, dv[D / 32] = {}, q[D / 32], o[D / 32];
  load_row<T, D>(p.k + j * p.k_token_stride + kvh * p.k_head_stride, k);
  load_row<T, D>(p.v + j * p.v_token_stride + kvh * p.v_head_stride, v);
  for (int c = 0; c < in.cover_count; ++c) {
    const key_cover cv = p.covers[in.cover_begin + c];
    const block_group& g = p.groups[cv.group];
    const kv_block& kb = g.kv[cv.segment];
    const std::int64_t jl = j - kb.kv_begin;
    // Rows i with lo <= jl - i <= hi.
    const std::int64_t i0 = jl - kb.mask.hi > 0 ? jl - kb.mask.hi : 0;
    const std::int64_t i1 = jl - kb.mask.lo + 1 < g.q_count ? jl - kb.mask.lo + 1 : g.q_count;
    for (std::int64_t i = i0; i < i1; ++i) {
      const std::int64_t row = g.q_begin + i;
      for (int h = kvh * p.group_size; h < (kvh + 1) * p.group_size; ++h) {
        const float lse = p.lse[h * p.q_tokens + row];
        load_row<T, D>(p.q + row * p.q_token_stride + h * p.q_head_stride, q);
        load_row<T, D>(p.dout + row * p.do_token_stride + h * p.do_head_stride, o);
        const float pr = __expf(dot<D>(q, k) * p.scale - lse);
        const float ds = pr * (dot<D>(o, v) - p.delta[h * p.q_tokens + row]) * p.scale;
#pragma unroll
        for (int e = 0; e < D / 32; ++e) {
          dv[e] = fmaf(pr, o[e], dv[e]);
          dk[e] = fmaf(ds, q[e], dk[e]);
        }
      }
    }
  }
  const int lane = static_cast<int>(threadIdx.x % 32);
  float* dkr = p.dk + (j * p.kv_heads + kvh) * D;
  float* dvr = p.dv + (j * p.kv_heads + kvh) * D;
#pragma unroll
  for (int e = 0; e < D / 32; ++e) {
    dkr[lane + 32 * e] += dk[e];
    dvr[lane + 32 * e] += dv[e];
  }
}

//! dQ of one (query row, query head) per warp, added to the fp32 accumulator.
template <class T, int D>
__global__ void dq_kernel(backward_params<T> p) {
  const std::int64_t w = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / 32;
  if (w >= p.row_items * p.q_heads) return;
  const query_row qr = p.rows[w / p.q_heads];
  const int h = static_cast<int>(w % p.q_heads), kvh = h / p.group_size;
  const block_group& g = p.groups[qr.group];
  const std::int64_t row = g.q_begin + qr.row;
  const float lse = p.lse[h * p.q_tokens + row];
  if (lse == -__int_as_float(0x7f800000)) return; // saw no key: no gradient
  const float dsum = p.delta[h * p.q_tokens + row];
  float q[D / 32], o[D / 32], k[D / 32], v[D / 32], acc[D / 32] = {};
  load_row<T, D>(p.q + row * p.q_token_stride + h * p.q_head_stride, q);
  load_row<T, D>(p.dout + row * p.do_token_stride + h * p.do_head_stride, o);
  for (int b = 0; b < g.count; ++b) {
    const kv_block& kb = g.kv[b];
    const index_range c = kb.mask.columns(qr.row, qr.row + 1, kb.kv_count);
    for (std::int64_t jl = c.begin; jl < c.end; ++jl) {
      const std::int64_t j = kb.kv_begin + jl;
      load_row<T, D>(p.k + j * p.k_token_stride + kvh * p.k_head_stride, k);
      load_row<T, D>(p.v + j * p.v_token_stride + kvh * p.v_head_stride, v);
      const float pr = __expf(dot<D>(q, k) * p.scale - lse);
      const float ds = pr * (dot<D>(o, v) - dsum) * p.scale;
#pragma unroll
      for (int e = 0; e < D / 32; ++e)
        acc[e] = fmaf(ds, k[e], acc[e]);
    }
  }
  const int lane = static_cast<int>(threadIdx.x % 32);
  float* dqr = p.dq + (row * p.q_heads + h) * D;
#pragma unroll
  for (int e = 0; e < D / 32; ++e)
    dqr[lane + 32 * e] += acc[e];
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
