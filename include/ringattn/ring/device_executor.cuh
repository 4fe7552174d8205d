#pragma once
//! \file
//! The ring's steps on device memory: the BlockKernel's device forward or backward on the
//! caller's stream, every exchange on a communication stream of the device's highest priority,
//! ordered by events, so that the exchange of step t + 1 overlaps the compute of step t and the
//! host never waits. `ring_device_resources` owns the streams, events and per-step kernel
//! schedules, made at plan time: the forward's by `prepare_device()`, the backward's at the first
//! backward (so a forward-only user never builds them).

#include <ringattn/arguments.cuh>
#include <ringattn/concepts.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/detail/nvtx.cuh>
#include <ringattn/detail/streams.cuh>
#include <ringattn/error.cuh>
#include <ringattn/kernel/backward_args.cuh>
#include <ringattn/kernel/forward_args.cuh>
#include <ringattn/kernel/state_ops.cuh>
#include <ringattn/ring/schedule.cuh>
#include <ringattn/ring/workspace.cuh>
#include <ringattn/tensor.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace ringattn::detail {

//! What a ring whose BlockKernel has no device path holds instead.
struct no_device_resources {};

template <class BlockKernel>
class ring_device_resources {
public:
  //! On the current device: the communication stream, the events and the forward's schedules.
  ring_device_resources(const ring_schedule& s, const attention_arguments& args)
      : arrived(static_cast<std::size_t>(s.ranks())), computed(static_cast<std::size_t>(s.ranks())),
        args_(args) {
    for (const ring_step& step : s.steps())
      forward.push_back(
          BlockKernel::make_forward_schedule(step.groups, s.q_tokens(), step.kv_tokens, args));
    if constexpr (requires { BlockKernel::plans_backward_at_prepare; })
      if (BlockKernel::plans_backward_at_prepare) prepare_backward(s);
  }
  //! The backward's schedules, once (on the device the resources live on).
  void prepare_backward(const ring_schedule& s) {
    if (!backward.empty() || s.steps().empty()) return;
    std::vector<typename BlockKernel::backward_schedule> made;
    for (const ring_step& step : s.steps())
      made.push_back(
          BlockKernel::make_backward_schedule(step.groups, s.q_tokens(), step.kv_tokens, args_));
    backward = std::move(made);
  }
  //! Device scratch the BlockKernel's schedules ask for, one step at a time (0 for a model that
  //! asks for none); the backward's once its schedules exist.
  std::size_t scratch_bytes(bool backward_direction) const {
    std::size_t most = 0;
    if constexpr (requires(const typename BlockKernel::forward_schedule& f) {
                    { f.scratch_bytes() } -> std::convertible_to<std::size_t>;
                  }) {
      for (const auto& f : backward_direction ? backward : forward)
        most = std::max<std::size_t>(most, f.scratch_bytes());
    }
    return most;
  }

  comm_stream comm; // comm.device(): the device the resources live on
  ordering_event own_ready, comm_end;
  ordering_event compute_done[2], recv_done[2];
  ordering_event grads_recv[2], grads_ready[2]; // backward: dK/dV arrived, complete
  // The all-gather schedule: per block, arrived (its K/V) and computed (its dK/dV share).
  std::vector<ordering_event> arrived, computed;
  std::vector<typename BlockKernel::forward_schedule> forward;
  std::vector<typename BlockKernel::backward_schedule> backward;

private:
  attention_arguments args_;
};

//! `ring_bytes` and, after them (256-byte aligned), the scratch of the BlockKernel's device
//! schedules. A model that plans its scratch at `prepare_device` needs the resources first.
template <class BlockKernel, class Resources>
std::size_t with_scratch(const Resources* d, std::size_t ring_bytes, bool backward) {
  if constexpr (requires { BlockKernel::plans_backward_at_prepare; }) {
    if (d == nullptr)
      throw invalid_argument("ringattn: " + std::string(BlockKernel::name) +
                             ": call prepare_device() before asking for the device workspace "
                             "(it includes what the block kernel plans there)");
  }
  std::size_t scratch = 0;
  if constexpr (requires { d->scratch_bytes(backward); })
    scratch = d ? d->scratch_bytes(backward) : 0;
  return scratch ? ring_workspace::align(ring_bytes) + scratch : ring_bytes;
}

#if defined(__CUDACC__)
//! A shard's k and v into a dense block (the layout that travels): one copy each when the input
//! is dense too, else one 2D copy per head.
template <class T, class Block>
void copy_own_block_device(thd_view<const T> k, thd_view<const T> v, const Block& own,
                           cudaStream_t stream) {
  const std::int64_t n = k.tokens;
  if (n == 0) return;
  for (int which = 0; which < 2; ++which) {
    const thd_view<const T>& x = which == 0 ? k : v;
    T* dst = which == 0 ? own.k.data : own.v.data;
    if (x.dense())
      RINGATTN_CUDA_CHECK(cudaMemcpyAsync(dst, x.data, sizeof(T) * n * x.heads * x.head_dim,
                                          cudaMemcpyDeviceToDevice, stream));
    else
      for (int h = 0; h < x.heads; ++h)
        RINGATTN_CUDA_CHECK(
            cudaMemcpy2DAsync(dst + h * x.head_dim, sizeof(T) * x.heads * x.head_dim, x.row(0, h),
                              sizeof(T) * x.token_stride, sizeof(T) * x.head_dim,
                              static_cast<std::size_t>(n), cudaMemcpyDeviceToDevice, stream));
  }
}

// Step t: `stream` computes Q against slot t % 2 while `comm` sends that slot on and receives
// block t + 1 into the other one. Events order the two streams:
//   compute(t)   waits recv_done[t % 2]         (block t has arrived)
//   receive(t+1) waits compute_done[(t+1) % 2]  (the compute of step t - 1 has read that slot)
// Each step's epilogue was decided with the schedule (ring_schedule::forward_epilogue).
template <class BlockKernel, class Communicator, class T>
void device_ring_forward(Communicator& comm, const ring_schedule& s,
                         ring_device_resources<BlockKernel>& d, const attention_arguments& args,
                         thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                         thd_view<T> out, float* lse, float* max_logit, std::byte* workspace,
                         cudaStream_t stream) {
  const ring_workspace ws(s.q_tokens(), s.max_kv_tokens(), args, sizeof(T));
  const attention_state state = ws.state(workspace, lse, max_logit);
  std::byte* scratch = workspace + ring_workspace::align(ws.forward_bytes());
  const bool dense = out.dense();
  if (s.forward_epilogue(0, dense) == step_epilogue::plain) {
    // One step, the own block, covering every row: the kernel writes `out` and `lse` directly (no
    // state, no copy of K/V).
    BlockKernel::device_forward(step_epilogue::plain, {q, k, v, args, state, scratch}, d.forward[0],
                                out, lse, stream);
    return;
  }
  if (s.needs_reset()) reset(state, stream);
  copy_own_block_device(k, v, ws.kv_slot_views<T>(workspace, 0, s.q_tokens()), stream);
  RINGATTN_CUDA_CHECK(cudaEventRecord(d.own_ready, stream));
  RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, d.own_ready, 0));
  for (const ring_step& step : s.steps()) {
    const int t = step.index;
    nvtx_range range("step", t, s.rank());
    const auto b = ws.kv_slot_views<T>(workspace, t % 2, step.kv_tokens);
    if (t > 0) RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.recv_done[t % 2], 0));
    const step_epilogue e = s.forward_epilogue(t, dense);
    if (e != step_epilogue::none)
      BlockKernel::device_forward(
          e, {q, thd_view<const T>(b.k), thd_view<const T>(b.v), args, state, scratch},
          d.forward[static_cast<std::size_t>(t)], out, lse, stream);
    RINGATTN_CUDA_CHECK(cudaEventRecord(d.compute_done[t % 2], stream));
    if (const ring_step* next = s.next(t)) {
      // Never recorded yet at t = 0: waiting on it is then a no-op.
      RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, d.compute_done[(t + 1) % 2], 0));
      // A block no later rank sees goes no further (its receiver expects nothing).
      comm.exchange_async(
          b.k.data, step.forwarded ? ws.block_bytes(step.kv_tokens) : 0, s.send_to(),
          ws.kv_slot_views<T>(workspace, (t + 1) % 2, next->kv_tokens).k.data,
          next->arrives ? ws.block_bytes(next->kv_tokens) : 0, s.receive_from(), t, d.comm);
      RINGATTN_CUDA_CHECK(cudaEventRecord(d.recv_done[(t + 1) % 2], d.comm));
    }
  }
  if (s.needs_finalize(dense)) finalize(state, out, stream);
  // Everything on the communication stream is done before later work on `stream` (a next call
  // reuses the slots).
  RINGATTN_CUDA_CHECK(cudaEventRecord(d.comm_end, d.comm));
  RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.comm_end, 0));
}

// The backward: the host executor's steps with the block backward on `stream` and the exchanges
// on the communication stream, in two parts per step so that both overlap the compute:
//   K/V of block t go on to rank + 1 as soon as the compute of step t - 1 is done (as in the
//   forward), and arrive for step t + 1 while step t computes;
//   step t's share of dK/dV goes into a local fp32 buffer (step 0: straight into the own
//   block's accumulators), which is added to block t's arriving accumulators once they are there
//   (sent by rank - 1 at the end of its step t - 1, in flight during this compute); the sum then
//   goes on to rank + 1, in flight during step t + 1.
// After the last step the complete dK/dV of the block held (rank + 1's after P steps) go home.
template <class BlockKernel, class Communicator, class T>
void device_ring_backward(Communicator& comm, const ring_schedule& s,
                          ring_device_resources<BlockKernel>& d, const attention_arguments& args,
                          thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                          thd_view<const T> out, const float* lse, thd_view<const T> dout,
                          thd_view<T> dq, thd_view<T> dk, thd_view<T> dv, std::byte* workspace,
                          cudaStream_t stream) {
  const ring_workspace ws(s.q_tokens(), s.max_kv_tokens(), args, sizeof(T));
  const int p = s.ranks();
  const std::int64_t n = s.q_tokens();
  const int dim = args.qk_dim(), qh = args.q_heads;
  std::byte* scratch = workspace + ring_workspace::align(ws.device_backward_bytes());
  if constexpr (whole_block_backward_for<BlockKernel, cudaStream_t>) {
    // One block: a model that can write dq, dk and dv directly does (no D, no fp32 sums).
    if (p == 1 && !d.backward.empty() &&
        BlockKernel::device_backward_whole(
            block_backward_args<T>{q, k, v, dout, lse, nullptr, args, {}, out, scratch},
            d.backward[0], dq, dk, dv, stream))
      return;
  }
  float* dq_acc = ws.dq(workspace);
  float* delta = ws.delta(workspace);
  float* local = ws.share(workspace);
  compute_delta<T>(out, dout, delta, stream);
  if (n > 0) {
    RINGATTN_CUDA_CHECK(
        cudaMemsetAsync(dq_acc, 0, sizeof(float) * static_cast<std::size_t>(n) * qh * dim, stream));
    const auto own = ws.grad_slot_views<T>(workspace, 0, n);
    copy_own_block_device(k, v, own, stream);
    RINGATTN_CUDA_CHECK(cudaMemsetAsync(own.dk, 0, ws.grad_bytes(n), stream));
  }
  RINGATTN_CUDA_CHECK(cudaEventRecord(d.own_ready, stream));
  RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, d.own_ready, 0));
  for (const ring_step& step : s.steps()) {
    const int t = step.index;
    nvtx_range range("backward step", t, s.rank());
    const std::int64_t nk = step.kv_tokens;
    const auto b = ws.grad_slot_views<T>(workspace, t % 2, nk);
    const ring_step* next = s.next(t);
    if (t > 0) RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.recv_done[t % 2], 0));
    if (next) {
      // K/V on; the other slot's K/V were last read by the compute of step t - 1.
      RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, d.compute_done[(t + 1) % 2], 0));
      comm.exchange_async(b.k.data, ws.block_bytes(nk), s.send_to(),
                          ws.grad_slot_views<T>(workspace, (t + 1) % 2, next->kv_tokens).k.data,
                          ws.block_bytes(next->kv_tokens), s.receive_from(), t, d.comm);
      RINGATTN_CUDA_CHECK(cudaEventRecord(d.recv_done[(t + 1) % 2], d.comm));
    }
    float* share = t == 0 ? b.dk : local;
    if (t > 0 && nk > 0) RINGATTN_CUDA_CHECK(cudaMemsetAsync(local, 0, ws.grad_bytes(nk), stream));
    if (!step.groups.empty())
      BlockKernel::device_backward(
          block_backward_args<T>{q,
                                 thd_view<const T>(b.k),
                                 thd_view<const T>(b.v),
                                 dout,
                                 lse,
                                 delta,
                                 args,
                                 {dq_acc, share, share + ws.k_elements(nk)},
                                 out,
                                 scratch},
          d.backward[static_cast<std::size_t>(t)], stream);
    RINGATTN_CUDA_CHECK(cudaEventRecord(d.compute_done[t % 2], stream));
    if (t > 0) {
      RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.grads_recv[t % 2], 0));
      accumulate(b.dk, local, static_cast<std::int64_t>(ws.kv_elements(nk)), stream);
    }
    RINGATTN_CUDA_CHECK(cudaEventRecord(d.grads_ready[t % 2], stream));
    if (next) {
      RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, d.grads_ready[t % 2], 0));
      comm.exchange_async(b.dk, ws.grad_bytes(nk), s.send_to(),
                          ws.grad_slot_views<T>(workspace, (t + 1) % 2, next->kv_tokens).dk,
                          ws.grad_bytes(next->kv_tokens), s.receive_from(), t, d.comm);
      RINGATTN_CUDA_CHECK(cudaEventRecord(d.grads_recv[(t + 1) % 2], d.comm));
    }
  }
  const float* own_dk = ws.grad_slot_views<T>(workspace, 0, n).dk;
  if (const int last = s.step_count() - 1; last > 0) {
    // The block held last (rank + 1's after P steps), complete: its dK/dV go home, and this
    // rank's own come back from the rank holding them.
    const ring_step& held = s.step(last);
    const auto b = ws.grad_slot_views<T>(workspace, last % 2, held.kv_tokens);
    float* home =
        reinterpret_cast<float*>(ws.grad_slot_views<T>(workspace, (last + 1) % 2, 0).k.data);
    RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, d.grads_ready[last % 2], 0));
    comm.exchange_async(b.dk, ws.grad_bytes(held.kv_tokens), held.source, home, ws.grad_bytes(n),
                        s.holder_of_own(), last + 1, d.comm);
    RINGATTN_CUDA_CHECK(cudaEventRecord(d.grads_recv[(last + 1) % 2], d.comm));
    RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.grads_recv[(last + 1) % 2], 0));
    own_dk = home;
  }
  write_gradient<T>(dq_acc, dq, stream);
  write_gradient<T>(own_dk, dk, stream);
  write_gradient<T>(own_dk + ws.k_elements(n), dv, stream);
  RINGATTN_CUDA_CHECK(cudaEventRecord(d.comm_end, d.comm));
  RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.comm_end, 0));
}
#endif // __CUDACC__

} // namespace ringattn::detail
