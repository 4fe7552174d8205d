#pragma once
//! \file
//! The running attention state that ring steps merge into, and its numerics.
//!
//! State of one (query row, head): the *normalised* partial output `o` (fp32, the softmax-weighted
//! mean of the values seen so far) and `lse`, the natural-log log-sum-exp of the scaled scores seen
//! so far. A row that has seen no key has `lse = -inf` and `o = 0`. Two partial results over
//! disjoint key sets combine exactly:
//!
//!     lse = log(exp(lse_a) + exp(lse_b))
//!     o   = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)
//!
//! computed as `m = max(lse_a, lse_b)`, `lse = m + log(exp(lse_a - m) + exp(lse_b - m))`, so no
//! exponential overflows, and a -inf side contributes weight 0 (never NaN). The order of merges
//! changes results only by fp32 rounding. After the last merge `o` *is* the attention output; the
//! finalise step only converts it to the input dtype.
//!
//! Layout: head-major, `o[q_heads, tokens, head_dim]` (dense fp32) and `lse[q_heads, tokens]`
//! (fp32, base e). `lse` is the library's LSE output layout, so the state's `lse` can be the user's
//! LSE buffer. `o` is head-major so that the rows a thread block merges (consecutive tokens of one
//! head) are one contiguous range: reading the old state from [tokens, q_heads, head_dim], 512-byte
//! rows 16 KB apart, made a merge cost twice as much against plain output (docs/kernels.md).
//!
//! \code
//! ringattn::attention_state s{o_workspace, lse_out, tokens, q_heads, head_dim};
//! // ring steps merge into s; then finalise converts s.o to the output dtype
//! \endcode

#include <ringattn/config.cuh>

#include <cmath>
#include <cstdint>
#include <limits>

namespace ringattn {

//! Running (o, lse) of every (row, head) of a rank's queries. Non-owning; host or device memory.
struct attention_state {
  float* o = nullptr;   //!< [q_heads, tokens, head_dim], dense
  float* lse = nullptr; //!< [q_heads, tokens], natural log; -inf = no key seen yet
  std::int64_t tokens = 0;
  std::int32_t q_heads = 0;
  std::int32_t head_dim = 0;

  RINGATTN_HOST_DEVICE constexpr float* o_row(std::int64_t t, std::int32_t h) const {
    return o + (h * tokens + t) * head_dim;
  }
  RINGATTN_HOST_DEVICE constexpr float& lse_at(std::int64_t t, std::int32_t h) const {
    return lse[h * tokens + t];
  }
  //! Elements of `o` and `lse` (the workspace a caller provides).
  RINGATTN_HOST_DEVICE constexpr std::int64_t o_elements() const {
    return tokens * q_heads * head_dim;
  }
  RINGATTN_HOST_DEVICE constexpr std::int64_t lse_elements() const { return tokens * q_heads; }
};

//! Weights `(w_a, w_b)` and merged lse of two partial states with log-sum-exps `a` and `b`.
struct merge_weights {
  float lse;
  float wa;
  float wb;
};

//! The merge rule above, safe for -inf on either or both sides (a row with no key on both sides
//! stays at lse = -inf with both weights 0).
RINGATTN_HOST_DEVICE inline merge_weights merge_lse(float a, float b) {
  const float m = a > b ? a : b;
  constexpr float inf = __builtin_huge_valf(); // numeric_limits is host-only under nvcc
  if (m == -inf) return {-inf, 0.0f, 0.0f};
  const float ea = expf(a - m), eb = expf(b - m); // one of them is exactly 1
  const float s = ea + eb;
  return {m + logf(s), ea / s, eb / s};
}

} // namespace ringattn
