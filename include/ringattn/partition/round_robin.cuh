#pragma once
//! \file
//! `round_robin` (a.k.a. striped): token at position p lives on rank p mod P.
//!
//! ```
//!   S = 10, P = 4                     positions 0 1 2 3 4 5 6 7 8 9
//!                                     rank      0 1 2 3 0 1 2 3 0 1
//!   rank r holds one segment: start r, stride P, ceil((S - r) / P) tokens
//! ```
//! Every rank holds the same number of tokens up to one, for any mix of sequence lengths, so a
//! packed batch of many short sequences stays balanced (SGLang's round-robin-split prefill CP).
//! Under a causal mask a block between two ranks is a band with hi = 0 or -1: the diagonal or
//! just below it, so causal work is balanced to within one token per sequence.

#include <ringattn/core/segment.cuh>

namespace ringattn {

struct round_robin {
  static constexpr const char* name = "round_robin";
  static constexpr int max_segments = 1;

  RINGATTN_HOST_DEVICE static constexpr std::int64_t local_length(std::int64_t length, int ranks,
                                                                  int rank) {
    return length > rank ? (length - rank + ranks - 1) / ranks : 0;
  }
  RINGATTN_HOST_DEVICE static constexpr segment_list<1> segments(std::int64_t length, int ranks,
                                                                 int rank) {
    segment_list<1> r;
    r.push({rank, ranks, local_length(length, ranks, rank), 0});
    return r;
  }
  RINGATTN_HOST_DEVICE static constexpr owner locate(std::int64_t, int ranks,
                                                     std::int64_t position) {
    return {static_cast<int>(position % ranks), position / ranks};
  }
  RINGATTN_HOST_DEVICE static constexpr std::int64_t position(std::int64_t, int ranks, int rank,
                                                              std::int64_t local) {
    return rank + local * ranks;
  }
};

} // namespace ringattn
