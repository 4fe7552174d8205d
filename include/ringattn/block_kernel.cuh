#pragma once
//! \file
//! The BlockKernel policy, the third template argument of
//! `ring_attention<Partitioner, Communicator, BlockKernel>`: the mask, and the math of one block —
//! a rank's queries against one K/V block — forward (merged into fp32 state) and backward (the
//! block's share of dQ, dK, dV from the final O, dO and LSE).
//!
//! A model names its mask (`mask`, `name`) and provides the host block forward and backward
//! (`block_kernel`). A model with a device path also provides per-step schedules, made at plan
//! time, and the device forward and backward (`device_block_kernel_for`). Models shipped:
//!
//! | model | host | device |
//! |---|---|---|
//! | `full`, `causal`, `sliding_window`, `causal_window` (`native_kernel<Mask>`) | the host
//! twin | the tensor-core kernels (sm_80 mma.sync, sm_90a wgmma) |
//! | `host_reference<Mask>` | the host twin | — |
//!
//! A model that wraps another library's fused attention fits the same shape: its forward
//! schedule holds what that library plans per step (a graph, say), `device_forward` computes the
//! block's O and LSE and merges them as the step's `step_epilogue` says, and `device_backward`
//! adds the block's dQ, dK, dV from O, dO and the final LSE.
//!
//! \code
//! using attention = ringattn::ring_attention<ringattn::zigzag, ringattn::nccl_communicator,
//!                                            ringattn::causal>;  // the native causal kernels
//! static_assert(ringattn::device_block_kernel_for<ringattn::causal, cudaStream_t>);
//! \endcode

#include <ringattn/block/device/backward.cuh>
#include <ringattn/block/device/block.cuh>
#include <ringattn/block/device/decode.cuh>
#include <ringattn/block/device/forward.cuh>
#include <ringattn/block/host_reference.cuh>
#include <ringattn/block/masks.cuh>
#include <ringattn/concepts.cuh>

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <concepts>
#include <cstdint>
#include <span>
#include <type_traits>

namespace ringattn {

//! The native kernels under `Mask`: the host twin on the host (block/device/host_forward.cuh,
//! block/device/host_backward.cuh); on the device the tensor-core kernels
//! (block/device/forward.cuh, block/device/backward.cuh). Its device functions compile only as CUDA
//! (in a .cu file).
template <class Mask>
struct native_kernel : host_reference<Mask> {
  using forward_schedule = device_block_schedule;
  using backward_schedule = device_backward_schedule;
  static forward_schedule make_forward_schedule(std::span<const block_group> groups,
                                                std::int64_t q_tokens, std::int64_t kv_tokens,
                                                const attention_arguments& args) {
    return forward_schedule(groups, q_tokens, kv_tokens, args);
  }
  //! Throws `invalid_argument` for widths no backward kernel here takes (unequal widths off
  //! sm_90a), at plan time.
  static backward_schedule make_backward_schedule(std::span<const block_group> groups,
                                                  std::int64_t q_tokens, std::int64_t kv_tokens,
                                                  const attention_arguments& args) {
    backward_schedule s(groups, q_tokens, kv_tokens);
    s.supports(args.qk_dim(), args.v_dim()).throw_if_invalid();
    return s;
  }

  //! One launch with epilogue `e` (never `none`): `out` is the dense output of `plain` and
  //! `merge_out`, `lse` the plain output's lse.
  template <class T>
  static void device_forward(step_epilogue e, const block_forward_args<T>& a,
                             const forward_schedule& s, thd_view<T> out, float* lse,
                             cudaStream_t stream) {
#if defined(__CUDACC__)
    switch (e) {
    case step_epilogue::none: return;
    case step_epilogue::plain: return block_forward_plain<T>(a, s, out, lse, stream);
    case step_epilogue::fresh: return block_forward_first<T>(a, s, stream);
    case step_epilogue::merge: return block_forward<T>(a, s, stream);
    case step_epilogue::merge_out: return block_forward_last<T>(a, s, out, stream);
    }
#else
    static_assert(detail::dependent_false<T>,
                  "ringattn: the native kernels' device path compiles only as CUDA (a .cu file)");
    (void)e, (void)a, (void)s, (void)out, (void)lse, (void)stream;
#endif
  }
  //! The split-K/V forward (block/device/decode.cuh): full blocks of few query rows per group.
  using split_schedule = device_decode_schedule;
  //! The steps its split kernel takes, in the words of an error message.
  static constexpr const char* split_shapes =
      "head_dim 64 or 128 with v as wide and at most 64 query rows (new tokens x query heads per "
      "kv head) per sequence";
  static_assert(decode_max_rows == 64, "split_shapes states decode_max_rows");
  static bool takes_split(std::span<const block_group> groups, const attention_arguments& args) {
    return split_schedule::takes(groups, args);
  }
  //! `launch`: fitted to the step, or `fixed` for steps replayed from a CUDA graph.
  static split_schedule make_split_schedule(std::span<const block_group> groups,
                                            std::int64_t q_tokens, std::int64_t kv_tokens,
                                            const attention_arguments& args,
                                            split_launch launch = split_launch::fitted) {
    return split_schedule(groups, q_tokens, kv_tokens, args, {}, launch);
  }
  //! The same over key rows counted through a page table (`key_pages`; `kv_tokens` is the
  //! table's size times the page size).
  static split_schedule make_split_schedule(std::span<const block_group> groups,
                                            std::int64_t q_tokens, std::int64_t kv_tokens,
                                            const attention_arguments& args, const key_pages& pages,
                                            split_launch launch = split_launch::fitted) {
    return split_schedule(groups, q_tokens, kv_tokens, args, pages, launch);
  }
  template <class T>
  static void device_split_forward(const block_forward_args<T>& a, const split_schedule& s,
                                   bool fresh, cudaStream_t stream) {
#if defined(__CUDACC__)
    s.forward(a, fresh, stream);
#else
    static_assert(detail::dependent_false<T>,
                  "ringattn: the native kernels' device path compiles only as CUDA (a .cu file)");
    (void)a, (void)s, (void)fresh, (void)stream;
#endif
  }
  //! The split-K/V forward over an FP8 cache `k`, `v` (e4m3, dequantised by `scales`) in place
  //! of `a.k` and `a.v`.
  template <class T, kv_scales Scales>
  static void device_split_forward(const block_forward_args<T>& a, thd_view<const fp8_e4m3> k,
                                   thd_view<const fp8_e4m3> v, Scales scales,
                                   const split_schedule& s, bool fresh, cudaStream_t stream) {
#if defined(__CUDACC__)
    s.forward(a, k, v, scales, fresh, stream);
#else
    static_assert(detail::dependent_false<T>,
                  "ringattn: the native kernels' device path compiles only as CUDA (a .cu file)");
    (void)a, (void)k, (void)v, (void)scales, (void)s, (void)fresh, (void)stream;
#endif
  }
  template <class T>
  static void device_backward(const block_backward_args<T>& a, const backward_schedule& s,
                              cudaStream_t stream) {
#if defined(__CUDACC__)
    block_backward<T>(a, s, stream);
#else
    static_assert(detail::dependent_false<T>,
                  "ringattn: the native kernels' device path compiles only as CUDA (a .cu file)");
    (void)a, (void)s, (void)stream;
#endif
  }
};

//! The native kernels with a full mask.
using full = native_kernel<full_mask>;
//! The native kernels with a causal mask.
using causal = native_kernel<causal_mask>;
//! The native kernels with a sliding window (`window_left`, `window_right` in the arguments).
using sliding_window = native_kernel<sliding_window_mask>;
//! The native kernels with a causal window (`window_left` in the arguments).
using causal_window = native_kernel<causal_window_mask>;

static_assert(device_block_kernel_for<full, cudaStream_t> &&
              device_block_kernel_for<causal, cudaStream_t> &&
              device_block_kernel_for<sliding_window, cudaStream_t> &&
              device_block_kernel_for<causal_window, cudaStream_t>);
static_assert(split_kv_block_kernel_for<causal, cudaStream_t>);

} // namespace ringattn
