#pragma once
//! \file
//! The mask policies of the BlockKernel family: which (query, key) pairs of a sequence interact,
//! as types a model takes as its template argument (`native_kernel<Mask>`,
//! `host_reference<Mask>`, `cudnn_kernel<Mask, T>`).

#include <ringattn/core/mask.cuh>

namespace ringattn {

//! Mask: every query sees every key of its sequence.
struct full_mask {
  static constexpr mask_kind kind = mask_kind::full;
  static constexpr const char* name = "full";
};
//! Mask: a query sees the keys at positions up to its own.
struct causal_mask {
  static constexpr mask_kind kind = mask_kind::causal;
  static constexpr const char* name = "causal";
};
//! Mask: the query at position p sees the keys at positions [p - left, p + right], `left` and
//! `right` being `attention_arguments::window_left` and `window_right` (-1: unbounded), agreed by
//! the ranks at plan time.
struct sliding_window_mask {
  static constexpr mask_kind kind = mask_kind::sliding_window;
  static constexpr const char* name = "sliding window";
};
//! Mask: causal attention to the keys at positions [p - left, p] (`left` =
//! `attention_arguments::window_left`, at least 0).
struct causal_window_mask {
  static constexpr mask_kind kind = mask_kind::causal_window;
  static constexpr const char* name = "causal window";
};

} // namespace ringattn
