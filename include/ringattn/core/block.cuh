#pragma once
//! \file
//! Block groups: what one call of a block kernel computes, as plain data for host and device.
//!
//! A block group is one query segment (rows `[q_begin, q_begin + q_count)` of the rank's Q shard)
//! with the key segments of the K/V block it attends to (at most `max_blocks_per_group`: zigzag
//! gives two), each with its band `lo <= j - i <= hi` on local indices (i: row within the query
//! segment, j: column within the key segment). Groups of one call never share query rows, so a
//! kernel may give each group's rows to one thread block and merge into the state without atomics.

#include <ringattn/core/segment.cuh>

#include <cstdint>
#include <span>

namespace ringattn {

//! Most key segments one query segment meets in one K/V block (zigzag: 2).
inline constexpr int max_blocks_per_group = 2;

//! One key segment of a K/V block and the band of a query segment against it.
struct kv_block {
  std::int64_t kv_begin = 0; //!< first row in the K/V block
  std::int64_t kv_count = 0;
  band mask; //!< visible (i, j): lo <= j - i <= hi
};

//! One query segment and the key segments it attends to.
struct block_group {
  std::int64_t q_begin = 0; //!< first row in the Q shard
  std::int64_t q_count = 0;
  std::int32_t count = 0; //!< used entries of kv
  kv_block kv[max_blocks_per_group] = {};
};

//! Key rows through a page table (a paged K/V cache): row `L` of a K/V block addressed this way
//! is row `L % page_size` of pool page `table[L / page_size]`, so a key segment that starts at
//! `first * page_size` reads the pages listed from `table[first]` on.
struct key_pages {
  std::span<const std::int32_t> table;
  std::int32_t page_size = 0; //!< a power of two
};

//! One unit of a kernel launch: query rows [row_begin, row_begin + block_m) of group `group`.
struct work_tile {
  std::int32_t group = 0;
  std::int32_t row_begin = 0;
};

} // namespace ringattn
