#pragma once
//! \file
//! Kernels that bring a library call's packed outputs (block/device/pieces.cuh) to the ring: merge
//! packed (O, LSE) rows into the running state, gather LSE rows into the packed layout, add
//! packed gradient rows into fp32 accumulators. Each destination row takes its packed rows in
//! the order of its `row_reduction`, so results repeat bit for bit.

#include <ringattn/block/kernel/primitives.cuh>
#include <ringattn/config.cuh>
#include <ringattn/core/element.cuh>
#include <ringattn/core/state.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

//! Packed rows into a head-major state: one warp per (destination entry, head). `o` is
//! `[rows, heads, head_dim]` (T, dense), the block's lse of packed row r and head h at
//! `stats[r * stats_row + h * stats_head]`.
template <class T>
__global__ void
merge_rows_kernel(const T* __restrict__ o, const float* __restrict__ stats, std::int64_t stats_row,
                  std::int64_t stats_head, const std::int32_t* __restrict__ dest,
                  const std::int32_t* __restrict__ first, const std::int32_t* __restrict__ source,
                  std::int64_t entries, attention_state s) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  const int d = s.head_dim;
  for (std::int64_t w = blockIdx.x * static_cast<std::int64_t>(blockDim.x / 32) + threadIdx.x / 32;
       w < entries * s.q_heads; w += warps) {
    const std::int64_t e = w / s.q_heads;
    const int h = static_cast<int>(w % s.q_heads);
    const std::int64_t t = dest[e];
    float* acc = s.o_row(t, h);
    float ref = s.lse_at(t, h), sum = s.sum_at(t, h);
    for (std::int32_t k = first[e]; k < first[e + 1]; ++k) {
      const std::int64_t r = source[k];
      const row_merge m = merge_into(ref, stats[r * stats_row + h * stats_head]);
      const T* src = o + (r * s.q_heads + h) * d;
      for (int i = lane; i < d; i += 32)
        acc[i] = acc[i] * m.old + m.block * to_float(src[i]);
      sum = sum * m.old + m.block;
      ref = m.new_ref;
    }
    if (lane == 0) s.lse_at(t, h) = ref, s.sum_at(t, h) = sum;
  }
}

//! `out[r * out_row + h * out_head] = lse[h * tokens + rows[r]]` for every packed row r.
//! (A template only so that every translation unit may define it.)
template <int Unused = 0>
__global__ void gather_lse_kernel(const float* __restrict__ lse, std::int64_t tokens, int heads,
                                  const std::int32_t* __restrict__ rows, std::int64_t count,
                                  float* __restrict__ out, std::int64_t out_row,
                                  std::int64_t out_head) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < count * heads; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / heads;
    const int h = static_cast<int>(i % heads);
    out[r * out_row + h * out_head] = lse[h * tokens + rows[r]];
  }
}

//! A library forward's max-logit form turned into its lse, in place: entry i of `row_max` (each
//! row's largest logit, natural units) and of `sum_exp` (its sum of exponentials against that
//! maximum) becomes `final_lse(max, sum)`. Entries are `[rows, heads]` (`token_major`) or
//! `[heads, rows]`. With `max_logit`, every entry's `max_logit_of(max, sum)` is raised into its
//! head's value (NaN winning), through a per-block maximum in shared memory (`heads` floats of
//! dynamic shared memory) and one atomic per head and block.
template <int Unused = 0>
__global__ void lse_of_row_maxima_kernel(float* __restrict__ row_max,
                                         const float* __restrict__ sum_exp, std::int64_t rows,
                                         int heads, bool token_major, float* max_logit) {
  extern __shared__ float block_max[];
  if (max_logit != nullptr) {
    for (int h = static_cast<int>(threadIdx.x); h < heads; h += static_cast<int>(blockDim.x))
      block_max[h] = -__builtin_huge_valf();
    __syncthreads();
  }
  const std::int64_t n = rows * heads;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float m = row_max[i], s = sum_exp[i];
    row_max[i] = final_lse(m, s);
    if (max_logit != nullptr) {
      const int h = static_cast<int>(token_major ? i % heads : i / rows);
      atomic_max_logit(block_max + h, max_logit_of(m, s));
    }
  }
  if (max_logit != nullptr) {
    __syncthreads();
    for (int h = static_cast<int>(threadIdx.x); h < heads; h += static_cast<int>(blockDim.x))
      atomic_max_logit(max_logit + h, block_max[h]);
  }
}

//! `acc[dest[e]] += sum of packed[source[k]]` (rows of `width` elements, fp32 accumulator, T
//! packed rows), the sum taken in order in fp32 before the one addition.
template <class T>
__global__ void add_rows_kernel(float* __restrict__ acc, const T* __restrict__ packed,
                                std::int64_t width, const std::int32_t* __restrict__ dest,
                                const std::int32_t* __restrict__ first,
                                const std::int32_t* __restrict__ source, std::int64_t entries) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < entries * width; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t e = i / width, c = i % width;
    float x = 0.0f;
    for (std::int32_t k = first[e]; k < first[e + 1]; ++k)
      x += to_float(packed[source[k] * width + c]);
    acc[dest[e] * width + c] += x;
  }
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
