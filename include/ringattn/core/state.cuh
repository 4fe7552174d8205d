#pragma once
//! \file
//! The running attention state that ring steps merge into, and its numerics.
//!
//! State of one (query row, head): a *reference* log-sum-exp `ref` (natural log; the lse of the
//! first block merged, moved only when a later block outgrows it), `o`, the sum of the merged
//! blocks' normalised outputs, each weighted by `exp(lse_block - ref)`, and `sum`, the sum of those
//! weights (fp32). A row that has seen no key has `ref = -inf`, `sum = 0`, `o = 0`. The attention
//! output is `o / sum` and its lse `ref + log(sum)`; `finalize` (or a ring's last step) writes
//! them. A block with log-sum-exp `lse_b` and normalised output `o_b` merges as
//!
//!     c    = exp(lse_b - ref)
//!     o   += c * o_b
//!     sum += c
//!
//! with `ref` unchanged, so a merge only *adds* to the state: the GPU may leave the read, the add
//! and the write to the L2 (`cp.reduce.async.bulk`, docs/kernels.md), and every merge rounds the
//! old values once, not once per rescale. Only when `ref = -inf` (nothing seen yet) or `lse_b`
//! exceeds `ref` by more than `rescale_above` (so that `c` and the sums stay far inside fp32's
//! range) does the row move its reference to `lse_b`: `o = o * s + o_b`, `sum = sum * s + 1`
//! with `s = exp(ref - lse_b)`. A block that saw no key (`lse_b = -inf`) changes nothing. The order
//! of merges changes results only by fp32 rounding. `merge_into` gives the factors; the kernels
//! round `c * o_b` (with `c * (1 / block sum)` as one factor) before adding, never fusing the two.
//!
//! Layout: head-major, `o[q_heads, tokens, head_dim]` (dense fp32), `lse[q_heads, tokens]` (the
//! reference until `finalize`, which replaces it by the row's lse; fp32, base e) and
//! `sum[q_heads, tokens]`. `lse` is the library's LSE output layout, so the state's `lse` can be
//! the user's LSE buffer. `o` is head-major so that the rows a thread block merges (consecutive
//! tokens of one head) are one contiguous range: reading the old state from [tokens, q_heads,
//! head_dim], 512-byte rows 16 KB apart, made a merge cost twice as much against plain output
//! (docs/kernels.md).
//!
//! `max_logit`, where a caller asks for it (else null, and no kernel spends anything on it), is
//! the per-head maximum of the logits the merged blocks saw: `max_logit[h] = max scale * q . k`
//! over every (row, key) of head h that the mask lets through, -inf while none was seen. A block
//! row whose weight sum is NaN (a NaN or an infinity reached its logits) makes its head's value
//! NaN, which no later maximum replaces (`max_logit_of`, `nan_max`).
//!
//! \code
//! ringattn::attention_state s{o_workspace, lse_out, sum_workspace, tokens, q_heads, head_dim};
//! // ring steps merge into s; then finalise writes o / sum in the output dtype and the lse
//! \endcode

#include <ringattn/config.cuh>
#include <ringattn/core/element.cuh>

#include <cmath>
#include <cstdint>
#include <limits>

namespace ringattn {

//! Running (o, reference lse, sum) of every (row, head) of a rank's queries. Non-owning; host or
//! device memory.
struct attention_state {
  float* o = nullptr;   //!< [q_heads, tokens, head_dim], dense
  float* lse = nullptr; //!< [q_heads, tokens], natural log: the reference; -inf = no key seen yet
  float* sum = nullptr; //!< [q_heads, tokens]: the merged blocks' weights, summed
  std::int64_t tokens = 0;
  std::int32_t q_heads = 0;
  std::int32_t head_dim = 0;
  //! [q_heads]: the heads' max logits so far (natural units), or null where nobody asked.
  float* max_logit = nullptr;

  RINGATTN_HOST_DEVICE constexpr float* o_row(std::int64_t t, std::int32_t h) const {
    return o + (h * tokens + t) * head_dim;
  }
  RINGATTN_HOST_DEVICE constexpr float& lse_at(std::int64_t t, std::int32_t h) const {
    return lse[h * tokens + t];
  }
  RINGATTN_HOST_DEVICE constexpr float& sum_at(std::int64_t t, std::int32_t h) const {
    return sum[h * tokens + t];
  }
  //! Elements of `o`, and of `lse` and of `sum` each (the workspace a caller provides).
  RINGATTN_HOST_DEVICE constexpr std::int64_t o_elements() const {
    return tokens * q_heads * head_dim;
  }
  RINGATTN_HOST_DEVICE constexpr std::int64_t lse_elements() const { return tokens * q_heads; }
};

//! How far (natural log) a block's lse may exceed a row's reference before the row moves its
//! reference. A merge's weight is then at most exp(24) = 2.6e10, so that o (a weighted sum of
//! the values) stays inside fp32's range over a thousand merges of values below 1e25.
inline constexpr float rescale_above = 24.0f;

//! How a block with log-sum-exp `lse_b` merges into a row whose reference is `ref`:
//! `o = o * old + o_b * block`, `sum = sum * old + block`, then `ref = new_ref`. In the common
//! case `old` is exactly 1 (`moves` false): the merge only adds.
struct row_merge {
  float old;     //!< factor on the row's o and sum
  float block;   //!< weight of the block's normalised output
  float new_ref; //!< the row's reference afterwards
  bool moves;    //!< the reference moves (old != 1)
};

//! The merge rule above, safe for -inf on either or both sides: a block that saw no key changes
//! nothing; a row that saw none takes the block as it is.
RINGATTN_HOST_DEVICE inline row_merge merge_into(float ref, float lse_b) {
  constexpr float inf = __builtin_huge_valf(); // numeric_limits is host-only under nvcc
  if (lse_b == -inf) return {1.0f, 0.0f, ref, false};
  if (ref != -inf && lse_b - ref <= rescale_above) return {1.0f, expf(lse_b - ref), ref, false};
  return {ref == -inf ? 0.0f : expf(ref - lse_b), 1.0f, lse_b, true};
}

//! Whether a row (or block row) with weight sum `sum` saw a key: a sum of exactly 0 means it saw
//! none; any other value, NaN included, is a row with keys. So a NaN that reached a row's sum
//! stays NaN in its output and lse and is never taken for "saw no key".
RINGATTN_HOST_DEVICE constexpr bool saw_key(float sum) { return sum != 0.0f; }

//! The attention output's lse of a row with reference `ref` and weight sum `sum` (-inf when the
//! row saw no key, NaN when NaN reached either).
RINGATTN_HOST_DEVICE inline float final_lse(float ref, float sum) {
  return saw_key(sum) ? ref + logf(sum) : -__builtin_huge_valf();
}

//! The normalising factor 1 / sum of a row's output (0 for a row that saw no key, whose o is 0).
RINGATTN_HOST_DEVICE inline float inverse_sum(float sum) {
  return saw_key(sum) ? 1.0f / sum : 0.0f;
}

//! The larger of two max logits, NaN when either is NaN (a maximum that drops NaN would turn a
//! non-finite input into a finite answer).
RINGATTN_HOST_DEVICE constexpr float nan_max(float a, float b) {
  return a != a ? a : b != b ? b : (b > a ? b : a);
}

//! What a block row adds to its head's max logit: its largest logit `row_max` (natural units)
//! where it saw a key, NaN where its weight sum `sum` is NaN, -inf where it saw none.
RINGATTN_HOST_DEVICE constexpr float max_logit_of(float row_max, float sum) {
  return sum != sum ? sum : saw_key(sum) ? row_max : -__builtin_huge_valf();
}

//! One element of one (row, head) merged from `parts` finished partials (a normalised output and
//! an lse per row, as the ranks of `sharded_attention` exchange them), in the order r = 0, 1, ...:
//! partial r's lse is `lse_of[r * lse_stride]` and its output element `to_float(o[r * o_stride])`.
//! Writes the row's lse to `lse` and returns the output element (0 for a row that saw no key).
//! Each partial merges as a block by `merge_into`, one with lse -inf (it saw no key of the row)
//! changing nothing: host and device compute the same steps. NaN in a partial's lse reaches the
//! row's output and lse, NaN in an output element that element.
template <class O>
RINGATTN_HOST_DEVICE inline float merge_finished(int parts, const float* lse_of,
                                                 std::int64_t lse_stride, const O* o,
                                                 std::int64_t o_stride, float& lse) {
  float r = -__builtin_huge_valf(), s = 0.0f, acc = 0.0f;
  for (int p = 0; p < parts; ++p) {
    const float lb = lse_of[p * lse_stride];
    if (lb == -__builtin_huge_valf()) continue; // this partial saw no key of the row
    const row_merge m = merge_into(r, lb);
    acc = acc * m.old + to_float(o[p * o_stride]) * m.block;
    s = s * m.old + m.block;
    r = m.new_ref;
  }
  lse = final_lse(r, s);
  return acc * inverse_sum(s);
}

} // namespace ringattn
