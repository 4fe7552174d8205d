#pragma once
//! \file
//! The BlockKernel family's concepts: a mask, the host block forward and backward, and the
//! device paths a model may add (per-step schedules, a one-rank ring's direct gradients, a
//! split-K/V forward for decoding). They name no CUDA type but the bf16 element they check with.

#include <ringattn/arguments.cuh>
#include <ringattn/block/device/backward_args.cuh>
#include <ringattn/block/device/block.cuh>
#include <ringattn/block/device/forward_args.cuh>
#include <ringattn/core/mask.cuh>
#include <ringattn/tensor.cuh>

#include <cuda_bf16.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

namespace ringattn {

//! A mask names its kind.
template <class M>
concept mask_policy = requires {
  { M::kind } -> std::convertible_to<mask_kind>;
  { M::name } -> std::convertible_to<const char*>;
};

//! A BlockKernel names its mask and computes a block on the host: `host_forward(args, groups)`
//! merges a block into `args.state`; `host_backward(args, groups)` adds its gradients. The ring
//! validates the groups once, at plan time, and the tensors on every call, before either runs.
template <class K>
concept block_kernel = requires(const block_forward_args<__nv_bfloat16>& f,
                                const block_backward_args<__nv_bfloat16>& b,
                                std::span<const block_group> groups) {
  { K::name } -> std::convertible_to<const char*>;
  { K::mask } -> std::convertible_to<mask_kind>;
  K::host_forward(f, groups);
  K::host_backward(b, groups);
};

//! A BlockKernel with a device path: schedules made once per step at plan time (on the current
//! device), and the forward (with the step's epilogue) and backward enqueued on a stream.
//! The stream type is a template parameter so this header needs no CUDA.
template <class K, class Stream>
concept device_block_kernel_for = block_kernel<K> &&
    requires(std::span<const block_group> groups, std::int64_t tokens,
             const attention_arguments& args, const typename K::forward_schedule& fs,
             const typename K::backward_schedule& bs, const block_forward_args<__nv_bfloat16>& f,
             const block_backward_args<__nv_bfloat16>& b, thd_view<__nv_bfloat16> out, float* lse,
             Stream stream) {
  {
    K::make_forward_schedule(groups, tokens, tokens, args)
    } -> std::same_as<typename K::forward_schedule>;
  {
    K::make_backward_schedule(groups, tokens, tokens, args)
    } -> std::same_as<typename K::backward_schedule>;
  K::device_forward(step_epilogue::merge, f, fs, out, lse, stream);
  K::device_backward(b, bs, stream);
};

//! A device BlockKernel that can also write a one-rank ring's gradients straight from its single
//! block: `device_backward_whole(args, schedule, dq, dk, dv, stream)` enqueues that and returns
//! true, or enqueues nothing and returns false where the schedule or the views do not allow it
//! (the ring then takes its general path through the fp32 accumulators).
template <class K, class Stream>
concept whole_block_backward_for = device_block_kernel_for<K, Stream> &&
    requires(const typename K::backward_schedule& bs, const block_backward_args<__nv_bfloat16>& b,
             thd_view<__nv_bfloat16> g, Stream stream) {
  { K::device_backward_whole(b, bs, g, g, g, stream) } -> std::same_as<bool>;
};

//! A device BlockKernel with a split-K/V forward for blocks of few query rows (decoding):
//! `takes_split(groups, args)` says at plan time whether it applies, `make_split_schedule` plans
//! it, and `device_split_forward(args, schedule, fresh, stream)` merges the block into the state
//! (`fresh`: writes it) with the schedule's `scratch_bytes()` of scratch.
template <class K, class Stream>
concept split_kv_block_kernel_for = device_block_kernel_for<K, Stream> &&
    requires(std::span<const block_group> groups, std::int64_t tokens,
             const attention_arguments& args, const typename K::split_schedule& ss,
             const block_forward_args<__nv_bfloat16>& f, Stream stream) {
  { K::takes_split(groups, args) } -> std::same_as<bool>;
  {
    K::make_split_schedule(groups, tokens, tokens, args)
    } -> std::same_as<typename K::split_schedule>;
  { ss.scratch_bytes() } -> std::convertible_to<std::size_t>;
  K::device_split_forward(f, ss, true, stream);
};

} // namespace ringattn
