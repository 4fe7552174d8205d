#pragma once
// A block-forward problem for the tests: a random packed batch, one group per sequence (its
// queries against its own keys under a band), the same band as a position window for the
// float64 oracle, and ways to split the keys into several blocks.
#include "common.hpp"

#include <ringattn/block/device/block.cuh>
#include <ringattn/reference/attention.cuh>

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <vector>

namespace ringattn::test {

template <class T>
struct block_case {
  std::vector<std::int32_t> cu;
  attention_arguments args;
  band mask;
  std::vector<T> q, k, v;

  block_case(std::vector<std::int32_t> cu_, attention_arguments a, band b, std::mt19937_64& rng)
      : cu(std::move(cu_)), args(a), mask(b) {
    const auto n = static_cast<std::size_t>(tokens());
    q = random_buffer<T>(n * a.q_heads * a.head_dim, rng);
    k = random_buffer<T>(n * a.kv_heads * a.head_dim, rng);
    v = random_buffer<T>(n * a.kv_heads * a.v_dim(), rng);
  }
  std::int64_t tokens() const { return cu.back(); }
  thd_view<const T> qv() const { return {q.data(), tokens(), args.q_heads, args.head_dim}; }
  thd_view<const T> kv() const { return {k.data(), tokens(), args.kv_heads, args.head_dim}; }
  thd_view<const T> vv() const { return {v.data(), tokens(), args.kv_heads, args.v_dim()}; }

  //! The band as the oracle's window: lo <= pk - pq <= hi.
  position_window window() const {
    return {mask.lo <= -unbounded ? unbounded : -mask.lo,
            mask.hi >= unbounded ? unbounded : mask.hi};
  }
  reference::forward_result oracle() const {
    return reference::attention_forward(qv(), kv(), vv(), cu, args, window());
  }

  //! The keys of every sequence cut into `pieces` near-equal ranges; piece p of every sequence
  //! forms one call. With `together`, the first two pieces share one call as two key segments of
  //! the same group (what zigzag produces).
  std::vector<std::vector<block_group>> calls(int pieces, bool together = false) const {
    std::vector<std::vector<block_group>> out(static_cast<std::size_t>(pieces));
    for (std::size_t s = 0; s + 1 < cu.size(); ++s) {
      const std::int64_t len = cu[s + 1] - cu[s];
      for (int p = 0; p < pieces; ++p) {
        const std::int64_t b = len * p / pieces, e = len * (p + 1) / pieces;
        // Keys [b, e) of the sequence: column j of the piece is position b + j.
        const kv_block kb{cu[s] + b, e - b,
                          band{mask.lo <= -unbounded ? -unbounded : mask.lo - b,
                               mask.hi >= unbounded ? unbounded : mask.hi - b}};
        auto& call = out[static_cast<std::size_t>(together && p == 1 ? 0 : p)];
        if (together && p == 1) {
          call.back().kv[call.back().count++] = kb;
        } else {
          block_group g{cu[s], len, 1, {}};
          g.kv[0] = kb;
          call.push_back(g);
        }
      }
    }
    if (together && pieces > 1) out.erase(out.begin() + 1);
    return out;
  }
};

//! A block case with an output gradient, the oracle's forward (for lse and D) and backward.
template <class T>
struct block_backward_case : block_case<T> {
  std::vector<T> dout;
  std::vector<float> lse, delta; // [q_heads, tokens], from the oracle's exact forward
  reference::backward_result ref;

  block_backward_case(std::vector<std::int32_t> cu, attention_arguments a, band b,
                      std::mt19937_64& rng)
      : block_case<T>(std::move(cu), a, b, rng) {
    const auto n = this->tokens();
    dout = random_buffer<T>(static_cast<std::size_t>(n * a.q_heads * a.v_dim()), rng);
    const auto fwd = this->oracle();
    lse.resize(static_cast<std::size_t>(n * a.q_heads));
    delta.resize(lse.size());
    for (std::int64_t t = 0; t < n; ++t)
      for (int h = 0; h < a.q_heads; ++h) {
        double s = 0.0;
        for (int e = 0; e < a.v_dim(); ++e)
          s += to_float(doutv()(t, h, e)) * fwd.out(t, h, e);
        lse[static_cast<std::size_t>(h * n + t)] = static_cast<float>(fwd.lse_at(h, t));
        delta[static_cast<std::size_t>(h * n + t)] = static_cast<float>(s);
      }
    ref = reference::attention_backward(this->qv(), this->kv(), this->vv(), doutv(), this->cu,
                                        this->args, this->window());
  }
  thd_view<const T> doutv() const {
    return {dout.data(), this->tokens(), this->args.q_heads, this->args.v_dim()};
  }
};

//! fp32 gradient accumulators of a block-backward test.
struct block_grads {
  std::vector<float> dq, dk, dv;
};

//! Relative L2 error of fp32 gradients against the oracle's; where the oracle's are exactly zero
//! (every row sees at most one key: then dS = P (dP - D) = 0), the absolute L2 norm instead.
inline double grad_error(const std::vector<float>& got, std::span<const double> want) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  return den == 0.0 ? std::sqrt(num) : std::sqrt(num / den);
}

//! Relative L2 error of an [tokens, heads, dim] result against the oracle's output.
template <class Get>
double out_error(const reference::forward_result& ref, Get get) {
  std::vector<double> got(ref.out.data.size());
  for (std::int64_t t = 0; t < ref.out.tokens; ++t)
    for (int h = 0; h < ref.out.heads; ++h)
      for (int d = 0; d < ref.out.dim; ++d)
        got[static_cast<std::size_t>((t * ref.out.heads + h) * ref.out.dim + d)] = get(t, h, d);
  return reference::relative_error(got, ref.out.data);
}

//! Largest |lse - oracle| (0 where both are -inf; infinite where only one is).
template <class Get>
double lse_error(const reference::forward_result& ref, Get get) {
  double worst = 0.0;
  for (std::int64_t t = 0; t < ref.out.tokens; ++t)
    for (int h = 0; h < ref.out.heads; ++h) {
      const double a = get(t, h), b = ref.lse_at(h, t);
      if (std::isinf(b) && a == b) continue;
      worst = std::max(worst,
                       std::isnan(a) ? std::numeric_limits<double>::infinity() : std::abs(a - b));
    }
  return worst;
}

//! Bands worth testing: full, causal, a diagonal offset both ways, a window, and one that leaves
//! the last rows with no key at all.
inline std::vector<band> test_bands(std::mt19937_64& rng) {
  std::uniform_int_distribution<int> off(-40, 40), width(1, 60);
  const int lo = off(rng);
  return {band{}, band{-unbounded, 0}, band{-unbounded, off(rng)}, band{lo, lo + width(rng)},
          band{1, 7}};
}

} // namespace ringattn::test
