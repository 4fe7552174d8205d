#pragma once
// A packed batch sharded by a partitioner: every rank's Q shard attends to every rank's K/V shard
// through the plan's block groups — the computation of a ring without its communication.
#include "common.hpp"

#include <ringattn/block/device/block.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/partition/scatter.cuh>
#include <ringattn/reference/attention.cuh>

#include <cmath>
#include <cstddef>
#include <span>
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
    q = random_buffer<T>(n * a.q_heads * a.qk_dim(), rng);
    k = random_buffer<T>(n * a.kv_heads * a.qk_dim(), rng);
    v = random_buffer<T>(n * a.kv_heads * a.v_dim(), rng);
    for (int r = 0; r < ranks; ++r) {
      qs.push_back(shard(q, r, a.q_heads));
      ks.push_back(shard(k, r, a.kv_heads));
      vs.push_back(shard(v, r, a.kv_heads, a.v_dim()));
    }
  }
  //! Rank r's shard of a full `[tokens, heads, width]` tensor (width 0: head_dim).
  std::vector<T> shard(const std::vector<T>& full, int r, int heads, int width = 0) const {
    const int d = width != 0 ? width : args.head_dim;
    std::vector<T> out(static_cast<std::size_t>(plan.local_tokens(r) * heads * d), poison<T>());
    scatter(plan, r, thd_view<const T>(full.data(), plan.tokens(), heads, d),
            thd_view<T>(out.data(), plan.local_tokens(r), heads, d));
    return out;
  }
  //! Block groups of rank r's queries against rank src's keys.
  std::vector<block_group> groups(int r, int src) const {
    return group_blocks(plan.blocks(r, src, args.window(mask)));
  }
  //! One rank's ring output: out `[local, q_heads, head_dim_v]`, lse `[q_heads, local]`.
  struct rank_output {
    std::vector<T> out;
    std::vector<float> lse;
  };

  //! Runs `attn.forward_host` on rank r's shards into poisoned outputs with an aligned workspace
  //! (`null_lse` passes a null LSE pointer, for validation tests; `max_logit`, where given, is
  //! poisoned, sized to q_heads and asked for).
  template <class Ring>
  rank_output forward_rank(Ring& attn, int r, bool null_lse = false,
                           std::vector<float>* max_logit = nullptr) const {
    const std::int64_t n = plan.local_tokens(r);
    const int qh = args.q_heads, kvh = args.kv_heads, d = args.qk_dim(), dv = args.v_dim();
    rank_output o{std::vector<T>(static_cast<std::size_t>(n * qh * dv), poison<T>()),
                  std::vector<float>(static_cast<std::size_t>(n * qh), -7.0f)};
    const std::size_t bytes = attn.template host_workspace_bytes<T>();
    std::vector<std::byte> ws(bytes + 16);
    const std::size_t pad = (16 - reinterpret_cast<std::uintptr_t>(ws.data()) % 16) % 16;
    const auto& q = qs[static_cast<std::size_t>(r)];
    const auto& k = ks[static_cast<std::size_t>(r)];
    const auto& v = vs[static_cast<std::size_t>(r)];
    if (max_logit) max_logit->assign(static_cast<std::size_t>(qh), 7.0f);
    attn.forward_host(thd_view<const T>(q.data(), n, qh, d), thd_view<const T>(k.data(), n, kvh, d),
                      thd_view<const T>(v.data(), n, kvh, dv), thd_view<T>(o.out.data(), n, qh, dv),
                      null_lse ? nullptr : o.lse.data(), max_logit ? max_logit->data() : nullptr,
                      std::span<std::byte>(ws).subspan(pad, bytes));
    return o;
  }

  //! The largest error of a rank's max logits against the oracle's, relative above 1 in
  //! magnitude; infinite where a head's value is not what the oracle's non-finite one asks for:
  //! NaN for NaN, not finite for +inf (the kernels' row sum is NaN there), -inf for -inf.
  static double max_logit_error(const std::vector<float>& got, const std::vector<double>& want) {
    double e = got.size() == want.size() ? 0.0 : HUGE_VAL;
    for (std::size_t h = 0; h < got.size() && h < want.size(); ++h) {
      const double g = got[h], w = want[h];
      bool ok = true;
      if (std::isnan(w))
        ok = std::isnan(g);
      else if (std::isinf(w))
        ok = w > 0 ? !std::isfinite(g) : g == w;
      else if (!std::isfinite(g))
        ok = false;
      else
        e = std::max(e, std::abs(g - w) / std::max(1.0, std::abs(w)));
      if (!ok) e = HUGE_VAL;
    }
    return e;
  }

  //! Rank r's part of the error against the oracle: sum of squared output differences, sum of
  //! squared oracle outputs (their ratio over all ranks, square-rooted, is the relative L2 error
  //! of the whole output) and the largest |lse - oracle|.
  struct error_parts {
    double num = 0.0, den = 0.0, lse = 0.0;
  };
  error_parts rank_error(int r, const rank_output& o, const reference::forward_result& ref) const {
    error_parts e;
    const std::int64_t n = plan.local_tokens(r);
    const int qh = args.q_heads, d = args.v_dim();
    for (std::int64_t l = 0; l < n; ++l) {
      const std::int64_t g = plan.global_token(r, l);
      for (int h = 0; h < qh; ++h) {
        e.lse = std::max(
            e.lse, std::abs(double(o.lse[static_cast<std::size_t>(h * n + l)]) - ref.lse_at(h, g)));
        for (int x = 0; x < d; ++x) {
          const double got = to_float(o.out[static_cast<std::size_t>((l * qh + h) * d + x)]);
          const double want = ref.out(g, h, x);
          e.num += (got - want) * (got - want);
          e.den += want * want;
        }
      }
    }
    return e;
  }

  reference::forward_result oracle() const {
    const thd_view<const T> qv(q.data(), plan.tokens(), args.q_heads, args.head_dim);
    const thd_view<const T> kv(k.data(), plan.tokens(), args.kv_heads, args.head_dim);
    const thd_view<const T> vv(v.data(), plan.tokens(), args.kv_heads, args.v_dim());
    return reference::attention_forward(qv, kv, vv, plan.cu_seqlens(), args, mask);
  }
};

} // namespace ringattn::test
