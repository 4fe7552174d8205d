#pragma once
//! \file
//! `zigzag`: each sequence is cut into 2P near-equal chunks; rank r holds chunks r and 2P-1-r.
//!
//! ```
//!   S = 16, P = 4: 8 chunks of 2      chunk  0  1  2  3  4  5  6  7
//!                                     rank   0  1  2  3  3  2  1  0
//!   rank 0 holds positions {0,1} then {14,15}; rank 3 holds {6,7} then {8,9}
//! ```
//! Chunk c covers `[floor(c S / 2P), floor((c + 1) S / 2P))`, so chunk sizes differ by at most one
//! token for any S. Under a causal mask each rank pairs an early chunk (little work) with a late
//! one (much work), which balances the work to within a few tokens' worth per sequence.
//! Local order: chunk r first, then chunk 2P-1-r.

#include <ringattn/core/segment.cuh>

namespace ringattn {

struct zigzag {
  static constexpr const char* name = "zigzag";
  static constexpr int max_segments = 2;

  //! First position of chunk c of 2P (c = 2P gives the sequence length).
  RINGATTN_HOST_DEVICE static constexpr std::int64_t chunk_begin(std::int64_t length, int ranks,
                                                                 std::int64_t c) {
    return c * length / (2 * static_cast<std::int64_t>(ranks));
  }
  RINGATTN_HOST_DEVICE static constexpr segment_list<2> segments(std::int64_t length, int ranks,
                                                                 int rank) {
    const std::int64_t lo0 = chunk_begin(length, ranks, rank);
    const std::int64_t lo1 = chunk_begin(length, ranks, rank + 1);
    const std::int64_t c2 = 2 * static_cast<std::int64_t>(ranks) - 1 - rank;
    const std::int64_t hi0 = chunk_begin(length, ranks, c2);
    const std::int64_t hi1 = chunk_begin(length, ranks, c2 + 1);
    segment_list<2> r;
    r.push({lo0, 1, lo1 - lo0, 0});
    r.push({hi0, 1, hi1 - hi0, lo1 - lo0});
    return r;
  }
  RINGATTN_HOST_DEVICE static constexpr std::int64_t local_length(std::int64_t length, int ranks,
                                                                  int rank) {
    const std::int64_t c2 = 2 * static_cast<std::int64_t>(ranks) - 1 - rank;
    return chunk_begin(length, ranks, rank + 1) - chunk_begin(length, ranks, rank) +
           chunk_begin(length, ranks, c2 + 1) - chunk_begin(length, ranks, c2);
  }
  RINGATTN_HOST_DEVICE static constexpr owner locate(std::int64_t length, int ranks,
                                                     std::int64_t position) {
    const std::int64_t n = 2 * static_cast<std::int64_t>(ranks);
    // The chunk c with floor(c S / n) <= p < floor((c + 1) S / n) is ceil((p + 1) n / S) - 1.
    const std::int64_t c = ((position + 1) * n - 1) / length;
    if (c < ranks) return {static_cast<int>(c), position - chunk_begin(length, ranks, c)};
    const int rank = static_cast<int>(n - 1 - c);
    const std::int64_t first =
        chunk_begin(length, ranks, rank + 1) - chunk_begin(length, ranks, rank);
    return {rank, first + position - chunk_begin(length, ranks, c)};
  }
  RINGATTN_HOST_DEVICE static constexpr std::int64_t position(std::int64_t length, int ranks,
                                                              int rank, std::int64_t local) {
    const std::int64_t lo0 = chunk_begin(length, ranks, rank);
    const std::int64_t first = chunk_begin(length, ranks, rank + 1) - lo0;
    if (local < first) return lo0 + local;
    return chunk_begin(length, ranks, 2 * static_cast<std::int64_t>(ranks) - 1 - rank) + local -
           first;
  }
};

} // namespace ringattn
