#pragma once
//! \file
//! The kernel that quantises rows of K or V into an FP8 (e4m3) cache (block/device/kv_quantize.cuh
//! launches it): one thread per element, each divided by its row's scale.

#include <ringattn/config.cuh>
#include <ringattn/core/element.cuh>
#include <ringattn/core/kv_scales.cuh>

#include <cstdint>

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

//! Row i of `src` (`tokens` rows of `heads` x `head_dim`, strides in elements) to row `rows[i]`
//! (i where `rows` is null) of `dst`, element x as `quantize_e4m3(x, scale[index])`.
template <class T, class Scales>
__global__ void quantize_rows_kernel(const T* src, std::int64_t src_token_stride,
                                     std::int64_t src_head_stride, std::int64_t tokens, int heads,
                                     int head_dim, const std::int64_t* rows, fp8_e4m3* dst,
                                     std::int64_t dst_token_stride, std::int64_t dst_head_stride,
                                     const float* scale, int page_shift) {
  const std::int64_t per_row = static_cast<std::int64_t>(heads) * head_dim;
  const std::int64_t all = tokens * per_row;
  for (std::int64_t at = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; at < all;
       at += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t i = at / per_row;
    const int h = static_cast<int>(at % per_row / head_dim), e = static_cast<int>(at % head_dim);
    const std::int64_t row = rows ? rows[i] : i;
    dst[row * dst_token_stride + h * dst_head_stride + e] =
        quantize_e4m3(to_float(src[i * src_token_stride + h * src_head_stride + e]),
                      scale[Scales::index(row, page_shift, h, heads)]);
  }
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
