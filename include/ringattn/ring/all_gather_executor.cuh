#pragma once
//! \file
//! The all-gather schedule's executors: every rank's K/V block is gathered once, then this rank's
//! queries attend to each block in place, with the ring schedule's groups (the block of rank
//! (rank - t) mod P in slot t, the groups of step t). No block travels twice and no block is
//! merged on arrival: the fp32 state is merged block after block as on the ring.
//!
//! The gather is P - 1 pairwise exchanges: in exchange k rank r sends its own block to
//! r + k and receives the block of r - k, so a rank sends (P - 1) x its own K/V; a block no query
//! of the receiver sees is neither sent nor received (`ring_step::own_wanted`, the step's groups).
//! The backward gathers K/V again, computes every block's fp32 dK/dV share, and returns each
//! share to its owner in the same pairwise pattern (a reduce-scatter; no share where nothing was
//! computed): the owner adds what it receives in the order k = 1 .. P - 1, so the result is the
//! same bit for bit from call to call.
//!
//! On the device the exchanges run on the communication stream and the compute of block t waits
//! only for block t's arrival, so the gather of the later blocks overlaps the compute of the
//! earlier ones; in the backward each share leaves as soon as its block is done.

#include <ringattn/arguments.cuh>
#include <ringattn/detail/nvtx.cuh>
#include <ringattn/kernel/host_backward.cuh>
#include <ringattn/kernel/host_forward.cuh>
#include <ringattn/ring/device_executor.cuh>
#include <ringattn/ring/host_executor.cuh>
#include <ringattn/ring/schedule.cuh>
#include <ringattn/ring/workspace.cuh>
#include <ringattn/tensor.cuh>

#include <algorithm>
#include <cstddef>
#include <span>

namespace ringattn::detail {

//! The all-gather's workspace: a slot for the block of every step (every rank's, or those a
//! window needs); in the backward a share for every block whose dK/dV come back (at least one).
inline ring_workspace all_gather_workspace(const ring_schedule& s, const attention_arguments& args,
                                           std::size_t element_bytes) {
  return {s.q_tokens(),  s.max_kv_tokens(),           args,
          element_bytes, std::max(2, s.step_count()), std::max(1, s.step_count() - 1)};
}

//! Exchange k of the gather: to rank + k, from rank - k (whose block is step k's).
inline int gather_to(const ring_schedule& s, int k) { return (s.rank() + k) % s.ranks(); }

template <class BlockKernel, class Communicator, element T>
void host_all_gather_forward(Communicator& comm, const ring_schedule& s,
                             const attention_arguments& args, thd_view<const T> q,
                             thd_view<const T> k, thd_view<const T> v, thd_view<T> out, float* lse,
                             float* max_logit, std::span<std::byte> workspace) {
  const ring_workspace ws = all_gather_workspace(s, args, sizeof(T));
  std::byte* base = workspace.data();
  const attention_state state = ws.state(base, lse, max_logit);
  reset(state);
  const auto own = ws.kv_slot_views<T>(base, 0, s.q_tokens());
  copy_own_block_host(k, v, own);
  for (int t = 1; t < s.step_count(); ++t) {
    const ring_step& step = s.step(t);
    comm.exchange(own.k.data, step.own_wanted ? ws.block_bytes(s.q_tokens()) : 0, gather_to(s, t),
                  ws.kv_slot_views<T>(base, t, step.kv_tokens).k.data,
                  step.groups.empty() ? 0 : ws.block_bytes(step.kv_tokens), step.source, t);
  }
  for (const ring_step& step : s.steps()) {
    nvtx_range range("block", step.index, s.rank());
    const auto b = ws.kv_slot_views<T>(base, step.index, step.kv_tokens);
    if (!step.groups.empty())
      BlockKernel::host_forward(
          block_forward_args<T>{q, thd_view<const T>(b.k), thd_view<const T>(b.v), args, state},
          step.groups);
  }
  finalize(state, out);
}

template <class BlockKernel, class Communicator, element T>
void host_all_gather_backward(Communicator& comm, const ring_schedule& s,
                              const attention_arguments& args, thd_view<const T> q,
                              thd_view<const T> k, thd_view<const T> v, thd_view<const T> out,
                              const float* lse, thd_view<const T> dout, thd_view<T> dq,
                              thd_view<T> dk, thd_view<T> dv, std::span<std::byte> workspace) {
  const ring_workspace ws = all_gather_workspace(s, args, sizeof(T));
  const std::int64_t n = s.q_tokens();
  const int p = s.ranks(), steps = s.step_count(), d = args.qk_dim(), qh = args.q_heads;
  std::byte* base = workspace.data();
  float* dq_acc = ws.dq(base);
  float* delta = ws.delta(base);
  compute_delta(out, dout, delta);
  std::fill(dq_acc, dq_acc + n * qh * d, 0.0f);
  const auto own = ws.grad_slot_views<T>(base, 0, n);
  copy_own_block_host(k, v, own);
  for (int t = 1; t < steps; ++t) {
    const ring_step& step = s.step(t);
    comm.exchange(own.k.data, step.own_wanted ? ws.block_bytes(n) : 0, gather_to(s, t),
                  ws.grad_slot_views<T>(base, t, step.kv_tokens).k.data,
                  step.groups.empty() ? 0 : ws.block_bytes(step.kv_tokens), step.source, t);
  }
  for (const ring_step& step : s.steps()) {
    nvtx_range range("backward block", step.index, s.rank());
    const auto b = ws.grad_slot_views<T>(base, step.index, step.kv_tokens);
    std::fill(b.dk, b.dk + ws.kv_elements(step.kv_tokens), 0.0f); // dk, then dv
    if (!step.groups.empty())
      BlockKernel::host_backward(block_backward_args<T>{q,
                                                        thd_view<const T>(b.k),
                                                        thd_view<const T>(b.v),
                                                        dout,
                                                        lse,
                                                        delta,
                                                        args,
                                                        {dq_acc, b.dk, b.dv}},
                                 step.groups);
  }
  // Every block's share goes home; this rank's own block collects the shares of rank + 1, + 2...
  float* received = ws.share(base);
  const std::size_t elements = ws.kv_elements(n);
  for (int t = 1; t < steps; ++t) {
    const ring_step& step = s.step(t);
    comm.exchange(ws.grad_slot_views<T>(base, t, step.kv_tokens).dk,
                  step.groups.empty() ? 0 : ws.grad_bytes(step.kv_tokens), step.source, received,
                  step.own_wanted ? ws.grad_bytes(n) : 0, gather_to(s, t), p + t);
    if (step.own_wanted)
      for (std::size_t i = 0; i < elements; ++i)
        own.dk[i] += received[i];
  }
  write_host_gradients(dq_acc, own.dk, own.dv, dq, dk, dv);
}

#if defined(__CUDACC__)
// Forward: the own block into slot 0 and its compute, then the P - 1 exchanges on the
// communication stream, each recording `arrived[t]`; block t's compute waits for its own arrival
// only. The epilogues are the
// ring's (ring_schedule::forward_epilogue): the same state, merged in the same block order.
template <class BlockKernel, class Communicator, class T>
void device_all_gather_forward(Communicator& comm, const ring_schedule& s,
                               ring_device_resources<BlockKernel>& d,
                               const attention_arguments& args, thd_view<const T> q,
                               thd_view<const T> k, thd_view<const T> v, thd_view<T> out,
                               float* lse, float* max_logit, std::byte* workspace,
                               cudaStream_t stream) {
  const ring_workspace ws = all_gather_workspace(s, args, sizeof(T));
  const bool dense = out.dense();
  if (s.ranks() == 1) { // one block: nothing to gather, the ring's path
    device_ring_forward<BlockKernel>(comm, s, d, args, q, k, v, out, lse, max_logit, workspace,
                                     stream);
    return;
  }
  const attention_state state = ws.state(workspace, lse, max_logit);
  std::byte* scratch = workspace + ring_workspace::align(ws.forward_bytes());
  if (s.needs_reset()) reset(state, stream);
  const auto own = ws.kv_slot_views<T>(workspace, 0, s.q_tokens());
  copy_own_block_device(k, v, own, stream);
  RINGATTN_CUDA_CHECK(cudaEventRecord(d.own_ready, stream));
  RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, d.own_ready, 0));
  auto compute = [&](const ring_step& step) {
    const int t = step.index;
    nvtx_range range("block", t, s.rank());
    if (t > 0)
      RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.arrived[static_cast<std::size_t>(t)], 0));
    const auto b = ws.kv_slot_views<T>(workspace, t, step.kv_tokens);
    const step_epilogue e = s.forward_epilogue(t, dense);
    if (e != step_epilogue::none)
      BlockKernel::device_forward(
          e, {q, thd_view<const T>(b.k), thd_view<const T>(b.v), args, state, scratch},
          d.forward[static_cast<std::size_t>(t)], out, lse, stream);
  };
  compute(s.step(0)); // the own block runs while the ranks meet for the exchanges
  for (int t = 1; t < s.step_count(); ++t) {
    const ring_step& step = s.step(t);
    comm.exchange_async(own.k.data, step.own_wanted ? ws.block_bytes(s.q_tokens()) : 0,
                        gather_to(s, t), ws.kv_slot_views<T>(workspace, t, step.kv_tokens).k.data,
                        step.groups.empty() ? 0 : ws.block_bytes(step.kv_tokens), step.source, t,
                        d.comm);
    RINGATTN_CUDA_CHECK(cudaEventRecord(d.arrived[static_cast<std::size_t>(t)], d.comm));
  }
  for (int t = 1; t < s.step_count(); ++t)
    compute(s.step(t));
  if (s.needs_finalize(dense)) finalize(state, out, stream);
  RINGATTN_CUDA_CHECK(cudaEventRecord(d.comm_end, d.comm));
  RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.comm_end, 0));
}

// Backward: the gather as in the forward; block t's share of dK/dV is computed into its slot's
// fp32 accumulators and, once done (`computed[t]`), sent home while the share of this rank's own
// block from rank + t arrives in share region t - 1. The own block's accumulators then add the
// P - 1 received shares in order.
template <class BlockKernel, class Communicator, class T>
void device_all_gather_backward(Communicator& comm, const ring_schedule& s,
                                ring_device_resources<BlockKernel>& d,
                                const attention_arguments& args, thd_view<const T> q,
                                thd_view<const T> k, thd_view<const T> v, thd_view<const T> out,
                                const float* lse, thd_view<const T> dout, thd_view<T> dq,
                                thd_view<T> dk, thd_view<T> dv, std::byte* workspace,
                                cudaStream_t stream) {
  const int p = s.ranks();
  if (p == 1) {
    device_ring_backward<BlockKernel>(comm, s, d, args, q, k, v, out, lse, dout, dq, dk, dv,
                                      workspace, stream);
    return;
  }
  const ring_workspace ws = all_gather_workspace(s, args, sizeof(T));
  const std::int64_t n = s.q_tokens();
  const int steps = s.step_count(), dim = args.qk_dim(), qh = args.q_heads;
  std::byte* scratch = workspace + ring_workspace::align(ws.device_backward_bytes());
  float* dq_acc = ws.dq(workspace);
  float* delta = ws.delta(workspace);
  compute_delta<T>(out, dout, delta, stream);
  const auto own = ws.grad_slot_views<T>(workspace, 0, n);
  if (n > 0) {
    RINGATTN_CUDA_CHECK(
        cudaMemsetAsync(dq_acc, 0, sizeof(float) * static_cast<std::size_t>(n) * qh * dim, stream));
    copy_own_block_device(k, v, own, stream);
  }
  RINGATTN_CUDA_CHECK(cudaEventRecord(d.own_ready, stream));
  RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, d.own_ready, 0));
  auto compute = [&](const ring_step& step) {
    const int t = step.index;
    nvtx_range range("backward block", t, s.rank());
    const std::int64_t nk = step.kv_tokens;
    const auto b = ws.grad_slot_views<T>(workspace, t, nk);
    if (t > 0)
      RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.arrived[static_cast<std::size_t>(t)], 0));
    if (nk > 0) RINGATTN_CUDA_CHECK(cudaMemsetAsync(b.dk, 0, ws.grad_bytes(nk), stream));
    if (!step.groups.empty())
      BlockKernel::device_backward(block_backward_args<T>{q,
                                                          thd_view<const T>(b.k),
                                                          thd_view<const T>(b.v),
                                                          dout,
                                                          lse,
                                                          delta,
                                                          args,
                                                          {dq_acc, b.dk, b.dv},
                                                          out,
                                                          scratch},
                                   d.backward[static_cast<std::size_t>(t)], stream);
    if (t == 0) return;
    cudaEvent_t done = d.computed[static_cast<std::size_t>(t)];
    RINGATTN_CUDA_CHECK(cudaEventRecord(done, stream));
    RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(d.comm, done, 0));
    comm.exchange_async(b.dk, step.groups.empty() ? 0 : ws.grad_bytes(nk), step.source,
                        ws.share(workspace, t - 1), step.own_wanted ? ws.grad_bytes(n) : 0,
                        gather_to(s, t), p + t, d.comm);
  };
  compute(s.step(0)); // the own block runs while the ranks meet for the gather
  // Every gather before any share goes home: a share waits for its block's compute, and the
  // gather queued behind it on the communication stream would wait too.
  for (int t = 1; t < steps; ++t) {
    const ring_step& step = s.step(t);
    comm.exchange_async(own.k.data, step.own_wanted ? ws.block_bytes(n) : 0, gather_to(s, t),
                        ws.grad_slot_views<T>(workspace, t, step.kv_tokens).k.data,
                        step.groups.empty() ? 0 : ws.block_bytes(step.kv_tokens), step.source, t,
                        d.comm);
    RINGATTN_CUDA_CHECK(cudaEventRecord(d.arrived[static_cast<std::size_t>(t)], d.comm));
  }
  for (int t = 1; t < steps; ++t)
    compute(s.step(t));
  RINGATTN_CUDA_CHECK(cudaEventRecord(d.comm_end, d.comm));
  RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, d.comm_end, 0));
  for (int t = 1; t < steps; ++t)
    if (s.step(t).own_wanted)
      accumulate(own.dk, ws.share(workspace, t - 1), static_cast<std::int64_t>(ws.kv_elements(n)),
                 stream);
  write_gradient<T>(dq_acc, dq, stream);
  write_gradient<T>(own.dk, dk, stream);
  write_gradient<T>(own.dv, dv, stream);
}
#endif // __CUDACC__

} // namespace ringattn::detail
