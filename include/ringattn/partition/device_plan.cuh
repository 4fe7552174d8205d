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

#include <ringattn/cuda_check.cuh>
#include <ringattn/partition/plan.cuh>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace ringattn {

//! Device-side view of a plan's tables (device pointers); trivially copyable.
struct device_plan_ref {
  const std::int32_t* cu_seqlens = nullptr;       //!< batch + 1
  const std::int32_t* local_cu_seqlens = nullptr; //!< ranks x (batch + 1), rank-major
  const std::int64_t* rank_offsets = nullptr;     //!< ranks + 1
  std::int32_t batch = 0;
  std::int32_t ranks = 0;
};

template <partitioner Partitioner>
class device_partition_plan {
public:
  using partitioner_type = Partitioner;

  //! Copies `plan`'s tables to the current device (synchronously; this is set-up, not run path).
  explicit device_partition_plan(const partition_plan<Partitioner>& plan) : host_(plan) {
    RINGATTN_CUDA_CHECK(cudaGetDevice(&device_));
    RINGATTN_CUDA_CHECK(
        cudaDeviceGetAttribute(&multiprocessors_, cudaDevAttrMultiProcessorCount, device_));
    const auto cu = plan.cu_seqlens();
    const auto lcu = plan.all_local_cu_seqlens();
    const auto ro = plan.rank_offsets();
    // One allocation: the int64 offsets first (8-byte aligned), then the int32 tables.
    const std::size_t bytes_ro = ro.size_bytes(), bytes_cu = cu.size_bytes();
    const std::size_t bytes = bytes_ro + bytes_cu + lcu.size_bytes();
    std::vector<unsigned char> staging(bytes);
    std::memcpy(staging.data(), ro.data(), bytes_ro);
    std::memcpy(staging.data() + bytes_ro, cu.data(), bytes_cu);
    std::memcpy(staging.data() + bytes_ro + bytes_cu, lcu.data(), lcu.size_bytes());
    RINGATTN_CUDA_CHECK(cudaMalloc(&memory_, bytes));
    const cudaError_t copied = cudaMemcpy(memory_, staging.data(), bytes, cudaMemcpyHostToDevice);
    if (copied != cudaSuccess) {
      cudaFree(memory_);
      RINGATTN_CUDA_CHECK(copied);
    }
    auto* base = static_cast<unsigned char*>(memory_);
    ref_.rank_offsets = reinterpret_cast<const std::int64_t*>(base);
    ref_.cu_seqlens = reinterpret_cast<const std::int32_t*>(base + bytes_ro);
    ref_.local_cu_seqlens = reinterpret_cast<const std::int32_t*>(base + bytes_ro + bytes_cu);
    ref_.batch = plan.batch();
    ref_.ranks = plan.ranks();
  }
  ~device_partition_plan() {
    if (memory_) cudaFree(memory_); // a destructor must not throw; nothing useful to report
  }
  device_partition_plan(device_partition_plan&& o) noexcept
      : host_(std::move(o.host_)), ref_(o.ref_), memory_(std::exchange(o.memory_, nullptr)),
        device_(o.device_), multiprocessors_(o.multiprocessors_) {}
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
  void* memory_ = nullptr;
  int device_ = 0;
  int multiprocessors_ = 0;
};

} // namespace ringattn
