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
#include <ringattn/ring/program.cuh>
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

template <class BlockKernel, class Communicator, element T>
void host_all_gather_forward(Communicator& comm, const ring_schedule& s,
                             const attention_arguments& args, thd_view<const T> q,
                             thd_view<const T> k, thd_view<const T> v, thd_view<T> out, float* lse,
                             float* max_logit, std::span<std::byte> workspace) {
  const ring_workspace ws = all_gather_workspace(s, args, sizeof(T));
  host_forward_engine<BlockKernel, Communicator, T> e(comm, ws, workspace.data(), s.rank(), args, q,
                                                      k, v, out, lse, max_logit);
  all_gather_forward_program(e, s, ws);
}

template <class BlockKernel, class Communicator, element T>
void host_all_gather_backward(Communicator& comm, const ring_schedule& s,
                              const attention_arguments& args, thd_view<const T> q,
                              thd_view<const T> k, thd_view<const T> v, thd_view<const T> out,
                              const float* lse, thd_view<const T> dout, thd_view<T> dq,
                              thd_view<T> dk, thd_view<T> dv, std::span<std::byte> workspace) {
  const ring_workspace ws = all_gather_workspace(s, args, sizeof(T));
  host_backward_engine<BlockKernel, Communicator, T> e(comm, s, ws, workspace.data(), args, q, k, v,
                                                       out, lse, dout, dq, dk, dv);
  all_gather_backward_program(e, s, ws);
}

#if defined(__CUDACC__)
// The device engine's events order the gather against the computes: block t's compute waits for
// block t's arrival only, so the gather of the later blocks overlaps the compute of the earlier
// ones; every gather is queued before any share goes home (a share waits for its block's
// compute, and a gather queued behind it on the communication stream would wait too).
template <class BlockKernel, class Communicator, class T>
void device_all_gather_forward(Communicator& comm, const ring_schedule& s,
                               ring_device_resources<BlockKernel>& d,
                               const attention_arguments& args, thd_view<const T> q,
                               thd_view<const T> k, thd_view<const T> v, thd_view<T> out,
                               float* lse, float* max_logit, std::byte* workspace,
                               cudaStream_t stream) {
  const ring_workspace ws = all_gather_workspace(s, args, sizeof(T));
  device_forward_engine<BlockKernel, Communicator, T> e(comm, s, d, ws, workspace, args, q, k, v,
                                                        out, lse, max_logit, stream);
  all_gather_forward_program(e, s, ws);
}

template <class BlockKernel, class Communicator, class T>
void device_all_gather_backward(Communicator& comm, const ring_schedule& s,
                                ring_device_resources<BlockKernel>& d,
                                const attention_arguments& args, thd_view<const T> q,
                                thd_view<const T> k, thd_view<const T> v, thd_view<const T> out,
                                const float* lse, thd_view<const T> dout, thd_view<T> dq,
                                thd_view<T> dk, thd_view<T> dv, std::byte* workspace,
                                cudaStream_t stream) {
  const ring_workspace ws = all_gather_workspace(s, args, sizeof(T));
  device_backward_engine<BlockKernel, Communicator, T> e(comm, s, d, ws, workspace, args, q, k, v,
                                                         out, lse, dout, dq, dk, dv, stream);
  all_gather_backward_program(e, s, ws);
}
#endif // __CUDACC__

} // namespace ringattn::detail
