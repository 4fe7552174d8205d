#pragma once
//! \file
//! One concept per policy family of `ring_attention<Partitioner, Communicator, BlockKernel>`.
//! They state type-level requirements only; the driver re-checks them with `static_assert` and a
//! sentence a user can act on. (The Communicator and BlockKernel concepts arrive with their
//! families.)

#include <ringattn/partition/segment.cuh>

#include <concepts>
#include <cstdint>

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

} // namespace ringattn
