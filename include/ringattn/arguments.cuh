#pragma once
//! \file
//! The shape-independent arguments of one attention problem, and their validation.
//!
//! LSE convention, everywhere in the library: `lse[h, t] = log(sum_j exp(scale * q_t . k_j))`,
//! natural log (base e), fp32, laid out `[q_heads, tokens]`. A row that sees no key has
//! LSE = -inf and output 0.
//!
//! \code
//! ringattn::attention_arguments args{.q_heads = 32, .kv_heads = 8, .head_dim = 128};
//! args.validate().throw_if_invalid();          // GQA 4:1, scale defaults to 1/sqrt(128)
//! ringattn::attention_arguments mla{.q_heads = 128, .kv_heads = 128, .head_dim = 192,
//!                                   .head_dim_v = 128}; // q/k 192 wide, v and out 128
//! \endcode

#include <ringattn/core/mask.cuh>
#include <ringattn/core/segment.cuh>
#include <ringattn/error.cuh>

#include <cmath>
#include <cstdint>

namespace ringattn {

//! Head widths an attention problem may have, for Q/K and for V alike. Which pairs a BlockKernel
//! runs is its own business: the host kernels take any pair, the native device kernels equal
//! widths of 64, 128 or 256 and (sm_90a) Q/K 192 with V 128, the cuDNN model what cuDNN takes.
inline constexpr int supported_head_dims[] = {64, 128, 192, 256};
//! The largest of them (the host kernels keep a row of this many doubles on the stack).
inline constexpr int max_head_dim = 256;
//! The most query heads an attention problem may have: with int32 token counts it keeps every
//! workspace and message size far inside 64 bits.
inline constexpr int max_heads = 65536;

//! Heads, head widths and softmax scale of an attention problem (self-attention; q and k/v share
//! their token positions).
//!
//! Q and K are `head_dim` wide; V, the output and their gradients `head_dim_v` wide (0: the same).
//! Multi-head latent attention (DeepSeek) runs its prefill with head_dim 192 and head_dim_v 128.
struct attention_arguments {
  std::int32_t q_heads = 0;  //!< query heads (a multiple of kv_heads)
  std::int32_t kv_heads = 0; //!< key/value heads; kv_heads < q_heads is GQA, 1 is MQA
  std::int32_t head_dim = 0; //!< width of q and k: 64, 128, 192 or 256
  //! Multiplies q . k before the softmax; 0 selects the default 1 / sqrt(head_dim).
  float softmax_scale = 0.0f;
  //! The window of `sliding_window_mask` and `causal_window_mask`: the query at position p sees
  //! the keys of its sequence at positions [p - window_left, p + window_right]; -1 leaves that
  //! side unbounded. The other masks take no window (both stay -1).
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  //! Width of v, of the output and of dv: 64, 128, 192 or 256; 0 is head_dim.
  std::int32_t head_dim_v = 0;

  //! Width of q, k, dq and dk.
  [[nodiscard]] std::int32_t qk_dim() const { return head_dim; }
  //! Width of v, out, dout and dv.
  [[nodiscard]] std::int32_t v_dim() const { return head_dim_v != 0 ? head_dim_v : head_dim; }
  //! Whether V is narrower or wider than Q/K.
  [[nodiscard]] bool separate_widths() const { return v_dim() != head_dim; }

  //! The scale actually applied.
  [[nodiscard]] double scale() const {
    return softmax_scale != 0.0f ? static_cast<double>(softmax_scale)
                                 : 1.0 / std::sqrt(static_cast<double>(head_dim));
  }
  //! Query heads per kv head.
  [[nodiscard]] std::int32_t group_size() const { return q_heads / kv_heads; }
  //! The key positions a query sees under mask `m` with this window.
  [[nodiscard]] position_window window(mask_kind m) const {
    return position_window::of(m, window_left, window_right);
  }

  //! Rejects non-positive counts, q_heads not a multiple of kv_heads, an unsupported head_dim or
  //! head_dim_v and a non-finite or negative scale.
  [[nodiscard]] validation validate() const {
    validation r = validation::ok();
    r.require(q_heads > 0, "q_heads must be positive (got ", q_heads, ")");
    r.require(q_heads <= max_heads, "q_heads (", q_heads, ") exceeds ", max_heads);
    r.require(kv_heads > 0, "kv_heads must be positive (got ", kv_heads, ")");
    r.require(!r || q_heads % kv_heads == 0, "q_heads (", q_heads,
              ") is not a multiple of kv_heads (", kv_heads, ")");
    bool dim_ok = false, v_ok = head_dim_v == 0;
    for (int d : supported_head_dims) {
      dim_ok = dim_ok || d == head_dim;
      v_ok = v_ok || d == head_dim_v;
    }
    r.require(dim_ok, "head_dim ", head_dim, " is not supported (supported: 64, 128, 192, 256)");
    r.require(v_ok, "head_dim_v ", head_dim_v,
              " is not supported (supported: 64, 128, 192, 256, or 0 for head_dim)");
    r.require(std::isfinite(softmax_scale) && softmax_scale >= 0.0f, "softmax_scale ",
              softmax_scale, " must be finite and >= 0 (0 selects 1/sqrt(head_dim))");
    r.require(window_left >= -1 && window_right >= -1, "window_left (", window_left,
              ") and window_right (", window_right, ") must be >= 0, or -1 for unbounded");
    return r;
  }
  //! `validate()`, and whether the window fits mask `m`: only the window masks take one, and
  //! `causal_window_mask` needs a bounded left side and nothing ahead (window_right 0 or -1).
  [[nodiscard]] validation validate(mask_kind m) const {
    validation r = validate();
    if (!has_window(m))
      r.require(window_left == -1 && window_right == -1, "window_left (", window_left,
                ") and window_right (", window_right, ") are set but the mask is ", to_string(m),
                ", which takes no window: use the BlockKernel ringattn::sliding_window or "
                "ringattn::causal_window (ringattn::host_reference<ringattn::sliding_window_mask> "
                "or <ringattn::causal_window_mask> on the host), or leave both at -1");
    if (m == mask_kind::causal_window) {
      r.require(window_left >= 0, "the causal window mask needs window_left >= 0 (got ",
                window_left, "); without one it is the BlockKernel ringattn::causal");
      r.require(window_right <= 0,
                "the causal window mask sees no key ahead of the query, but "
                "window_right is ",
                window_right,
                " (leave it -1 or 0, or use the BlockKernel ringattn::sliding_window)");
    }
    return r;
  }
};

} // namespace ringattn
