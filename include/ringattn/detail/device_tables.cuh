#pragma once
//! \file
//! Host arrays packed into one device allocation at plan time (one allocation, one copy), each
//! starting 16-byte aligned: the tables of the kernels' schedules and of device partition plans.

#include <ringattn/cuda_check.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

namespace ringattn::detail {

class device_tables {
public:
  device_tables() = default;
  //! Copies every span to the current device, synchronously; `at<T>(i)` is where span i landed.
  template <class... T>
  explicit device_tables(std::span<const T>... parts) {
    const std::size_t sizes[] = {parts.size_bytes()...};
    std::size_t total = 0;
    for (std::size_t n : sizes) {
      offsets_.push_back(total);
      total += (n + 15) / 16 * 16;
    }
    std::vector<unsigned char> staging(std::max<std::size_t>(total, 16));
    std::size_t i = 0;
    (copy_part(staging.data() + offsets_[i++], parts.data(), parts.size_bytes()), ...);
    RINGATTN_CUDA_CHECK(device_malloc(&memory_, staging.size()));
    const cudaError_t e =
        cudaMemcpy(memory_, staging.data(), staging.size(), cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
      cudaFree(memory_);
      memory_ = nullptr;
      RINGATTN_CUDA_CHECK(e);
    }
  }
  ~device_tables() {
    if (memory_) cudaFree(memory_); // a destructor must not throw; nothing useful to report
  }
  device_tables(device_tables&& o) noexcept
      : memory_(std::exchange(o.memory_, nullptr)), offsets_(std::move(o.offsets_)) {}
  device_tables& operator=(device_tables&& o) noexcept {
    std::swap(memory_, o.memory_);
    std::swap(offsets_, o.offsets_);
    return *this;
  }
  device_tables(const device_tables&) = delete;
  device_tables& operator=(const device_tables&) = delete;

  template <class T>
  T* at(std::size_t i) const {
    return reinterpret_cast<T*>(static_cast<unsigned char*>(memory_) + offsets_.at(i));
  }

private:
  static void copy_part(unsigned char* dst, const void* src, std::size_t n) {
    if (n) std::memcpy(dst, src, n);
  }
  void* memory_ = nullptr;
  std::vector<std::size_t> offsets_;
};

} // namespace ringattn::detail
