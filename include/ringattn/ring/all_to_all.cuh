#pragma once
//! \file
//! The plan of the all-to-all schedule (`all_to_all_heads`, ring/schedules.cuh): how the heads
//! split over the ranks, what a rank computes once it holds every shard of its heads, and the
//! layout of its workspace.
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
#include <ringattn/error.cuh>
#include <ringattn/kernel/block.cuh>
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

//! How P ranks share the heads under the all-to-all.
struct head_split {
  int ranks = 1;
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

//! A rank's plan under the all-to-all: the shards' sizes and offsets, the head split and the
//! schedule of its attention over the gathered shards.
class all_to_all_plan {
public:
  //! Throws `invalid_argument` where the heads do not split over the plan's ranks (the same on
  //! every rank: the arguments are agreed first).
  template <class Partitioner>
  all_to_all_plan(const partition_plan<Partitioner>& plan, int rank, const position_window& window,
                  const attention_arguments& args)
      : rank_(rank), heads_(head_split::of(args, plan.ranks())), args_(args),
        local_args_(heads_.local(args)),
        offsets_(plan.rank_offsets().begin(), plan.rank_offsets().end()),
        local_(gathered_schedule(plan, rank, window)) {}

  int ranks() const noexcept { return heads_.ranks; }
  int rank() const noexcept { return rank_; }
  const head_split& heads() const noexcept { return heads_; }
  //! The arguments as given, and those of this rank's attention over the gathered shards (its
  //! heads).
  const attention_arguments& arguments() const noexcept { return args_; }
  const attention_arguments& local_arguments() const noexcept { return local_args_; }
  //! Tokens of rank `r`'s shard, where it starts among the gathered shards, and all tokens.
  std::int64_t tokens_of(int r) const { return offset_of(r + 1) - offset_of(r); }
  std::int64_t offset_of(int r) const { return offsets_.at(static_cast<std::size_t>(r)); }
  std::int64_t tokens() const noexcept { return offsets_.back(); }
  //! Tokens of this rank's shard.
  std::int64_t q_tokens() const { return tokens_of(rank_); }
  std::int64_t max_tokens() const {
    std::int64_t m = 0;
    for (int r = 0; r < ranks(); ++r)
      m = std::max(m, tokens_of(r));
    return m;
  }
  //! The schedule of this rank's attention: the gathered queries (`tokens()` rows) against the
  //! gathered K/V, one step per ring step (the same on every rank: only the heads differ).
  const ring_schedule& local() const noexcept { return local_; }
  int step_count() const noexcept { return local_.step_count(); }

private:
  template <class Partitioner>
  static ring_schedule gathered_schedule(const partition_plan<Partitioner>& plan, int rank,
                                         const position_window& window) {
    const int p = plan.ranks();
    const int steps = ring_schedule::steps_needed(plan, window);
    std::vector<ring_step> all;
    for (int t = 0; t < steps; ++t) {
      ring_step step;
      step.index = t;
      step.source = -1; // every shard's source at once
      step.kv_tokens = plan.tokens();
      for (int s = 0; s < p; ++s) {
        const int source = ((s - t) % p + p) % p;
        for (block_group g : group_blocks(plan.blocks(s, source, window))) {
          g.q_begin += plan.rank_offset(s);
          for (int b = 0; b < g.count; ++b)
            g.kv[b].kv_begin += plan.rank_offset(source);
          step.groups.push_back(g);
        }
      }
      all.push_back(std::move(step));
    }
    return {p, rank, plan.tokens(), plan.tokens(), std::move(all)};
  }

  int rank_;
  head_split heads_;
  attention_arguments args_, local_args_;
  std::vector<std::int64_t> offsets_;
  ring_schedule local_;
};

//! The all-to-all's workspace, one layout for the host and device paths (every region 256-byte
//! aligned; `N` all tokens, `n` this rank's, `hq`, `hk` a rank's heads, T the element type):
//!
//! Forward:  gathered q, k, v (T) | P send slots (this rank's q, k, v of one rank's heads) |
//!           fp32 state o, sum, lse of the gathered queries | gathered output (T) |
//!           P return slots (the output of one rank's heads) | lse pieces going home
//! Backward: gathered q, k, v, out, dout (T) | gathered lse, D | P send slots (q, k, v, out,
//!           dout) | lse pieces arriving | fp32 dq, dk, dv of the gathered tokens | dq (and,
//!           without replicas, dk and dv) in T | P return slots (dq, dk, dv of one rank's heads)
//!
//! With replicated kv heads (P > kv_heads) dk and dv go home in fp32 and the owner adds the
//! replicas' shares in rank order; otherwise in T. One rank takes the ring's path and at least
//! the ring's workspace.
class all_to_all_workspace {
public:
  all_to_all_workspace(const all_to_all_plan& p, std::size_t element_bytes)
      : tokens_(p.tokens()), n_(p.q_tokens()), most_(p.max_tokens()), ranks_(p.ranks()),
        hq_(p.heads().q_per_rank), hk_(p.heads().kv_per_rank), d_(p.local_arguments().qk_dim()),
        dv_(p.local_arguments().v_dim()), replicated_(p.heads().replicas > 1), e_(element_bytes) {
    const std::size_t n = static_cast<std::size_t>(n_), all = static_cast<std::size_t>(tokens_);
    const std::size_t rows = all * hq_, lse = rows * sizeof(float);
    // forward
    bump f;
    f_.q = f.take(q_bytes(all));
    f_.k = f.take(k_bytes(all));
    f_.v = f.take(v_bytes(all));
    in_slot_ = align(q_bytes(n)) + align(k_bytes(n)) + align(v_bytes(n));
    f_.send = f.take(in_slot_ * ranks_);
    f_.o = f.take(rows * dv_ * sizeof(float));
    f_.sum = f.take(lse);
    f_.lse = f.take(lse);
    f_.out = f.take(o_bytes(all));
    f_.back = f.take(align(o_bytes(n)) * ranks_);
    f_.lse_out = f.take(lse);
    forward_bytes_ = f.at;
    // backward
    bump b;
    b_.q = b.take(q_bytes(all));
    b_.k = b.take(k_bytes(all));
    b_.v = b.take(v_bytes(all));
    b_.out = b.take(o_bytes(all));
    b_.dout = b.take(o_bytes(all));
    b_.lse = b.take(lse);
    b_.delta = b.take(lse);
    grad_in_slot_ = in_slot_ + 2 * align(o_bytes(n));
    b_.send = b.take(grad_in_slot_ * ranks_);
    b_.lse_in = b.take(lse);
    b_.dq = b.take(rows * d_ * sizeof(float));
    b_.dk = b.take(all * hk_ * d_ * sizeof(float));
    b_.dv = b.take(all * hk_ * dv_ * sizeof(float));
    b_.dq_t = b.take(q_bytes(all));
    b_.dkv_t = b.take(replicated_ ? 0 : k_bytes(all) + v_bytes(all));
    grad_out_slot_ = align(q_bytes(n)) + align(grad_k_bytes(n)) + align(grad_v_bytes(n));
    b_.back = b.take(grad_out_slot_ * ranks_);
    backward_bytes_ = b.at;
    if (ranks_ == 1) { // one rank runs the ring's path (one block, nothing exchanged)
      const ring_workspace ring(n_, n_, p.arguments(), element_bytes);
      forward_bytes_ = std::max(forward_bytes_, ring.forward_bytes());
      backward_bytes_ = std::max(backward_bytes_, ring.device_backward_bytes());
    }
  }

  static constexpr std::size_t align(std::size_t n) { return (n + 255) / 256 * 256; }

  std::size_t forward_bytes() const noexcept { return forward_bytes_; }
  std::size_t backward_bytes() const noexcept { return backward_bytes_; }
  std::size_t host_backward_bytes() const noexcept { return backward_bytes_; }
  std::size_t device_backward_bytes() const noexcept { return backward_bytes_; }

  //! Bytes of `tokens` rows of a rank's heads of q, k, v, out (T) and of dk, dv as they go home
  //! (T, or fp32 with replicated kv heads).
  std::size_t q_bytes(std::size_t tokens) const { return tokens * hq_ * d_ * e_; }
  std::size_t k_bytes(std::size_t tokens) const { return tokens * hk_ * d_ * e_; }
  std::size_t v_bytes(std::size_t tokens) const { return tokens * hk_ * dv_ * e_; }
  std::size_t o_bytes(std::size_t tokens) const { return tokens * hq_ * dv_ * e_; }
  std::size_t lse_bytes(std::size_t tokens) const { return tokens * hq_ * sizeof(float); }
  std::size_t grad_k_bytes(std::size_t tokens) const {
    return replicated_ ? tokens * hk_ * d_ * sizeof(float) : k_bytes(tokens);
  }
  std::size_t grad_v_bytes(std::size_t tokens) const {
    return replicated_ ? tokens * hk_ * dv_ * sizeof(float) : v_bytes(tokens);
  }
  //! The largest message a forward (a backward) sends: one tensor of one shard's heads.
  std::size_t largest_message(bool backward) const {
    const auto n = static_cast<std::size_t>(most_);
    std::size_t m = std::max({q_bytes(n), k_bytes(n), v_bytes(n), o_bytes(n), lse_bytes(n)});
    if (backward) m = std::max({m, grad_k_bytes(n), grad_v_bytes(n)});
    return m;
  }
  bool replicated() const noexcept { return replicated_; }

  // ---- regions (base: the workspace's start)
  struct forward_regions {
    std::size_t q, k, v, send, o, sum, lse, out, back, lse_out;
  };
  struct backward_regions {
    std::size_t q, k, v, out, dout, lse, delta, send, lse_in, dq, dk, dv, dq_t, dkv_t, back;
  };
  const forward_regions& forward() const noexcept { return f_; }
  const backward_regions& backward() const noexcept { return b_; }
  //! Send slot `to` of the forward (its q, k, v one after another, each aligned) and of the
  //! backward (q, k, v, out, dout); return slot `from` of either.
  std::size_t send_slot(int to, bool backward) const {
    return (backward ? b_.send : f_.send) +
           static_cast<std::size_t>(to) * (backward ? grad_in_slot_ : in_slot_);
  }
  std::size_t return_slot(int from, bool backward) const {
    return (backward ? b_.back : f_.back) +
           static_cast<std::size_t>(from) * (backward ? grad_out_slot_ : align(o_bytes(n_u())));
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
  std::size_t n_u() const { return static_cast<std::size_t>(n_); }

  std::int64_t tokens_, n_, most_;
  std::size_t ranks_, hq_, hk_, d_, dv_;
  bool replicated_;
  std::size_t e_;
  std::size_t in_slot_ = 0, grad_in_slot_ = 0, grad_out_slot_ = 0;
  forward_regions f_{};
  backward_regions b_{};
  std::size_t forward_bytes_ = 0, backward_bytes_ = 0;
};

} // namespace ringattn
