#pragma once
//! \file
//! The Schedule policy's models: how the K/V blocks reach the ranks that need them.
//!
//! - `ring_pass` (the default): at step t rank r attends to the block of rank (r - t) mod P and
//!   passes it on to r + 1 while the next one arrives; the backward carries each block's fp32
//!   dK/dV along with it. Two block slots per rank, whatever P.
//! - `all_gather_kv`: every rank's block is gathered once (P - 1 pairwise exchanges, each rank
//!   sending its own block to every other), then the rank attends to each block in place; the
//!   backward returns each block's fp32 dK/dV share to its owner (a reduce-scatter). A slot for
//!   every rank's block. K/V moves once instead of travelling P - 1 hops, and nothing is sent
//!   between blocks: it wins where K/V is small next to Q (GQA, MQA) and where the per-step
//!   latency of the ring does not hide behind the compute.
//!
//! Both use the same per-step groups (ring/schedule.cuh) and merge the blocks in the same order,
//! so their forwards agree bit for bit; their backwards add the dK/dV shares in different orders.
//!
//! \code
//! ringattn::ring_attention<ringattn::zigzag, ringattn::nccl_communicator, ringattn::causal,
//!                          ringattn::all_gather_kv> attn(comm, args, cu_seqlens);
//! \endcode

#include <ringattn/arguments.cuh>
#include <ringattn/concepts.cuh>
#include <ringattn/ring/all_gather_executor.cuh>
#include <ringattn/ring/device_executor.cuh>
#include <ringattn/ring/host_executor.cuh>
#include <ringattn/ring/schedule.cuh>
#include <ringattn/ring/workspace.cuh>
#include <ringattn/tensor.cuh>

#include <cstddef>
#include <span>

namespace ringattn {

//! The ring: blocks pass from rank to rank, one step at a time.
struct ring_pass {
  static constexpr const char* name = "ring_pass";
  static ring_workspace workspace(const ring_schedule& s, const attention_arguments& args,
                                  std::size_t element_bytes) {
    return {s.q_tokens(), s.max_kv_tokens(), args, element_bytes};
  }
  static std::size_t host_backward_bytes(const ring_workspace& w) {
    return w.host_backward_bytes();
  }
  template <class BlockKernel, class Communicator, element T, class... Views>
  static void host_forward(Communicator& comm, const ring_schedule& s,
                           const attention_arguments& args, Views... views) {
    detail::host_ring_forward<BlockKernel, Communicator, T>(comm, s, args, views...);
  }
  template <class BlockKernel, class Communicator, element T, class... Views>
  static void host_backward(Communicator& comm, const ring_schedule& s,
                            const attention_arguments& args, Views... views) {
    detail::host_ring_backward<BlockKernel, Communicator, T>(comm, s, args, views...);
  }
#if defined(__CUDACC__)
  template <class BlockKernel, class Communicator, class T, class... Views>
  static void device_forward(Communicator& comm, const ring_schedule& s,
                             detail::ring_device_resources<BlockKernel>& d,
                             const attention_arguments& args, Views... views) {
    detail::device_ring_forward<BlockKernel, Communicator, T>(comm, s, d, args, views...);
  }
  template <class BlockKernel, class Communicator, class T, class... Views>
  static void device_backward(Communicator& comm, const ring_schedule& s,
                              detail::ring_device_resources<BlockKernel>& d,
                              const attention_arguments& args, Views... views) {
    detail::device_ring_backward<BlockKernel, Communicator, T>(comm, s, d, args, views...);
  }
#endif
};

//! The all-gather: every block gathered once, then attended to in place.
struct all_gather_kv {
  static constexpr const char* name = "all_gather_kv";
  static ring_workspace workspace(const ring_schedule& s, const attention_arguments& args,
                                  std::size_t element_bytes) {
    return detail::all_gather_workspace(s, args, element_bytes);
  }
  //! The host path receives the returning dK/dV shares into the first share region too.
  static std::size_t host_backward_bytes(const ring_workspace& w) {
    return w.device_backward_bytes();
  }
  template <class BlockKernel, class Communicator, element T, class... Views>
  static void host_forward(Communicator& comm, const ring_schedule& s,
                           const attention_arguments& args, Views... views) {
    detail::host_all_gather_forward<BlockKernel, Communicator, T>(comm, s, args, views...);
  }
  template <class BlockKernel, class Communicator, element T, class... Views>
  static void host_backward(Communicator& comm, const ring_schedule& s,
                            const attention_arguments& args, Views... views) {
    detail::host_all_gather_backward<BlockKernel, Communicator, T>(comm, s, args, views...);
  }
#if defined(__CUDACC__)
  template <class BlockKernel, class Communicator, class T, class... Views>
  static void device_forward(Communicator& comm, const ring_schedule& s,
                             detail::ring_device_resources<BlockKernel>& d,
                             const attention_arguments& args, Views... views) {
    detail::device_all_gather_forward<BlockKernel, Communicator, T>(comm, s, d, args, views...);
  }
  template <class BlockKernel, class Communicator, class T, class... Views>
  static void device_backward(Communicator& comm, const ring_schedule& s,
                              detail::ring_device_resources<BlockKernel>& d,
                              const attention_arguments& args, Views... views) {
    detail::device_all_gather_backward<BlockKernel, Communicator, T>(comm, s, d, args, views...);
  }
#endif
};

} // namespace ringattn
