#pragma once
//! \file
//! Block groups as *pieces*: rectangles of query rows x key rows that a library's fused attention
//! (cuDNN's SDPA, say) computes in one batched call, each under one of three masks, and the
//! tables that put the pieces' outputs back where the ring wants them.
//!
//! A library mask is coarser than a band: every row sees every key (`full`), or row i of a
//! piece of n rows and m keys sees keys j <= i + (m - n) (`causal_bottom_right`; n = m is the
//! usual top-left causal). A group's key segments that lie next to each other in the K/V block
//! (zigzag's two chunks of a source) join into one key range when one band describes both; the
//! band `j - i <= hi` (no lower bound: full and causal masks) is then cut into pieces: rows that
//! see no key are dropped, rows that see part of the range form one bottom-right causal piece,
//! rows that see all of it one full piece; pieces of adjacent query rows then join where one
//! mask describes both. A key segment whose band also binds below (a window's) becomes one `band`
//! piece of its own: the rows that see a key against the keys they see, row i seeing keys j with
//! `lo <= j - i <= hi` (a library's top-left diagonal band). Every visible (row, key) pair lies in
//! exactly one piece and every row of a piece sees at least one key, so a piece's log-sum-exp is
//! finite.
//!
//! A *call* is pieces of one step under one mask (and one band) that compute no query row twice.
//! Its outputs are packed: piece b's rows at scratch rows `[q_scratch(b), q_scratch(b) + q_count)`
//! (and its keys likewise), so that no two pieces write the same place even where they read the
//! same rows; or, on the query side, at the rows' own places. A `row_reduction` then names, per
//! destination row, the scratch rows that belong to it, in piece order: merges and sums follow it,
//! so every result is the same bit for bit from call to call.
//!
//! \code
//! auto pieces = ringattn::pieces_of(step.groups);       // plan time
//! for (const ringattn::piece_call& c : ringattn::calls_of(pieces)) { ... }
//! \endcode

#include <ringattn/block/device/block.cuh>
#include <ringattn/core/segment.cuh>
#include <ringattn/error.cuh>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace ringattn {

//! How a library masks one piece of n query rows and m keys.
enum class piece_mask : std::uint8_t {
  full,                //!< every row sees every key
  causal_bottom_right, //!< row i sees keys j <= i + (m - n)
  band                 //!< row i sees keys j with lo <= j - i <= hi (the piece's `lo`, `hi`)
};

constexpr const char* to_string(piece_mask m) noexcept {
  return m == piece_mask::full   ? "full"
         : m == piece_mask::band ? "band (top-left)"
                                 : "causal (bottom-right)";
}

//! Query rows `[q_begin, q_begin + q_count)` of the Q shard against key rows
//! `[kv_begin, kv_begin + kv_count)` of the K/V block, under `mask`.
struct attention_piece {
  std::int64_t q_begin = 0;
  std::int64_t q_count = 0;
  std::int64_t kv_begin = 0;
  std::int64_t kv_count = 0;
  piece_mask mask = piece_mask::full;
  //! The band of a `band` piece, on the piece's own rows and keys (`-unbounded` / `unbounded`
  //! where a side binds no row); 0 for the other masks.
  std::int64_t lo = 0, hi = 0;

  //! Whether row i (within the piece) sees key j (within the piece).
  constexpr bool sees(std::int64_t i, std::int64_t j) const {
    if (mask == piece_mask::band) return j - i >= lo && j - i <= hi;
    return mask == piece_mask::full || j - i <= kv_count - q_count;
  }
  friend constexpr bool operator==(const attention_piece&, const attention_piece&) = default;
};

namespace detail {

// Keys a row i of [0, n) sees of m keys under `j - i <= hi`, clamp(i + hi + 1, 0, m), agree for
// every row under two bounds a and b.
constexpr bool same_visibility(std::int64_t n, std::int64_t m, std::int64_t a, std::int64_t b) {
  if (a == b) return true;
  const auto all = [&](std::int64_t h) { return h + 1 >= m; };     // row 0 sees every key
  const auto none = [&](std::int64_t h) { return n - 1 + h < 0; }; // the last row sees none
  return (all(a) && all(b)) || (none(a) && none(b));
}

// Whether a key segment's band has a lower bound that binds some row of n (a window's).
constexpr bool binds_below(std::int64_t n, const kv_block& s) { return s.mask.lo > -(n - 1); }

// A key segment whose band binds below, as one band piece: the rows that see a key, against the
// keys they see, the band shifted onto them; a side that binds no row of the piece is unbounded.
// Nothing when no row sees a key.
inline bool band_piece(std::int64_t q_begin, std::int64_t n, const kv_block& s,
                       attention_piece& out) {
  const std::int64_t m = s.kv_count, lo = s.mask.lo, hi = s.mask.hi;
  const std::int64_t i0 = std::max<std::int64_t>(0, -hi), i1 = std::min<std::int64_t>(n, m - lo);
  if (i1 <= i0) return false;
  const std::int64_t j0 = std::max<std::int64_t>(0, i0 + lo);
  const std::int64_t j1 = std::min<std::int64_t>(m, i1 - 1 + (hi >= unbounded ? m : hi) + 1);
  if (j1 <= j0) return false;
  out = {q_begin + i0,
         i1 - i0,
         s.kv_begin + j0,
         j1 - j0,
         piece_mask::band,
         lo + i0 - j0,
         hi >= unbounded ? unbounded : hi + i0 - j0};
  if (out.lo <= -(out.q_count - 1)) out.lo = -unbounded;
  if (out.hi >= out.kv_count - 1) out.hi = unbounded;
  return true;
}

// One key range of a group with the bound of its band (no lower bound).
struct key_span {
  std::int64_t begin = 0, count = 0, hi = 0;
};

// Key segments of a group joined where they touch and one bound serves both.
inline std::vector<key_span> key_spans(const block_group& g) {
  std::vector<kv_block> segs(g.kv, g.kv + g.count);
  std::sort(segs.begin(), segs.end(),
            [](const kv_block& a, const kv_block& b) { return a.kv_begin < b.kv_begin; });
  std::vector<key_span> spans;
  std::vector<kv_block> members; // of the last span
  for (const kv_block& s : segs) {
    const std::int64_t n = g.q_count;
    if (s.kv_count == 0) continue;
    if (binds_below(n, s)) continue; // a band piece of its own (band_piece)
    if (same_visibility(n, s.kv_count, s.mask.hi, -unbounded)) continue; // sees nothing
    bool joined = false;
    if (!spans.empty() && spans.back().begin + spans.back().count == s.kv_begin) {
      key_span& cur = spans.back();
      const std::int64_t off = s.kv_begin - cur.begin;
      // Either the span's bound also describes the new segment, or the new segment's bound
      // (shifted to the span's columns) describes every member.
      if (same_visibility(n, s.kv_count, s.mask.hi, cur.hi - off)) {
        joined = true;
      } else {
        const std::int64_t cand = s.mask.hi + off;
        bool fits = true;
        for (const kv_block& mbr : members)
          fits = fits &&
                 same_visibility(n, mbr.kv_count, mbr.mask.hi, cand - (mbr.kv_begin - cur.begin));
        if (fits) cur.hi = cand, joined = true;
      }
      if (joined) cur.count += s.kv_count, members.push_back(s);
    }
    if (!joined) {
      spans.push_back({s.kv_begin, s.kv_count, s.mask.hi});
      members.assign(1, s);
    }
  }
  return spans;
}

} // namespace detail

//! The pieces of a step's groups (`ring_schedule`'s groups of one step): the full and causal
//! pieces in group order, then the band pieces.
inline std::vector<attention_piece> pieces_of(std::span<const block_group> groups) {
  std::vector<attention_piece> out, bands;
  for (const block_group& g : groups) {
    if (g.q_count == 0) continue;
    for (int b = 0; b < g.count; ++b) {
      attention_piece p;
      if (g.kv[b].kv_count > 0 && detail::binds_below(g.q_count, g.kv[b]) &&
          detail::band_piece(g.q_begin, g.q_count, g.kv[b], p))
        bands.push_back(p);
    }
    for (const detail::key_span& s : detail::key_spans(g)) {
      const std::int64_t n = g.q_count, m = s.count;
      if (s.hi >= m - 1) {
        out.push_back({g.q_begin, n, s.begin, m, piece_mask::full});
        continue;
      }
      const std::int64_t skip = std::max<std::int64_t>(0, -s.hi); // rows that see no key
      if (skip >= n) continue;
      const std::int64_t q0 = g.q_begin + skip, rows = n - skip, h = s.hi + skip; // h >= 0
      const std::int64_t partial = std::min(rows, m - h); // rows that see part of the keys
      out.push_back({q0, partial, s.begin, partial + h,
                     partial == 1 ? piece_mask::full : piece_mask::causal_bottom_right});
      if (rows > partial)
        out.push_back({q0 + partial, rows - partial, s.begin, m, piece_mask::full});
    }
  }
  // Pieces of adjacent query rows from the same first key join where one mask describes both:
  // full pieces against the same keys (zigzag's two chunks of a rank both see a whole earlier
  // chunk: one piece of 2c rows), and causal pieces on one diagonal (zigzag's own block, chunk
  // c x c and chunk c x 2c: one causal 2c x 2c piece).
  std::vector<attention_piece> joined;
  for (const attention_piece& p : out) {
    auto into = std::find_if(joined.begin(), joined.end(), [&](const attention_piece& x) {
      if (x.mask != p.mask || x.kv_begin != p.kv_begin || x.q_begin + x.q_count != p.q_begin)
        return false;
      return p.mask == piece_mask::full ? x.kv_count == p.kv_count
                                        : p.kv_count == x.kv_count + p.q_count;
    });
    if (into != joined.end())
      into->q_count += p.q_count, into->kv_count = p.kv_count;
    else
      joined.push_back(p);
  }
  joined.insert(joined.end(), bands.begin(), bands.end());
  return joined;
}

//! The pieces of one step under one mask (for bands: one band), computed by one library call.
struct piece_call {
  piece_mask mask = piece_mask::full;
  std::int64_t lo = 0, hi = 0; //!< the band of a `band` call's pieces
  std::vector<attention_piece> pieces;
  std::int64_t q_rows = 0;  //!< query rows of all pieces (the packed output's rows)
  std::int64_t kv_rows = 0; //!< key rows of all pieces (the packed dK/dV's rows)
  std::int64_t max_q = 0;   //!< the largest piece's query rows
  std::int64_t max_kv = 0;  //!< the largest piece's key rows
};

//! The calls of one step: one per mask that occurs, full first, a mask's pieces split over more
//! calls where two of them compute the same query row, so that no call computes a row twice
//! (a call's gradients can then be written at the rows' own places, `in_place_reduction_of`).
inline std::vector<piece_call> calls_of(std::span<const attention_piece> pieces) {
  std::vector<piece_call> calls;
  for (piece_mask m : {piece_mask::full, piece_mask::causal_bottom_right, piece_mask::band}) {
    std::vector<piece_call> of_mask;
    std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> taken; // row ranges per call
    for (const attention_piece& p : pieces) {
      if (p.mask != m) continue;
      const std::int64_t b = p.q_begin, e = p.q_begin + p.q_count;
      std::size_t at = 0;
      for (; at < of_mask.size(); ++at)
        if ((m != piece_mask::band || (of_mask[at].lo == p.lo && of_mask[at].hi == p.hi)) &&
            std::none_of(taken[at].begin(), taken[at].end(),
                         [&](const auto& r) { return r.first < e && b < r.second; }))
          break;
      if (at == of_mask.size()) {
        piece_call& made = of_mask.emplace_back();
        made.mask = m, made.lo = p.lo, made.hi = p.hi;
        taken.emplace_back();
      }
      piece_call& c = of_mask[at];
      taken[at].emplace_back(b, e);
      c.pieces.push_back(p);
      c.q_rows += p.q_count, c.kv_rows += p.kv_count;
      c.max_q = std::max(c.max_q, p.q_count), c.max_kv = std::max(c.max_kv, p.kv_count);
    }
    for (piece_call& c : of_mask)
      calls.push_back(std::move(c));
  }
  return calls;
}

//! Destination rows, each with the packed (scratch) rows that belong to it, in piece order:
//! destination `dest[e]` takes scratch rows `source[first[e]] .. source[first[e + 1] - 1]`.
struct row_reduction {
  std::vector<std::int32_t> dest;
  std::vector<std::int32_t> first;
  std::vector<std::int32_t> source;
};

//! The reduction of a call's query side (`keys` false) or key side (`keys` true). Rows are int32
//! (`validate_groups` bounds the shards); a call whose packed rows exceed that is refused.
inline row_reduction reduction_of(const piece_call& c, bool keys) {
  constexpr std::int64_t most = std::numeric_limits<std::int32_t>::max();
  if ((keys ? c.kv_rows : c.q_rows) > most)
    throw invalid_argument("ringattn: a library call packs more than " + std::to_string(most) +
                           " rows");
  std::vector<std::pair<std::int32_t, std::int32_t>> pairs; // (destination, scratch row)
  std::int64_t scratch = 0;
  for (const attention_piece& p : c.pieces) {
    const std::int64_t begin = keys ? p.kv_begin : p.q_begin, count = keys ? p.kv_count : p.q_count;
    for (std::int64_t r = 0; r < count; ++r)
      pairs.emplace_back(static_cast<std::int32_t>(begin + r),
                         static_cast<std::int32_t>(scratch + r));
    scratch += count;
  }
  std::stable_sort(pairs.begin(), pairs.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  row_reduction r;
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    if (i == 0 || pairs[i].first != pairs[i - 1].first) {
      r.dest.push_back(pairs[i].first);
      r.first.push_back(static_cast<std::int32_t>(i));
    }
    r.source.push_back(pairs[i].second);
  }
  r.first.push_back(static_cast<std::int32_t>(pairs.size()));
  return r;
}

//! The reduction of a call's query side when its outputs lie at the rows' own places (scratch row
//! r belongs to Q-shard row r): every row a piece computes, in order. Needs a call that computes
//! no row twice (`calls_of` makes such calls).
inline row_reduction in_place_reduction_of(const piece_call& c) {
  row_reduction r;
  for (const attention_piece& p : c.pieces)
    for (std::int64_t i = 0; i < p.q_count; ++i)
      r.dest.push_back(static_cast<std::int32_t>(p.q_begin + i));
  std::sort(r.dest.begin(), r.dest.end());
  if (std::adjacent_find(r.dest.begin(), r.dest.end()) != r.dest.end())
    throw invalid_argument("ringattn: a library call computes a query row twice");
  r.source = r.dest;
  for (std::size_t i = 0; i <= r.dest.size(); ++i)
    r.first.push_back(static_cast<std::int32_t>(i));
  return r;
}

//! For each packed query row of a call, the Q-shard row it computes.
inline std::vector<std::int32_t> packed_query_rows(const piece_call& c) {
  std::vector<std::int32_t> rows;
  rows.reserve(static_cast<std::size_t>(c.q_rows));
  for (const attention_piece& p : c.pieces)
    for (std::int64_t r = 0; r < p.q_count; ++r)
      rows.push_back(static_cast<std::int32_t>(p.q_begin + r));
  return rows;
}

} // namespace ringattn
