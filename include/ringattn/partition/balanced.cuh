#pragma once
//! \file
//! `balanced`: packed documents placed by their causal work. A short document is kept whole on
//! one rank, where no other rank ever needs its keys; a long one is cut zigzag-fashion over as few
//! neighbouring ranks as keep the work even, or over all of them.
//!
//! ```
//!   P = 4, documents 0: 4096 tokens, 1-6: 512, 7-14: 128 (causal work ~ length^2 / 2)
//!   document 0 -> zigzag over ranks 0..3 (each ~2.1M pairs); 1-6 -> whole, two ranks hold two of
//!   them and two hold one; 7-14 -> whole, onto the ranks holding less
//! ```
//! The placement (`place`) is a pure function of the lengths and the rank count, so every rank
//! computes the same layout and every helper that maps tokens (`partition_plan`, the scatter, the
//! PyTorch layout functions) agrees with the ring. It balances causal work (query x visible key
//! pairs under a causal mask); a full mask's work is proportional to it up to the diagonal, and
//! under a window short documents weigh alike and long ones split evenly over their ranks.
//!
//! The rule, in one pass over the documents from the most work to the least (ties: the earlier
//! document first): the target is the mean work per rank plus 1/256;
//! a document goes over the fewest k consecutive ranks (the ring's neighbours, modulo P; k = 1
//! keeps it whole) whose loads plus its zigzag chunks stay within it, choosing the window with the
//! smallest maximum; a document that fits nowhere goes where the largest load grows least. Time:
//! O(n log n) to order the documents, O(P) for each one kept whole, O(P^3) at most for one split
//! (65,536 documents over 8 ranks: see bench/plan.cpp). Within its ranks a document is laid out as
//! `zigzag` lays out a sequence over that many ranks; kept whole, it is one segment.

#include <ringattn/core/segment.cuh>
#include <ringattn/partition/zigzag.cuh>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

namespace ringattn {

struct balanced {
  static constexpr const char* name = "balanced";
  static constexpr int max_segments = zigzag::max_segments;

  //! A sequence over `ranks` ranks, indexed 0..ranks-1 among them: zigzag's layout, except that a
  //! sequence kept on one rank is one segment.
  RINGATTN_HOST_DEVICE static constexpr segment_list<2> segments(std::int64_t length, int ranks,
                                                                 int rank) {
    if (ranks == 1) {
      segment_list<2> r;
      r.push({0, 1, length, 0});
      return r;
    }
    return zigzag::segments(length, ranks, rank);
  }
  RINGATTN_HOST_DEVICE static constexpr std::int64_t local_length(std::int64_t length, int ranks,
                                                                  int rank) {
    return zigzag::local_length(length, ranks, rank);
  }
  RINGATTN_HOST_DEVICE static constexpr owner locate(std::int64_t length, int ranks,
                                                     std::int64_t position) {
    return zigzag::locate(length, ranks, position);
  }
  RINGATTN_HOST_DEVICE static constexpr std::int64_t position(std::int64_t length, int ranks,
                                                              int rank, std::int64_t local) {
    return zigzag::position(length, ranks, rank, local);
  }

  //! Causal pairs (query, key at or before it) of the positions `[begin, end)` of a sequence.
  static constexpr std::int64_t causal_pairs(std::int64_t begin, std::int64_t end) {
    return (end * (end + 1) - begin * (begin + 1)) / 2;
  }
  //! Causal work of rank `rank` of `ranks` holding its zigzag chunks of a `length`-token sequence.
  static constexpr std::int64_t causal_work(std::int64_t length, int ranks, int rank) {
    if (ranks == 1) return causal_pairs(0, length);
    const std::int64_t c2 = 2 * static_cast<std::int64_t>(ranks) - 1 - rank;
    return causal_pairs(zigzag::chunk_begin(length, ranks, rank),
                        zigzag::chunk_begin(length, ranks, rank + 1)) +
           causal_pairs(zigzag::chunk_begin(length, ranks, c2),
                        zigzag::chunk_begin(length, ranks, c2 + 1));
  }

  //! The placement of every sequence of `cu_seqlens` (batch + 1 non-decreasing offsets from 0)
  //! over `ranks` ranks (see the file's comment for the rule).
  static std::vector<placement> place(std::span<const std::int32_t> cu_seqlens, int ranks) {
    const std::size_t batch = cu_seqlens.empty() ? 0 : cu_seqlens.size() - 1;
    std::vector<placement> out(batch, placement{0, 1});
    if (ranks <= 1 || batch == 0) return out;
    auto length = [&](std::size_t s) {
      return static_cast<std::int64_t>(cu_seqlens[s + 1]) - cu_seqlens[s];
    };
    std::vector<std::int64_t> work(batch);
    std::int64_t total = 0;
    for (std::size_t s = 0; s < batch; ++s)
      total += work[s] = causal_pairs(0, length(s));
    std::vector<std::size_t> order(batch);
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return work[a] > work[b]; });
    const std::int64_t mean = (total + ranks - 1) / ranks;
    const std::int64_t target = mean + mean / 256;
    std::vector<std::int64_t> load(static_cast<std::size_t>(ranks), 0);
    std::vector<std::int64_t> piece(static_cast<std::size_t>(ranks));
    auto at = [&](int f, int i) -> std::int64_t& {
      return load[static_cast<std::size_t>((f + i) % ranks)];
    };
    for (const std::size_t s : order) {
      if (work[s] == 0) continue; // an empty sequence: on rank 0, holding nothing
      const std::int64_t n = length(s);
      // Over the fewest consecutive ranks (whole: k = 1) whose largest load stays within the
      // target, at the window with the smallest largest load; where none does, the k and window
      // with the smallest largest load of all.
      placement chosen{0, 0}, fallback{0, 1};
      std::int64_t fallback_most = -1;
      for (int k = 1; chosen.ranks == 0 && k <= ranks; ++k) {
        for (int i = 0; i < k; ++i)
          piece[static_cast<std::size_t>(i)] = causal_work(n, k, i);
        std::int64_t best = 0;
        int best_first = -1;
        for (int f = 0; f < ranks; ++f) {
          std::int64_t most = 0;
          for (int i = 0; i < k; ++i)
            most = std::max(most, at(f, i) + piece[static_cast<std::size_t>(i)]);
          if (best_first < 0 || most < best) best = most, best_first = f;
        }
        if (best <= target) chosen = {best_first, k};
        if (fallback_most < 0 || best < fallback_most)
          fallback_most = best, fallback = {best_first, k};
      }
      if (chosen.ranks == 0) chosen = fallback;
      out[s] = chosen;
      for (int i = 0; i < chosen.ranks; ++i)
        at(chosen.first, i) += causal_work(n, chosen.ranks, i);
    }
    return out;
  }
};

} // namespace ringattn
