#pragma once
//! \file
//! `host_reference<Mask>`: the BlockKernel with the host twin alone (block/device/host_forward.cuh,
//! block/device/host_backward.cuh) and no device path; the base of every shipped model, whose host
//! forward and backward it provides. Includes no device kernel.

#include <ringattn/block/device/host_backward.cuh>
#include <ringattn/block/device/host_forward.cuh>
#include <ringattn/block/masks.cuh>
#include <ringattn/concepts.cuh>

#include <cuda_runtime_api.h>

#include <span>

namespace ringattn {

namespace detail {
//! False for every type: a `static_assert` that fires only where a template is instantiated.
template <class>
inline constexpr bool dependent_false = false;
} // namespace detail

//! The host twin alone under `Mask`: a BlockKernel with no device path (CPU runs, tests).
template <class Mask>
struct host_reference {
  static_assert(mask_policy<Mask>,
                "ringattn::host_reference<Mask>: Mask must be a mask "
                "(ringattn::full_mask, ringattn::causal_mask, "
                "ringattn::sliding_window_mask or ringattn::causal_window_mask)");
  static constexpr mask_kind mask = Mask::kind;
  static constexpr const char* name = Mask::name;
  template <element T>
  static void host_forward(const block_forward_args<T>& a, std::span<const block_group> groups) {
    detail::host_block_forward_rows(a, groups);
  }
  template <element T>
  static void host_backward(const block_backward_args<T>& a, std::span<const block_group> groups) {
    detail::host_block_backward_rows(a, groups);
  }
};

static_assert(block_kernel<host_reference<causal_mask>> &&
              !device_block_kernel_for<host_reference<causal_mask>, cudaStream_t>);

} // namespace ringattn
