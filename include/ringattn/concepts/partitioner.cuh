#pragma once
//! \file
//! The Partitioner family's concepts: index math over a sequence's tokens, and the placing
//! partitioners that also choose each sequence's ranks.

#include <ringattn/core/segment.cuh>

#include <concepts>
#include <cstdint>
#include <span>
#include <vector>

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

//! A placing Partitioner also decides, from the whole batch, over which ranks each sequence is
//! partitioned (`place(cu_seqlens, ranks)`: one `placement` per sequence, a pure function of its
//! arguments, so every rank computes the same layout); its index math then applies per sequence
//! over the placement's ranks. The other partitioners place every sequence over every rank.
template <class P>
concept placing_partitioner = partitioner<P> &&
    requires(std::span<const std::int32_t> cu_seqlens, int ranks) {
  { P::place(cu_seqlens, ranks) } -> std::same_as<std::vector<placement>>;
};

} // namespace ringattn
