#pragma once
//! \file
//! Mask kinds: which (query, key) pairs of one sequence interact. Plain data, for host and device.

namespace ringattn {

//! Which (query, key) pairs of one sequence interact. Positions are global positions in the
//! sequence (0-based), whatever partitioner placed the tokens.
enum class mask_kind {
  full,   //!< every query sees every key of its sequence
  causal, //!< query at position p sees keys at positions <= p
};

constexpr const char* to_string(mask_kind m) noexcept {
  return m == mask_kind::causal ? "causal" : "full";
}

} // namespace ringattn
