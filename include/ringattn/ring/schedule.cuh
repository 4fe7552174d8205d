#pragma once
//! \file
//! The ring schedule of one rank, built once at plan time: for every step, the rank whose K/V
//! block it attends to, the block groups of this rank's queries against that block (validated
//! here, once), and the step's kind — what the block kernel's epilogue does with the state.
//!
//! At step t rank r holds the K/V block of rank (r - t) mod P, sends it on to rank r + 1 and
//! receives the block of step t + 1 from rank r - 1. Every index of that arithmetic lives here.
//! The ring takes P steps, or fewer when no rank needs the blocks of the later ones (a window
//! shorter than the distance they would travel): `step_count()`, the same on every rank. In the
//! forward a block goes on only as far as some rank's queries see it: a rank sends nothing after
//! a step whose block no later rank sees (`ring_step::forwarded`), and the next rank then
//! receives nothing (`ring_step::arrives`) and computes nothing. The backward carries every block
//! the whole ring, since its dK/dV go home from the last rank.
//!
//! Only the rows of a shard that some other rank's queries see travel (`kv_travel`): the key
//! segments no other rank sees under the window (a document kept whole on its rank, zigzag's last
//! chunk on rank 0 under a causal mask) stay home, in the forward and in the backward. A step's
//! groups index the block as it travels; step 0 computes on the caller's k and v where the shard
//! does not travel whole.
//!
//! \code
//! ringattn::ring_schedule s(plan, rank, ringattn::position_window::of(mask_kind::causal));
//! for (const ringattn::ring_step& step : s.steps())
//!   ... step.source, step.groups, s.forward_epilogue(step.index, out_dense) ...
//! \endcode

#include <ringattn/block/device/block.cuh>
#include <ringattn/error.cuh>
#include <ringattn/partition/plan.cuh>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace ringattn {

//! A stretch of a shard that travels: rows `[local_begin, local_begin + count)` of the shard are
//! rows `[travel_begin, travel_begin + count)` of the block that travels.
struct travel_run {
  std::int64_t local_begin = 0, count = 0, travel_begin = 0;
  friend bool operator==(const travel_run&, const travel_run&) = default;
};

//! The rows of a rank's K/V shard that travel on the ring and the all-gather: every key segment
//! that some query of another rank sees under the window, in shard order. A shard travels `whole`
//! (no runs) where all its rows do, or where they lie in more than `max_runs` stretches (each is a
//! copy when the block is packed, and an addition when its dK/dV come home).
struct kv_travel {
  static constexpr int max_runs = 16;
  bool whole = true;
  std::int64_t tokens = 0;      //!< rows that travel
  std::vector<travel_run> runs; //!< where they are (none when whole)

  //! The row of the travelling block that holds shard row `local` (a row that travels).
  std::int64_t row(std::int64_t local) const {
    if (whole) return local;
    const auto next =
        std::upper_bound(runs.begin(), runs.end(), local,
                         [](std::int64_t x, const travel_run& r) { return x < r.local_begin; });
    if (next == runs.begin() || local >= std::prev(next)->local_begin + std::prev(next)->count)
      throw std::logic_error("ringattn: shard row " + std::to_string(local) + " does not travel");
    return std::prev(next)->travel_begin + local - std::prev(next)->local_begin;
  }
  //! Calls `f(local_begin, count, travel_begin)` for every stretch that travels (one, the whole
  //! shard of `shard_tokens` rows, when whole).
  template <class F>
  void for_each_run(std::int64_t shard_tokens, F&& f) const {
    if (whole) {
      if (shard_tokens > 0) f(std::int64_t{0}, shard_tokens, std::int64_t{0});
      return;
    }
    for (const travel_run& r : runs)
      f(r.local_begin, r.count, r.travel_begin);
  }
};

//! Which rows of rank `rank`'s shard travel under `window` (`kv_travel`). O(segments x ranks
//! holding each sequence), stopping at the first rank that sees a segment.
template <class Partitioner>
kv_travel travelling_rows(const partition_plan<Partitioner>& plan, int rank,
                          const position_window& window) {
  const std::int64_t n = plan.local_tokens(rank);
  kv_travel t;
  t.whole = false;
  for (int s = 0; s < plan.batch(); ++s) {
    const placement pl = plan.placement_of(s);
    for (const segment& k : plan.segments(rank, s)) {
      if (k.count == 0) continue;
      bool seen = false;
      for (int i = 0; i < pl.ranks && !seen; ++i) {
        const int q = (pl.first + i) % plan.ranks();
        if (q == rank) continue;
        for (const segment& g : plan.segments(q, s))
          if (g.count > 0 && classify(g, k, window).kind != block_kind::empty) {
            seen = true;
            break;
          }
      }
      if (!seen) continue;
      if (!t.runs.empty() && t.runs.back().local_begin + t.runs.back().count == k.local_begin)
        t.runs.back().count += k.count;
      else
        t.runs.push_back({k.local_begin, k.count, t.tokens});
      t.tokens += k.count;
    }
  }
  if (t.tokens == n || t.runs.size() > static_cast<std::size_t>(kv_travel::max_runs))
    return {true, n, {}};
  return t;
}

//! One step of a rank's ring.
struct ring_step {
  int index = 0;                   //!< t
  int source = 0;                  //!< whose K/V block this step attends to: (rank - t) mod P
  std::int64_t kv_tokens = 0;      //!< rows of that block (step 0: the shard; later: what travels)
  std::int64_t rows = 0;           //!< query rows the groups cover
  std::vector<block_group> groups; //!< this rank's queries against the block, validated
  //! Forward: the block arrives from the previous rank before this step (false at step 0, the
  //! own block, and where no rank from this one on sees it), and goes on to the next rank after
  //! it (false after the last step and where no rank after this one sees it).
  bool arrives = true, forwarded = true;
  //! The all-gather: whether rank (rank + t) mod P sees this rank's own block (exchange t sends it
  //! there, and its dK/dV share comes back). This rank receives the block of step t where its
  //! groups are not empty.
  bool own_wanted = true;
};

class ring_schedule {
public:
  //! The schedule of `rank` under `window`. Throws `invalid_argument` if the plan's blocks do not
  //! form valid groups (a partitioner meeting more key segments than a kernel takes).
  template <class Partitioner>
  ring_schedule(const partition_plan<Partitioner>& plan, int rank, const position_window& window)
      : ranks_(plan.ranks()), rank_(rank), q_tokens_(plan.local_tokens(rank)), max_kv_tokens_(0) {
    const int steps = steps_needed(plan, window);
    std::vector<kv_travel> travel;
    for (int r = 0; r < ranks_; ++r) {
      travel.push_back(travelling_rows(plan, r, window));
      travel_tokens_.push_back(travel.back().tokens);
    }
    own_ = travel[static_cast<std::size_t>(rank)];
    // Whether some rank at hop `from_hop` or later sees the block this rank holds at step t: the
    // block of rank (rank - t) is at rank (rank - t + u) at step u.
    auto seen_later = [&](int t, int from_hop) {
      const int source = source_of(t);
      for (int u = steps - 1; u >= from_hop; --u)
        if (plan.sees((source + u) % ranks_, source, window)) return true;
      return false;
    };
    for (int t = 0; t < steps; ++t) {
      ring_step s;
      s.index = t;
      s.source = source_of(t);
      s.arrives = t > 0 && seen_later(t, t);
      s.forwarded = t + 1 < steps && seen_later(t, t + 1);
      s.own_wanted = t > 0 && plan.sees((rank + t) % ranks_, rank, window);
      const kv_travel& held = travel[static_cast<std::size_t>(s.source)];
      s.kv_tokens = t == 0 ? q_tokens_ : held.tokens;
      s.groups = group_blocks(plan.blocks(rank, s.source, window));
      if (t > 0)
        for (block_group& g : s.groups)
          for (int b = 0; b < g.count; ++b)
            g.kv[b].kv_begin = held.row(g.kv[b].kv_begin);
      validate_groups(s.groups, q_tokens_, s.kv_tokens).throw_if_invalid();
      s.rows = rows_of(s.groups);
      max_kv_tokens_ = std::max(max_kv_tokens_, held.tokens);
      steps_.push_back(std::move(s));
    }
    note_writes();
  }

  //! A schedule of given steps: `q_tokens` query rows against blocks of up to `max_kv_tokens` rows
  //! (a schedule computing on gathered shards, ring/all_to_all.cuh). Validates every step's
  //! groups and counts their rows; throws `invalid_argument` on groups that do not fit.
  ring_schedule(int ranks, int rank, std::int64_t q_tokens, std::int64_t max_kv_tokens,
                std::vector<ring_step> steps)
      : ranks_(ranks), rank_(rank), q_tokens_(q_tokens), max_kv_tokens_(max_kv_tokens),
        steps_(std::move(steps)) {
    if (steps_.empty()) throw invalid_argument("ringattn: a schedule needs at least one step");
    own_ = {true, steps_.front().kv_tokens, {}};      // step 0's block, whole
    for (std::size_t t = 0; t < steps_.size(); ++t) { // every block exchanged, nothing skipped
      steps_[t].arrives = t > 0;
      steps_[t].forwarded = t + 1 < steps_.size();
      steps_[t].own_wanted = t > 0;
    }
    for (ring_step& s : steps_) {
      validate_groups(s.groups, q_tokens_, s.kv_tokens).throw_if_invalid();
      s.rows = rows_of(s.groups);
    }
    note_writes();
  }

  int ranks() const noexcept { return ranks_; }
  int rank() const noexcept { return rank_; }
  //! Where every step's block goes next, and where the next one comes from.
  int send_to() const noexcept { return (rank_ + 1) % ranks_; }
  int receive_from() const noexcept { return (rank_ - 1 + ranks_) % ranks_; }
  //! The rank whose block a step t in [0, P] holds (step P: the block after the last, rank + 1's
  //! dK/dV home exchange in the backward).
  int source_of(int t) const noexcept { return ((rank_ - t) % ranks_ + ranks_) % ranks_; }
  //! Tokens of this rank's Q shard and of the largest block that travels (the size of a ring
  //! buffer).
  std::int64_t q_tokens() const noexcept { return q_tokens_; }
  std::int64_t max_kv_tokens() const noexcept { return max_kv_tokens_; }
  //! The rows of this rank's shard that travel.
  const kv_travel& own_travel() const noexcept { return own_; }
  //! Rows of rank `r`'s block as it travels (schedules built from a plan).
  std::int64_t travel_tokens(int r) const {
    return r == rank_ ? own_.tokens : travel_tokens_.at(static_cast<std::size_t>(r));
  }
  //! Rows of the block in a step's slot: the own block's travelling rows at step 0, the block as
  //! it arrived later.
  std::int64_t held_tokens(const ring_step& step) const noexcept {
    return step.index == 0 ? own_.tokens : step.kv_tokens;
  }

  std::span<const ring_step> steps() const noexcept { return steps_; }
  const ring_step& step(int t) const { return steps_.at(static_cast<std::size_t>(t)); }
  //! Steps the ring takes: P, or fewer where no rank's queries see a block that would travel
  //! further (a window shorter than the distance the ring carries blocks).
  int step_count() const noexcept { return static_cast<int>(steps_.size()); }
  //! The step after `t`, or null after the last.
  const ring_step* next(int t) const {
    return t + 1 < step_count() ? &steps_[static_cast<std::size_t>(t + 1)] : nullptr;
  }
  //! The rank that holds this rank's own block after the last step (whose dK/dV come home from
  //! there in the backward): rank + step_count() - 1.
  int holder_of_own() const noexcept { return (rank_ + step_count() - 1) % ranks_; }

  //! Steps every rank's ring takes under `window`: one past the last step t at which some rank r
  //! sees a block of rank r - t (the same on every rank: it is a function of the plan). Searched
  //! from step P - 1 down, so a layout that needs every step costs a few block classifications.
  template <class Partitioner>
  static int steps_needed(const partition_plan<Partitioner>& plan, const position_window& window) {
    const int p = plan.ranks();
    for (int t = p - 1; t > 0; --t)
      for (int r = 0; r < p; ++r)
        if (plan.sees(r, ((r - t) % p + p) % p, window)) return t + 1;
    return 1;
  }

  //! Whether the first step's groups cover every query row (then it writes the state fresh: no
  //! reset), and whether the last step's do (then it writes the output: no finalise).
  bool first_writes() const noexcept { return first_writes_; }
  bool last_writes() const noexcept { return last_writes_; }
  //! The epilogue of step t of the device forward, given whether the output is dense (the kernels
  //! write a dense output only; otherwise the state is finalised into it). Together with
  //! `needs_reset` and `needs_finalize` it accounts for every row of the state. A ring of one step
  //! whose groups cover every row (one rank, or ranks whose peers hold nothing this rank sees)
  //! writes the output and lse directly (`plain`).
  step_epilogue forward_epilogue(int t, bool out_dense) const {
    const ring_step& s = step(t);
    if (s.groups.empty()) return step_epilogue::none;
    if (t == 0 && first_writes_)
      return step_count() == 1 && out_dense ? step_epilogue::plain : step_epilogue::fresh;
    if (t == step_count() - 1 && last_writes_ && out_dense) return step_epilogue::merge_out;
    return step_epilogue::merge;
  }
  bool needs_reset() const { return !first_writes_; }
  bool needs_finalize(bool out_dense) const { return !(last_writes_ && out_dense); }

private:
  void note_writes() {
    const bool any = q_tokens_ > 0;
    first_writes_ = any && steps_.front().rows == q_tokens_;
    last_writes_ = any && steps_.back().rows == q_tokens_;
  }

  int ranks_, rank_;
  std::int64_t q_tokens_, max_kv_tokens_;
  kv_travel own_;
  std::vector<std::int64_t> travel_tokens_; // every rank's (plan-built schedules)
  bool first_writes_ = false, last_writes_ = false;
  std::vector<ring_step> steps_;
};

} // namespace ringattn
