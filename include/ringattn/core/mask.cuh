#pragma once
//! \file
//! Mask kinds: which (query, key) pairs of one sequence interact. Plain data, for host and device.

namespace ringattn {

//! Which (query, key) pairs of one sequence interact. Positions are global positions in the
//! sequence (0-based), whatever partitioner placed the tokens.
enum class mask_kind {
  full,           //!< every query sees every key of its sequence
  causal,         //!< query at position p sees keys at positions <= p
  sliding_window, //!< query at p sees keys in [p - left, p + right] (either side may be unbounded)
  causal_window,  //!< query at p sees keys in [p - left, p]
};

constexpr const char* to_string(mask_kind m) noexcept {
  switch (m) {
  case mask_kind::full: return "full";
  case mask_kind::causal: return "causal";
  case mask_kind::sliding_window: return "sliding window";
  case mask_kind::causal_window: return "causal window";
  }
  return "unknown";
}

//! Whether a mask kind takes its extent from `attention_arguments::window_left/right`.
constexpr bool has_window(mask_kind m) noexcept {
  return m == mask_kind::sliding_window || m == mask_kind::causal_window;
}

} // namespace ringattn
