#pragma once
//! \file
//! The state operations of the device path, shared by every BlockKernel and every schedule: a
//! state's reset and finalisation, finished partials and their merge (sharded decoding), the
//! backward's delta, fp32 sums and the gradients' conversion to T. Each validates its views on
//! the host, then enqueues one element-wise kernel (block/kernel/elementwise.cuh) on `stream`; none
//! allocates or waits on the host.
//!
//! \code
//! ringattn::reset(state, stream);                     // o = 0, lse = -inf, sum = 0
//! // ... block forwards merge into the state ...
//! ringattn::finalize(state, out, stream);             // o / sum -> out, the rows' lse
//! ringattn::compute_delta(out, dout, delta, stream);  // the backward's rowwise dO . O
//! ringattn::write_gradient(dq_fp32, dq, stream);      // fp32 -> T
//! \endcode

#include <ringattn/block/kernel/elementwise.cuh>
#include <ringattn/core/element.cuh>
#include <ringattn/core/state.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/error.cuh>
#include <ringattn/tensor.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace ringattn {

#if defined(__CUDACC__)
namespace detail {
//! Thread blocks of 256 threads for `warps` warps (a warp per row).
inline unsigned warp_blocks(std::int64_t warps) {
  return static_cast<unsigned>((warps + 7) / 8); // 8 warps a block
}
} // namespace detail

//! Sets a device state to "no key seen" (o = 0, lse = -inf, sum = 0), asynchronously on `stream`.
inline void reset(const attention_state& s, cudaStream_t stream) {
  if (s.o_elements() == 0) return;
  RINGATTN_CUDA_CHECK(cudaMemsetAsync(s.o, 0, sizeof(float) * s.o_elements(), stream));
  const std::int64_t n = s.lse_elements();
  RINGATTN_CUDA_CHECK(cudaMemsetAsync(s.sum, 0, sizeof(float) * n, stream));
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((n + 255) / 256, 1024));
  kernels::fill_kernel<<<blocks, 256, 0, stream>>>(s.lse, n,
                                                   -std::numeric_limits<float>::infinity());
  RINGATTN_CUDA_CHECK_LAUNCH();
}

//! Writes a device state's output, o / sum, to `out` (fp16/bf16) and replaces the state's lse (the
//! reference) by the rows' lse, asynchronously on `stream`.
template <device_element T>
void finalize(const attention_state& s, thd_view<T> out, cudaStream_t stream) {
  validation r = validate_view(out, "out");
  r.require(out.tokens == s.tokens && out.heads == s.q_heads && out.head_dim == s.head_dim,
            "out is [", out.tokens, ", ", out.heads, ", ", out.head_dim, "] but the state is [",
            s.tokens, ", ", s.q_heads, ", ", s.head_dim, "]");
  r.require(rows_aligned_to(out, 4), "out must be 4-byte aligned with even strides");
  r.throw_if_invalid();
  const std::int64_t pairs = s.tokens * s.q_heads * (s.head_dim / 2);
  if (pairs == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((pairs + 255) / 256, 4096));
  kernels::finalize_kernel<T>
      <<<blocks, 256, 0, stream>>>(s.o, s.lse, s.sum, out.data, s.tokens * s.q_heads, s.tokens,
                                   s.head_dim, out.token_stride, out.head_stride);
  RINGATTN_CUDA_CHECK_LAUNCH();
}

//! State `s` (fp32) as a finished partial, asynchronously on `stream`: its rows' normalised
//! outputs (`[rows, head_dim]` of T, row = head * tokens + token) to `o` and their lse to `lse`.
template <device_element T>
void finish_partial(const attention_state& s, T* o, float* lse, cudaStream_t stream) {
  const std::int64_t rows = s.tokens * s.q_heads, pairs = rows * (s.head_dim / 2);
  if (pairs == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((pairs + 255) / 256, 4096));
  kernels::finish_partial_kernel<T>
      <<<blocks, 256, 0, stream>>>(s.o, s.lse, s.sum, o, lse, rows, s.head_dim);
  RINGATTN_CUDA_CHECK_LAUNCH();
}

//! Merges `parts` finished partials of `out`'s shape (fp16/bf16, `[tokens, q_heads, head_dim]`)
//! into `out` and `lse` (`[q_heads, tokens]`), asynchronously on `stream`. Partial r's outputs
//! sit at `o + r * o_stride` and its lse at `lse_of + r * lse_stride` (elements, as
//! `finish_partial` wrote them). The order of the partials is the order of the merges: the same
//! partials give the same bits on any device.
template <device_element T>
void merge_finished_partials(const T* o, std::int64_t o_stride, const float* lse_of,
                             std::int64_t lse_stride, int parts, thd_view<T> out, float* lse,
                             cudaStream_t stream) {
  validation r = validate_view(out, "out");
  r.require(rows_aligned_to(out, 4), "out must be 4-byte aligned with even strides");
  r.require(parts >= 1, "no partial state to merge");
  r.throw_if_invalid();
  const std::int64_t rows = out.tokens * out.heads, pairs = rows * (out.head_dim / 2);
  if (pairs == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((pairs + 255) / 256, 4096));
  kernels::merge_finished_kernel<T>
      <<<blocks, 256, 0, stream>>>(o, o_stride, lse_of, lse_stride, parts, rows, out.tokens,
                                   out.head_dim, out.data, out.token_stride, out.head_stride, lse);
  RINGATTN_CUDA_CHECK_LAUNCH();
}

//! `delta[h, t] = dout(t, h) . out(t, h)` (fp32, `[heads, tokens]`), asynchronously on `stream`.
template <device_element T>
void compute_delta(thd_view<const T> out, thd_view<const T> dout, float* delta,
                   cudaStream_t stream) {
  validation r = validate_view(out, "out");
  r.require(validate_view(dout, "dout"));
  r.require(out.tokens == dout.tokens && out.heads == dout.heads && out.head_dim == dout.head_dim,
            "out and dout differ in shape");
  r.require(out.tokens == 0 || delta != nullptr, "delta is a null pointer");
  r.require(aligned_to(delta, 4), "delta must be 4-byte aligned");
  r.require(out.head_dim == 64 || out.head_dim == 128 || out.head_dim == 256, "head_dim ",
            out.head_dim, " is not supported (supported: 64, 128, 256)");
  r.throw_if_invalid();
  const std::int64_t warps = out.tokens * out.heads;
  if (warps == 0) return;
  auto launch = [&](auto kernel) {
    kernel<<<detail::warp_blocks(warps), 256, 0, stream>>>(
        out.data, out.token_stride, out.head_stride, dout.data, dout.token_stride, dout.head_stride,
        delta, out.tokens, out.heads);
    RINGATTN_CUDA_CHECK_LAUNCH();
  };
  switch (out.head_dim) {
  case 64: launch(kernels::delta_kernel<T, 64>); break;
  case 128: launch(kernels::delta_kernel<T, 128>); break;
  default: launch(kernels::delta_kernel<T, 256>); break;
  }
}

//! `a[i] += b[i]` for `n` fp32 elements (device memory), asynchronously on `stream`.
inline void accumulate(float* a, const float* b, std::int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((n + 255) / 256, 4096));
  kernels::add_kernel<><<<blocks, 256, 0, stream>>>(a, b, n);
  RINGATTN_CUDA_CHECK_LAUNCH();
}

//! Writes a dense fp32 `[tokens, heads, head_dim]` accumulator into `out` (T, any strides),
//! asynchronously on `stream`.
template <device_element T>
void write_gradient(const float* x, thd_view<T> out, cudaStream_t stream) {
  validate_view(out, "the gradient").throw_if_invalid();
  const std::int64_t n = out.tokens * out.heads * out.head_dim;
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((n + 255) / 256, 4096));
  kernels::convert_kernel<T><<<blocks, 256, 0, stream>>>(
      x, out.data, out.tokens, out.heads, out.head_dim, out.token_stride, out.head_stride);
  RINGATTN_CUDA_CHECK_LAUNCH();
}
#endif // __CUDACC__

} // namespace ringattn
