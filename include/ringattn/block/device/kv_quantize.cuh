#pragma once
//! \file
//! Appending to an FP8 KV cache: rows of K or V in the step's element type quantised to e4m3
//! (`quantize_e4m3`: x / scale, rounded to nearest even, finite values saturating at +-448, NaN
//! and infinity becoming NaN) into rows of a cache shard, with the scales the cache is read with
//! (`head_scales` or `page_scales`, core/kv_scales.cuh); the kernel is
//! block/kernel/kv_quantize.cuh's. The scales are the caller's: a page's or a head's scale is
//! chosen before its first row is written (from a prefill's largest magnitude, say) and kept while
//! the cache holds it.
//!
//! \code
//! // After a step: this rank's owned new rows (owned_new_rows) into the pool rows it gave them.
//! ringattn::quantize_into_cache(k_new_rows, dst_rows, k_pool, ringattn::page_scales{ks, vs},
//!                               /*key=*/true, page_size, stream);
//! \endcode

#include <ringattn/block/kernel/kv_quantize.cuh>
#include <ringattn/core/element.cuh>
#include <ringattn/core/kv_scales.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/error.cuh>
#include <ringattn/tensor.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <span>
#include <string>

namespace ringattn {

namespace detail {
// The common checks of both paths: `src` and `dst` views of the same heads and width, a page
// size that is a power of two where the scales are per page, scales present.
template <element T, kv_scales Scales>
validation check_quantize(thd_view<const T> src, thd_view<fp8_e4m3> dst, const Scales& scales,
                          bool key, int page_size) {
  validation r = validate_view(src, "the rows to append");
  r.require(validate_view(dst, "the cache"));
  if (!r) return r;
  r.require(src.heads == dst.heads && src.head_dim == dst.head_dim, "the rows to append are [",
            src.tokens, ", ", src.heads, ", ", src.head_dim, "] but the cache's rows are [",
            dst.heads, ", ", dst.head_dim, "]");
  if constexpr (std::same_as<Scales, page_scales>)
    r.require(page_size >= 1 && std::has_single_bit(static_cast<unsigned>(page_size)),
              "page_scales need the cache's page size, a power of two (got ", page_size, ")");
  r.require(src.tokens == 0 || (key ? scales.k : scales.v) != nullptr, "the ", Scales::name, "' ",
            key ? "k" : "v", " is a null pointer");
  return r;
}
} // namespace detail

//! Host memory: row i of `src` quantised into row `rows[i]` of `dst` with the scales of `key`
//! (K's, else V's) of `scales` (`page_size`: the cache's, for `page_scales`). Throws
//! `invalid_argument`, writing nothing, for a row outside `dst` or mismatched views.
template <element T, kv_scales Scales>
void quantize_into_cache_host(thd_view<const T> src, std::span<const std::int64_t> rows,
                              thd_view<fp8_e4m3> dst, Scales scales, bool key, int page_size = 1) {
  validation r = detail::check_quantize(src, dst, scales, key, page_size);
  r.require(static_cast<std::int64_t>(rows.size()) == src.tokens, "rows names ", rows.size(),
            " destinations for ", src.tokens, " rows");
  for (std::size_t i = 0; r && i < rows.size(); ++i)
    r.require(rows[i] >= 0 && rows[i] < dst.tokens, "row ", i, " goes to cache row ", rows[i],
              ", outside the cache's ", dst.tokens);
  r.throw_if_invalid();
  const int shift = std::countr_zero(static_cast<unsigned>(page_size));
  const float* scale = key ? scales.k : scales.v;
  for (std::int64_t i = 0; i < src.tokens; ++i)
    for (int h = 0; h < src.heads; ++h) {
      const float s = scale[Scales::index(rows[static_cast<std::size_t>(i)], shift, h, dst.heads)];
      for (int e = 0; e < src.head_dim; ++e)
        dst(rows[static_cast<std::size_t>(i)], h, e) = quantize_e4m3(to_float(src(i, h, e)), s);
    }
}

} // namespace ringattn

#if defined(__CUDACC__)
namespace ringattn {

//! Device memory, asynchronous on `stream`: row i of `src` quantised into row `rows[i]` of `dst`
//! (`rows`: device memory, `src.tokens` entries inside `dst`, the caller's to keep so; null:
//! row i itself) with the scales of `key` of `scales` (device memory). Throws
//! `invalid_argument`, enqueuing nothing, for mismatched views or missing scales.
template <device_element T, kv_scales Scales>
void quantize_into_cache(thd_view<const T> src, const std::int64_t* rows, thd_view<fp8_e4m3> dst,
                         Scales scales, bool key, int page_size, cudaStream_t stream) {
  validation r = detail::check_quantize(src, dst, scales, key, page_size);
  r.require(rows != nullptr || src.tokens <= dst.tokens, "the ", src.tokens,
            " rows to append do not fit the cache's ", dst.tokens, " rows");
  r.throw_if_invalid();
  if (src.tokens == 0) return;
  const std::int64_t all = src.tokens * src.heads * src.head_dim;
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((all + 255) / 256, 65535));
  kernels::quantize_rows_kernel<T, Scales><<<blocks, 256, 0, stream>>>(
      src.data, src.token_stride, src.head_stride, src.tokens, src.heads, src.head_dim, rows,
      dst.data, dst.token_stride, dst.head_stride, key ? scales.k : scales.v,
      std::countr_zero(static_cast<unsigned>(page_size)));
  RINGATTN_CUDA_CHECK_LAUNCH();
}

} // namespace ringattn
#endif
