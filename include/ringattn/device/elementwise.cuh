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

//! `parts` partial states, slot r at `partials + r * slot_floats` (o `[rows, head_dim]`, then the
//! references `[rows]`, then the sums `[rows]`; row = head * tokens + token), merged in slot
//! order (`merge_partials`) into `out` and the rows' `lse`; two elements a thread at a time.
template <class T>
__global__ void merge_partials_kernel(const float* partials, std::int64_t slot_floats, int parts,
                                      std::int64_t rows, std::int64_t tokens, int head_dim, T* out,
                                      std::int64_t token_stride, std::int64_t head_stride,
                                      float* lse) {
  const std::int64_t pairs = rows * (head_dim / 2);
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / (head_dim / 2);
    const int e = static_cast<int>(i % (head_dim / 2)) * 2;
    const float* ref = partials + rows * head_dim + row;
    const float* sum = partials + rows * (head_dim + 1) + row;
    const float* o = partials + row * head_dim + e;
    float l = 0.0f;
    const float x = merge_partials(parts, ref, sum, o, slot_floats, l);
    const float y = merge_partials(parts, ref, sum, o + 1, slot_floats, l);
    T* dst = out + (row % tokens) * token_stride + (row / tokens) * head_stride + e;
    *reinterpret_cast<std::uint32_t*>(dst) = pack2<T>(x, y);
    if (e == 0) lse[row] = l;
  }
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
