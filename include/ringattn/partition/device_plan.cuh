#pragma once
//! \file
//! `device_partition_plan<Partitioner>`: a partition plan's tables copied to device memory once, so
//! device scatter/gather (and later the ring kernels) can map tokens without host help.
//!
//! Allocation happens here, at plan time, never in the run path. The object owns the memory
//! (RAII, move-only); `ref()` is a trivially copyable handle for kernels.
//!
//! \code
//! ringattn::partition_plan<ringattn::zigzag> plan(cu_seqlens, ranks);
//! ringattn::device_partition_plan<ringattn::zigzag> dplan(plan);    // on the current device
//! ringattn::scatter(dplan, rank, full, shard, stream);
//! \endcode

#include <ringattn/core/plan_ref.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/detail/device_tables.cuh>
#include <ringattn/partition/plan.cuh>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace ringattn {

template <partitioner Partitioner>
class device_partition_plan {
public:
  using partitioner_type = Partitioner;

  //! Copies `plan`'s tables to the current device (synchronously; this is set-up, not run path).
  explicit device_partition_plan(const partition_plan<Partitioner>& plan) : host_(plan) {
    RINGATTN_CUDA_CHECK(cudaGetDevice(&device_));
    RINGATTN_CUDA_CHECK(
        cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, device_));
    tables_ = detail::device_tables(plan.rank_offsets(), plan.cu_seqlens(),
                                    plan.all_local_cu_seqlens(), plan.placements());
    ref_.rank_offsets = tables_.at<const std::int64_t>(0);
    ref_.cu_seqlens = tables_.at<const std::int32_t>(1);
    ref_.local_cu_seqlens = tables_.at<const std::int32_t>(2);
    if (!plan.placements().empty()) ref_.placements = tables_.at<const placement>(3);
    ref_.batch = plan.batch();
    ref_.ranks = plan.ranks();
  }
  device_partition_plan(device_partition_plan&&) noexcept = default;
  device_partition_plan& operator=(device_partition_plan&&) = delete;
  device_partition_plan(const device_partition_plan&) = delete;
  device_partition_plan& operator=(const device_partition_plan&) = delete;

  //! The host plan this was made from.
  const partition_plan<Partitioner>& host() const noexcept { return host_; }
  //! Handle for kernels.
  const device_plan_ref& ref() const noexcept { return ref_; }
  //! Device the tables live on.
  int device() const noexcept { return device_; }
  //! Multiprocessors of that device (sizes persistent grids).
  int multiprocessors() const noexcept { return multiprocessors_; }

private:
  partition_plan<Partitioner> host_;
  device_plan_ref ref_{};
  detail::device_tables tables_; // rank offsets, cu_seqlens, local cu_seqlens, placements
  int device_ = 0;
  int multiprocessors_ = 0;
};

} // namespace ringattn
