#pragma once
//! \file
//! Element-wise kernels of the state and the gradients, shared by every BlockKernel and schedule:
//! fill (a state's reset), finalise (o / sum into the output, the rows' lse), finished partials
//! and their merge, the backward's delta (one warp per row), fp32 sums and the gradients'
//! conversion to T.

#include <ringattn/block/kernel/primitives.cuh>
#include <ringattn/config.cuh>
#include <ringattn/core/element.cuh>
#include <ringattn/core/state.cuh>

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

//! One warp's fp32 sum, in every lane.
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1)
    x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <class T, int D>
__device__ __forceinline__ void load_row(const T* p, float (&x)[D / 32]) {
  const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
  for (int e = 0; e < D / 32; ++e)
    x[e] = to_float(p[lane + 32 * e]);
}

template <int D>
__device__ __forceinline__ float dot(const float (&a)[D / 32], const float (&b)[D / 32]) {
  float s = 0.0f;
#pragma unroll
  for (int e = 0; e < D / 32; ++e)
    s = fmaf(a[e], b[e], s);
  return warp_sum(s);
}

//! D[h, t] = dout(t, h) . out(t, h): one warp per (t, h).
template <class T, int D>
__global__ void delta_kernel(const T* out, std::int64_t o_ts, std::int64_t o_hs, const T* dout,
                             std::int64_t d_ts, std::int64_t d_hs, float* delta,
                             std::int64_t tokens, int heads) {
  const std::int64_t w = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / 32;
  if (w >= tokens * heads) return;
  const std::int64_t t = w / heads;
  const int h = static_cast<int>(w % heads);
  float a[D / 32], b[D / 32];
  load_row<T, D>(out + t * o_ts + h * o_hs, a);
  load_row<T, D>(dout + t * d_ts + h * d_hs, b);
  const float s = dot<D>(a, b);
  if (threadIdx.x % 32 == 0) delta[h * tokens + t] = s;
}

//! a[i] += b[i] (fp32), one writer per element. (A template only so that every translation unit
//! may define it.)
template <int Unused = 0>
__global__ void add_kernel(float* a, const float* b, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    a[i] += b[i];
}

//! An fp32 dense [tokens, heads, d] accumulator written to a (strided) T view.
template <class T>
__global__ void convert_kernel(const float* x, T* out, std::int64_t tokens, int heads, int d,
                               std::int64_t token_stride, std::int64_t head_stride) {
  const std::int64_t n = tokens * heads * d;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / d;
    const int e = static_cast<int>(i % d);
    out[(row / heads) * token_stride + (row % heads) * head_stride + e] = from_float<T>(x[i]);
  }
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
