#pragma once
//! \file
//! The Schedule policy's models: how the work of attention is spread over the ranks and what
//! travels between them.
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
//! - `all_to_all_heads`: Q, K and V trade heads for tokens (P - 1 pairwise exchanges, one message
//!   per peer with all three), so a rank holds every token of q_heads / P heads; it attends over
//!   the whole sequence and the output trades back. Each rank sends about (P - 1) / P of its Q, K,
//!   V and output, whatever the length of the sequence; P must divide q_heads, and P and kv_heads
//!   one another (a kv head is copied to P / kv_heads ranks where P > kv_heads).
//!
//! The ring and the all-gather use the same per-step groups (ring/schedule.cuh) and merge the
//! blocks in the same order, so their forwards agree bit for bit; their backwards add the dK/dV
//! shares in different orders. The all-to-all's steps are every rank's ring steps at once.
//!
//! \code
//! ringattn::ring_attention<ringattn::zigzag, ringattn::nccl_communicator, ringattn::causal,
//!                          ringattn::all_gather_kv> attn(comm, args, cu_seqlens);
//! \endcode

#include <ringattn/arguments.cuh>
#include <ringattn/concepts.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/ring/all_to_all.cuh>
#include <ringattn/ring/all_to_all_program.cuh>
#include <ringattn/ring/device_engine.cuh>
#include <ringattn/ring/host_engine.cuh>
#include <ringattn/ring/program.cuh>
#include <ringattn/ring/schedule.cuh>
#include <ringattn/ring/workspace.cuh>
#include <ringattn/tensor.cuh>

#include <array>
#include <cstddef>
#include <span>

namespace ringattn {

namespace detail {
//! What the ring and the all-gather share: the ring's plan and groups, the slots of `Program`
//! (ring/program.cuh), and its two programs run by the host and the device engines.
template <class Program>
struct program_schedule {
  using program = Program;
  using plan_type = ring_schedule;
  using layout_type = ring_workspace;
  template <class Partitioner>
  static ring_schedule plan(const partition_plan<Partitioner>& p, int rank,
                            const position_window& window, const attention_arguments&) {
    return {p, rank, window};
  }
  //! The schedule of the block-kernel calls (the device schedules are made from it).
  static const ring_schedule& compute(const ring_schedule& s) noexcept { return s; }
  static const attention_arguments& compute_arguments(const ring_schedule&,
                                                      const attention_arguments& args) noexcept {
    return args;
  }
  static ring_workspace workspace(const ring_schedule& s, const attention_arguments& args,
                                  element_format format) {
    return Program::workspace(s, args, format);
  }
  //! The host path computes a step's dK/dV share apart and receives the returning shares into
  //! the device path's regions, as the device path does.
  static std::size_t host_backward_bytes(const ring_workspace& w) {
    return w.device_backward_bytes();
  }
  template <class BlockKernel, class Communicator, element T, class... Views>
  static void host_forward(Communicator& comm, const ring_schedule& s,
                           const attention_arguments& args, Views... views) {
    detail::host_forward<Program, BlockKernel, Communicator, T>(comm, s, args, views...);
  }
  template <class BlockKernel, class Communicator, element T, class... Views>
  static void host_backward(Communicator& comm, const ring_schedule& s,
                            const attention_arguments& args, Views... views) {
    detail::host_backward<Program, BlockKernel, Communicator, T>(comm, s, args, views...);
  }
#if defined(__CUDACC__)
  template <class BlockKernel, class Communicator, class T, class... Views>
  static void device_forward(Communicator& comm, const ring_schedule& s,
                             ring_device_resources<BlockKernel>& d, const attention_arguments& args,
                             Views... views) {
    detail::device_forward<Program, BlockKernel, Communicator, T>(comm, s, d, args, views...);
  }
  template <class BlockKernel, class Communicator, class T, class... Views>
  static void device_backward(Communicator& comm, const ring_schedule& s,
                              ring_device_resources<BlockKernel>& d,
                              const attention_arguments& args, Views... views) {
    detail::device_backward<Program, BlockKernel, Communicator, T>(comm, s, d, args, views...);
  }
#endif
};
} // namespace detail

//! The ring: blocks pass from rank to rank, one step at a time.
struct ring_pass : detail::program_schedule<detail::ring_program> {
  static constexpr const char* name = "ring_pass";
};

//! The all-gather: every block gathered once, then attended to in place.
struct all_gather_kv : detail::program_schedule<detail::all_gather_program> {
  static constexpr const char* name = "all_gather_kv";
};

namespace detail {
//! What the all-to-all and its hybrid share: groups of `Group` consecutive ranks (0: all of them)
//! trade heads for tokens; the groups gather each other's K/V (ring/all_to_all.cuh).
template <int Group>
struct heads_schedule {
  using plan_type = all_to_all_plan;
  using layout_type = all_to_all_workspace;
  template <class Partitioner>
  static all_to_all_plan plan(const partition_plan<Partitioner>& p, int rank,
                              const position_window& window, const attention_arguments& args) {
    return {p, rank, window, args, Group};
  }
  static const ring_schedule& compute(const all_to_all_plan& s) noexcept { return s.local(); }
  static const attention_arguments& compute_arguments(const all_to_all_plan& s,
                                                      const attention_arguments&) noexcept {
    return s.local_arguments();
  }
  static all_to_all_workspace workspace(const all_to_all_plan& s, const attention_arguments&,
                                        element_format format) {
    return {s, format};
  }
  static std::size_t host_backward_bytes(const all_to_all_workspace& w) {
    return w.host_backward_bytes();
  }
  template <class BlockKernel, class Communicator, element T, class... Views>
  static void host_forward(Communicator& comm, const all_to_all_plan& s, const attention_arguments&,
                           Views... views) {
    host_all_to_all_forward<BlockKernel, Communicator, T>(comm, s, views...);
  }
  template <class BlockKernel, class Communicator, element T, class... Views>
  static void host_backward(Communicator& comm, const all_to_all_plan& s,
                            const attention_arguments&, Views... views) {
    host_all_to_all_backward<BlockKernel, Communicator, T>(comm, s, views...);
  }
#if defined(__CUDACC__)
  template <class BlockKernel, class Communicator, class T, class... Views>
  static void device_forward(Communicator& comm, const all_to_all_plan& s,
                             ring_device_resources<BlockKernel>& d, const attention_arguments& args,
                             Views... views) {
    device_all_to_all_forward<BlockKernel, Communicator, T>(comm, s, d, args, views...);
  }
  template <class BlockKernel, class Communicator, class T, class... Views>
  static void device_backward(Communicator& comm, const all_to_all_plan& s,
                              ring_device_resources<BlockKernel>& d,
                              const attention_arguments& args, Views... views) {
    device_all_to_all_backward<BlockKernel, Communicator, T>(comm, s, d, args, views...);
  }
#endif
};

//! "all_to_all_heads_x_all_gather<A>", at compile time (the schedule's name, agreed by the ranks).
template <int A>
struct hybrid_name {
  static constexpr auto text = [] {
    constexpr char prefix[] = "all_to_all_heads_x_all_gather<";
    std::array<char, sizeof(prefix) + 12> s{};
    std::size_t i = 0;
    for (; prefix[i] != '\0'; ++i)
      s[i] = prefix[i];
    char digits[12] = {};
    int count = 0;
    for (int x = A; x > 0; x /= 10)
      digits[count++] = static_cast<char>('0' + x % 10);
    while (count > 0)
      s[i++] = digits[--count];
    s[i] = '>';
    return s;
  }();
};
} // namespace detail

//! The all-to-all (head-parallel, "Ulysses"): Q, K and V trade heads for tokens, each rank
//! attends over the whole sequence for its heads, and the output trades back
//! (ring/all_to_all.cuh). Needs P to divide q_heads and P and kv_heads to divide one another.
struct all_to_all_heads : detail::heads_schedule<0> {
  static constexpr const char* name = "all_to_all_heads";
};

//! The 2D hybrid: the all-to-all inside groups of `GroupSize` consecutive ranks (the GPUs of a
//! node, say), K/V gathered across the P / GroupSize groups. A rank computes q_heads / GroupSize
//! heads for its group's tokens against every token's K/V, so the head cap is the group's size,
//! not P; across groups only K/V travel (and their fp32 dK/dV shares back). GroupSize must
//! divide P (the plan says so where it does not) and the heads split over it as for
//! `all_to_all_heads`; GroupSize = P is the plain all-to-all, 1 an all-gather of K/V.
template <int GroupSize>
struct all_to_all_heads_x_all_gather : detail::heads_schedule<GroupSize> {
  static_assert(GroupSize > 0, "ringattn::all_to_all_heads_x_all_gather: the group size must be "
                               "positive (the number of ranks that trade heads for tokens)");
  static constexpr const char* name = detail::hybrid_name<GroupSize>::text.data();
};

} // namespace ringattn
