#pragma once
//! \file
//! The host block backward: the contract of backward_args.cuh in plain C++ (scores,
//! probabilities and each row's sums in fp64; the accumulators in fp32 as on the device). What the
//! CPU ring's backward runs.
//!
//! \code
//! ringattn::compute_delta(out, dout, delta);          // D = rowsum(dO * O), once per rank
//! zero dq, dk, dv (fp32)
//! for (each K/V block) ringattn::host_block_backward({q, k, v, dout, lse, delta, args,
//!                                                     {dq, dk, dv}}, groups);
//! \endcode

#include <ringattn/block/device/backward_args.cuh>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <span>

namespace ringattn {

//! `delta[h, t] = sum_e dout(t, h, e) * out(t, h, e)` in fp64, stored fp32 (`[q_heads, tokens]`),
//! from the forward's output in its dtype (as FlashAttention does: the softmax-weighted sum of
//! dP over a row equals dO . O).
template <element T>
void compute_delta(thd_view<const T> out, thd_view<const T> dout, float* delta) {
  validation r = validate_view(out, "out");
  r.require(validate_view(dout, "dout"));
  r.require(out.tokens == dout.tokens && out.heads == dout.heads && out.head_dim == dout.head_dim,
            "out and dout differ in shape");
  r.require(out.tokens == 0 || delta != nullptr, "delta is a null pointer");
  r.throw_if_invalid();
  for (std::int64_t t = 0; t < out.tokens; ++t)
    for (int h = 0; h < out.heads; ++h) {
      double s = 0.0;
      for (int e = 0; e < out.head_dim; ++e)
        s += static_cast<double>(to_float(dout(t, h, e))) * to_float(out(t, h, e));
      delta[h * out.tokens + t] = static_cast<float>(s);
    }
}

namespace detail {
//! The host block backward on arguments validated by the caller; allocates nothing.
template <element T>
void host_block_backward_rows(const block_backward_args<T>& a,
                              std::span<const block_group> groups) {
  const double scale = a.args.scale();
  const int group_size = a.args.group_size(), d = a.args.qk_dim(), dv_dim = a.args.v_dim(),
            qh = a.args.q_heads, kvh_count = a.args.kv_heads;
  const std::int64_t nq = a.q.tokens;
  std::array<double, max_head_dim> dq, qrow, dorow;
  for (const block_group& g : groups)
    for (std::int64_t i = 0; i < g.q_count; ++i) {
      const std::int64_t row = g.q_begin + i;
      for (int h = 0; h < qh; ++h) {
        const double lse = a.lse[h * nq + row];
        if (lse == -std::numeric_limits<double>::infinity()) continue;
        const double dsum = a.delta[h * nq + row];
        const int kvh = h / group_size;
        for (int e = 0; e < d; ++e)
          qrow[static_cast<std::size_t>(e)] = to_float(a.q(row, h, e));
        for (int e = 0; e < dv_dim; ++e)
          dorow[static_cast<std::size_t>(e)] = to_float(a.dout(row, h, e));
        std::fill(dq.begin(), dq.begin() + d, 0.0);
        for (int b = 0; b < g.count; ++b) {
          const kv_block& kb = g.kv[b];
          const index_range c = kb.mask.columns(i, i + 1, kb.kv_count);
          for (std::int64_t j = c.begin; j < c.end; ++j) {
            const std::int64_t col = kb.kv_begin + j;
            double dot = 0.0, dp = 0.0;
            for (int e = 0; e < d; ++e)
              dot += qrow[static_cast<std::size_t>(e)] * to_float(a.k(col, kvh, e));
            for (int e = 0; e < dv_dim; ++e)
              dp += dorow[static_cast<std::size_t>(e)] * to_float(a.v(col, kvh, e));
            const double p = std::exp(dot * scale - lse);
            const double ds = p * (dp - dsum) * scale;
            float* dk = a.grad.dk + (col * kvh_count + kvh) * d;
            float* dv = a.grad.dv + (col * kvh_count + kvh) * dv_dim;
            for (int e = 0; e < d; ++e) {
              dq[static_cast<std::size_t>(e)] += ds * to_float(a.k(col, kvh, e));
              dk[e] += static_cast<float>(ds * qrow[static_cast<std::size_t>(e)]);
            }
            for (int e = 0; e < dv_dim; ++e)
              dv[e] += static_cast<float>(p * dorow[static_cast<std::size_t>(e)]);
          }
        }
        float* dqs = a.grad.dq + (row * qh + h) * d;
        for (int e = 0; e < d; ++e)
          dqs[e] += static_cast<float>(dq[static_cast<std::size_t>(e)]);
      }
    }
}

} // namespace detail

//! Host block backward: accumulates this block's share of dq, dk and dv into `a.grad`. Rows with
//! lse = -inf (no key anywhere) get nothing. Throws `invalid_argument` (nothing written) when
//! validation fails.
template <element T>
void host_block_backward(const block_backward_args<T>& a, std::span<const block_group> groups) {
  validate_block_backward(a, groups).throw_if_invalid();
  detail::host_block_backward_rows(a, groups);
}

} // namespace ringattn
