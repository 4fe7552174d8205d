#pragma once
//! \file
//! One concept per policy family of `ring_attention<Partitioner, Communicator, BlockKernel>`.
//! They state type-level requirements only; the driver re-checks them with `static_assert` and a
//! sentence a user can act on.

#include <ringattn/partition/segment.cuh>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>

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

//! A mask policy names its mask kind (`full`, `causal`).
template <class M>
concept mask_policy = requires {
  { M::mask } -> std::convertible_to<mask_kind>;
  { M::name } -> std::convertible_to<const char*>;
};

} // namespace ringattn
