#pragma once
//! \file
//! The float64 oracle: plain attention on a whole (gathered) packed batch, forward and backward.
//!
//! Every test of the library compares against this. It is deliberately the textbook formula with
//! nothing clever in it (no tiling, no online softmax), computed in double precision on the host:
//! `S = scale * Q K^T` per sequence and head, masked, `P = softmax(S)`, `O = P V`,
//! `LSE = log(sum_j exp(S_ij))` (natural log). Rows that see no key get O = 0 and LSE = -inf.
//! The mask is a position window (segment.cuh): full, causal, a sliding window, or any band of
//! key-minus-query position offsets.
//! Backward from dO: `dV = P^T dO`, `dP = dO V^T`, `D_i = sum_j P_ij dP_ij`,
//! `dS = P * (dP - D)`, `dQ = scale * dS K`, `dK = scale * dS^T Q`; under GQA, dK and dV sum over
//! the query heads of each group.
//!
//! \code
//! auto fwd = ringattn::reference::attention_forward(q, k, v, cu_seqlens, args,
//!                                                   ringattn::mask_kind::causal);
//! double o = fwd.out(t, h, d), l = fwd.lse(h, t);
//! \endcode

#include <ringattn/arguments.cuh>
#include <ringattn/core/segment.cuh>
#include <ringattn/tensor.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace ringattn::reference {

//! A dense float64 `[tokens, heads, dim]` tensor owned by the host.
struct tensor {
  std::int64_t tokens = 0;
  std::int32_t heads = 0;
  std::int32_t dim = 0;
  std::vector<double> data;

  tensor() = default;
  tensor(std::int64_t t, std::int32_t h, std::int32_t d)
      : tokens(t), heads(h), dim(d), data(static_cast<std::size_t>(t * h * d), 0.0) {}

  double& operator()(std::int64_t t, std::int32_t h, std::int32_t d) {
    return data[static_cast<std::size_t>((t * heads + h) * dim + d)];
  }
  double operator()(std::int64_t t, std::int32_t h, std::int32_t d) const {
    return data[static_cast<std::size_t>((t * heads + h) * dim + d)];
  }
  const double* row(std::int64_t t, std::int32_t h) const {
    return data.data() + (t * heads + h) * dim;
  }
  double* row(std::int64_t t, std::int32_t h) { return data.data() + (t * heads + h) * dim; }
};

//! Copies any THD view (strided, fp16/bf16/fp32) into a dense float64 tensor.
template <element T>
tensor to_tensor(thd_view<const T> v) {
  tensor r(v.tokens, v.heads, v.head_dim);
  for (std::int64_t t = 0; t < v.tokens; ++t)
    for (std::int32_t h = 0; h < v.heads; ++h)
      for (std::int32_t d = 0; d < v.head_dim; ++d)
        r(t, h, d) = to_float(v(t, h, d));
  return r;
}

//! Output of the forward oracle.
struct forward_result {
  tensor out;              //!< [tokens, q_heads, head_dim_v]
  std::vector<double> lse; //!< [q_heads, tokens], natural log; -inf for rows that see no key
  //! [q_heads]: the largest logit `scale * q . k` a head's queries see (NaN where a logit is NaN,
  //! -inf where none sees a key); `attention_forward` alone fills it.
  std::vector<double> max_logit;
  double lse_at(std::int32_t h, std::int64_t t) const {
    return lse[static_cast<std::size_t>(h * out.tokens + t)];
  }
};

//! Output of the backward oracle.
struct backward_result {
  tensor dq; //!< [tokens, q_heads, head_dim]
  tensor dk; //!< [tokens, kv_heads, head_dim]
  tensor dv; //!< [tokens, kv_heads, head_dim_v]
};

namespace detail {
inline validation validate_problem(const tensor& q, const tensor& k, const tensor& v,
                                   std::span<const std::int32_t> cu_seqlens,
                                   const attention_arguments& args) {
  validation r = validation::ok();
  r.require(args.q_heads > 0 && args.kv_heads > 0 && args.q_heads % args.kv_heads == 0, "q_heads (",
            args.q_heads, ") must be a positive multiple of kv_heads (", args.kv_heads, ")");
  r.require(q.heads == args.q_heads, "q has ", q.heads, " heads, arguments say ", args.q_heads);
  r.require(k.heads == args.kv_heads && v.heads == args.kv_heads, "k/v have ", k.heads, "/",
            v.heads, " heads, arguments say ", args.kv_heads);
  r.require(q.dim == args.qk_dim() && k.dim == args.qk_dim(), "q/k head_dim ", q.dim, "/", k.dim,
            " differ from ", args.qk_dim());
  r.require(v.dim == args.v_dim(), "v is ", v.dim, " wide, arguments say ", args.v_dim());
  r.require(q.tokens == k.tokens && q.tokens == v.tokens, "q/k/v token counts differ: ", q.tokens,
            "/", k.tokens, "/", v.tokens);
  r.require(validate_cu_seqlens(cu_seqlens, q.tokens));
  return r;
}

// Scores of query row (t, h) against the keys [begin, end) of its sequence that the window
// admits: fills s[j - begin] (or -inf when masked) and returns the maximum (NaN when a score the
// window admits is NaN: the NaN then reaches the row's output, lse and gradients).
inline double scores(const tensor& q, const tensor& k, std::int64_t t, std::int32_t h,
                     std::int32_t kvh, std::int64_t begin, std::int64_t end,
                     const position_window& w, double scale, std::vector<double>& s) {
  const double inf = std::numeric_limits<double>::infinity();
  double m = -inf;
  s.assign(static_cast<std::size_t>(end - begin), -inf);
  const double* qr = q.row(t, h);
  for (std::int64_t j = begin; j < end; ++j) {
    // Positions are offsets within the sequence: t - begin and j - begin.
    if (!w.sees(t - begin, j - begin)) continue;
    const double* kr = k.row(j, kvh);
    double dot = 0.0;
    for (std::int32_t d = 0; d < q.dim; ++d)
      dot += qr[d] * kr[d];
    s[static_cast<std::size_t>(j - begin)] = dot * scale;
    const double x = dot * scale;
    if (!std::isnan(m) && (x > m || std::isnan(x))) m = x;
  }
  return m;
}

// One query row (t, h) of sequence [begin, end): writes o[0, v.dim) and returns the natural-log
// LSE (-inf, with o left at 0, when the window admits no key).
inline double forward_row(const tensor& q, const tensor& k, const tensor& v, std::int64_t t,
                          std::int32_t h, std::int32_t kvh, std::int64_t begin, std::int64_t end,
                          const position_window& w, double scale, std::vector<double>& s,
                          double* o) {
  const double m = scores(q, k, t, h, kvh, begin, end, w, scale, s);
  if (m == -std::numeric_limits<double>::infinity()) return m;
  double sum = 0.0;
  for (std::int64_t j = begin; j < end; ++j) {
    const double x = s[static_cast<std::size_t>(j - begin)];
    if (x == -std::numeric_limits<double>::infinity()) continue; // masked
    const double p = std::exp(x - m);
    if (p == 0.0) continue;
    sum += p;
    const double* vr = v.row(j, kvh);
    for (std::int32_t d = 0; d < v.dim; ++d)
      o[d] += p * vr[d];
  }
  for (std::int32_t d = 0; d < v.dim; ++d)
    o[d] /= sum;
  return m + std::log(sum);
}
} // namespace detail

//! Forward attention of a packed batch in float64 under a position window (full, causal, sliding,
//! or any band). Throws `invalid_argument` on inconsistent shapes. `cu_seqlens` holds batch + 1
//! offsets into the token dimension.
inline forward_result attention_forward(const tensor& q, const tensor& k, const tensor& v,
                                        std::span<const std::int32_t> cu_seqlens,
                                        const attention_arguments& args,
                                        const position_window& mask) {
  detail::validate_problem(q, k, v, cu_seqlens, args).throw_if_invalid();
  const double inf = std::numeric_limits<double>::infinity();
  const double scale = args.scale();
  const std::int32_t group = args.q_heads / args.kv_heads;
  forward_result r{tensor(q.tokens, q.heads, v.dim),
                   std::vector<double>(static_cast<std::size_t>(q.heads * q.tokens), -inf),
                   std::vector<double>(static_cast<std::size_t>(q.heads), -inf)};
  std::vector<double> s;
  for (std::size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    const std::int64_t begin = cu_seqlens[b], end = cu_seqlens[b + 1];
    for (std::int64_t t = begin; t < end; ++t)
      for (std::int32_t h = 0; h < q.heads; ++h) {
        r.lse[static_cast<std::size_t>(h * q.tokens + t)] = detail::forward_row(
            q, k, v, t, h, h / group, begin, end, mask, scale, s, r.out.row(t, h));
        double& most = r.max_logit[static_cast<std::size_t>(h)];
        for (const double x : s) // the row's scores, -inf where masked
          if (!std::isnan(most) && (x > most || std::isnan(x))) most = x;
      }
  }
  return r;
}

//! The oracle for selected rows only: `rows[i]` is a token index of the packed batch; returns
//! out `[rows.size(), q_heads, head_dim_v]` and lse `[q_heads, rows.size()]`. For checking samples
//! of long sequences, where the whole oracle would take too long.
inline forward_result attention_forward_rows(const tensor& q, const tensor& k, const tensor& v,
                                             std::span<const std::int32_t> cu_seqlens,
                                             const attention_arguments& args,
                                             const position_window& mask,
                                             std::span<const std::int64_t> rows) {
  detail::validate_problem(q, k, v, cu_seqlens, args).throw_if_invalid();
  const double inf = std::numeric_limits<double>::infinity();
  const double scale = args.scale();
  const std::int32_t group = args.q_heads / args.kv_heads;
  const auto n = static_cast<std::int64_t>(rows.size());
  forward_result r{tensor(n, q.heads, v.dim),
                   std::vector<double>(static_cast<std::size_t>(q.heads * n), -inf),
                   {}};
  std::vector<double> s;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t t = rows[static_cast<std::size_t>(i)];
    if (t < 0 || t >= q.tokens) throw invalid_argument("ringattn: sample row out of range");
    const auto b = static_cast<std::size_t>(
        std::upper_bound(cu_seqlens.begin(), cu_seqlens.end(), static_cast<std::int32_t>(t)) -
        cu_seqlens.begin() - 1);
    const std::int64_t begin = cu_seqlens[b], end = cu_seqlens[b + 1];
    for (std::int32_t h = 0; h < q.heads; ++h)
      r.lse[static_cast<std::size_t>(h * n + i)] = detail::forward_row(
          q, k, v, t, h, h / group, begin, end, mask, scale, s, r.out.row(i, h));
  }
  return r;
}

//! Backward attention of a packed batch in float64 under a position window, recomputing P.
inline backward_result attention_backward(const tensor& q, const tensor& k, const tensor& v,
                                          const tensor& dout,
                                          std::span<const std::int32_t> cu_seqlens,
                                          const attention_arguments& args,
                                          const position_window& mask) {
  detail::validate_problem(q, k, v, cu_seqlens, args).throw_if_invalid();
  validation shape = validation::ok();
  shape.require(dout.tokens == q.tokens && dout.heads == q.heads && dout.dim == v.dim,
                "dout must have the shape of the output: q's tokens and heads, v's width");
  shape.throw_if_invalid();
  const double inf = std::numeric_limits<double>::infinity();
  const double scale = args.scale();
  const std::int32_t group = args.q_heads / args.kv_heads;
  backward_result r{tensor(q.tokens, q.heads, q.dim), tensor(k.tokens, k.heads, k.dim),
                    tensor(v.tokens, v.heads, v.dim)};
  std::vector<double> s, dp;
  for (std::size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
    const std::int64_t begin = cu_seqlens[b], end = cu_seqlens[b + 1];
    for (std::int64_t t = begin; t < end; ++t)
      for (std::int32_t h = 0; h < q.heads; ++h) {
        const std::int32_t kvh = h / group;
        const double m = detail::scores(q, k, t, h, kvh, begin, end, mask, scale, s);
        if (m == -inf) continue; // no key, no gradient
        double sum = 0.0;
        for (double& x : s) {
          x = x == -inf ? 0.0 : std::exp(x - m); // now P * sum (0 where masked)
          sum += x;
        }
        const double* dor = dout.row(t, h);
        dp.assign(s.size(), 0.0);
        double dsum = 0.0; // D = sum_j P_ij dP_ij
        for (std::int64_t j = begin; j < end; ++j) {
          const std::size_t jj = static_cast<std::size_t>(j - begin);
          if (s[jj] == 0.0) continue; // masked (or too small to count): stays 0
          s[jj] /= sum;
          const double* vr = v.row(j, kvh);
          double x = 0.0;
          for (std::int32_t d = 0; d < v.dim; ++d)
            x += dor[d] * vr[d];
          dp[jj] = x;
          dsum += s[jj] * x;
        }
        const double* qr = q.row(t, h);
        double* dq = r.dq.row(t, h);
        for (std::int64_t j = begin; j < end; ++j) {
          const std::size_t jj = static_cast<std::size_t>(j - begin);
          const double p = s[jj];
          if (p == 0.0) continue;
          const double ds = p * (dp[jj] - dsum) * scale;
          const double* kr = k.row(j, kvh);
          double* dk = r.dk.row(j, kvh);
          double* dv = r.dv.row(j, kvh);
          for (std::int32_t d = 0; d < q.dim; ++d) {
            dq[d] += ds * kr[d];
            dk[d] += ds * qr[d];
          }
          for (std::int32_t d = 0; d < v.dim; ++d)
            dv[d] += p * dor[d];
        }
      }
  }
  return r;
}

//! Forward under a mask kind (a window kind takes its extent from `args`).
inline forward_result attention_forward(const tensor& q, const tensor& k, const tensor& v,
                                        std::span<const std::int32_t> cu_seqlens,
                                        const attention_arguments& args, mask_kind mask) {
  return attention_forward(q, k, v, cu_seqlens, args, args.window(mask));
}
//! Backward under a mask kind (a window kind takes its extent from `args`).
inline backward_result attention_backward(const tensor& q, const tensor& k, const tensor& v,
                                          const tensor& dout,
                                          std::span<const std::int32_t> cu_seqlens,
                                          const attention_arguments& args, mask_kind mask) {
  return attention_backward(q, k, v, dout, cu_seqlens, args, args.window(mask));
}

//! Convenience overloads taking THD views of any element type.
template <element T, class Mask>
forward_result attention_forward(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                                 std::span<const std::int32_t> cu_seqlens,
                                 const attention_arguments& args, const Mask& mask) {
  return attention_forward(to_tensor(q), to_tensor(k), to_tensor(v), cu_seqlens, args, mask);
}
template <element T, class Mask>
backward_result attention_backward(thd_view<const T> q, thd_view<const T> k, thd_view<const T> v,
                                   thd_view<const T> dout, std::span<const std::int32_t> cu_seqlens,
                                   const attention_arguments& args, const Mask& mask) {
  return attention_backward(to_tensor(q), to_tensor(k), to_tensor(v), to_tensor(dout), cu_seqlens,
                            args, mask);
}

//! ||a - b||_2 / ||b||_2 over all elements (0 when both are zero): the error measure of the tests.
inline double relative_error(std::span<const double> a, std::span<const double> b) {
  double num = 0.0, den = 0.0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  if (den == 0.0) return num == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

} // namespace ringattn::reference
