#pragma once
// Strict checks of a ring's outputs against the float64 oracle, for batches where some rows see
// no key or where NaN or inf reaches some outputs: every element is compared one by one, not only
// through a norm. A row the oracle gives lse = -inf must come back with lse exactly -inf and its
// output exactly 0; an element the oracle makes NaN or inf must come back non-finite; every other
// element finite and, over all of them, within the given relative L2 bounds (out, each gradient)
// and absolute lse bound. Where a test allows it (`spread`, one sequence of the packed batch), a
// non-finite element may also come back non-finite beside the oracle's within that sequence: a
// tensor-core product multiplies a masked pair's 0 by the NaN in a shared tile (0 x NaN = NaN),
// which the oracle, skipping masked pairs, never does. It never spreads to other sequences, and
// never turns non-finite into finite.
#include "sharded_backward_case.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <random>
#include <vector>

namespace ringattn::test {

//! Counts and errors of an element-wise comparison.
struct strict_tally {
  double num = 0.0, den = 0.0, lse = 0.0;
  std::int64_t mismatched = 0;   // finite where the oracle is not, or the other way round
  std::int64_t no_key_wrong = 0; // a no-key row whose lse is not -inf or whose output is not 0
  std::int64_t non_finite = 0;   // non-finite elements the oracle also makes non-finite
  std::int64_t spread = 0;       // non-finite where the oracle is finite, where that may spread
  void add(double got, double want, bool may_spread = false) {
    if (may_spread && std::isfinite(want) && !std::isfinite(got)) {
      ++spread;
      return;
    }
    if (std::isfinite(got) != std::isfinite(want)) {
      ++mismatched;
      return;
    }
    if (!std::isfinite(want)) {
      ++non_finite;
      return;
    }
    num += (got - want) * (got - want);
    den += want * want;
  }
  double rel() const { return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num); }
};

//! Every rank's forward outputs, element by element (see the file notes).
//! The sequence of the packed batch that global token `g` belongs to.
template <class P, class T>
int sequence_of(const sharded_case<P, T>& c, std::int64_t g) {
  const auto cu = c.plan.cu_seqlens();
  return static_cast<int>(std::upper_bound(cu.begin(), cu.end(), g) - cu.begin()) - 1;
}

//! `spread`: the sequence where non-finite values may spread (-1: none; see the file notes).
template <class P, class T>
strict_tally strict_forward(const sharded_case<P, T>& c,
                            const std::vector<typename sharded_case<P, T>::rank_output>& outs,
                            int spread = -1) {
  const auto ref = c.oracle();
  constexpr double neg_inf = -std::numeric_limits<double>::infinity();
  strict_tally s;
  const int qh = c.args.q_heads, d = c.args.v_dim();
  for (int r = 0; r < c.plan.ranks(); ++r) {
    const auto& o = outs[static_cast<std::size_t>(r)];
    const std::int64_t n = c.plan.local_tokens(r);
    for (std::int64_t l = 0; l < n; ++l) {
      const std::int64_t g = c.plan.global_token(r, l);
      for (int h = 0; h < qh; ++h) {
        const double got_lse = o.lse[static_cast<std::size_t>(h * n + l)],
                     want_lse = ref.lse_at(h, g);
        const auto out_at = [&](int x) {
          return static_cast<double>(
              to_float(o.out[static_cast<std::size_t>((l * qh + h) * d + x)]));
        };
        if (want_lse == neg_inf) {
          bool zero = got_lse == neg_inf;
          for (int x = 0; x < d; ++x)
            zero = zero && out_at(x) == 0.0;
          if (!zero) ++s.no_key_wrong;
          continue;
        }
        const bool may_spread = sequence_of(c, g) == spread;
        if (may_spread && std::isfinite(want_lse) && !std::isfinite(got_lse))
          ++s.spread;
        else if (std::isfinite(got_lse) != std::isfinite(want_lse))
          ++s.mismatched;
        else if (std::isfinite(want_lse))
          s.lse = std::max(s.lse, std::abs(got_lse - want_lse));
        for (int x = 0; x < d; ++x)
          s.add(out_at(x), ref.out(g, h, x), may_spread);
      }
    }
  }
  return s;
}

//! Every rank's gradients, element by element: dq, dk, dv (index 0, 1, 2); `spread` as in
//! `strict_forward`.
template <class P, class T>
std::array<strict_tally, 3>
strict_backward(const sharded_backward_case<P, T>& c,
                const std::vector<typename sharded_backward_case<P, T>::rank_grads>& grads,
                int spread = -1) {
  const auto ref = c.oracle_backward();
  std::array<strict_tally, 3> s;
  for (int r = 0; r < c.plan.ranks(); ++r) {
    const auto& g = grads[static_cast<std::size_t>(r)];
    const std::int64_t n = c.plan.local_tokens(r);
    auto add = [&](strict_tally& t, const std::vector<T>& got, const reference::tensor& want) {
      for (std::int64_t l = 0; l < n; ++l) {
        const std::int64_t tok = c.plan.global_token(r, l);
        const bool may_spread = sequence_of(c, tok) == spread;
        for (int h = 0; h < want.heads; ++h)
          for (int x = 0; x < want.dim; ++x)
            t.add(to_float(got[static_cast<std::size_t>((l * want.heads + h) * want.dim + x)]),
                  want(tok, h, x), may_spread);
      }
    };
    add(s[0], g.dq, ref.dq);
    add(s[1], g.dk, ref.dk);
    add(s[2], g.dv, ref.dv);
  }
  return s;
}

//! Batches with empty and one-token sequences (the first is three empty sequences among seven of
//! one token), and a random mix of lengths 0, 1, 2 and 3-40.
inline std::vector<std::vector<std::int32_t>> sparse_batches(std::mt19937_64& rng) {
  std::vector<std::vector<std::int32_t>> all = {
      {0, 1, 1, 2, 3, 3, 4, 5, 6, 6, 7}, {0, 0, 0, 1}, {0, 0, 5, 5, 6, 6}};
  std::uniform_int_distribution<int> kind(0, 3), longer(3, 40);
  std::vector<std::int32_t> mix{0};
  for (int b = 0; b < 12; ++b) {
    const int k = kind(rng);
    mix.push_back(mix.back() + (k == 3 ? longer(rng) : k));
  }
  all.push_back(mix);
  return all;
}

//! An input that gets a non-finite value planted (`plant`).
enum class planted_in { q, k, v, dout };

//! Sets element (`token`, `head`, `elem`) of the full tensor `where` to `value` and shards it
//! again for every rank.
template <class P, class T>
void plant(sharded_backward_case<P, T>& c, planted_in where, std::int64_t token, int head, int elem,
           float value) {
  const attention_arguments& a = c.args;
  const bool is_q = where == planted_in::q || where == planted_in::dout;
  const int heads = is_q ? a.q_heads : a.kv_heads;
  const int width = where == planted_in::q || where == planted_in::k ? a.qk_dim() : a.v_dim();
  std::vector<T>& full = where == planted_in::q   ? c.q
                         : where == planted_in::k ? c.k
                         : where == planted_in::v ? c.v
                                                  : c.dout;
  std::vector<std::vector<T>>& shards = where == planted_in::q   ? c.qs
                                        : where == planted_in::k ? c.ks
                                        : where == planted_in::v ? c.vs
                                                                 : c.douts;
  full[static_cast<std::size_t>((token * heads + head) * width + elem)] = from_float<T>(value);
  for (int r = 0; r < c.plan.ranks(); ++r)
    shards[static_cast<std::size_t>(r)] = c.shard(full, r, heads, width);
}

//! The non-finite inputs the tests plant: NaN in any input; inf in v and dout (an infinite
//! element of q or k gives scores of -inf, which weigh 0 as keys outside the mask do, or +inf,
//! which makes the row NaN).
struct planted_case {
  planted_in where;
  float value;
};
inline constexpr planted_case planted_cases[] = {
    {planted_in::q, std::numeric_limits<float>::quiet_NaN()},
    {planted_in::k, std::numeric_limits<float>::quiet_NaN()},
    {planted_in::v, std::numeric_limits<float>::quiet_NaN()},
    {planted_in::dout, std::numeric_limits<float>::quiet_NaN()},
    {planted_in::v, std::numeric_limits<float>::infinity()},
    {planted_in::dout, std::numeric_limits<float>::infinity()}};

//! For every P of `ranks_list` and every planted case: a packed batch of three sequences of
//! 3-`longest` tokens (the same at every P) with the case's value at a random element, passed to
//! `check(c, token, where)` (`token`: the planted token, global).
template <class P, class T, class Check>
void for_each_planted(const attention_arguments& a, mask_kind mask,
                      std::initializer_list<int> ranks_list, int longest, Check check) {
  const auto seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 draw(seed);
  const auto cu = random_cu_seqlens(3, 3, longest, draw);
  for (int ranks : ranks_list) {
    CAPTURE(ranks);
    for (const planted_case& pc : planted_cases) {
      CAPTURE(static_cast<int>(pc.where));
      CAPTURE(pc.value);
      std::mt19937_64 rng(seed + static_cast<std::uint64_t>(ranks));
      sharded_backward_case<P, T> c(cu, ranks, a, mask, rng);
      std::uniform_int_distribution<std::int64_t> token(0, c.plan.tokens() - 1);
      std::uniform_int_distribution<int> head(0, a.kv_heads - 1), elem(0, a.v_dim() - 1);
      const std::int64_t t = token(rng);
      CAPTURE(t);
      plant(c, pc.where, t, head(rng), elem(rng), pc.value);
      check(c, t, pc.where);
    }
  }
}

//! Bounds of `check_strict`.
struct strict_bounds {
  double out, lse, grad;
};

//! The tallies within `b`; `forward_non_finite` / `backward_non_finite`: the oracle makes some
//! outputs / gradients non-finite (then some must be, else none of the forward's may be).
inline void check_strict(const strict_tally& fwd, const std::array<strict_tally, 3>& bwd,
                         bool forward_non_finite, bool backward_non_finite, strict_bounds b) {
  CHECK(fwd.mismatched == 0);
  CHECK(fwd.no_key_wrong == 0);
  CHECK(fwd.rel() < b.out);
  CHECK(fwd.lse < b.lse);
  CHECK((fwd.non_finite > 0) == forward_non_finite);
  std::int64_t non_finite = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(bwd[i].mismatched == 0);
    CHECK(bwd[i].rel() < b.grad);
    non_finite += bwd[i].non_finite;
  }
  if (backward_non_finite) CHECK(non_finite > 0);
}

} // namespace ringattn::test
