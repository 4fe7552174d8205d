#pragma once
//! \file
//! The plan of the all-to-all schedule (`all_to_all_heads` and its hybrid
//! `all_to_all_heads_x_all_gather<A>`, ring/schedules.cuh): how the heads split over the ranks,
//! what a rank computes once it holds every shard of its heads, and the layout of its workspace.
//! The description below is the plain all-to-all (one group of P ranks); in the hybrid the heads
//! split over a group of A ranks, the queries are the group's shards and K/V every rank's.
//!
//! An all-to-all turns a sequence shard of every head into every shard of a subset of heads: rank
//! r ends up with `q_heads / P` query heads (those from `r * q_heads / P` on) and the kv heads
//! they read, for all tokens, the shards one after another in rank order (`rank_offset`, the
//! layout of an all-gather). With P <= kv_heads every rank takes `kv_heads / P` kv heads; with
//! P > kv_heads every kv head goes to the `P / kv_heads` ranks whose query heads read it (each
//! rank takes one), so K/V then cost `P / kv_heads` times what one copy of them would. The split
//! needs P to divide q_heads, and P and kv_heads to divide one another; otherwise the plan says
//! so.
//!
//! Its attention is then every rank's ring at once: step t is one block-kernel call whose groups
//! are the union, over the shards s, of rank s's ring step t (its queries against the shard of
//! rank (s - t) mod P), the query rows moved by `rank_offset(s)` and the key rows by the offset
//! of the source shard. Each shard meets one source per step, so no two groups share query rows;
//! the state merges across the steps as on the ring, and no token is reordered.

#include <ringattn/arguments.cuh>
#include <ringattn/block/device/block.cuh>
#include <ringattn/error.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/ring/schedule.cuh>
#include <ringattn/ring/workspace.cuh>
#include <ringattn/tensor.cuh>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace ringattn {

//! How the P ranks of an all-to-all (the A of a hybrid's group) share the heads.
struct head_split {
  int ranks = 1;       //!< P (A)
  int q_per_rank = 0;  //!< query heads a rank computes: q_heads / P
  int kv_per_rank = 0; //!< kv heads it holds: kv_heads / P, or 1 when P > kv_heads
  int replicas = 1;    //!< ranks holding each kv head: P / kv_heads when P > kv_heads, else 1

  //! Why `args` cannot split over `ranks`, or ok.
  static validation check(const attention_arguments& args, int ranks) {
    validation r = validation::ok();
    r.require(args.q_heads % ranks == 0,
              "the all-to-all schedule gives every rank q_heads / P "
              "query heads, but ",
              args.q_heads, " q heads do not split over ", ranks,
              " ranks (use a P that divides q_heads, or the ring)");
    r.require(args.kv_heads % ranks == 0 || ranks % args.kv_heads == 0,
              "the all-to-all schedule gives every rank kv_heads / P kv heads, or one kv head "
              "shared by P / kv_heads ranks, but neither of ",
              args.kv_heads, " kv heads and ", ranks, " ranks divides the other");
    return r;
  }
  //! The split of `args` over `ranks`; throws `invalid_argument` where `check` refuses it.
  static head_split of(const attention_arguments& args, int ranks) {
    check(args, ranks).throw_if_invalid();
    head_split h;
    h.ranks = ranks;
    h.q_per_rank = args.q_heads / ranks;
    h.replicas = ranks > args.kv_heads ? ranks / args.kv_heads : 1;
    h.kv_per_rank = ranks > args.kv_heads ? 1 : args.kv_heads / ranks;
    return h;
  }
  //! The first query head and the first kv head of rank `r`.
  int q_begin(int r) const noexcept { return r * q_per_rank; }
  int kv_begin(int r) const noexcept { return replicas > 1 ? r / replicas : r * kv_per_rank; }
  //! The arguments of a rank's local attention (its heads; the widths, scale and window as given).
  attention_arguments local(attention_arguments args) const {
    args.q_heads = q_per_rank;
    args.kv_heads = kv_per_rank;
    return args;
  }
};

//! A rank's plan under the all-to-all: its group (`group_size` consecutive ranks trade heads for
//! tokens; the P / group_size groups gather each other's K/V), the shards' sizes and offsets, the
//! head split and the schedule of its attention over the gathered shards.
class all_to_all_plan {
public:
  //! `group_size` 0: every rank in one group. Throws `invalid_argument` where the ranks do not
  //! form groups of that size or the heads do not split over a group (the same on every rank: the
  //! arguments are agreed first).
  template <class Partitioner>
  all_to_all_plan(const partition_plan<Partitioner>& plan, int rank, const position_window& window,
                  const attention_arguments& args, int group_size = 0)
      : rank_(rank), ranks_(plan.ranks()), group_(checked_group(plan.ranks(), group_size)),
        heads_(head_split::of(args, group_)), args_(args), local_args_(heads_.local(args)),
        offsets_(plan.rank_offsets().begin(), plan.rank_offsets().end()),
        local_(gathered_schedule(plan, rank, window)) {}

  int ranks() const noexcept { return ranks_; }
  int rank() const noexcept { return rank_; }
  //! Ranks per group, this rank's group's first rank and this rank's place in it (its head class).
  int group_size() const noexcept { return group_; }
  int group_first() const noexcept { return rank_ / group_ * group_; }
  int head_class() const noexcept { return rank_ % group_; }
  //! The head class of rank `r`, and whether `r` is in this rank's group.
  int class_of(int r) const noexcept { return r % group_; }
  bool in_group(int r) const noexcept { return r / group_ == rank_ / group_; }
  const head_split& heads() const noexcept { return heads_; }
  //! The arguments as given, and those of this rank's attention over the gathered shards (its
  //! heads).
  const attention_arguments& arguments() const noexcept { return args_; }
  const attention_arguments& local_arguments() const noexcept { return local_args_; }
  //! Tokens of rank `r`'s shard and where it starts among all shards (rank order): the rows of
  //! the gathered K/V.
  std::int64_t tokens_of(int r) const { return offset_of(r + 1) - offset_of(r); }
  std::int64_t offset_of(int r) const { return offsets_.at(static_cast<std::size_t>(r)); }
  std::int64_t tokens() const noexcept { return offsets_.back(); }
  //! Where group member `r`'s shard starts among the group's shards (the rows of the gathered
  //! queries), and the group's tokens.
  std::int64_t group_offset_of(int r) const { return offset_of(r) - offset_of(group_first()); }
  std::int64_t group_tokens() const {
    return offset_of(group_first() + group_) - offset_of(group_first());
  }
  //! Tokens of this rank's shard, and of the largest.
  std::int64_t q_tokens() const { return tokens_of(rank_); }
  std::int64_t max_tokens() const {
    std::int64_t m = 0;
    for (int r = 0; r < ranks(); ++r)
      m = std::max(m, tokens_of(r));
    return m;
  }
  //! Ranks whose partial dK/dV of one kv head add up: every rank, of any group, whose class
  //! holds that head (1 where nothing is replicated and there is one group).
  int kv_sharers() const noexcept { return ranks_ / group_ * heads_.replicas; }
  //! The schedule of this rank's attention: the group's gathered queries (`group_tokens()` rows)
  //! against every shard's K/V, one step per ring step (the same in every group member: only the
  //! heads differ).
  const ring_schedule& local() const noexcept { return local_; }
  int step_count() const noexcept { return local_.step_count(); }

private:
  static int checked_group(int ranks, int group_size) {
    const int a = group_size == 0 ? ranks : group_size;
    validation v = validation::ok();
    v.require(a > 0 && ranks % a == 0, "the hybrid schedule splits the ", ranks,
              " ranks into groups of ", a, " consecutive ranks, but ", a, " does not divide ",
              ranks, " (use a group size that divides the ranks)");
    v.throw_if_invalid();
    return a;
  }
  template <class Partitioner>
  ring_schedule gathered_schedule(const partition_plan<Partitioner>& plan, int rank,
                                  const position_window& window) const {
    const int p = plan.ranks(), first = rank / group_ * group_;
    const int steps = ring_schedule::steps_needed(plan, window);
    std::vector<ring_step> all;
    for (int t = 0; t < steps; ++t) {
      ring_step step;
      step.index = t;
      step.source = -1; // every shard's source at once
      step.kv_tokens = plan.tokens();
      for (int s = first; s < first + group_; ++s) {
        const int source = ((s - t) % p + p) % p;
        for (block_group g : group_blocks(plan.blocks(s, source, window))) {
          g.q_begin += plan.rank_offset(s) - plan.rank_offset(first);
          for (int b = 0; b < g.count; ++b)
            g.kv[b].kv_begin += plan.rank_offset(source);
          step.groups.push_back(g);
        }
      }
      all.push_back(std::move(step));
    }
    const std::int64_t queries = plan.rank_offset(first + group_) - plan.rank_offset(first);
    return {p, rank, queries, plan.tokens(), std::move(all)};
  }

  int rank_, ranks_, group_;
  head_split heads_;
  attention_arguments args_, local_args_;
  std::vector<std::int64_t> offsets_;
  ring_schedule local_;
};

//! The all-to-all's workspace, one layout for the host and device paths (every region and slot
//! 256-byte aligned; `G` the group's tokens, `N` all tokens, `n` this rank's, `m` the largest
//! shard's, `hq`, `hk` a rank's heads, A ranks per group, P ranks, T the element type).
//!
//! Each exchange carries one message per peer, its pieces back to back (no padding between
//! them, so the bytes on the wire are the pieces' own):
//! - forward in: k, v of this rank's tokens (the peer's head class), then q where the peer is in
//!   this rank's group;
//! - forward out: the peer's output rows and lse (group peers);
//! - backward in: k, v, then q, out, dout and the lse where the peer is in the group;
//! - backward out: the peer's dk, dv rows (T, or fp32 shares where ranks share kv heads), then
//!   its dq rows where the peer is in the group.
//!
//! Forward:  gathered q (G rows), k, v (N rows) in T | fp32 state o, sum, lse of the gathered
//!           queries | gathered output (T) | either A send slots (one message per head class)
//!           and P - 1 landing slots (one per peer), or, once the attention has run, A output
//!           send slots and A landing slots
//! Backward: gathered q, out, dout (G), k, v (N) | gathered lse, D | fp32 dq (G), dk, dv (N) |
//!           either A send slots and P - 1 landing slots, or P gradient send slots (one per
//!           rank) and P - 1 landing slots
//!
//! A rank's own message of the in-exchange stays in its send slot, from where it is copied into
//! the gathered buffers like the peers'. One rank takes the ring's path and at least the ring's
//! workspace.
class all_to_all_workspace {
public:
  all_to_all_workspace(const all_to_all_plan& p, element_format format)
      : rank_(p.rank()), ranks_(p.ranks()), n_(p.q_tokens()), most_(p.max_tokens()),
        hq_(p.heads().q_per_rank), hk_(p.heads().kv_per_rank), d_(p.local_arguments().qk_dim()),
        dv_(p.local_arguments().v_dim()), shared_(p.kv_sharers() > 1), e_(format.bytes) {
    if (format.scale_bytes_per_kv_head != 0)
      throw std::logic_error("ringattn: the all-to-all schedules' messages carry no block scales");
    const auto n = static_cast<std::size_t>(n_), m = static_cast<std::size_t>(most_);
    const auto all = static_cast<std::size_t>(p.tokens());
    const auto group = static_cast<std::size_t>(p.group_tokens());
    const auto classes = static_cast<std::size_t>(p.group_size());
    const auto ranks = static_cast<std::size_t>(p.ranks());
    const std::size_t lse = group * hq_ * sizeof(float);
    classes_ = classes;
    // forward
    bump f;
    f_.q = f.take(q_bytes(group));
    f_.k = f.take(k_bytes(all));
    f_.v = f.take(v_bytes(all));
    f_.o = f.take(group * hq_ * dv_ * sizeof(float));
    f_.sum = f.take(lse);
    f_.lse = f.take(lse);
    f_.out = f.take(o_bytes(group));
    f_.phase = f.at;
    send_[0] = align(in_bytes(n, true));
    land_[0] = align(in_bytes(m, true));
    back_send_[0] = align(out_bytes(m));
    back_land_[0] = align(out_bytes(n));
    forward_bytes_ = f.at + std::max(classes * send_[0] + (ranks - 1) * land_[0],
                                     classes * (back_send_[0] + back_land_[0]));
    // backward
    bump b;
    b_.q = b.take(q_bytes(group));
    b_.k = b.take(k_bytes(all));
    b_.v = b.take(v_bytes(all));
    b_.out = b.take(o_bytes(group));
    b_.dout = b.take(o_bytes(group));
    b_.lse = b.take(lse);
    b_.delta = b.take(lse);
    b_.dq = b.take(group * hq_ * d_ * sizeof(float));
    b_.dk = b.take(all * hk_ * d_ * sizeof(float));
    b_.dv = b.take(all * hk_ * dv_ * sizeof(float));
    b_.phase = b.at;
    send_[1] = align(grad_in_bytes(n, true));
    land_[1] = align(grad_in_bytes(m, true));
    back_send_[1] = align(grad_out_bytes(m, true));
    back_land_[1] = align(grad_out_bytes(n, true));
    backward_bytes_ = b.at + std::max(classes * send_[1] + (ranks - 1) * land_[1],
                                      ranks * back_send_[1] + (ranks - 1) * back_land_[1]);
    if (ranks == 1) { // one rank runs the ring's path (one block, nothing exchanged)
      const ring_workspace ring(n_, n_, p.arguments(), format);
      forward_bytes_ = std::max(forward_bytes_, ring.forward_bytes());
      backward_bytes_ = std::max(backward_bytes_, ring.device_backward_bytes());
    }
  }

  static constexpr std::size_t align(std::size_t n) { return (n + 255) / 256 * 256; }

  std::size_t forward_bytes() const noexcept { return forward_bytes_; }
  std::size_t host_backward_bytes() const noexcept { return backward_bytes_; }
  std::size_t device_backward_bytes() const noexcept { return backward_bytes_; }

  //! Bytes of `tokens` rows of a rank's heads of q, k, v, out (T), of its lse, and of dk, dv as
  //! they go home (T, or fp32 where ranks share kv heads).
  std::size_t q_bytes(std::size_t tokens) const { return tokens * hq_ * d_ * e_; }
  std::size_t k_bytes(std::size_t tokens) const { return tokens * hk_ * d_ * e_; }
  std::size_t v_bytes(std::size_t tokens) const { return tokens * hk_ * dv_ * e_; }
  std::size_t o_bytes(std::size_t tokens) const { return tokens * hq_ * dv_ * e_; }
  std::size_t lse_bytes(std::size_t tokens) const { return tokens * hq_ * sizeof(float); }
  std::size_t grad_k_bytes(std::size_t tokens) const {
    return shared_ ? tokens * hk_ * d_ * sizeof(float) : k_bytes(tokens);
  }
  std::size_t grad_v_bytes(std::size_t tokens) const {
    return shared_ ? tokens * hk_ * dv_ * sizeof(float) : v_bytes(tokens);
  }
  //! The messages (see the class notes) carrying a shard of `tokens` rows, `group`: between
  //! ranks of one group.
  std::size_t in_bytes(std::size_t tokens, bool group) const {
    return k_bytes(tokens) + v_bytes(tokens) + (group ? q_bytes(tokens) : 0);
  }
  std::size_t out_bytes(std::size_t tokens) const { return o_bytes(tokens) + lse_bytes(tokens); }
  std::size_t grad_in_bytes(std::size_t tokens, bool group) const {
    return in_bytes(tokens, group) +
           (group ? 2 * o_bytes(tokens) + lse_bytes(tokens) : std::size_t{0});
  }
  std::size_t grad_out_bytes(std::size_t tokens, bool group) const {
    return grad_k_bytes(tokens) + grad_v_bytes(tokens) + (group ? q_bytes(tokens) : 0);
  }
  //! The largest message a forward (a backward) sends.
  std::size_t largest_message(bool backward) const {
    const auto m = static_cast<std::size_t>(most_);
    std::size_t x = std::max(in_bytes(m, true), out_bytes(m));
    if (backward) x = std::max({x, grad_in_bytes(m, true), grad_out_bytes(m, true)});
    return x;
  }
  //! Whether dk and dv go home as fp32 shares.
  bool shared() const noexcept { return shared_; }

  // ---- regions (offsets from the workspace's start)
  struct forward_regions {
    std::size_t q, k, v, o, sum, lse, out, phase;
  };
  struct backward_regions {
    std::size_t q, k, v, out, dout, lse, delta, dq, dk, dv, phase;
  };
  const forward_regions& forward() const noexcept { return f_; }
  const backward_regions& backward() const noexcept { return b_; }
  //! The in-exchange's slots: the message to head class `c`, and where the one from rank `from`
  //! (not this rank) lands.
  std::size_t send_slot(int c, bool backward) const {
    return phase(backward) + static_cast<std::size_t>(c) * send_[backward];
  }
  std::size_t land_slot(int from, bool backward) const {
    return phase(backward) + classes() * send_[backward] + peer_index(from) * land_[backward];
  }
  //! The out-exchange's slots: the message to head class `i` (forward) or rank `i` (backward),
  //! and where the one from head class `i` (forward) or rank `i` (backward, not this rank)
  //! lands.
  std::size_t back_send_slot(int i, bool backward) const {
    return phase(backward) + static_cast<std::size_t>(i) * back_send_[backward];
  }
  std::size_t back_land_slot(int i, bool backward) const {
    const std::size_t senders = backward ? static_cast<std::size_t>(ranks_) : classes();
    return phase(backward) + senders * back_send_[backward] +
           (backward ? peer_index(i) : static_cast<std::size_t>(i)) * back_land_[backward];
  }

private:
  struct bump {
    std::size_t at = 0;
    std::size_t take(std::size_t bytes) {
      const std::size_t r = at;
      at += align(bytes);
      return r;
    }
  };
  std::size_t phase(bool backward) const { return backward ? b_.phase : f_.phase; }
  std::size_t classes() const noexcept { return classes_; }
  // Rank `from`'s place among this rank's peers (0 for the next rank on).
  std::size_t peer_index(int from) const {
    return static_cast<std::size_t>((from - rank_ + ranks_) % ranks_ - 1);
  }

  int rank_, ranks_;
  std::int64_t n_, most_;
  std::size_t hq_, hk_, d_, dv_;
  bool shared_;
  std::size_t e_;
  std::size_t classes_ = 0;
  std::size_t send_[2] = {}, land_[2] = {}, back_send_[2] = {}, back_land_[2] = {};
  forward_regions f_{};
  backward_regions b_{};
  std::size_t forward_bytes_ = 0, backward_bytes_ = 0;
};

} // namespace ringattn
