#pragma once
//! \file
//! The host block kernel: the exact contract of the CUDA kernel in plain C++ (scores and the
//! block's softmax in fp64, the state in fp32 as on the device). It is what the CPU ring runs, in
//! CI and on machines without a GPU.
//!
//! \code
//! ringattn::reset(state);                                  // o = 0, lse = -inf, sum = 0
//! for (each K/V block) ringattn::host_block_forward({q, k, v, args, state}, groups);
//! ringattn::finalize(state, out);                          // o / sum -> out, the lse
//! \endcode

#include <ringattn/block/device/forward_args.cuh>
#include <ringattn/core/kv_scales.cuh>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <span>

namespace ringattn {

//! Sets a host state to "no key seen": o = 0, lse = -inf, sum = 0.
inline void reset(const attention_state& s) {
  std::fill(s.o, s.o + s.o_elements(), 0.0f);
  std::fill(s.lse, s.lse + s.lse_elements(), -std::numeric_limits<float>::infinity());
  std::fill(s.sum, s.sum + s.lse_elements(), 0.0f);
}

namespace detail {
//! The host block forward on arguments validated by the caller (the ring validates its groups
//! once, at plan time), with `a.q`, `a.args` and `a.state`; key and value elements are
//! `key(row, kv head, e)` and `value(row, kv head, e)` as floats (`a.k` and `a.v` are read
//! through them only). Allocates nothing: each (row, head) runs an online softmax in fp64 with
//! its output row on the stack.
template <element T, class Key, class Value>
void host_block_forward_rows(const block_forward_args<T>& a, std::span<const block_group> groups,
                             Key key, Value value) {
  const double scale = a.args.scale();
  const int group_size = a.args.group_size(), d = a.args.qk_dim(), dv = a.args.v_dim();
  std::array<double, max_head_dim> o;
  for (const block_group& g : groups)
    for (std::int64_t i = 0; i < g.q_count; ++i) {
      const std::int64_t row = g.q_begin + i;
      for (int h = 0; h < a.args.q_heads; ++h) {
        const int kvh = h / group_size;
        double m = -std::numeric_limits<double>::infinity(), sum = 0.0;
        std::fill(o.begin(), o.begin() + dv, 0.0);
        for (int b = 0; b < g.count; ++b) {
          const kv_block& kb = g.kv[b];
          const index_range c = kb.mask.columns(i, i + 1, kb.kv_count);
          for (std::int64_t j = c.begin; j < c.end; ++j) {
            const std::int64_t col = kb.kv_begin + j;
            double dot = 0.0;
            for (int e = 0; e < d; ++e)
              dot += static_cast<double>(to_float(a.q(row, h, e))) * key(col, kvh, e);
            const double x = dot * scale;
            if (x > m) { // a new maximum: rescale what was summed so far
              const double s = std::exp(m - x);
              sum *= s;
              for (int e = 0; e < dv; ++e)
                o[static_cast<std::size_t>(e)] *= s;
              m = x;
            }
            const double p = std::exp(x - m);
            sum += p;
            for (int e = 0; e < dv; ++e)
              o[static_cast<std::size_t>(e)] += p * value(col, kvh, e);
          }
        }
        if (a.state.max_logit != nullptr)
          a.state.max_logit[h] = nan_max(
              a.state.max_logit[h], max_logit_of(static_cast<float>(m), static_cast<float>(sum)));
        if (sum == 0.0) continue; // nothing visible in this block: the state is unchanged
        const float lse_b = static_cast<float>(m + std::log(sum));
        float& ref = a.state.lse_at(row, h);
        // Logits beyond fp32 (scores in fp64 here) make lse +inf: blocks that both saturate merge
        // with equal weights (inf - inf would be NaN), so the output stays finite at any P.
        constexpr float inf = std::numeric_limits<float>::infinity();
        const row_merge w =
            ref == inf && lse_b == inf ? row_merge{1.0f, 1.0f, inf, false} : merge_into(ref, lse_b);
        float* os = a.state.o_row(row, h);
        for (int e = 0; e < dv; ++e)
          os[e] =
              os[e] * w.old + static_cast<float>(o[static_cast<std::size_t>(e)] / sum) * w.block;
        float& row_sum = a.state.sum_at(row, h);
        row_sum = row_sum * w.old + w.block;
        ref = w.new_ref;
      }
    }
}
//! The same with the keys and values of `a.k` and `a.v`.
template <element T>
void host_block_forward_rows(const block_forward_args<T>& a, std::span<const block_group> groups) {
  host_block_forward_rows(
      a, groups,
      [&](std::int64_t row, int h, int e) { return static_cast<double>(to_float(a.k(row, h, e))); },
      [&](std::int64_t row, int h, int e) {
        return static_cast<double>(to_float(a.v(row, h, e)));
      });
}
//! The host block forward over an FP8 cache `k`, `v` (the rows `groups` name), each element read
//! as `float(x) * scale` in fp32 (the dequantised value; `page_shift`: log2 of a paged cache's
//! page size, the pool row's page choosing a `page_scales` entry).
template <element T, kv_scales Scales>
void host_block_forward_fp8(const block_forward_args<T>& a, std::span<const block_group> groups,
                            thd_view<const fp8_e4m3> k, thd_view<const fp8_e4m3> v, Scales scales,
                            int page_shift) {
  const int kv_heads = a.args.kv_heads;
  host_block_forward_rows(
      a, groups,
      [&](std::int64_t row, int h, int e) {
        return static_cast<double>(to_float(k(row, h, e)) *
                                   scales.k[Scales::index(row, page_shift, h, kv_heads)]);
      },
      [&](std::int64_t row, int h, int e) {
        return static_cast<double>(to_float(v(row, h, e)) *
                                   scales.v[Scales::index(row, page_shift, h, kv_heads)]);
      });
}
} // namespace detail

//! Host block forward: merges attention of `a.q` against the K/V block into `a.state`.
//! Throws `invalid_argument` (nothing written) when validation fails.
template <element T>
void host_block_forward(const block_forward_args<T>& a, std::span<const block_group> groups) {
  validate_block_forward(a, groups).throw_if_invalid();
  detail::host_block_forward_rows(a, groups);
}

//! Writes the state's output, o / sum, in the output dtype (rows that saw no key are 0), and
//! replaces the state's lse (the reference) by the rows' lse.
template <element T>
void finalize(const attention_state& s, thd_view<T> out) {
  validation r = validate_view(out, "out");
  r.require(out.tokens == s.tokens && out.heads == s.q_heads && out.head_dim == s.head_dim,
            "out is [", out.tokens, ", ", out.heads, ", ", out.head_dim, "] but the state is [",
            s.tokens, ", ", s.q_heads, ", ", s.head_dim, "]");
  r.throw_if_invalid();
  for (std::int64_t t = 0; t < s.tokens; ++t)
    for (int h = 0; h < s.q_heads; ++h) {
      const float sum = s.sum_at(t, h), inv = inverse_sum(sum);
      for (int e = 0; e < s.head_dim; ++e)
        out(t, h, e) = from_float<T>(s.o_row(t, h)[e] * inv);
      s.lse_at(t, h) = final_lse(s.lse_at(t, h), sum);
    }
}

//! The host twin of the device `finish_partial` (block/device/state_ops.cuh): state `s` as a
//! finished partial, its rows' normalised outputs (`[rows, head_dim]`, row = head * tokens + token)
//! to `o` and their lse to `lse`.
template <element T>
void finish_partial(const attention_state& s, T* o, float* lse) {
  const std::int64_t rows = s.tokens * s.q_heads;
  for (std::int64_t row = 0; row < rows; ++row) {
    const float sum = s.sum[row], inv = inverse_sum(sum);
    for (int e = 0; e < s.head_dim; ++e)
      o[row * s.head_dim + e] = from_float<T>(s.o[row * s.head_dim + e] * inv);
    lse[row] = final_lse(s.lse[row], sum);
  }
}

//! The host twin of the device `merge_finished_partials` (block/device/state_ops.cuh): `parts`
//! finished partials of `out`'s shape, partial r's outputs at `o + r * o_stride` and lse at
//! `lse_of + r * lse_stride` (elements), merged in that order into `out` and `lse`.
template <element T>
void merge_finished_partials(const T* o, std::int64_t o_stride, const float* lse_of,
                             std::int64_t lse_stride, int parts, thd_view<T> out, float* lse) {
  validation r = validate_view(out, "out");
  r.require(parts >= 1, "no partial state to merge");
  r.throw_if_invalid();
  const std::int64_t tokens = out.tokens, rows = tokens * out.heads;
  const int d = out.head_dim;
  for (std::int64_t row = 0; row < rows; ++row) {
    float l = 0.0f;
    for (int e = 0; e < d; ++e)
      out(row % tokens, static_cast<int>(row / tokens), e) = from_float<T>(
          merge_finished(parts, lse_of + row, lse_stride, o + row * d + e, o_stride, l));
    lse[row] = l;
  }
}

} // namespace ringattn
