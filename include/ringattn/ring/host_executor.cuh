#pragma once
//! \file
//! The ring's steps on host memory: the BlockKernel's host block forward or backward, each
//! exchange blocking (in-process threads, MPI processes). Runs everywhere, CI included. The
//! caller validated the arguments; the schedule's groups were validated at plan time.

#include <ringattn/arguments.cuh>
#include <ringattn/detail/nvtx.cuh>
#include <ringattn/kernel/host_backward.cuh>
#include <ringattn/kernel/host_forward.cuh>
#include <ringattn/ring/schedule.cuh>
#include <ringattn/ring/workspace.cuh>
#include <ringattn/tensor.cuh>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>

namespace ringattn::detail {

//! Copies a shard's k and v into a dense block (the layout that travels).
template <class T, class Block>
void copy_own_block_host(thd_view<const T> k, thd_view<const T> v, const Block& own) {
  for (std::int64_t t = 0; t < k.tokens; ++t)
    for (int h = 0; h < k.heads; ++h) {
      std::memcpy(own.k.row(t, h), k.row(t, h), sizeof(T) * k.head_dim);
      std::memcpy(own.v.row(t, h), v.row(t, h), sizeof(T) * v.head_dim);
    }
}

//! A rank's fp32 gradient sums (dense `[tokens, heads, width]`) into its dq, dk and dv.
template <element T>
void write_host_gradients(const float* dq_acc, const float* dk_acc, const float* dv_acc,
                          thd_view<T> dq, thd_view<T> dk, thd_view<T> dv) {
  const int qh = dq.heads, kvh = dk.heads, d = dq.head_dim, dvw = dv.head_dim;
  for (std::int64_t t = 0; t < dq.tokens; ++t) {
    for (int h = 0; h < qh; ++h)
      for (int e = 0; e < d; ++e)
        dq(t, h, e) = from_float<T>(dq_acc[(t * qh + h) * d + e]);
    for (int h = 0; h < kvh; ++h) {
      for (int e = 0; e < d; ++e)
        dk(t, h, e) = from_float<T>(dk_acc[(t * kvh + h) * d + e]);
      for (int e = 0; e < dvw; ++e)
        dv(t, h, e) = from_float<T>(dv_acc[(t * kvh + h) * dvw + e]);
    }
  }
}

template <class BlockKernel, class Communicator, element T>
void host_ring_forward(Communicator& comm, const ring_schedule& s, const attention_arguments& args,
                       thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                       thd_view<T> out, float* lse, float* max_logit,
                       std::span<std::byte> workspace) {
  const ring_workspace ws(s.q_tokens(), s.max_kv_tokens(), args, sizeof(T));
  std::byte* base = workspace.data();
  const attention_state state = ws.state(base, lse, max_logit);
  reset(state);
  copy_own_block_host(k, v, ws.kv_slot_views<T>(base, 0, s.q_tokens()));
  for (const ring_step& step : s.steps()) {
    nvtx_range range("step", step.index, s.rank());
    const auto b = ws.kv_slot_views<T>(base, step.index % 2, step.kv_tokens);
    if (!step.groups.empty())
      BlockKernel::host_forward(
          block_forward_args<T>{q, thd_view<const T>(b.k), thd_view<const T>(b.v), args, state},
          step.groups);
    // A block no later rank sees goes no further (its receiver expects nothing).
    if (const ring_step* next = s.next(step.index))
      comm.exchange(b.k.data, step.forwarded ? ws.block_bytes(step.kv_tokens) : 0, s.send_to(),
                    ws.kv_slot_views<T>(base, next->index % 2, next->kv_tokens).k.data,
                    next->arrives ? ws.block_bytes(next->kv_tokens) : 0, s.receive_from(),
                    step.index);
  }
  finalize(state, out);
}

// Step t: this rank adds Q's share against block source(t) (carried with its dK/dV) and passes the
// block on; after the last step (P - 1, or fewer under a short window) it holds a complete block
// and sends that block's dK/dV home while receiving its own ("step P").
template <class BlockKernel, class Communicator, element T>
void host_ring_backward(Communicator& comm, const ring_schedule& s, const attention_arguments& args,
                        thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                        thd_view<const T> out, const float* lse, thd_view<const T> dout,
                        thd_view<T> dq, thd_view<T> dk, thd_view<T> dv,
                        std::span<std::byte> workspace) {
  const ring_workspace ws(s.q_tokens(), s.max_kv_tokens(), args, sizeof(T));
  const std::int64_t n = s.q_tokens();
  const int steps = s.step_count(), d = args.qk_dim(), qh = args.q_heads;
  std::byte* base = workspace.data();
  float* dq_acc = ws.dq(base);
  float* delta = ws.delta(base);
  compute_delta(out, dout, delta);
  std::fill(dq_acc, dq_acc + n * qh * d, 0.0f);
  {
    const auto own = ws.grad_slot_views<T>(base, 0, n);
    copy_own_block_host(k, v, own);
    std::fill(own.dk, own.dk + ws.kv_elements(n), 0.0f); // dk, then dv
  }
  // The device ring's messages in its order (ring/device_executor.cuh), each exchange blocking:
  // block t's K/V go on before its compute; its share of dK/dV is computed into `local` (step 0:
  // straight into the own block's accumulators) and added to block t's accumulators, which came
  // from rank - 1 in step t - 1's second exchange; the sum goes on to rank + 1 while block
  // t + 1's accumulators arrive.
  float* local = ws.share(base);
  for (const ring_step& step : s.steps()) {
    const int t = step.index;
    nvtx_range range("backward step", t, s.rank());
    const std::int64_t nk = step.kv_tokens;
    const auto b = ws.grad_slot_views<T>(base, t % 2, nk);
    const ring_step* next = s.next(t);
    if (next)
      comm.exchange(b.k.data, ws.block_bytes(nk), s.send_to(),
                    ws.grad_slot_views<T>(base, (t + 1) % 2, next->kv_tokens).k.data,
                    ws.block_bytes(next->kv_tokens), s.receive_from(), t);
    float* share = t == 0 ? b.dk : local;
    const std::size_t elements = ws.kv_elements(nk);
    if (t > 0) std::fill(local, local + elements, 0.0f);
    if (!step.groups.empty())
      BlockKernel::host_backward(block_backward_args<T>{q,
                                                        thd_view<const T>(b.k),
                                                        thd_view<const T>(b.v),
                                                        dout,
                                                        lse,
                                                        delta,
                                                        args,
                                                        {dq_acc, share, share + ws.k_elements(nk)}},
                                 step.groups);
    if (t > 0)
      for (std::size_t i = 0; i < elements; ++i)
        b.dk[i] += local[i];
    if (next)
      comm.exchange(b.dk, ws.grad_bytes(nk), s.send_to(),
                    ws.grad_slot_views<T>(base, (t + 1) % 2, next->kv_tokens).dk,
                    ws.grad_bytes(next->kv_tokens), s.receive_from(), t);
  }
  const float* own_dk = ws.grad_slot_views<T>(base, 0, n).dk;
  if (steps > 1) {
    // The block held last (rank + 1's after P steps), complete: its dK/dV go home, and this
    // rank's own come back from the rank holding them.
    const ring_step& held = s.step(steps - 1);
    const auto b = ws.grad_slot_views<T>(base, (steps - 1) % 2, held.kv_tokens);
    float* home = reinterpret_cast<float*>(ws.grad_slot_views<T>(base, steps % 2, 0).k.data);
    comm.exchange(b.dk, ws.grad_bytes(held.kv_tokens), held.source, home, ws.grad_bytes(n),
                  s.holder_of_own(), steps);
    own_dk = home;
  }
  write_host_gradients(dq_acc, own_dk, own_dk + ws.k_elements(n), dq, dk, dv);
}

} // namespace ringattn::detail
