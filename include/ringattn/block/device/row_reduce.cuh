#pragma once
//! \file
//! Launchers of the packed-row kernels (block/kernel/row_reduce.cuh): what a model backed by
//! another library's fused attention runs around each of its calls. Asynchronous on the given
//! stream; nothing is allocated.
//!
//! \code
//! ringattn::merge_rows(o_packed, lse_packed, heads, 1, reduction, state, stream); // forward
//! ringattn::add_rows(dq_fp32, dq_packed, heads * head_dim, reduction, stream);     // backward
//! ringattn::lse_of_row_maxima(max_packed, sum_packed, rows, heads, true, max_logit, stream);
//! \endcode

#include <ringattn/block/kernel/row_reduce.cuh>
#include <ringattn/core/state.cuh>
#include <ringattn/cuda_check.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace ringattn {

//! A `row_reduction` (block/device/pieces.cuh) in device memory.
struct device_row_reduction {
  const std::int32_t* dest = nullptr;
  const std::int32_t* first = nullptr; //!< entries + 1 offsets into source
  const std::int32_t* source = nullptr;
  std::int64_t entries = 0;
};

#if defined(__CUDACC__)
namespace detail {
inline unsigned grid_for(std::int64_t threads) {
  return static_cast<unsigned>(std::clamp<std::int64_t>((threads + 255) / 256, 1, 8192));
}
} // namespace detail

//! Merges packed rows (`o`: `[rows, q_heads, head_dim]` in T; the lse of row r, head h at
//! `stats[r * stats_row + h * stats_head]`, natural log) into the state, each destination row
//! taking its packed rows in order.
template <class T>
void merge_rows(const T* o, const float* stats, std::int64_t stats_row, std::int64_t stats_head,
                const device_row_reduction& r, const attention_state& s, cudaStream_t stream) {
  if (r.entries == 0 || s.q_heads == 0) return;
  kernels::merge_rows_kernel<T><<<detail::grid_for(r.entries * s.q_heads * 32), 256, 0, stream>>>(
      o, stats, stats_row, stats_head, r.dest, r.first, r.source, r.entries, s);
  RINGATTN_CUDA_CHECK_LAUNCH();
}

//! The lse (`[heads, tokens]`) of Q-shard rows `rows[0..count)` into the packed layout
//! `out[r * out_row + h * out_head]`.
inline void gather_lse(const float* lse, std::int64_t tokens, int heads, const std::int32_t* rows,
                       std::int64_t count, float* out, std::int64_t out_row, std::int64_t out_head,
                       cudaStream_t stream) {
  if (count == 0 || heads == 0) return;
  kernels::gather_lse_kernel<><<<detail::grid_for(count * heads), 256, 0, stream>>>(
      lse, tokens, heads, rows, count, out, out_row, out_head);
  RINGATTN_CUDA_CHECK_LAUNCH();
}

//! A library forward's per-row maxima and sums of exponentials (`[rows, heads]` when
//! `token_major`, else `[heads, rows]`) into the rows' lse, in place of the maxima; with
//! `max_logit` (`[heads]`), also raises each head's max logit over those rows.
inline void lse_of_row_maxima(float* row_max, const float* sum_exp, std::int64_t rows, int heads,
                              bool token_major, float* max_logit, cudaStream_t stream) {
  if (rows == 0 || heads == 0) return;
  // Few blocks where each ends with one atomic per head.
  const unsigned grid = max_logit != nullptr ? std::min(detail::grid_for(rows * heads), 256u)
                                             : detail::grid_for(rows * heads);
  const std::size_t shared =
      max_logit != nullptr ? static_cast<std::size_t>(heads) * sizeof(float) : 0;
  kernels::lse_of_row_maxima_kernel<>
      <<<grid, 256, shared, stream>>>(row_max, sum_exp, rows, heads, token_major, max_logit);
  RINGATTN_CUDA_CHECK_LAUNCH();
}

//! Adds packed rows of `width` elements (T) into fp32 rows of `acc`, each destination row
//! taking the sum of its packed rows.
template <class T>
void add_rows(float* acc, const T* packed, std::int64_t width, const device_row_reduction& r,
              cudaStream_t stream) {
  if (r.entries == 0 || width == 0) return;
  kernels::add_rows_kernel<T><<<detail::grid_for(r.entries * width), 256, 0, stream>>>(
      acc, packed, width, r.dest, r.first, r.source, r.entries);
  RINGATTN_CUDA_CHECK_LAUNCH();
}
#endif // __CUDACC__

} // namespace ringattn
