#pragma once
//! \file
//! The Schedule family's concept: how the work reaches the ranks.

#include <ringattn/arguments.cuh>
#include <ringattn/core/kv_scales.cuh>

#include <concepts>
#include <cstddef>

namespace ringattn {

//! A Schedule decides how the work reaches the ranks (the ring passes K/V blocks on step by
//! step; the all-gather gathers them once; the all-to-all trades heads for tokens): it names
//! itself, plans a rank's part once (`plan_type`, made by `S::plan(partition plan, rank,
//! window, arguments)`), says which schedule of block-kernel calls that plan runs and with which
//! arguments (`compute`, `compute_arguments`: the device schedules are made from them), and lays
//! out the workspace its paths use (`layout_type`). Its host and device paths (`host_forward`,
//! `device_backward`, ...) are static member templates the driver instantiates per call.
template <class S>
concept schedule_policy = requires(const typename S::plan_type& plan,
                                   const typename S::layout_type& layout,
                                   const attention_arguments& args) {
  { S::name } -> std::convertible_to<const char*>;
  { S::workspace(plan, args, element_format{2}) } -> std::same_as<typename S::layout_type>;
  {S::compute(plan).steps()};
  { S::compute_arguments(plan, args) } -> std::convertible_to<attention_arguments>;
  { layout.forward_bytes() } -> std::convertible_to<std::size_t>;
  { layout.device_backward_bytes() } -> std::convertible_to<std::size_t>;
  { layout.largest_message(true) } -> std::convertible_to<std::size_t>;
  { S::host_backward_bytes(layout) } -> std::convertible_to<std::size_t>;
};

} // namespace ringattn
