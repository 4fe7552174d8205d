#pragma once
//! \file
//! Segments and bands: the index algebra every partitioner and mask reduces to.
//!
//! A rank's tokens of one sequence are a union of *segments*, each an arithmetic progression of
//! global positions `{start + stride * i : 0 <= i < count}` held at consecutive local indices.
//! A mask is a *position window*: key position pk is visible from query position pq when
//! `-max_behind <= pk - pq <= max_ahead` (causal: max_ahead = 0; full: both unbounded; a sliding
//! window (left, right): max_behind = left, max_ahead = right).
//!
//! For a query segment (a, s, n) and a key segment (b, s, m) of the same stride, the window becomes
//! a *band* on local indices: `lo <= j - i <= hi` with
//! `hi = floor((max_ahead + a - b) / s)` and `lo = ceil((a - b - max_behind) / s)`.
//! Every (query segment, key segment) block is therefore empty, full, or a band, and a kernel needs
//! only `lo`, `hi` and the block's extent, never the partitioner that produced it.
//!
//! ```
//!   causal, q segment a=8, k segment b=0, s=1, n=m=4:   hi = 8 (>= m-1): full block
//!   causal, q segment a=0, k segment b=8:               hi = -8 (<= -n): empty block
//!   causal, q a=r, k b=r', s=P (round-robin, r < r'):   hi = -1: strictly below the diagonal
//! ```

#include <ringattn/config.cuh>
#include <ringattn/core/mask.cuh>

#include <cstdint>

namespace ringattn {

//! Positions `start + stride * i` (0 <= i < count) of one sequence, held by one rank at local token
//! indices `local_begin + i` (local to that rank's shard of the packed batch).
struct segment {
  std::int64_t start = 0;
  std::int64_t stride = 1;
  std::int64_t count = 0;
  std::int64_t local_begin = 0;

  //! Global position of the i-th token of the segment.
  RINGATTN_HOST_DEVICE constexpr std::int64_t position(std::int64_t i) const {
    return start + stride * i;
  }
  friend constexpr bool operator==(const segment&, const segment&) = default;
};

//! Up to `Capacity` segments (one per contiguous run of a partitioner's layout).
template <int Capacity>
struct segment_list {
  segment items[Capacity] = {};
  int count = 0;

  RINGATTN_HOST_DEVICE constexpr const segment& operator[](int i) const { return items[i]; }
  RINGATTN_HOST_DEVICE constexpr void push(const segment& s) { items[count++] = s; }
  RINGATTN_HOST_DEVICE constexpr const segment* begin() const { return items; }
  RINGATTN_HOST_DEVICE constexpr const segment* end() const { return items + count; }
};

//! Where a global position lives: the rank and the index within that rank's part of the sequence.
struct owner {
  int rank = 0;
  std::int64_t local = 0;
  friend constexpr bool operator==(const owner&, const owner&) = default;
};

//! Where a sequence lives: partitioned over the `ranks` ranks `first`, `first + 1`, ... (modulo
//! the rank count), its i-th of them holding what the partitioner gives rank i of `ranks`. A
//! sequence over one rank is kept whole there; one over every rank from 0 is the plain layout.
struct placement {
  std::int32_t first = 0;
  std::int32_t ranks = 1;
  friend constexpr bool operator==(const placement&, const placement&) = default;
};

//! Unbounded distance in a position window or band (large, yet safe to add and negate).
inline constexpr std::int64_t unbounded = std::int64_t{1} << 60;

//! Which key positions a query position sees: `-max_behind <= pk - pq <= max_ahead`.
struct position_window {
  std::int64_t max_behind = unbounded;
  std::int64_t max_ahead = unbounded;

  //! The window of a mask kind; `left` and `right` (keys behind and ahead of the query, -1 for
  //! unbounded) bound the window kinds and are ignored by `full` and `causal`.
  RINGATTN_HOST_DEVICE static constexpr position_window of(mask_kind m, std::int64_t left = -1,
                                                           std::int64_t right = -1) {
    const std::int64_t behind = left < 0 ? unbounded : left;
    switch (m) {
    case mask_kind::causal: return {unbounded, 0};
    case mask_kind::sliding_window: return {behind, right < 0 ? unbounded : right};
    case mask_kind::causal_window: return {behind, 0};
    case mask_kind::full: break;
    }
    return {unbounded, unbounded};
  }
  RINGATTN_HOST_DEVICE constexpr bool sees(std::int64_t pq, std::int64_t pk) const {
    return pk - pq <= max_ahead && pq - pk <= max_behind;
  }
};

namespace detail {
RINGATTN_HOST_DEVICE constexpr std::int64_t floor_div(std::int64_t a, std::int64_t b) {
  const std::int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
RINGATTN_HOST_DEVICE constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return -floor_div(-a, b);
}
RINGATTN_HOST_DEVICE constexpr std::int64_t min64(std::int64_t a, std::int64_t b) {
  return a < b ? a : b;
}
RINGATTN_HOST_DEVICE constexpr std::int64_t max64(std::int64_t a, std::int64_t b) {
  return a > b ? a : b;
}
} // namespace detail

//! Half-open range `[begin, end)` of indices.
struct index_range {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  RINGATTN_HOST_DEVICE constexpr std::int64_t size() const { return end > begin ? end - begin : 0; }
  RINGATTN_HOST_DEVICE constexpr bool empty() const { return end <= begin; }
  friend constexpr bool operator==(const index_range&, const index_range&) = default;
};

//! KV tiles a row tile visits: tiles `[begin, end)`, of which `[unmasked_begin, unmasked_end)`
//! need no band mask (begin <= unmasked_begin <= unmasked_end <= end). Tiles past the block's last
//! column still need the bounds check of a ragged tail; that is not a band mask.
struct tile_trips {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  std::int64_t unmasked_begin = 0;
  std::int64_t unmasked_end = 0;
  //! Tiles that need the band predicate.
  RINGATTN_HOST_DEVICE constexpr std::int64_t masked() const {
    return (end - begin) - (unmasked_end - unmasked_begin);
  }
};

//! The visible (i, j) of a block with `rows` x `cols` local indices: `lo <= j - i <= hi`.
struct band {
  std::int64_t lo = -unbounded;
  std::int64_t hi = unbounded;

  RINGATTN_HOST_DEVICE constexpr bool sees(std::int64_t i, std::int64_t j) const {
    return j - i >= lo && j - i <= hi;
  }
  //! Columns that at least one row of `[i0, i1)` sees, clipped to `[0, cols)`.
  RINGATTN_HOST_DEVICE constexpr index_range columns(std::int64_t i0, std::int64_t i1,
                                                     std::int64_t cols) const {
    if (i1 <= i0) return {0, 0};
    const std::int64_t b = detail::max64(0, i0 + lo);
    const std::int64_t e = detail::min64(cols, i1 - 1 + hi + 1);
    return e > b ? index_range{b, e} : index_range{b, b};
  }
  //! Columns that every row of `[i0, i1)` sees, clipped to `[0, cols)` (possibly empty).
  RINGATTN_HOST_DEVICE constexpr index_range full_columns(std::int64_t i0, std::int64_t i1,
                                                          std::int64_t cols) const {
    if (i1 <= i0) return {0, 0};
    const std::int64_t b = detail::max64(0, i1 - 1 + lo);
    const std::int64_t e = detail::min64(cols, i0 + hi + 1);
    return e > b ? index_range{b, e} : index_range{b, b};
  }
  //! KV tiles of width `tile` that rows `[i0, i1)` visit, and which of them need the band mask.
  RINGATTN_HOST_DEVICE constexpr tile_trips kv_tiles(std::int64_t i0, std::int64_t i1,
                                                     std::int64_t cols, std::int64_t tile) const {
    const index_range c = columns(i0, i1, cols);
    if (c.empty()) return {0, 0, 0, 0};
    tile_trips t{c.begin / tile, detail::ceil_div(c.end, tile), 0, 0};
    const index_range f = full_columns(i0, i1, cols);
    // A tile needs no band mask when all its columns that exist are seen by every row.
    std::int64_t ub = detail::ceil_div(f.begin, tile);
    std::int64_t ue = f.end >= cols ? t.end : f.end / tile;
    if (f.empty() || ue <= ub) ub = ue = t.begin;
    t.unmasked_begin = ub;
    t.unmasked_end = ue;
    return t;
  }
  //! Number of visible (i, j) in a `rows` x `cols` block.
  RINGATTN_HOST_DEVICE constexpr std::int64_t visible(std::int64_t rows, std::int64_t cols) const {
    std::int64_t n = 0;
    // Rows split into at most three runs where the clipped column range changes linearly; a
    // per-row loop keeps this obviously right and costs O(rows).
    for (std::int64_t i = 0; i < rows; ++i)
      n += columns(i, i + 1, cols).size();
    return n;
  }
};

//! What a (query segment, key segment) block needs from a kernel.
enum class block_kind { empty, full, banded };

constexpr const char* to_string(block_kind k) noexcept {
  return k == block_kind::empty ? "empty" : k == block_kind::full ? "full" : "band";
}

//! Classification of one block: query segment `q` against key segment `kv`.
struct block {
  block_kind kind = block_kind::empty;
  std::int32_t sequence = 0; //!< index of the sequence in the packed batch (set by the plan)
  segment q;
  segment kv;
  band mask;
  //! Number of visible score elements (exact).
  RINGATTN_HOST_DEVICE constexpr std::int64_t visible() const {
    return kind == block_kind::empty ? 0 : mask.visible(q.count, kv.count);
  }
};

//! The band of a query segment against a key segment of the same stride under `w`. Both segments
//! must be of one sequence and have equal strides (true of every partitioner's segments).
RINGATTN_HOST_DEVICE constexpr band band_of(const segment& q, const segment& kv,
                                            const position_window& w) {
  const std::int64_t s = q.stride;
  const std::int64_t d = q.start - kv.start;
  band b;
  b.hi = w.max_ahead >= unbounded ? unbounded : detail::floor_div(w.max_ahead + d, s);
  b.lo = w.max_behind >= unbounded ? -unbounded : detail::ceil_div(d - w.max_behind, s);
  return b;
}

//! Classifies a block as empty, full or banded.
RINGATTN_HOST_DEVICE constexpr block classify(const segment& q, const segment& kv,
                                              const position_window& w) {
  block r{block_kind::empty, 0, q, kv, band_of(q, kv, w)};
  const std::int64_t n = q.count, m = kv.count;
  if (n <= 0 || m <= 0 || r.mask.hi < -(n - 1) || r.mask.lo > m - 1 || r.mask.lo > r.mask.hi)
    r.kind = block_kind::empty;
  else if (r.mask.lo <= -(n - 1) && r.mask.hi >= m - 1)
    r.kind = block_kind::full;
  else
    r.kind = block_kind::banded;
  return r;
}

} // namespace ringattn
