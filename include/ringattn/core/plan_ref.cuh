#pragma once
//! \file
//! The device handle of a partition plan's tables (partition/device_plan.cuh owns them).

#include <ringattn/core/segment.cuh>

#include <cstdint>

namespace ringattn {

//! Device-side view of a plan's tables (device pointers); trivially copyable.
struct device_plan_ref {
  const std::int32_t* cu_seqlens = nullptr;       //!< batch + 1
  const std::int32_t* local_cu_seqlens = nullptr; //!< ranks x (batch + 1), rank-major
  const std::int64_t* rank_offsets = nullptr;     //!< ranks + 1
  const placement* placements = nullptr;          //!< batch, or null: every sequence on every rank
  std::int32_t batch = 0;
  std::int32_t ranks = 0;
};

} // namespace ringattn
