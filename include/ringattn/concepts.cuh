#pragma once
//! \file
//! One concept per policy family of
//! `ring_attention<Partitioner, Communicator, BlockKernel, Schedule>`.
//! They state type-level requirements only; the driver re-checks them with `static_assert` and a
//! sentence a user can act on.

#include <ringattn/core/segment.cuh>
#include <ringattn/kernel/backward_args.cuh>
#include <ringattn/kernel/block.cuh>
#include <ringattn/kernel/forward_args.cuh>
#include <ringattn/tensor.cuh>

#include <cuda_bf16.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace ringattn {

//! A Partitioner is index math only: for a sequence of `length` tokens over `ranks` ranks it names
//! each rank's tokens as at most `max_segments` segments of equal stride, maps positions to
//! (rank, local index) and back. All of it is constexpr and usable on host and device.
template <class P>
concept partitioner = requires(std::int64_t length, int ranks, int rank, std::int64_t i) {
  { P::name } -> std::convertible_to<const char*>;
  { P::max_segments } -> std::convertible_to<int>;
  { P::segments(length, ranks, rank) } -> std::same_as<segment_list<P::max_segments>>;
  { P::local_length(length, ranks, rank) } -> std::same_as<std::int64_t>;
  { P::locate(length, ranks, i) } -> std::same_as<owner>;
  { P::position(length, ranks, rank, i) } -> std::same_as<std::int64_t>;
};

//! A placing Partitioner also decides, from the whole batch, over which ranks each sequence is
//! partitioned (`place(cu_seqlens, ranks)`: one `placement` per sequence, a pure function of its
//! arguments, so every rank computes the same layout); its index math then applies per sequence
//! over the placement's ranks. The other partitioners place every sequence over every rank.
template <class P>
concept placing_partitioner = partitioner<P> &&
    requires(std::span<const std::int32_t> cu_seqlens, int ranks) {
  { P::place(cu_seqlens, ranks) } -> std::same_as<std::vector<placement>>;
};

//! A host Communicator moves bytes between ranks' host buffers, with bounded waits: ring
//! exchange (send to one peer, receive from another, for a numbered step), all-gather (plan-time
//! agreement checks), barrier, abort (fail the group so peers stop waiting), and a byte count.
template <class C>
concept host_communicator = requires(C& c, const void* s, void* r, std::size_t n, int peer,
                                     std::int64_t step, const std::string& why) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.exchange(s, n, peer, r, n, peer, step);
  c.all_gather(s, n, r);
  c.barrier();
  c.abort(why);
  { c.bytes_sent() } -> std::convertible_to<std::uint64_t>;
};

//! A device Communicator also moves device buffers, enqueued on a CUDA stream with no host wait
//! on the device (NCCL, or the in-process one for ranks sharing a process), after a plan-time
//! `prepare_device()`. The stream type is a template parameter so this header needs no CUDA.
template <class C, class Stream>
concept device_communicator_for = host_communicator<C> &&
    requires(C& c, const void* s, void* r, std::size_t n, int peer, std::int64_t step,
             Stream stream) {
  c.prepare_device();
  c.exchange_async(s, n, peer, r, n, peer, step, stream);
};

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

//! A Schedule decides how the work reaches the ranks (the ring passes K/V blocks on step by
//! step; the all-gather gathers them once; the all-to-all trades heads for tokens): it names
//! itself, plans a rank's part once (`plan_type`, made by `S::plan(partition plan, rank,
//! window, arguments)`), says which schedule of block-kernel calls that plan runs and with which
//! arguments (`compute`, `compute_arguments`: the device schedules are made from them), and lays
//! out the workspace its executors use (`layout_type`). Its executors are static member
//! templates the driver instantiates per call.
template <class S>
concept schedule_policy = requires(const typename S::plan_type& plan,
                                   const typename S::layout_type& layout,
                                   const attention_arguments& args) {
  { S::name } -> std::convertible_to<const char*>;
  { S::workspace(plan, args, std::size_t{2}) } -> std::same_as<typename S::layout_type>;
  {S::compute(plan).steps()};
  { S::compute_arguments(plan, args) } -> std::convertible_to<attention_arguments>;
  { layout.forward_bytes() } -> std::convertible_to<std::size_t>;
  { layout.device_backward_bytes() } -> std::convertible_to<std::size_t>;
  { layout.largest_message(true) } -> std::convertible_to<std::size_t>;
  { S::host_backward_bytes(layout) } -> std::convertible_to<std::size_t>;
};

} // namespace ringattn
