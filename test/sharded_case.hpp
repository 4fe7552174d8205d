#pragma once
// A packed batch sharded by a partitioner: every rank's Q shard attends to every rank's K/V shard
// through the plan's block groups — the computation of a ring without its communication.
#include "common.hpp"

#include <ringattn/kernel/block.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/partition/scatter.cuh>
#include <ringattn/reference/attention.cuh>

#include <vector>

namespace ringattn::test {

template <class P, class T>
struct sharded_case {
  partition_plan<P> plan;
  attention_arguments args;
  mask_kind mask;
  std::vector<T> q, k, v;                 // full tensors
  std::vector<std::vector<T>> qs, ks, vs; // per-rank shards

  sharded_case(std::vector<std::int32_t> cu, int ranks, attention_arguments a, mask_kind m,
               std::mt19937_64& rng)
      : plan(cu, ranks), args(a), mask(m) {
    const auto n = static_cast<std::size_t>(plan.tokens());
    q = random_buffer<T>(n * a.q_heads * a.head_dim, rng);
    k = random_buffer<T>(n * a.kv_heads * a.head_dim, rng);
    v = random_buffer<T>(n * a.kv_heads * a.head_dim, rng);
    for (int r = 0; r < ranks; ++r) {
      qs.push_back(shard(q, r, a.q_heads));
      ks.push_back(shard(k, r, a.kv_heads));
      vs.push_back(shard(v, r, a.kv_heads));
    }
  }
  std::vector<T> shard(const std::vector<T>& full, int r, int heads) const {
    std::vector<T> out(static_cast<std::size_t>(plan.local_tokens(r) * heads * args.head_dim),
                       poison<T>());
    scatter(plan, r, thd_view<const T>(full.data(), plan.tokens(), heads, args.head_dim),
            thd_view<T>(out.data(), plan.local_tokens(r), heads, args.head_dim));
    return out;
  }
  //! Block groups of rank r's queries against rank src's keys.
  std::vector<block_group> groups(int r, int src) const {
    return group_blocks(plan.blocks(r, src, position_window::of(mask)));
  }
  reference::forward_result oracle() const {
    const thd_view<const T> qv(q.data(), plan.tokens(), args.q_heads, args.head_dim);
    const thd_view<const T> kv(k.data(), plan.tokens(), args.kv_heads, args.head_dim);
    const thd_view<const T> vv(v.data(), plan.tokens(), args.kv_heads, args.head_dim);
    return reference::attention_forward(qv, kv, vv, plan.cu_seqlens(), args, mask);
  }
};

} // namespace ringattn::test
