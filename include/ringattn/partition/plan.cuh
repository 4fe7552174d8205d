#pragma once
//! \file
//! `partition_plan<Partitioner>`: the layout of a packed batch over P ranks, computed once.
//!
//! Each sequence of `cu_seqlens` is partitioned on its own, over every rank or, for a placing
//! partitioner (`balanced`), over the ranks its `placement` names; a rank's shard holds its part of
//! sequence 0, then of sequence 1, ... (its *local* `cu_seqlens`). No length needs to divide P:
//! shares may be uneven or empty. The plan answers everything the ring driver and the user need
//! about the layout: local `cu_seqlens` of every rank, segments, global <-> local token indices,
//! position ids (for RoPE), the blocks of a (query rank, key rank) pair, and per-rank work.
//!
//! \code
//! std::vector<int32_t> cu = {0, 2999, 4000};        // two sequences
//! ringattn::partition_plan<ringattn::zigzag> plan(cu, /*ranks=*/4);
//! auto local_cu = plan.local_cu_seqlens(rank);      // this rank's packed layout
//! auto pos = plan.position_ids(rank);               // RoPE positions of the local tokens
//! for (const auto& b : plan.blocks(rank, src, ringattn::position_window::of(mask_kind::causal)))
//!   ...                                              // empty blocks are already left out
//! \endcode

#include <ringattn/concepts/partitioner.cuh>
#include <ringattn/error.cuh>
#include <ringattn/tensor.cuh>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace ringattn {

template <partitioner Partitioner>
class partition_plan {
public:
  using partitioner_type = Partitioner;
  static constexpr int max_segments = Partitioner::max_segments;

  //! Why `(cu_seqlens, ranks)` cannot be planned, or ok: ranks >= 1, cu_seqlens starting at 0 and
  //! non-decreasing with at least one sequence.
  static validation validate(std::span<const std::int32_t> cu_seqlens, int ranks) {
    validation r = validation::ok();
    r.require(ranks >= 1, "the number of ranks must be at least 1 (got ", ranks, ")");
    if (cu_seqlens.size() < 2)
      return r.require(false, "cu_seqlens needs batch + 1 >= 2 entries (got ", cu_seqlens.size(),
                       ")");
    r.require(validate_cu_seqlens(cu_seqlens, cu_seqlens.back()));
    return r;
  }

  //! Plans `cu_seqlens` (global, batch + 1 entries) over `ranks` ranks; throws `invalid_argument`.
  partition_plan(std::span<const std::int32_t> cu_seqlens, int ranks)
      : ranks_(ranks), cu_(cu_seqlens.begin(), cu_seqlens.end()) {
    validate(cu_seqlens, ranks).throw_if_invalid();
    const int b = batch();
    if constexpr (placing_partitioner<Partitioner>) {
      placements_ = Partitioner::place(cu_seqlens, ranks);
      validation v = validation::ok();
      v.require(placements_.size() == static_cast<std::size_t>(b), Partitioner::name, " placed ",
                placements_.size(), " sequences of ", b);
      for (std::size_t s = 0; v && s < placements_.size(); ++s)
        v.require(placements_[s].first >= 0 && placements_[s].first < ranks &&
                      placements_[s].ranks >= 1 && placements_[s].ranks <= ranks,
                  Partitioner::name, " placed sequence ", s, " over ", placements_[s].ranks,
                  " ranks from rank ", placements_[s].first, ", not within the ", ranks, " ranks");
      if (!v) throw error("ringattn: " + v.reason());
    }
    local_cu_.assign(static_cast<std::size_t>(ranks) * (b + 1), 0);
    rank_offsets_.assign(static_cast<std::size_t>(ranks) + 1, 0);
    for (int r = 0; r < ranks; ++r) {
      std::int32_t* lc = local_cu_.data() + static_cast<std::size_t>(r) * (b + 1);
      for (int s = 0; s < b; ++s)
        lc[s + 1] = lc[s] + static_cast<std::int32_t>(placed_length(s, r));
      rank_offsets_[r + 1] = rank_offsets_[r] + lc[b];
    }
  }

  int ranks() const noexcept { return ranks_; }
  //! Number of sequences.
  int batch() const noexcept { return static_cast<int>(cu_.size()) - 1; }
  //! Tokens of the whole packed batch.
  std::int64_t tokens() const noexcept { return cu_.back(); }
  //! The global cu_seqlens the plan was built from.
  std::span<const std::int32_t> cu_seqlens() const noexcept { return cu_; }
  //! Length of sequence `s`.
  std::int64_t length(int s) const { return cu_[s + 1] - cu_[s]; }

  //! Rank `rank`'s packed layout: batch + 1 offsets into its shard.
  std::span<const std::int32_t> local_cu_seqlens(int rank) const {
    check_rank(rank);
    return {local_cu_.data() + static_cast<std::size_t>(rank) * (batch() + 1),
            static_cast<std::size_t>(batch() + 1)};
  }
  //! All ranks' local cu_seqlens, rank-major: ranks x (batch + 1).
  std::span<const std::int32_t> all_local_cu_seqlens() const noexcept { return local_cu_; }
  //! Tokens in rank `rank`'s shard.
  std::int64_t local_tokens(int rank) const { return local_cu_seqlens(rank).back(); }
  //! The largest shard (the size of a ring buffer).
  std::int64_t max_local_tokens() const {
    std::int64_t m = 0;
    for (int r = 0; r < ranks_; ++r)
      m = std::max(m, local_tokens(r));
    return m;
  }
  //! Where rank `rank`'s shard starts in the rank-major concatenation of all shards (the layout
  //! an all-gather of unequal shards produces); `rank_offset(ranks())` is the total.
  std::int64_t rank_offset(int rank) const {
    if (rank != ranks_) check_rank(rank);
    return rank_offsets_[rank];
  }
  std::span<const std::int64_t> rank_offsets() const noexcept { return rank_offsets_; }

  //! Over which ranks sequence `s` is partitioned (every rank from 0 unless the partitioner
  //! places sequences).
  placement placement_of(int s) const {
    if (placements_.empty()) return {0, ranks_};
    return placements_[static_cast<std::size_t>(s)];
  }
  //! Every sequence's placement, or none where every sequence spans every rank.
  std::span<const placement> placements() const noexcept { return placements_; }

  //! Rank `rank`'s segments of sequence `s`, with `local_begin` counted from the start of the
  //! rank's shard (so they index the shard directly).
  segment_list<max_segments> segments(int rank, int s) const {
    check_rank(rank);
    const placement pl = placement_of(s);
    const int i = index_in(pl, rank);
    if (i < 0) return {};
    auto list = Partitioner::segments(length(s), pl.ranks, i);
    const std::int64_t base = local_cu_seqlens(rank)[s];
    for (int i = 0; i < list.count; ++i)
      list.items[i].local_begin += base;
    return list;
  }

  //! Index in the full packed batch of the `local`-th token of rank `rank`'s shard.
  std::int64_t global_token(int rank, std::int64_t local) const {
    const auto lc = local_cu_seqlens(rank);
    const int s =
        static_cast<int>(std::upper_bound(lc.begin(), lc.end(), static_cast<std::int32_t>(local)) -
                         lc.begin()) -
        1;
    const placement pl = placement_of(s);
    return cu_[s] + Partitioner::position(length(s), pl.ranks, index_in(pl, rank), local - lc[s]);
  }
  //! Owner rank and shard index of the token at `global` in the full packed batch.
  owner locate(std::int64_t global) const {
    const int s = sequence_of(global);
    const placement pl = placement_of(s);
    owner o = Partitioner::locate(length(s), pl.ranks, global - cu_[s]);
    o.rank = (pl.first + o.rank) % ranks_;
    o.local += local_cu_seqlens(o.rank)[s];
    return o;
  }
  //! Sequence holding token `global` of the full batch (the last one if several are empty).
  int sequence_of(std::int64_t global) const {
    return static_cast<int>(
               std::upper_bound(cu_.begin(), cu_.end(), static_cast<std::int32_t>(global)) -
               cu_.begin()) -
           1;
  }

  //! Position within its sequence of every token of rank `rank`'s shard (for RoPE).
  std::vector<std::int32_t> position_ids(int rank) const {
    std::vector<std::int32_t> pos(static_cast<std::size_t>(local_tokens(rank)));
    for (int s = 0; s < batch(); ++s)
      for (const segment& g : segments(rank, s))
        for (std::int64_t i = 0; i < g.count; ++i)
          pos[static_cast<std::size_t>(g.local_begin + i)] =
              static_cast<std::int32_t>(g.position(i));
    return pos;
  }

  //! The non-empty blocks of rank `q_rank`'s queries against rank `kv_rank`'s keys under `w`,
  //! sequence by sequence. Segments' `local_begin` index the respective shards.
  std::vector<block> blocks(int q_rank, int kv_rank, const position_window& w) const {
    std::vector<block> out;
    for (int s = 0; s < batch(); ++s) {
      const auto qs = segments(q_rank, s);
      const auto ks = segments(kv_rank, s);
      for (const segment& q : qs)
        for (const segment& k : ks) {
          block b = classify(q, k, w);
          if (b.kind == block_kind::empty) continue;
          b.sequence = s;
          out.push_back(b);
        }
    }
    return out;
  }

  //! Whether some query of rank `q_rank` sees some key of rank `kv_rank` under `w` (whether
  //! `blocks(q_rank, kv_rank, w)` has any), stopping at the first such block.
  bool sees(int q_rank, int kv_rank, const position_window& w) const {
    check_rank(q_rank);
    check_rank(kv_rank);
    for (int s = 0; s < batch(); ++s) {
      if (!placements_.empty()) {
        const placement pl = placements_[static_cast<std::size_t>(s)];
        if (index_in(pl, q_rank) < 0 || index_in(pl, kv_rank) < 0) continue;
      }
      const auto qs = segments(q_rank, s);
      const auto ks = segments(kv_rank, s);
      for (const segment& q : qs)
        for (const segment& k : ks)
          if (classify(q, k, w).kind != block_kind::empty) return true;
    }
    return false;
  }

  //! Exact number of visible score elements of rank `rank`'s queries (against all keys).
  std::int64_t work(int rank, const position_window& w) const {
    std::int64_t n = 0;
    for (int src = 0; src < ranks_; ++src)
      for (const block& b : blocks(rank, src, w))
        n += b.visible();
    return n;
  }

  //! The largest rank's work over the mean (1 where there is none): what the slowest rank costs
  //! the ring against a perfect balance.
  double work_imbalance(const position_window& w) const {
    std::int64_t most = 0, sum = 0;
    for (int r = 0; r < ranks_; ++r) {
      const std::int64_t x = work(r, w);
      most = std::max(most, x);
      sum += x;
    }
    return sum == 0 ? 1.0 : static_cast<double>(most) * ranks_ / static_cast<double>(sum);
  }

private:
  // The index of `rank` among a placement's ranks, or -1 where it holds none of the sequence.
  int index_in(const placement& pl, int rank) const noexcept {
    const int i = (rank - pl.first + ranks_) % ranks_;
    return i < pl.ranks ? i : -1;
  }
  std::int64_t placed_length(int s, int rank) const {
    const placement pl = placement_of(s);
    const int i = index_in(pl, rank);
    return i < 0 ? 0 : Partitioner::local_length(length(s), pl.ranks, i);
  }
  void check_rank(int rank) const {
    if (rank < 0 || rank >= ranks_)
      throw invalid_argument(
          detail::concat("ringattn: rank ", rank, " is out of range [0, ", ranks_, ")"));
  }

  int ranks_;
  std::vector<std::int32_t> cu_;
  std::vector<std::int32_t> local_cu_;
  std::vector<std::int64_t> rank_offsets_;
  std::vector<placement> placements_; // empty: every sequence over every rank
};

} // namespace ringattn
