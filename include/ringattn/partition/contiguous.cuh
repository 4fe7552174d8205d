#pragma once
//! \file
//! `contiguous`: each sequence is cut into P consecutive pieces of ceil(S / P) tokens.
//!
//! ```
//!   S = 10, P = 4, chunk = 3          positions 0 1 2 3 4 5 6 7 8 9
//!   rank 0: [0, 3)                              0 0 0 1 1 1 2 2 2 3
//!   rank 1: [3, 6)    rank 2: [6, 9)    rank 3: [9, 10)  (last ranks may be short or empty)
//! ```
//! Under a causal mask the work is unbalanced: rank r's queries see about (2r + 1) / (2P) of the
//! sequence, so the last rank does about 2P - 1 times the work of the first. Use `zigzag` or
//! `round_robin` for causal attention; `contiguous` suits full attention and matches the layout
//! most data loaders produce.

#include <ringattn/core/segment.cuh>

namespace ringattn {

struct contiguous {
  static constexpr const char* name = "contiguous";
  static constexpr int max_segments = 1;

  //! Tokens per rank (the last ranks may hold fewer).
  RINGATTN_HOST_DEVICE static constexpr std::int64_t chunk(std::int64_t length, int ranks) {
    return (length + ranks - 1) / ranks;
  }
  RINGATTN_HOST_DEVICE static constexpr segment_list<1> segments(std::int64_t length, int ranks,
                                                                 int rank) {
    const std::int64_t c = chunk(length, ranks);
    const std::int64_t a = detail::min64(c * rank, length);
    segment_list<1> r;
    r.push({a, 1, detail::min64(c, length - a), 0});
    return r;
  }
  RINGATTN_HOST_DEVICE static constexpr std::int64_t local_length(std::int64_t length, int ranks,
                                                                  int rank) {
    return segments(length, ranks, rank)[0].count;
  }
  //! Rank and local index of `position` (0 <= position < length).
  RINGATTN_HOST_DEVICE static constexpr owner locate(std::int64_t length, int ranks,
                                                     std::int64_t position) {
    const std::int64_t c = chunk(length, ranks);
    return {static_cast<int>(position / c), position % c};
  }
  //! Global position of the `local`-th token of `rank`.
  RINGATTN_HOST_DEVICE static constexpr std::int64_t position(std::int64_t length, int ranks,
                                                              int rank, std::int64_t local) {
    return chunk(length, ranks) * rank + local;
  }
};

} // namespace ringattn
