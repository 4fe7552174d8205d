#pragma once
//! \file
//! Element-wise kernels of the state and the gradients: fill (a state's reset), finalise (o / sum
//! into the output, the rows' lse).

#include <ringattn/config.cuh>
#include <ringattn/core/state.cuh>
#include <ringattn/device/primitives.cuh>

#include <cstdint>

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

template <class V>
__global__ void fill_kernel(V* p, std::int64_t n, V value) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    p[i] = value;
}

//! `acc[i] = nan_max(acc[i], in[i])` for i < n (the max logits of another rank). (A template
//! only so that every translation unit may define it.)
template <int Unused = 0>
__global__ void max_logit_kernel(float* acc, const float* in, int n) {
  for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x))
    acc[i] = nan_max(acc[i], in[i]);
}

//! o / sum of every row of a (head-major) state into `out`, and the row's lse over its reference
//! (the thread that handles a row's first pair).
template <class T>
__global__ void finalize_kernel(const float* o, float* lse, const float* sum, T* out,
                                std::int64_t rows, std::int64_t tokens, int head_dim,
                                std::int64_t token_stride, std::int64_t head_stride) {
  // Row r of the state is (head r / tokens, token r % tokens); two elements a thread at a time.
  const std::int64_t pairs = rows * (head_dim / 2);
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / (head_dim / 2);
    const int e = static_cast<int>(i % (head_dim / 2)) * 2;
    const float s = sum[row], inv = inverse_sum(s);
    const float2 x = *reinterpret_cast<const float2*>(o + row * head_dim + e);
    T* dst = out + (row % tokens) * token_stride + (row / tokens) * head_stride + e;
    *reinterpret_cast<std::uint32_t*>(dst) = pack2<T>(x.x * inv, x.y * inv);
    if (e == 0) lse[row] = final_lse(lse[row], s);
  }
}

//! A (head-major) state as a finished partial: o / sum of every row to `out` (`[rows,
//! head_dim]`) and the row's lse over its reference to `out_lse`; two elements a thread at a time.
template <class T>
__global__ void finish_partial_kernel(const float* o, const float* ref, const float* sum, T* out,
                                      float* out_lse, std::int64_t rows, int head_dim) {
  const std::int64_t pairs = rows * (head_dim / 2);
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / (head_dim / 2);
    const float s = sum[row], inv = inverse_sum(s);
    const float2 x = *reinterpret_cast<const float2*>(o + 2 * i);
    *reinterpret_cast<std::uint32_t*>(out + 2 * i) = pack2<T>(x.x * inv, x.y * inv);
    if (2 * i == row * head_dim) out_lse[row] = final_lse(ref[row], s);
  }
}

//! `parts` finished partials, partial r's outputs (`[rows, head_dim]`, row = head * tokens +
//! token) at `o + r * o_stride` and its lse at `lse_of + r * lse_stride` (elements), merged in
//! that order (`merge_finished`) into `out` and the rows' `lse`; two elements a thread at a time.
template <class T>
__global__ void merge_finished_kernel(const T* o, std::int64_t o_stride, const float* lse_of,
                                      std::int64_t lse_stride, int parts, std::int64_t rows,
                                      std::int64_t tokens, int head_dim, T* out,
                                      std::int64_t token_stride, std::int64_t head_stride,
                                      float* lse) {
  const std::int64_t pairs = rows * (head_dim / 2);
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / (head_dim / 2);
    const int e = static_cast<int>(i % (head_dim / 2)) * 2;
    float l = 0.0f;
    const float x = merge_finished(parts, lse_of + row, lse_stride, o + 2 * i, o_stride, l);
    const float y = merge_finished(parts, lse_of + row, lse_stride, o + 2 * i + 1, o_stride, l);
    T* dst = out + (row % tokens) * token_stride + (row / tokens) * head_stride + e;
    *reinterpret_cast<std::uint32_t*>(dst) = pack2<T>(x, y);
    if (e == 0) lse[row] = l;
  }
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
