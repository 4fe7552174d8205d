#pragma once
//! \file
//! `ring_attention<Partitioner, Communicator, BlockKernel, Schedule>`: context-parallel
//! attention, its K/V blocks passed around a ring (`ring_pass`, the default) or gathered once
//! (`all_gather_kv`), or its heads traded for tokens (`all_to_all_heads`; ring/schedules.cuh).
//!
//! Each rank holds its Q, K, V shard (the partitioner's layout of a packed batch). The functor is
//! built once per layout: the ranks agree on the arguments (ring/agreement.cuh: a disagreement is
//! an error on every rank, never a hang) and the rank's ring schedule is made (ring/schedule.cuh:
//! per step, the source block, its validated block groups and the step's epilogue). A call then
//! takes P steps: at step t rank r attends to the K/V of rank (r - t) mod P and passes that block
//! on to rank r + 1. Only kv heads travel: a step moves
//! `2 * local tokens of the source * kv_heads * head_dim * element size` bytes. State is merged in
//! fp32 across all steps (core/state.cuh).
//!
//! Two paths share the schedule and one workspace layout (ring/workspace.cuh). The host path
//! (`forward_host`, `backward_host`: the BlockKernel's host block, in-process threads or MPI
//! processes) runs everywhere, CI included. The device path (`prepare_device` once, then
//! `forward` / `backward` on a stream) overlaps the exchange of step t + 1 with the compute of
//! step t, allocates nothing after its first call and never waits on the host.
//!
//! The facade includes no BlockKernel: a program includes the model it names (`block_kernel.cuh`
//! for the native kernels below, `cudnn.cuh`, `block/host_reference.cuh`) or `ringattn.cuh`.
//!
//! \code
//! ringattn::in_process_group group(P);                          // or an MPI communicator
//! auto comm = group.communicator(rank);                          // one per rank's thread
//! ringattn::ring_attention<ringattn::zigzag, ringattn::in_process_communicator, ringattn::causal>
//!     attn(comm, {.q_heads = 32, .kv_heads = 8, .head_dim = 128}, cu_seqlens);
//! std::vector<std::byte> ws(attn.host_workspace_bytes<__nv_bfloat16>());
//! attn.forward_host(q, k, v, out, lse, ws);   // this rank's shards; lse [q_heads, local tokens]
//! std::vector<float> max_logit(32);            // per head, over every rank (QK-clip)
//! attn.forward_host(q, k, v, out, lse, max_logit.data(), ws);
//! \endcode
//!
//! Thread safety: one object serves one call at a time (calls reuse its schedules and events); a
//! second call while one runs throws `invalid_argument` and leaves the first alone. Objects of
//! different groups may run concurrently. Every call is agreed by all ranks first (ring/call.cuh).

#include <ringattn/arguments.cuh>
#include <ringattn/concepts.cuh>
#include <ringattn/error.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/ring/agreement.cuh>
#include <ringattn/ring/call.cuh>
#include <ringattn/ring/device_engine.cuh>
#include <ringattn/ring/host_engine.cuh>
#include <ringattn/ring/max_logit.cuh>
#include <ringattn/ring/schedule.cuh>
#include <ringattn/ring/schedules.cuh>
#include <ringattn/ring/validation.cuh>
#include <ringattn/ring/workspace.cuh>
#include <ringattn/tensor.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace ringattn {

template <class Partitioner, class Communicator, class BlockKernel, class Schedule = ring_pass>
class ring_attention {
  static_assert(partitioner<Partitioner>,
                "ringattn::ring_attention: the first template argument must be a Partitioner "
                "(ringattn::contiguous, ringattn::round_robin, ringattn::zigzag or "
                "ringattn::balanced)");
  static_assert(host_communicator<Communicator>,
                "ringattn::ring_attention: the second template argument must be a Communicator "
                "(ringattn::in_process_communicator, ringattn::mpi_communicator or "
                "ringattn::nccl_communicator)");
  static_assert(block_kernel<BlockKernel>,
                "ringattn::ring_attention: the third template argument must be a BlockKernel "
                "(ringattn::full, ringattn::causal, ringattn::cudnn_kernel<Mask, T> or "
                "ringattn::host_reference<Mask>)");
  static_assert(schedule_policy<Schedule>,
                "ringattn::ring_attention: the fourth template argument must be a Schedule "
                "(ringattn::ring_pass, ringattn::all_gather_kv, ringattn::all_to_all_heads or "
                "ringattn::all_to_all_heads_x_all_gather<A>)");

public:
  //! What the Schedule plans for a rank (ring_schedule for the ring and the all-gather,
  //! all_to_all_plan for the all-to-all).
  using schedule_type = typename Schedule::plan_type;
  //! Whether K/V travel in blocks (the ring and the all-gather).
  static constexpr bool ring_shaped = std::same_as<typename Schedule::layout_type, ring_workspace>;

  //! Plans the ring for this rank. `cu_seqlens` is the *global* packed layout (batch + 1
  //! offsets), the same on every rank. Collective: every rank of `comm` must construct its
  //! functor; throws `invalid_argument` on every rank if the ranks disagree.
  ring_attention(Communicator& comm, const attention_arguments& args,
                 std::span<const std::int32_t> cu_seqlens)
      : comm_(comm), args_(args),
        plan_(detail::agreed_plan<Partitioner>(comm, args, cu_seqlens, BlockKernel::mask,
                                               BlockKernel::name, Schedule::name, fingerprint_)),
        schedule_(Schedule::plan(plan_, comm.rank(), args.window(BlockKernel::mask), args)),
        checks_(args, plan_.local_tokens(comm.rank()), comm.rank()),
        gate_(comm, fingerprint_, layout<__half>().largest_message(false)),
        max_logits_(static_cast<std::size_t>(comm.size()) *
                    static_cast<std::size_t>(args.q_heads)) {}

  const partition_plan<Partitioner>& plan() const noexcept { return plan_; }
  const schedule_type& schedule() const noexcept { return schedule_; }
  const attention_arguments& arguments() const noexcept { return args_; }
  int rank() const noexcept { return comm_.rank(); }
  int size() const noexcept { return comm_.size(); }
  //! Tokens of this rank's shards.
  std::int64_t local_tokens() const { return plan_.local_tokens(comm_.rank()); }
  //! Block groups of step t (on the ring: this rank's queries against the K/V of rank
  //! (rank - t) mod P; on the all-to-all: every shard's of its heads at once).
  std::span<const block_group> step_groups(int t) const {
    return Schedule::compute(schedule_).step(t).groups;
  }

  //! Bytes a K/V block of rank `src` occupies on the wire (and in a ring buffer): the ring and
  //! the all-gather; its rows that some other rank sees (`ring_schedule::travel_tokens`).
  template <element T>
  std::size_t block_bytes(int src) const requires ring_shaped {
    return layout<T>().block_bytes(Schedule::compute(schedule_).travel_tokens(src));
  }
  //! Bytes this rank sends in one forward on the ring or the all-gather, as its communicator counts
  //! them (the max logit's exchanges aside): the ring forwards the blocks a later rank sees, the
  //! all-gather sends the own block to each rank that sees some of it. A plan-time figure, for
  //! choosing a layout.
  template <element T>
  std::size_t forward_bytes() const requires ring_shaped {
    std::size_t n = 0;
    for (const ring_step& step : schedule_.steps()) {
      if constexpr (std::same_as<Schedule, all_gather_kv>)
        n += step.own_wanted ? block_bytes<T>(comm_.rank()) : 0;
      else
        n += step.forwarded ? block_bytes<T>(step.source) : 0;
    }
    return n;
  }
  //! Bytes a K/V block of rank `src` and its fp32 dK/dV occupy on the wire in the backward.
  template <element T>
  std::size_t backward_block_bytes(int src) const requires ring_shaped {
    const std::int64_t n = Schedule::compute(schedule_).travel_tokens(src);
    return layout<T>().block_bytes(n) + layout<T>().grad_bytes(n);
  }
  //! Workspace of `forward_host` and `forward`: two K/V ring buffers of the largest shard and the
  //! fp32 state of this rank's shard (its o and weight sums; the lse is the caller's).
  template <element T>
  std::size_t host_workspace_bytes() const {
    return layout<T>().forward_bytes();
  }
  //! The device path adds the BlockKernel's scratch (cuDNN's workspace, say), known once
  //! `prepare_device()` has planned it, and two `[q_heads]` fp32 buffers for the max logit's
  //! reduction over the ranks.
  template <element T>
  std::size_t device_workspace_bytes() const {
    return max_logit_buffers<T>() + detail::max_logit_buffer_bytes(args_.q_heads);
  }
  //! Workspace of `backward_host`: two ring buffers of the largest block with its dK/dV, this
  //! rank's fp32 dQ and D; `backward` adds one fp32 dK/dV share of the largest block.
  template <element T>
  std::size_t host_backward_workspace_bytes() const {
    return Schedule::host_backward_bytes(layout<T>());
  }
  template <element T>
  std::size_t device_backward_workspace_bytes() const {
    return with_scratch(layout<T>().device_backward_bytes(), true);
  }

  //! Why `forward_host(q, k, v, out, lse, workspace)` cannot run, or ok.
  template <element T>
  validation validate_forward(std::type_identity_t<thd_view<const T>> q,
                              std::type_identity_t<thd_view<const T>> k,
                              std::type_identity_t<thd_view<const T>> v, thd_view<T> out,
                              const float* lse, std::span<const std::byte> workspace) const {
    return checks_.forward(q, k, v, thd_view<const T>(out), lse, workspace,
                           host_workspace_bytes<T>());
  }
  //! Why `backward_host(...)` cannot run, or ok.
  template <element T>
  validation validate_backward(std::type_identity_t<thd_view<const T>> q,
                               std::type_identity_t<thd_view<const T>> k,
                               std::type_identity_t<thd_view<const T>> v,
                               std::type_identity_t<thd_view<const T>> out, const float* lse,
                               std::type_identity_t<thd_view<const T>> dout, thd_view<T> dq,
                               std::type_identity_t<thd_view<T>> dk,
                               std::type_identity_t<thd_view<T>> dv,
                               std::span<const std::byte> workspace) const {
    return checks_.backward(q, k, v, out, lse, dout, dq, dk, dv, workspace,
                            host_backward_workspace_bytes<T>());
  }

  //! The ring forward on host memory. `q`, `k`, `v`: this rank's shards (const or mutable
  //! views; T is taken from `out`); `out` like `q`; `lse`: `[q_heads, local tokens]` fp32,
  //! natural log. Collective: every rank must call it. Validation throws `invalid_argument` before
  //! anything is sent or written; a failure during the ring aborts the group (peers stop waiting
  //! with an error naming this rank).
  template <element T>
  void forward_host(std::type_identity_t<thd_view<const T>> q,
                    std::type_identity_t<thd_view<const T>> k,
                    std::type_identity_t<thd_view<const T>> v, thd_view<T> out, float* lse,
                    std::span<std::byte> workspace) {
    forward_host<T>(q, k, v, out, lse, nullptr, workspace);
  }
  //! The same, also writing `max_logit` (`[q_heads]` fp32; null: not computed, at no cost): for
  //! each query head, the largest logit `scale * q . k` over every query of every rank and every
  //! key the mask lets it see; -inf for a head no query of which sees a key, NaN where a NaN or an
  //! infinity reached the head's logits. Every rank gets the same values; every rank passes a
  //! buffer, or none does.
  template <element T>
  void forward_host(std::type_identity_t<thd_view<const T>> q,
                    std::type_identity_t<thd_view<const T>> k,
                    std::type_identity_t<thd_view<const T>> v, thd_view<T> out, float* lse,
                    float* max_logit, std::span<std::byte> workspace) {
    guarded<T>(
        validate_forward(q, k, v, out, lse, workspace), call::forward_host,
        [&] {
          if (max_logit)
            std::fill(max_logit, max_logit + args_.q_heads,
                      -std::numeric_limits<float>::infinity());
          Schedule::template host_forward<BlockKernel, Communicator, T>(
              comm_, schedule_, args_, q, k, v, out, lse, max_logit, workspace);
          if (max_logit)
            detail::reduce_max_logit_host(comm_, max_logit, args_.q_heads, std::span(max_logits_));
        },
        max_logit != nullptr);
  }

  //! The ring backward on host memory: from this rank's shards, the forward's `out` and `lse`
  //! and the output gradient `dout`, writes `dq` (like q; T is taken from it), `dk` and `dv`
  //! (like k, v). K/V blocks travel the ring again, each carrying its fp32 dK/dV, which every rank
  //! adds its share to; after the last step each block's dK/dV goes home. Deterministic: the order
  //! of every fp32 addition is fixed by the ring. Collective; validation and failures as in
  //! `forward_host`.
  template <element T>
  void backward_host(std::type_identity_t<thd_view<const T>> q,
                     std::type_identity_t<thd_view<const T>> k,
                     std::type_identity_t<thd_view<const T>> v,
                     std::type_identity_t<thd_view<const T>> out, const float* lse,
                     std::type_identity_t<thd_view<const T>> dout, thd_view<T> dq,
                     std::type_identity_t<thd_view<T>> dk, std::type_identity_t<thd_view<T>> dv,
                     std::span<std::byte> workspace) {
    guarded<T>(validate_backward(q, k, v, out, lse, dout, dq, dk, dv, workspace),
               call::backward_host, [&] {
                 Schedule::template host_backward<BlockKernel, Communicator, T>(
                     comm_, schedule_, args_, q, k, v, out, lse, dout, dq, dk, dv, workspace);
               });
  }

  //! Stands in for a call that this rank's caller refused before reaching the ring (its own
  //! checks of the arguments failed, or an allocation did): collective like the call it replaces
  //! (`backward` and `device` name it, T its element type), so that the peers' call fails naming
  //! this rank and `reason` instead of waiting for it. Over in-process and MPI communicators
  //! every rank throws `invalid_argument` and the communicator stays usable; over NCCL the
  //! communicator is aborted, as for any rejected call. Throws `invalid_argument` with `reason`.
  template <element T>
  [[noreturn]] void refuse(bool backward, bool device, const std::string& reason) {
    validation no = validation::ok();
    no.require(false, reason);
    const call kind = device ? (backward ? call::backward : call::forward)
                             : (backward ? call::backward_host : call::forward_host);
    guarded<T>(no, kind, [] {});
    throw invalid_argument("ringattn: " + reason); // not reached: the gate throws first
  }

  //! Device path, plan time: on the current device, the communication stream, the events, the
  //! forward's per-step kernel schedules and the communicator's device resources. Call once per
  //! rank before `forward` or `backward`; the backward's schedules are made at the first
  //! `backward` (here, for a BlockKernel that plans them with the forward's: the cuDNN one).
  //! After those first calls neither allocates nor sets a kernel attribute.
  void prepare_device() requires device_communicator_for<Communicator, cudaStream_t> {
    static_assert(device_block_kernel_for<BlockKernel, cudaStream_t>,
                  "ringattn::ring_attention::prepare_device: this BlockKernel has no device path "
                  "(ringattn::host_reference runs on the host only; use ringattn::full or "
                  "ringattn::causal)");
    if constexpr (device_block_kernel_for<BlockKernel, cudaStream_t>) {
      if (device_) return;
      comm_.prepare_device();
      device_ = std::make_unique<device_resources>(Schedule::compute(schedule_),
                                                   Schedule::compute_arguments(schedule_, args_));
    }
  }

#if defined(__CUDACC__)
  //! The ring forward on device memory, asynchronous on `stream`: the arguments of
  //! `forward_host` as device pointers, `workspace` device memory of
  //! `device_workspace_bytes<T>()`. Collective. All work is ordered on `stream` (the exchange
  //! runs on an internal stream joined back by events). Validation throws `invalid_argument`
  //! before anything is enqueued (and aborts the group so peers stop waiting).
  template <device_element T>
  void forward(std::type_identity_t<thd_view<const T>> q, std::type_identity_t<thd_view<const T>> k,
               std::type_identity_t<thd_view<const T>> v, thd_view<T> out, float* lse,
               void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
    forward<T>(q, k, v, out, lse, nullptr, workspace, workspace_bytes, stream);
  }
  //! The same, also writing `max_logit` (`[q_heads]` fp32 device memory; null: not computed, at
  //! no cost), as `forward_host` does: the ranks' maxima meet in P - 1 exchanges of `q_heads`
  //! floats on `stream` after the last block.
  template <device_element T>
  void forward(std::type_identity_t<thd_view<const T>> q, std::type_identity_t<thd_view<const T>> k,
               std::type_identity_t<thd_view<const T>> v, thd_view<T> out, float* lse,
               float* max_logit, void* workspace, std::size_t workspace_bytes,
               cudaStream_t stream) {
    const std::span<std::byte> ws(static_cast<std::byte*>(workspace), workspace_bytes);
    using buffer = ring_checks::named_buffer;
    const buffer buffers[] = {{q.data, "q"},
                              {k.data, "k"},
                              {v.data, "v"},
                              {out.data, "out"},
                              {lse, "lse"},
                              {max_logit, "max_logit"},
                              {workspace, "the workspace"}};
    auto device = [&](validation& ok) {
      ring_checks::device_forward<T>(ok, device_ ? device_->comm.device() : -1, stream, buffers, q,
                                     thd_view<const T>(out), lse);
      if constexpr (requires { BlockKernel::check_forward_views(ok, q, k, v); })
        BlockKernel::check_forward_views(ok, q, k, v);
      if constexpr (requires { BlockKernel::device_max_logit; })
        ok.require(max_logit == nullptr || BlockKernel::device_max_logit, "the BlockKernel ",
                   BlockKernel::name,
                   " computes no max logit on the device (the library's kernels do); pass a null "
                   "max_logit");
    };
    const validation ok = checks_.forward(q, k, v, thd_view<const T>(out), lse, ws,
                                          device_ ? device_workspace_bytes<T>() : 0, device);
    guarded<T>(
        ok, call::forward,
        [&] {
          const int heads = args_.q_heads;
          if (max_logit) detail::clear_max_logit(max_logit, heads, stream);
          Schedule::template device_forward<BlockKernel, Communicator, T>(
              comm_, schedule_, *device_, args_, q, k, v, out, lse, max_logit, ws.data(), stream);
          if (max_logit)
            detail::reduce_max_logit_device(
                comm_, max_logit, heads,
                reinterpret_cast<float*>(ws.data() + max_logit_buffers<T>()), max_logit_first_step,
                stream);
        },
        max_logit != nullptr);
  }

  //! The ring backward on device memory, asynchronous on `stream`: the arguments of
  //! `backward_host` as device pointers, `workspace` device memory of
  //! `device_backward_workspace_bytes<T>()`. Collective; deterministic (two calls give the same
  //! bits) with every BlockKernel but the cuDNN model's `cudnn_atomic` backward. Validation
  //! throws `invalid_argument` before anything is enqueued (and aborts the group).
  template <device_element T>
  void
  backward(std::type_identity_t<thd_view<const T>> q, std::type_identity_t<thd_view<const T>> k,
           std::type_identity_t<thd_view<const T>> v, std::type_identity_t<thd_view<const T>> out,
           const float* lse, std::type_identity_t<thd_view<const T>> dout, thd_view<T> dq,
           std::type_identity_t<thd_view<T>> dk, std::type_identity_t<thd_view<T>> dv,
           void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
    const std::span<std::byte> ws(static_cast<std::byte*>(workspace), workspace_bytes);
    using buffer = ring_checks::named_buffer;
    const buffer buffers[] = {{q.data, "q"},   {k.data, "k"},
                              {v.data, "v"},   {out.data, "out"},
                              {lse, "lse"},    {dout.data, "dout"},
                              {dq.data, "dq"}, {dk.data, "dk"},
                              {dv.data, "dv"}, {workspace, "the workspace"}};
    auto device = [&](validation& ok) {
      ring_checks::device_backward<T>(ok, device_ ? device_->comm.device() : -1, stream, buffers, q,
                                      dout, lse);
      if constexpr (requires { BlockKernel::check_backward_views(ok, q, out, dout); })
        BlockKernel::check_backward_views(ok, q, out, dout);
    };
    const validation ok =
        checks_.backward(q, k, v, out, lse, dout, dq, dk, dv, ws,
                         device_ ? device_backward_workspace_bytes<T>() : 0, device);
    guarded<T>(ok, call::backward, [&] {
      device_->prepare_backward(Schedule::compute(schedule_));
      Schedule::template device_backward<BlockKernel, Communicator, T>(
          comm_, schedule_, *device_, args_, q, k, v, out, lse, dout, dq, dk, dv, ws.data(),
          stream);
    });
  }
#endif

private:
  template <element T>
  typename Schedule::layout_type layout() const {
    return Schedule::workspace(schedule_, args_, element_format::of<T>());
  }
  std::size_t with_scratch(std::size_t ring_bytes, bool backward) const {
    return detail::with_scratch<BlockKernel>(device_.get(), ring_bytes, backward);
  }
  //! Where the max logit's reduction buffers start in the device forward's workspace.
  template <element T>
  std::size_t max_logit_buffers() const {
    return ring_workspace::align(with_scratch(layout<T>().forward_bytes(), false));
  }
  //! The max logit's exchanges are numbered from here: past every step and tag of the schedules.
  static constexpr std::int64_t max_logit_first_step = std::int64_t{1} << 40;
  using call = detail::call_kind;
  using ring_checks = detail::ring_checks;
  template <class T, class Body>
  void guarded(const validation& ok, call kind, Body&& body, bool max_logit = false) {
    gate_.run(ok, kind, dtype_of_v<T>, layout<T>(), std::forward<Body>(body), max_logit);
  }

  Communicator& comm_;
  attention_arguments args_;
  std::uint64_t fingerprint_ = 0; // what the ranks agreed on (set while plan_ is made)
  partition_plan<Partitioner> plan_;
  schedule_type schedule_;
  detail::ring_checks checks_;
  // A host-only BlockKernel has no device resources.
  using device_resources =
      std::conditional_t<device_block_kernel_for<BlockKernel, cudaStream_t>,
                         detail::ring_device_resources<BlockKernel>, detail::no_device_resources>;
  std::unique_ptr<device_resources> device_;
  detail::call_gate<Communicator> gate_;
  std::vector<float> max_logits_; // the host reduction's every-rank maxima, [size(), q_heads]
};

} // namespace ringattn
