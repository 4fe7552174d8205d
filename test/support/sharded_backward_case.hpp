#pragma once
// A sharded batch with an output gradient: each rank's backward through `ring_attention` from its
// own forward's output and LSE, and the error of every rank's dq, dk, dv against the float64
// oracle's backward of the gathered batch.
#include "sharded_case.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

namespace ringattn::test {

template <class P, class T>
struct sharded_backward_case : sharded_case<P, T> {
  std::vector<T> dout;               // full
  std::vector<std::vector<T>> douts; // per-rank shards

  sharded_backward_case(std::vector<std::int32_t> cu, int ranks, attention_arguments a, mask_kind m,
                        std::mt19937_64& rng)
      : sharded_case<P, T>(std::move(cu), ranks, a, m, rng) {
    const auto n = static_cast<std::size_t>(this->plan.tokens());
    dout = random_buffer<T>(n * a.q_heads * a.v_dim(), rng);
    for (int r = 0; r < ranks; ++r)
      douts.push_back(this->shard(dout, r, a.q_heads, a.v_dim()));
  }

  struct rank_grads {
    std::vector<T> dq, dk, dv;
  };

  //! Rank r's backward into poisoned gradients, from `fwd` (its forward's out and lse).
  template <class Ring>
  rank_grads backward_rank(Ring& attn, int r,
                           const typename sharded_case<P, T>::rank_output& fwd) const {
    const std::int64_t n = this->plan.local_tokens(r);
    const int qh = this->args.q_heads, kvh = this->args.kv_heads, d = this->args.qk_dim(),
              dv = this->args.v_dim();
    const auto at = static_cast<std::size_t>(r);
    rank_grads g{std::vector<T>(static_cast<std::size_t>(n * qh * d), poison<T>()),
                 std::vector<T>(static_cast<std::size_t>(n * kvh * d), poison<T>()),
                 std::vector<T>(static_cast<std::size_t>(n * kvh * dv), poison<T>())};
    const std::size_t bytes = attn.template host_backward_workspace_bytes<T>();
    std::vector<std::byte> ws(bytes + 16);
    const std::size_t pad = (16 - reinterpret_cast<std::uintptr_t>(ws.data()) % 16) % 16;
    attn.backward_host(thd_view<const T>(this->qs[at].data(), n, qh, d),
                       thd_view<const T>(this->ks[at].data(), n, kvh, d),
                       thd_view<const T>(this->vs[at].data(), n, kvh, dv),
                       thd_view<const T>(fwd.out.data(), n, qh, dv), fwd.lse.data(),
                       thd_view<const T>(douts[at].data(), n, qh, dv),
                       thd_view<T>(g.dq.data(), n, qh, d), thd_view<T>(g.dk.data(), n, kvh, d),
                       thd_view<T>(g.dv.data(), n, kvh, dv),
                       std::span<std::byte>(ws).subspan(pad, bytes));
    return g;
  }

  reference::backward_result oracle_backward() const {
    const auto tokens = this->plan.tokens();
    const attention_arguments& a = this->args;
    return reference::attention_backward(
        thd_view<const T>(this->q.data(), tokens, a.q_heads, a.head_dim),
        thd_view<const T>(this->k.data(), tokens, a.kv_heads, a.head_dim),
        thd_view<const T>(this->v.data(), tokens, a.kv_heads, a.v_dim()),
        thd_view<const T>(dout.data(), tokens, a.q_heads, a.v_dim()), this->plan.cu_seqlens(), a,
        this->mask);
  }

  //! Rank r's squared error and squared oracle norm for dq, dk, dv (index 0, 1, 2).
  struct grad_parts {
    std::array<double, 3> num{}, den{};
  };
  grad_parts rank_grad_error(int r, const rank_grads& g,
                             const reference::backward_result& ref) const {
    grad_parts e;
    const std::int64_t n = this->plan.local_tokens(r);
    auto add = [&](int which, const std::vector<T>& got, const reference::tensor& want) {
      for (std::int64_t l = 0; l < n; ++l) {
        const std::int64_t t = this->plan.global_token(r, l);
        for (int h = 0; h < want.heads; ++h)
          for (int x = 0; x < want.dim; ++x) {
            const double a =
                to_float(got[static_cast<std::size_t>((l * want.heads + h) * want.dim + x)]);
            const double b = want(t, h, x);
            e.num[static_cast<std::size_t>(which)] += (a - b) * (a - b);
            e.den[static_cast<std::size_t>(which)] += b * b;
          }
      }
    };
    add(0, g.dq, ref.dq);
    add(1, g.dk, ref.dk);
    add(2, g.dv, ref.dv);
    return e;
  }
};

//! A ring's errors over all ranks: the relative L2 error of the whole output and of each of dq,
//! dk, dv, and the largest lse error.
struct ring_errors {
  double out = 0.0, lse = 0.0;
  std::array<double, 3> grad{};
};
//! Every rank's error parts (`sharded_case::rank_error`, `rank_grad_error`) summed.
template <class Parts, class GradParts>
ring_errors total_errors(const std::vector<Parts>& parts, const std::vector<GradParts>& grads) {
  double num = 0.0, den = 0.0;
  std::array<double, 3> gnum{}, gden{};
  ring_errors e;
  for (std::size_t r = 0; r < parts.size(); ++r) {
    num += parts[r].num, den += parts[r].den;
    e.lse = std::max(e.lse, parts[r].lse);
    for (std::size_t i = 0; i < 3; ++i)
      gnum[i] += grads[r].num[i], gden[i] += grads[r].den[i];
  }
  e.out = den > 0 ? std::sqrt(num / den) : 0.0;
  for (std::size_t i = 0; i < 3; ++i)
    e.grad[i] = gden[i] > 0 ? std::sqrt(gnum[i] / gden[i]) : 0.0;
  return e;
}
//! The host ring's tolerances against the float64 oracle (bf16 output and gradients 4e-3
//! relative L2, lse 1e-5; test_ring.cpp, test_ring_backward.cpp), and the errors at P = 8 within
//! 1.2x of those at P = 1 (call it for P = 1 first).
struct error_growth {
  ring_errors at_p1;
  void check(int ranks, const ring_errors& e) {
    CHECK(e.out < 4e-3);
    CHECK(e.lse < 1e-5);
    for (std::size_t i = 0; i < 3; ++i)
      CHECK(e.grad[i] < 4e-3);
    if (ranks == 1) at_p1 = e;
    if (ranks != 8) return;
    CHECK(e.out <= 1.2 * at_p1.out + 1e-6);
    for (std::size_t i = 0; i < 3; ++i)
      CHECK(e.grad[i] <= 1.2 * at_p1.grad[i] + 1e-6);
  }
};

} // namespace ringattn::test
