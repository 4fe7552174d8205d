#pragma once
//! \file
//! `ring_attention<Partitioner, Communicator, Mask>`: context-parallel attention over a ring.
//!
//! Each rank holds its Q, K, V shard (the partitioner's layout of a packed batch). The functor is
//! built once per layout — it validates the arguments, checks that every rank agrees on them (at
//! plan time, so a disagreement is an error on every rank, never a hang) and precomputes, for
//! every step, the block groups of this rank's queries against the K/V block that will arrive.
//! The run then takes P steps: at step t rank r attends to the K/V of rank (r - t) mod P and
//! passes that block on to rank r + 1, receiving the next from rank r - 1. Only kv heads travel:
//! a step moves `2 * local tokens of the source * kv_heads * head_dim * element size` bytes.
//! State is merged in fp32 across all steps (kernel/state.cuh) and finalised once.
//!
//! Two paths share the plan. The host path (`forward_host`: host block kernel, in-process threads
//! or MPI processes) runs everywhere, CI included. The device path (`prepare_device` once, then
//! `forward` on a stream: CUDA block kernel, two K/V buffers, a communication stream and events)
//! overlaps the exchange of step t + 1 with the compute of step t and never waits on the host.
//!
//! \code
//! ringattn::in_process_group group(P);                          // or an MPI communicator
//! auto comm = group.communicator(rank);                          // one per rank's thread
//! ringattn::ring_attention<ringattn::zigzag, ringattn::in_process_communicator, ringattn::causal>
//!     attn(comm, {.q_heads = 32, .kv_heads = 8, .head_dim = 128}, cu_seqlens);
//! std::vector<std::byte> ws(attn.host_workspace_bytes<__nv_bfloat16>());
//! attn.forward_host(q, k, v, out, lse, ws);   // this rank's shards; lse [q_heads, local tokens]
//! \endcode

#include <ringattn/arguments.cuh>
#include <ringattn/concepts.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/detail/nvtx.cuh>
#include <ringattn/error.cuh>
#include <ringattn/kernel/backward.cuh>
#include <ringattn/kernel/block.cuh>
#include <ringattn/kernel/forward.cuh>
#include <ringattn/kernel/host_backward.cuh>
#include <ringattn/kernel/host_forward.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/tensor.cuh>

#include <cuda_runtime_api.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace ringattn {

namespace detail {
//! What every rank of a ring must agree on, compared at plan time.
struct ring_fingerprint {
  std::int32_t valid; // 0: this rank rejected its own arguments (the rest is then unset)
  std::int32_t reserved = 0;
  std::int64_t tokens;
  std::uint64_t cu_seqlens_hash;
  std::uint64_t partitioner_hash;
  std::int32_t ranks, batch, q_heads, kv_heads, head_dim, mask;
  std::uint32_t scale_bits;
  std::int32_t padding = 0;
};

inline std::uint64_t fnv1a(const void* p, std::size_t n, std::uint64_t h = 1469598103934665603ull) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i)
    h = (h ^ b[i]) * 1099511628211ull;
  return h;
}
} // namespace detail

template <class Partitioner, class Communicator, class Mask>
class ring_attention {
  static_assert(partitioner<Partitioner>,
                "ringattn::ring_attention: the first template argument must be a Partitioner "
                "(ringattn::contiguous, ringattn::round_robin or ringattn::zigzag)");
  static_assert(host_communicator<Communicator>,
                "ringattn::ring_attention: the second template argument must be a Communicator "
                "(ringattn::in_process_communicator or ringattn::mpi_communicator)");
  static_assert(mask_policy<Mask>,
                "ringattn::ring_attention: the third template argument must be a mask policy "
                "(ringattn::full or ringattn::causal)");

public:
  //! Plans the ring for this rank. `cu_seqlens` is the *global* packed layout (batch + 1
  //! offsets), the same on every rank. Collective: every rank of `comm` must construct its
  //! functor; throws `invalid_argument` on every rank if the ranks disagree.
  ring_attention(Communicator& comm, const attention_arguments& args,
                 std::span<const std::int32_t> cu_seqlens)
      : comm_(comm), args_(args), plan_(agreed_plan(comm, args, cu_seqlens)) {
    const int p = comm_.size(), r = comm_.rank();
    const position_window w = position_window::of(Mask::mask);
    for (int t = 0; t < p; ++t)
      steps_.push_back(group_blocks(plan_.blocks(r, (r - t + p) % p, w)));
  }

  const partition_plan<Partitioner>& plan() const noexcept { return plan_; }
  const attention_arguments& arguments() const noexcept { return args_; }
  int rank() const noexcept { return comm_.rank(); }
  int size() const noexcept { return comm_.size(); }
  //! Tokens of this rank's shards.
  std::int64_t local_tokens() const { return plan_.local_tokens(comm_.rank()); }
  //! Block groups of step t (this rank's queries against the K/V of rank (rank - t) mod P).
  std::span<const block_group> step_groups(int t) const {
    return steps_.at(static_cast<std::size_t>(t));
  }

  //! Bytes a K/V block of rank `src` occupies on the wire (and in a ring buffer).
  template <element T>
  std::size_t block_bytes(int src) const {
    return 2 * static_cast<std::size_t>(plan_.local_tokens(src)) * args_.kv_heads * args_.head_dim *
           sizeof(T);
  }
  //! Host workspace of `forward_host`: two K/V ring buffers of the largest shard and the fp32
  //! state of this rank's shard (its o and its weight sums; the lse is the caller's).
  template <element T>
  std::size_t host_workspace_bytes() const {
    const std::size_t kv = align(2 * static_cast<std::size_t>(plan_.max_local_tokens()) *
                                 args_.kv_heads * args_.head_dim * sizeof(T));
    return 2 * kv + state_o_bytes() +
           static_cast<std::size_t>(local_tokens()) * args_.q_heads * sizeof(float);
  }

  //! Why `forward_host(q, k, v, out, lse, workspace)` cannot run, or ok.
  template <element T>
  validation validate_forward(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                              thd_view<T> out, const float* lse,
                              std::span<const std::byte> workspace) const {
    validation r = validation::ok();
    require_forward_views(r, q, k, v, thd_view<const T>(out));
    if (!r) return r;
    require_forward_shards(r, q, k, v, thd_view<const T>(out), lse);
    require_workspace(r, workspace, host_workspace_bytes<T>());
    return r;
  }

  //! The ring forward on host memory. `q`, `k`, `v`: this rank's shards; `out` like `q`;
  //! `lse`: `[q_heads, local tokens]` fp32, natural log. Collective: every rank must call it.
  //! Validation throws `invalid_argument` before anything is sent or written; a failure during
  //! the ring aborts the group (peers stop waiting with an error naming this rank) and rethrows.
  template <element T>
  void forward_host(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v, thd_view<T> out,
                    float* lse, std::span<std::byte> workspace) {
    error_rank_scope scope(comm_.rank());
    const validation ok = validate_forward(q, k, v, out, lse, workspace);
    if (!ok) comm_.abort(ok.reason()); // the peers stop waiting for this rank at once
    ok.throw_if_invalid();
    try {
      run_host(q, k, v, out, lse, workspace);
    } catch (const std::exception& e) {
      comm_.abort(e.what());
      throw;
    }
  }

  //! Bytes a K/V block of rank `src` and its fp32 dK/dV accumulators occupy on the wire in the
  //! backward: K, V in T, then dK, dV in fp32, each `[tokens, kv_heads, head_dim]`, contiguous.
  template <element T>
  std::size_t backward_block_bytes(int src) const {
    return block_bytes<T>(src) + 2 * static_cast<std::size_t>(plan_.local_tokens(src)) *
                                     args_.kv_heads * args_.head_dim * sizeof(float);
  }
  //! Host workspace of `backward_host`: two ring buffers of the largest block with its dK/dV
  //! (what travels), this rank's fp32 dQ accumulator and D (`[q_heads, local tokens]` fp32).
  template <element T>
  std::size_t host_backward_workspace_bytes() const {
    const std::size_t n = static_cast<std::size_t>(local_tokens());
    return 2 * backward_slot<T>() + align(n * args_.q_heads * args_.head_dim * sizeof(float)) +
           n * args_.q_heads * sizeof(float);
  }

  //! Why `backward_host(...)` cannot run, or ok.
  template <element T>
  validation validate_backward(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                               thd_view<const T> out, const float* lse, thd_view<const T> dout,
                               thd_view<T> dq, thd_view<T> dk, thd_view<T> dv,
                               std::span<const std::byte> workspace) const {
    return check_backward(q, k, v, out, lse, dout, dq, dk, dv, workspace,
                          host_backward_workspace_bytes<T>());
  }

  //! The ring backward on host memory: from this rank's shards `q`, `k`, `v`, the forward's `out`
  //! and `lse` and the output gradient `dout`, writes `dq` (like q), `dk` and `dv` (like k, v) in
  //! T. K/V blocks travel the ring again, each carrying its fp32 dK/dV, which every rank adds its
  //! share to; after the last step each block's dK/dV goes home to its owner. dQ stays local in
  //! fp32. Deterministic: the order of every fp32 addition is fixed by the ring. Collective;
  //! validation and failures behave as in `forward_host`. T is taken from `q` (the others
  //! convert, so a writable `out` view can be passed as is).
  template <element T>
  void backward_host(thd_view<const T> q, std::type_identity_t<thd_view<const T>> k,
                     std::type_identity_t<thd_view<const T>> v,
                     std::type_identity_t<thd_view<const T>> out, const float* lse,
                     std::type_identity_t<thd_view<const T>> dout,
                     std::type_identity_t<thd_view<T>> dq, std::type_identity_t<thd_view<T>> dk,
                     std::type_identity_t<thd_view<T>> dv, std::span<std::byte> workspace) {
    error_rank_scope scope(comm_.rank());
    const validation ok = validate_backward(q, k, v, out, lse, dout, dq, dk, dv, workspace);
    if (!ok) comm_.abort(ok.reason());
    ok.throw_if_invalid();
    try {
      run_host_backward(q, k, v, out, lse, dout, dq, dk, dv, workspace);
    } catch (const std::exception& e) {
      comm_.abort(e.what());
      throw;
    }
  }

  //! Device path, plan time: creates the communication stream, the events and the per-step
  //! kernel schedules on the current device, and the communicator's device resources. Call once
  //! per rank before `forward`; `forward` allocates nothing.
  void prepare_device() requires device_communicator_for<Communicator, cudaStream_t> {
    if (device_) return;
    comm_.prepare_device();
    auto d = std::make_unique<device_resources>();
    RINGATTN_CUDA_CHECK(cudaGetDevice(&d->device));
    // The exchanges' stream has the device's highest priority: a communication kernel (NCCL's)
    // enqueued while the block kernel fills the GPU gets the next free SM instead of queueing
    // behind the block kernel's remaining waves, so the transfer overlaps the compute.
    int least = 0, greatest = 0;
    RINGATTN_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    RINGATTN_CUDA_CHECK(cudaStreamCreateWithPriority(&d->comm, cudaStreamNonBlocking, greatest));
    for (cudaEvent_t* e : {&d->own_ready, &d->comm_end, &d->compute_done[0], &d->compute_done[1],
                           &d->recv_done[0], &d->recv_done[1], &d->grads_recv[0], &d->grads_recv[1],
                           &d->grads_ready[0], &d->grads_ready[1]})
      RINGATTN_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    const int p = comm_.size(), r = comm_.rank();
    for (int t = 0; t < p; ++t) {
      d->schedules.emplace_back(steps_[static_cast<std::size_t>(t)], local_tokens(),
                                plan_.local_tokens((r - t + p) % p), args_.head_dim);
      d->backward_schedules.emplace_back(steps_[static_cast<std::size_t>(t)], local_tokens(),
                                         plan_.local_tokens((r - t + p) % p));
    }
    device_ = std::move(d);
  }
  //! Device workspace of `forward` (the same layout as the host path's).
  template <element T>
  std::size_t device_workspace_bytes() const {
    return host_workspace_bytes<T>();
  }
  //! Device workspace of `backward`: the host path's, plus one fp32 dK/dV of the largest block
  //! (a step's share, added to the arriving accumulator once it is there, so the accumulators'
  //! transfer overlaps the compute). Plain arithmetic, so host-only code can size it too.
  template <element T>
  std::size_t device_backward_workspace_bytes() const {
    return align(host_backward_workspace_bytes<T>()) +
           align(2 * static_cast<std::size_t>(plan_.max_local_tokens()) * args_.kv_heads *
                 args_.head_dim * sizeof(float));
  }

#if defined(__CUDACC__)
  //! The ring forward on device memory, asynchronous on `stream`: `q`, `k`, `v` this rank's
  //! shards, `out` like `q`, `lse` `[q_heads, local tokens]` fp32 natural log, `workspace`
  //! device memory of `device_workspace_bytes<T>()`. Collective over the ranks. All work is
  //! ordered on `stream` (the exchange runs on an internal stream joined back by events); the
  //! host never waits for the device. Validation throws `invalid_argument` before anything is
  //! enqueued (and aborts the group so peers stop waiting).
  template <class T>
  requires(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) void forward(
      thd_view<const T> q, thd_view<const T> k, thd_view<const T> v, thd_view<T> out, float* lse,
      void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
    error_rank_scope scope(comm_.rank());
    validation ok = validate_forward(
        q, k, v, out, lse,
        std::span<const std::byte>(static_cast<const std::byte*>(workspace), workspace_bytes));
    ok.require(device_ != nullptr, "prepare_device() must run before the device forward");
    if (ok) ok.require(validate_device_call(q, k, v, out, lse, workspace, stream));
    if (!ok) comm_.abort(ok.reason());
    ok.throw_if_invalid();
    try {
      run_device(q, k, v, out, lse, static_cast<std::byte*>(workspace), stream);
    } catch (const std::exception& e) {
      comm_.abort(e.what());
      throw;
    }
  }

  //! The ring backward on device memory, asynchronous on `stream`: the arguments of
  //! `backward_host` as device pointers, `workspace` device memory of
  //! `device_backward_workspace_bytes<T>()`. Collective; deterministic (two calls give the same
  //! bits); the host never waits for the device. Validation throws `invalid_argument` before
  //! anything is enqueued (and aborts the group).
  template <class T>
  requires(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>) void backward(
      thd_view<const T> q, std::type_identity_t<thd_view<const T>> k,
      std::type_identity_t<thd_view<const T>> v, std::type_identity_t<thd_view<const T>> out,
      const float* lse, std::type_identity_t<thd_view<const T>> dout,
      std::type_identity_t<thd_view<T>> dq, std::type_identity_t<thd_view<T>> dk,
      std::type_identity_t<thd_view<T>> dv, void* workspace, std::size_t workspace_bytes,
      cudaStream_t stream) {
    error_rank_scope scope(comm_.rank());
    validation ok = check_backward(
        q, k, v, out, lse, dout, dq, dk, dv,
        std::span<const std::byte>(static_cast<const std::byte*>(workspace), workspace_bytes),
        device_backward_workspace_bytes<T>());
    ok.require(device_ != nullptr, "prepare_device() must run before the device backward");
    if (ok)
      ok.require(validate_device_placement(stream,
                                           {{q.data, "q"},
                                            {k.data, "k"},
                                            {v.data, "v"},
                                            {out.data, "out"},
                                            {lse, "lse"},
                                            {dout.data, "dout"},
                                            {dq.data, "dq"},
                                            {dk.data, "dk"},
                                            {dv.data, "dv"},
                                            {workspace, "the workspace"}},
                                           "backward"));
    // The block backward reads q and dout in place (k and v travel in the workspace).
    ok.require(rows_aligned_to(q, 16) && rows_aligned_to(dout, 16),
               "q and dout must be 16-byte aligned with token and head strides that are multiples "
               "of 8 elements (the kernels load 16-byte vectors)");
    ok.require(aligned_to(lse, 4), "lse must be 4-byte aligned");
    if (!ok) comm_.abort(ok.reason());
    ok.throw_if_invalid();
    try {
      run_device_backward(q, k, v, out, lse, dout, dq, dk, dv, static_cast<std::byte*>(workspace),
                          stream);
    } catch (const std::exception& e) {
      comm_.abort(e.what());
      throw;
    }
  }
#endif

private:
  static std::size_t align(std::size_t n) { return (n + 255) / 256 * 256; }

  // A view of this rank's shard: [local tokens, heads, head_dim].
  template <class View>
  void require_shard(validation& r, const View& x, const char* name, int heads) const {
    const std::int64_t n = local_tokens();
    r.require(x.tokens == n && x.heads == heads && x.head_dim == args_.head_dim, name, " is [",
              x.tokens, ", ", x.heads, ", ", x.head_dim, "] but rank ", comm_.rank(),
              "'s shard is [", n, ", ", heads, ", ", args_.head_dim, "]");
  }
  // The backward's arguments against this rank's shard; the workspace against `need` bytes (the
  // host and device paths need different amounts).
  template <element T>
  validation check_backward(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                            thd_view<const T> out, const float* lse, thd_view<const T> dout,
                            thd_view<T> dq, thd_view<T> dk, thd_view<T> dv,
                            std::span<const std::byte> workspace, std::size_t need) const {
    validation r = validation::ok();
    require_forward_views(r, q, k, v, out);
    r.require(validate_view(dout, "dout"));
    r.require(validate_view(dq, "dq"))
        .require(validate_view(dk, "dk"))
        .require(validate_view(dv, "dv"));
    if (!r) return r;
    require_forward_shards(r, q, k, v, out, lse);
    require_shard(r, dout, "dout", args_.q_heads);
    require_shard(r, dq, "dq", args_.q_heads);
    require_shard(r, dk, "dk", args_.kv_heads);
    require_shard(r, dv, "dv", args_.kv_heads);
    require_workspace(r, workspace, need);
    return r;
  }
  // The forward's tensors (both passes take them): each a sound view; then each the shape of
  // this rank's shard, and lse present where there are tokens.
  template <element T>
  static void require_forward_views(validation& r, thd_view<const T> q, thd_view<const T> k,
                                    thd_view<const T> v, thd_view<const T> out) {
    r.require(validate_view(q, "q")).require(validate_view(k, "k")).require(validate_view(v, "v"));
    r.require(validate_view(out, "out"));
  }
  template <element T>
  void require_forward_shards(validation& r, thd_view<const T> q, thd_view<const T> k,
                              thd_view<const T> v, thd_view<const T> out, const float* lse) const {
    require_shard(r, q, "q", args_.q_heads);
    require_shard(r, k, "k", args_.kv_heads);
    require_shard(r, v, "v", args_.kv_heads);
    require_shard(r, out, "out", args_.q_heads);
    r.require(local_tokens() == 0 || lse != nullptr, "lse is a null pointer");
  }
  // A workspace of at least `need` bytes, 16-byte aligned.
  static void require_workspace(validation& r, std::span<const std::byte> workspace,
                                std::size_t need) {
    r.require(workspace.size() >= need, "the workspace has ", workspace.size(), " bytes; ", need,
              " are needed");
    r.require(workspace.data() != nullptr || need == 0, "the workspace is a null pointer");
    r.require(aligned_to(workspace.data(), 16), "the workspace must be 16-byte aligned");
  }

#if defined(__CUDACC__)
  // What the device path needs on top of `validate_forward`: the current device and the stream's
  // are the one prepare_device() ran on; every buffer is device memory there (or managed), so no
  // kernel ever dereferences a host pointer; q meets the kernels' 16-byte alignment, out the
  // finalise kernel's 4-byte pairs.
  // The current device and the stream's are the one prepare_device() ran on, and every buffer is
  // device memory there (or managed), so no kernel ever dereferences a host pointer. `call` names
  // the entry point in messages.
  struct named_buffer {
    const void* data;
    const char* name;
  };
  validation validate_device_placement(cudaStream_t stream,
                                       std::initializer_list<named_buffer> buffers,
                                       const char* call) const {
    validation r = validation::ok();
    const int want = device_->device;
    int current = -1;
    RINGATTN_CUDA_CHECK(cudaGetDevice(&current));
    r.require(current == want, "the current device is ", current, " but prepare_device() ran on ",
              want);
    if (stream != nullptr && stream != cudaStreamLegacy && stream != cudaStreamPerThread) {
      int on = -1;
      RINGATTN_CUDA_CHECK(cudaStreamGetDevice(stream, &on));
      r.require(on == want, "the stream belongs to device ", on, "; this rank runs on device ",
                want);
    }
    for (const named_buffer& b : buffers) {
      if (b.data == nullptr || !r) continue;
      cudaPointerAttributes a{};
      const cudaError_t e = cudaPointerGetAttributes(&a, b.data);
      if (e != cudaSuccess) { // older drivers report unregistered host memory this way
        (void)cudaGetLastError();
        r.require(false, b.name, " is not device memory (", cudaGetErrorName(e), ")");
        continue;
      }
      if (a.type == cudaMemoryTypeManaged || (a.type == cudaMemoryTypeDevice && a.device == want))
        continue; // (the messages below are built only on failure: a valid call allocates nothing)
      if (a.type == cudaMemoryTypeDevice)
        r.require(false, b.name, " is device memory of another device (", a.device,
                  "; this rank runs on device ", want, ")");
      else
        r.require(false, b.name, " is host memory; the device ", call, " takes device memory");
    }
    return r;
  }
  // What the device forward needs on top of `validate_forward`: placement, and q meets the
  // kernels' 16-byte alignment, out the finalise kernel's 4-byte pairs.
  template <class T>
  validation validate_device_call(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                                  thd_view<T> out, const float* lse, const void* workspace,
                                  cudaStream_t stream) const {
    validation r = validate_device_placement(stream,
                                             {{q.data, "q"},
                                              {k.data, "k"},
                                              {v.data, "v"},
                                              {out.data, "out"},
                                              {lse, "lse"},
                                              {workspace, "the workspace"}},
                                             "forward");
    r.require(rows_aligned_to(q, 16),
              "q must be 16-byte aligned with token and head strides that are "
              "multiples of 8 elements (the kernels load 16-byte vectors)");
    r.require(rows_aligned_to(out, 4),
              "out must be 4-byte aligned with even token and head strides");
    r.require(aligned_to(lse, 4), "lse must be 4-byte aligned");
    return r;
  }
#endif

  // Every rank validates its own arguments, then all exchange a fingerprint in one all-gather —
  // also the ranks whose arguments are invalid, so that every rank fails together, at once,
  // whether one rank rejected its arguments or the ranks disagree; nobody is left waiting.
  static partition_plan<Partitioner> agreed_plan(Communicator& comm,
                                                 const attention_arguments& args,
                                                 std::span<const std::int32_t> cu) {
    validation own = args.validate();
    own.require(partition_plan<Partitioner>::validate(cu, comm.size()));
    detail::ring_fingerprint mine{};
    mine.valid = own.is_ok() ? 1 : 0;
    if (own) {
      mine.tokens = cu.back();
      mine.cu_seqlens_hash = detail::fnv1a(cu.data(), cu.size_bytes());
      mine.partitioner_hash =
          detail::fnv1a(Partitioner::name, std::char_traits<char>::length(Partitioner::name));
      mine.ranks = comm.size();
      mine.batch = static_cast<std::int32_t>(cu.size()) - 1;
      mine.q_heads = args.q_heads;
      mine.kv_heads = args.kv_heads;
      mine.head_dim = args.head_dim;
      mine.mask = static_cast<std::int32_t>(Mask::mask);
      mine.scale_bits = std::bit_cast<std::uint32_t>(static_cast<float>(args.scale()));
    }
    std::vector<detail::ring_fingerprint> all(static_cast<std::size_t>(comm.size()));
    comm.all_gather(&mine, sizeof mine, all.data());
    own.throw_if_invalid();
    validation v = validation::ok();
    for (int r = 0; r < comm.size() && v; ++r)
      v.require(all[static_cast<std::size_t>(r)].valid == 1, "rank ", r,
                " rejected its arguments (its own error says why)");
    const detail::ring_fingerprint& ref = all[0];
    for (int r = 1; r < comm.size() && v; ++r) {
      const detail::ring_fingerprint& x = all[static_cast<std::size_t>(r)];
      auto differ = [&](bool same, const char* what, auto a, auto b) {
        v.require(same, "rank ", r, " disagrees with rank 0 on ", what, " (", a, " vs ", b, ")");
      };
      differ(x.ranks == ref.ranks, "the number of ranks", x.ranks, ref.ranks);
      differ(x.q_heads == ref.q_heads, "q_heads", x.q_heads, ref.q_heads);
      differ(x.kv_heads == ref.kv_heads, "kv_heads", x.kv_heads, ref.kv_heads);
      differ(x.head_dim == ref.head_dim, "head_dim", x.head_dim, ref.head_dim);
      differ(x.scale_bits == ref.scale_bits, "the softmax scale",
             std::bit_cast<float>(x.scale_bits), std::bit_cast<float>(ref.scale_bits));
      differ(x.mask == ref.mask, "the mask", to_string(static_cast<mask_kind>(x.mask)),
             to_string(static_cast<mask_kind>(ref.mask)));
      differ(x.partitioner_hash == ref.partitioner_hash, "the partitioner", "a different one",
             Partitioner::name);
      differ(x.tokens == ref.tokens, "the total token count", x.tokens, ref.tokens);
      differ(x.batch == ref.batch, "the number of sequences", x.batch, ref.batch);
      differ(x.cu_seqlens_hash == ref.cu_seqlens_hash, "cu_seqlens", "other lengths", "rank 0's");
    }
    v.throw_if_invalid();
    return partition_plan<Partitioner>(cu, comm.size());
  }

  //! The fp32 o of this rank's state, aligned for what follows it (the weight sums).
  std::size_t state_o_bytes() const {
    return align(static_cast<std::size_t>(local_tokens()) * args_.q_heads * args_.head_dim *
                 sizeof(float));
  }
  //! The state in workspace memory at `at` (o, then the weight sums), with the caller's lse.
  attention_state state_in(std::byte* at, float* lse) const {
    return {reinterpret_cast<float*>(at),
            lse,
            reinterpret_cast<float*>(at + state_o_bytes()),
            local_tokens(),
            args_.q_heads,
            args_.head_dim};
  }

  template <element T>
  void run_host(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v, thd_view<T> out,
                float* lse, std::span<std::byte> workspace) {
    const int p = comm_.size(), r = comm_.rank();
    const std::int64_t n = local_tokens();
    const int kvh = args_.kv_heads, d = args_.head_dim;
    const std::size_t slot =
        align(2 * static_cast<std::size_t>(plan_.max_local_tokens()) * kvh * d * sizeof(T));
    T* buf[2] = {reinterpret_cast<T*>(workspace.data()),
                 reinterpret_cast<T*>(workspace.data() + slot)};
    const attention_state state = state_in(workspace.data() + 2 * slot, lse);
    reset(state);
    // The K/V block in a ring buffer: k of `tokens` rows, then v, both dense.
    auto block_views = [&](T* b, std::int64_t tokens) {
      const std::int64_t e = tokens * kvh * d;
      return std::pair{thd_view<T>(b, tokens, kvh, d), thd_view<T>(b + e, tokens, kvh, d)};
    };
    {
      auto [k0, v0] = block_views(buf[0], n); // own block, dense, ready to travel
      for (std::int64_t t = 0; t < n; ++t)
        for (int h = 0; h < kvh; ++h) {
          std::memcpy(k0.row(t, h), k.row(t, h), sizeof(T) * d);
          std::memcpy(v0.row(t, h), v.row(t, h), sizeof(T) * d);
        }
    }
    for (int t = 0; t < p; ++t) {
      detail::nvtx_range range("step", t, r);
      const int src = (r - t + p) % p;
      const std::int64_t nk = plan_.local_tokens(src);
      auto [kb, vb] = block_views(buf[t % 2], nk);
      const auto& groups = steps_[static_cast<std::size_t>(t)];
      if (!groups.empty()) host_block_forward<T>({q, kb, vb, args_, state}, groups);
      if (t + 1 < p) {
        const int next = (r - t - 1 + p) % p; // the block that arrives for step t + 1
        comm_.exchange(buf[t % 2], block_bytes<T>(src), (r + 1) % p, buf[(t + 1) % 2],
                       block_bytes<T>(next), (r - 1 + p) % p, t);
      }
    }
    finalize(state, out);
  }

  // One ring buffer of the backward: the largest block's K, V (T) and dK, dV (fp32).
  template <element T>
  std::size_t backward_slot() const {
    const std::size_t e =
        2 * static_cast<std::size_t>(plan_.max_local_tokens()) * args_.kv_heads * args_.head_dim;
    return align(e * sizeof(T) + e * sizeof(float));
  }
  // A backward block in a ring buffer: k, v of `tokens` rows (T, dense), then dk, dv (fp32).
  template <element T>
  struct backward_block {
    thd_view<T> k, v;
    float *dk, *dv;
  };
  template <element T>
  backward_block<T> backward_views(std::byte* b, std::int64_t tokens) const {
    const std::int64_t e = tokens * args_.kv_heads * args_.head_dim;
    T* kv = reinterpret_cast<T*>(b);
    float* g = reinterpret_cast<float*>(b + 2 * e * static_cast<std::int64_t>(sizeof(T)));
    return {thd_view<T>(kv, tokens, args_.kv_heads, args_.head_dim),
            thd_view<T>(kv + e, tokens, args_.kv_heads, args_.head_dim), g, g + e};
  }

  // Step t: this rank adds Q's share against block src = r - t (carried with its dK/dV) and passes
  // the block on; after step P - 1 it holds block r + 1, complete, and sends that block's dK/dV
  // home while receiving its own from rank r - 1 ("step P").
  template <element T>
  void run_host_backward(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                         thd_view<const T> out, const float* lse, thd_view<const T> dout,
                         thd_view<T> dq, thd_view<T> dk, thd_view<T> dv,
                         std::span<std::byte> workspace) {
    const int p = comm_.size(), r = comm_.rank();
    const std::int64_t n = local_tokens();
    const int kvh = args_.kv_heads, d = args_.head_dim, qh = args_.q_heads;
    const std::size_t slot = backward_slot<T>();
    std::byte* buf[2] = {workspace.data(), workspace.data() + slot};
    float* dq_acc = reinterpret_cast<float*>(workspace.data() + 2 * slot);
    float* delta = reinterpret_cast<float*>(
        workspace.data() + 2 * slot + align(static_cast<std::size_t>(n) * qh * d * sizeof(float)));
    compute_delta(out, dout, delta);
    std::fill(dq_acc, dq_acc + n * qh * d, 0.0f);
    {
      const backward_block<T> own = backward_views<T>(buf[0], n);
      for (std::int64_t t = 0; t < n; ++t)
        for (int h = 0; h < kvh; ++h) {
          std::memcpy(own.k.row(t, h), k.row(t, h), sizeof(T) * d);
          std::memcpy(own.v.row(t, h), v.row(t, h), sizeof(T) * d);
        }
      std::fill(own.dk, own.dk + 2 * n * kvh * d, 0.0f); // dk, then dv
    }
    for (int t = 0; t < p; ++t) {
      detail::nvtx_range range("backward step", t, r);
      const int src = (r - t + p) % p;
      const backward_block<T> b = backward_views<T>(buf[t % 2], plan_.local_tokens(src));
      const auto& groups = steps_[static_cast<std::size_t>(t)];
      if (!groups.empty())
        host_block_backward<T>({q, b.k, b.v, dout, lse, delta, args_, {dq_acc, b.dk, b.dv}},
                               groups);
      if (t + 1 < p) {
        const int next = (r - t - 1 + p) % p;
        comm_.exchange(buf[t % 2], backward_block_bytes<T>(src), (r + 1) % p, buf[(t + 1) % 2],
                       backward_block_bytes<T>(next), (r - 1 + p) % p, t);
      }
    }
    const float* own_dk = backward_views<T>(buf[0], n).dk;
    if (p > 1) {
      const int held = (r + 1) % p; // the block of step P - 1
      const backward_block<T> b = backward_views<T>(buf[(p - 1) % 2], plan_.local_tokens(held));
      const std::size_t grads = 2 * static_cast<std::size_t>(kvh) * d * sizeof(float);
      float* home = reinterpret_cast<float*>(buf[p % 2]);
      comm_.exchange(b.dk, grads * static_cast<std::size_t>(plan_.local_tokens(held)), held, home,
                     grads * static_cast<std::size_t>(n), (r - 1 + p) % p, p);
      own_dk = home;
    }
    const float* own_dv = own_dk + n * kvh * d;
    for (std::int64_t t = 0; t < n; ++t) {
      for (int h = 0; h < qh; ++h)
        for (int e = 0; e < d; ++e)
          dq(t, h, e) = from_float<T>(dq_acc[(t * qh + h) * d + e]);
      for (int h = 0; h < kvh; ++h)
        for (int e = 0; e < d; ++e) {
          dk(t, h, e) = from_float<T>(own_dk[(t * kvh + h) * d + e]);
          dv(t, h, e) = from_float<T>(own_dv[(t * kvh + h) * d + e]);
        }
    }
  }

  struct device_resources {
    int device = -1; // where prepare_device() ran: streams, events and schedules live there
    cudaStream_t comm = nullptr;
    cudaEvent_t own_ready = nullptr, comm_end = nullptr;
    cudaEvent_t compute_done[2] = {}, recv_done[2] = {};
    cudaEvent_t grads_recv[2] = {}, grads_ready[2] = {}; // backward: dK/dV arrived, complete
    std::vector<device_block_schedule> schedules;
    std::vector<device_backward_schedule> backward_schedules;
    device_resources() = default;
    device_resources(const device_resources&) = delete;
    device_resources& operator=(const device_resources&) = delete;
    ~device_resources() {
      for (cudaEvent_t e :
           {own_ready, comm_end, compute_done[0], compute_done[1], recv_done[0], recv_done[1],
            grads_recv[0], grads_recv[1], grads_ready[0], grads_ready[1]})
        if (e) cudaEventDestroy(e);
      if (comm) cudaStreamDestroy(comm);
    }
  };

#if defined(__CUDACC__)
  // Step t: `stream` computes Q against buffer t % 2 while `comm` sends that buffer on and
  // receives block t + 1 into the other one. Events order the two streams:
  //   compute(t)  waits recv_done[t % 2]        (block t has arrived)
  //   receive(t+1) waits compute_done[(t+1) % 2] (the compute of step t - 1 has read that buffer)
  template <class T>
  void run_device(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v, thd_view<T> out,
                  float* lse, std::byte* workspace, cudaStream_t stream) {
    device_resources& d = *device_;
    const int p = comm_.size(), r = comm_.rank();
    const std::int64_t n = local_tokens();
    const int kvh = args_.kv_heads, dim = args_.head_dim;
    const std::size_t slot =
        align(2 * static_cast<std::size_t>(plan_.max_local_tokens()) * kvh * dim * sizeof(T));
    T* buf[2] = {reinterpret_cast<T*>(workspace), reinterpret_cast<T*>(workspace + slot)};
    const attention_state state = state_in(workspace + 2 * slot, lse);
    if (p == 1 && out.dense()) {
      // One block, and every row sees at least its own key: the kernel writes `out` and `lse`
      // directly (no state to reset, merge or finalise, no copy of K/V).
      if (!steps_[0].empty())
        block_forward_plain<T>({q, k, v, args_, state}, d.schedules[0], out, lse, stream);
      return;
    }
    // The state's fixed costs, where the steps allow: a first step whose groups cover every row
    // (the own block: every row sees its own key) writes the state without reading it, so no
    // reset; a last step that covers every row (full masks, unless a sequence is missing from
    // the last block) writes the output itself, so no finalise.
    const bool first_writes = n > 0 && rows_of(steps_.front()) == n;
    const bool last_writes = n > 0 && rows_of(steps_.back()) == n && out.dense();
    if (!first_writes) reset(state, stream);
    copy_own_block(k, v, buf[0], stream);
    RINGATTN_CUDA_CHECK(cudaEventRecord(d.own_ready, stream));
    RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, d.own_ready, 0));
    for (int t = 0; t < p; ++t) {
      detail::nvtx_range range("step", t, r);
      const int src = (r - t + p) % p;
      const std::int64_t nk = plan_.local_tokens(src);
      T* cur = buf[t % 2];
      if (t > 0) RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.recv_done[t % 2], 0));
      const block_forward_args<T> a{q, thd_view<const T>(cur, nk, kvh, dim),
                                    thd_view<const T>(cur + nk * kvh * dim, nk, kvh, dim), args_,
                                    state};
      const device_block_schedule& sched = d.schedules[static_cast<std::size_t>(t)];
      if (t == 0 && first_writes)
        block_forward_first<T>(a, sched, stream);
      else if (t == p - 1 && last_writes)
        block_forward_last<T>(a, sched, out, stream);
      else if (!steps_[static_cast<std::size_t>(t)].empty())
        block_forward<T>(a, sched, stream);
      RINGATTN_CUDA_CHECK(cudaEventRecord(d.compute_done[t % 2], stream));
      if (t + 1 < p) {
        const int next = (r - t - 1 + p) % p;
        // Never recorded yet at t = 0: waiting on it is then a no-op.
        RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, d.compute_done[(t + 1) % 2], 0));
        comm_.exchange_async(cur, block_bytes<T>(src), (r + 1) % p, buf[(t + 1) % 2],
                             block_bytes<T>(next), (r - 1 + p) % p, t, d.comm);
        RINGATTN_CUDA_CHECK(cudaEventRecord(d.recv_done[(t + 1) % 2], d.comm));
      }
    }
    if (!last_writes) finalize(state, out, stream);
    // Everything on the communication stream is done before later work on `stream` (a next
    // forward reuses the buffers).
    RINGATTN_CUDA_CHECK(cudaEventRecord(d.comm_end, d.comm));
    RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.comm_end, 0));
  }
  // Own K/V into a ring buffer, dense (the layout that travels): one copy each when the input is
  // dense too, else one 2D copy per head.
  template <class T>
  void copy_own_block(thd_view<const T> k, thd_view<const T> v, T* dst0,
                      cudaStream_t stream) const {
    const std::int64_t n = local_tokens();
    const int kvh = args_.kv_heads, dim = args_.head_dim;
    for (int which = 0; which < 2; ++which) {
      const thd_view<const T>& x = which == 0 ? k : v;
      T* dst = dst0 + which * n * kvh * dim;
      if (x.dense() && n > 0)
        RINGATTN_CUDA_CHECK(cudaMemcpyAsync(dst, x.data, sizeof(T) * n * kvh * dim,
                                            cudaMemcpyDeviceToDevice, stream));
      else
        for (int h = 0; h < kvh && n > 0; ++h)
          RINGATTN_CUDA_CHECK(cudaMemcpy2DAsync(
              dst + h * dim, sizeof(T) * kvh * dim, x.row(0, h), sizeof(T) * x.token_stride,
              sizeof(T) * dim, static_cast<std::size_t>(n), cudaMemcpyDeviceToDevice, stream));
    }
  }

  // The backward on the device: the host path's steps (run_host_backward) with the block
  // backward kernels on `stream` and the exchanges on the communication stream, in two parts per
  // step so that both overlap the compute:
  //   K/V of block t go on to rank r + 1 as soon as the compute of step t - 1 is done (as in the
  //   forward), and arrive for step t + 1 while step t computes;
  //   step t's share of dK/dV goes into a local fp32 buffer (step 0: straight into the own
  //   block's accumulators), which is added to block t's arriving accumulators once they are there
  //   (sent by rank r - 1 at the end of its step t - 1, in flight during this compute); the sum
  //   then goes on to rank r + 1, in flight during step t + 1.
  // After the last step the complete dK/dV of the block held (rank r + 1's) go home.
  template <class T>
  void run_device_backward(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                           thd_view<const T> out, const float* lse, thd_view<const T> dout,
                           thd_view<T> dq, thd_view<T> dk, thd_view<T> dv, std::byte* workspace,
                           cudaStream_t stream) {
    device_resources& d = *device_;
    const int p = comm_.size(), r = comm_.rank();
    const std::int64_t n = local_tokens();
    const int kvh = args_.kv_heads, dim = args_.head_dim, qh = args_.q_heads;
    const std::size_t slot = backward_slot<T>();
    std::byte* buf[2] = {workspace, workspace + slot};
    float* dq_acc = reinterpret_cast<float*>(workspace + 2 * slot);
    float* delta = reinterpret_cast<float*>(
        workspace + 2 * slot + align(static_cast<std::size_t>(n) * qh * dim * sizeof(float)));
    float* local = reinterpret_cast<float*>(workspace + align(host_backward_workspace_bytes<T>()));
    const std::int64_t row_grads = 2 * static_cast<std::int64_t>(kvh) * dim; // dK + dV a token
    compute_delta<T>(out, dout, delta, stream);
    if (n > 0) {
      RINGATTN_CUDA_CHECK(cudaMemsetAsync(
          dq_acc, 0, sizeof(float) * static_cast<std::size_t>(n) * qh * dim, stream));
      const backward_block<T> own = backward_views<T>(buf[0], n);
      copy_own_block(k, v, own.k.data, stream);
      RINGATTN_CUDA_CHECK(cudaMemsetAsync(own.dk, 0, sizeof(float) * n * row_grads, stream));
    }
    RINGATTN_CUDA_CHECK(cudaEventRecord(d.own_ready, stream));
    RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, d.own_ready, 0));
    for (int t = 0; t < p; ++t) {
      detail::nvtx_range range("backward step", t, r);
      const int src = (r - t + p) % p, next = (r - t - 1 + p) % p;
      const std::int64_t nk = plan_.local_tokens(src);
      const backward_block<T> b = backward_views<T>(buf[t % 2], nk);
      if (t > 0) RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.recv_done[t % 2], 0));
      if (t + 1 < p) {
        // K/V on; the other slot's K/V were last read by the compute of step t - 1.
        RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, d.compute_done[(t + 1) % 2], 0));
        comm_.exchange_async(b.k.data, block_bytes<T>(src), (r + 1) % p,
                             backward_views<T>(buf[(t + 1) % 2], plan_.local_tokens(next)).k.data,
                             block_bytes<T>(next), (r - 1 + p) % p, t, d.comm);
        RINGATTN_CUDA_CHECK(cudaEventRecord(d.recv_done[(t + 1) % 2], d.comm));
      }
      float* share = t == 0 ? b.dk : local;
      if (t > 0 && nk > 0)
        RINGATTN_CUDA_CHECK(cudaMemsetAsync(local, 0, sizeof(float) * nk * row_grads, stream));
      if (!steps_[static_cast<std::size_t>(t)].empty())
        block_backward<T>(
            {q, b.k, b.v, dout, lse, delta, args_, {dq_acc, share, share + nk * row_grads / 2}},
            d.backward_schedules[static_cast<std::size_t>(t)], stream);
      RINGATTN_CUDA_CHECK(cudaEventRecord(d.compute_done[t % 2], stream));
      if (t > 0) {
        RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.grads_recv[t % 2], 0));
        accumulate(b.dk, local, nk * row_grads, stream);
      }
      RINGATTN_CUDA_CHECK(cudaEventRecord(d.grads_ready[t % 2], stream));
      if (t + 1 < p) {
        RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, d.grads_ready[t % 2], 0));
        comm_.exchange_async(b.dk, sizeof(float) * nk * row_grads, (r + 1) % p,
                             backward_views<T>(buf[(t + 1) % 2], plan_.local_tokens(next)).dk,
                             sizeof(float) * plan_.local_tokens(next) * row_grads, (r - 1 + p) % p,
                             t, d.comm);
        RINGATTN_CUDA_CHECK(cudaEventRecord(d.grads_recv[(t + 1) % 2], d.comm));
      }
    }
    const float* own_dk = backward_views<T>(buf[0], n).dk;
    if (p > 1) {
      const int held = (r + 1) % p; // the block of step P - 1, complete: its dK/dV go home
      const backward_block<T> b = backward_views<T>(buf[(p - 1) % 2], plan_.local_tokens(held));
      float* home = reinterpret_cast<float*>(buf[p % 2]);
      RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, d.grads_ready[(p - 1) % 2], 0));
      comm_.exchange_async(b.dk, sizeof(float) * plan_.local_tokens(held) * row_grads, held, home,
                           sizeof(float) * n * row_grads, (r - 1 + p) % p, p, d.comm);
      RINGATTN_CUDA_CHECK(cudaEventRecord(d.grads_recv[p % 2], d.comm));
      RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.grads_recv[p % 2], 0));
      own_dk = home;
    }
    write_gradient<T>(dq_acc, dq, stream);
    write_gradient<T>(own_dk, dk, stream);
    write_gradient<T>(own_dk + n * kvh * dim, dv, stream);
    RINGATTN_CUDA_CHECK(cudaEventRecord(d.comm_end, d.comm));
    RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.comm_end, 0));
  }
#endif

  Communicator& comm_;
  attention_arguments args_;
  partition_plan<Partitioner> plan_;
  std::vector<std::vector<block_group>> steps_;
  std::unique_ptr<device_resources> device_;
};

} // namespace ringattn
