#pragma once
//! \file
//! The CUDA objects a device path holds for its lifetime: its communication stream and the events
//! that order it against the caller's stream, each destroyed with its owner.

#include <ringattn/cuda_check.cuh>

#include <cuda_runtime_api.h>

#include <utility>

namespace ringattn::detail {

//! A stream for the exchanges on the current device: non-blocking, at the device's highest
//! priority, so that a communication kernel (NCCL's) enqueued while a block kernel fills the GPU
//! gets the next free SM instead of queueing behind the block kernel's remaining waves.
class comm_stream {
public:
  comm_stream() {
    RINGATTN_CUDA_CHECK(cudaGetDevice(&device_));
    int least = 0, greatest = 0;
    RINGATTN_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    RINGATTN_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest));
  }
  ~comm_stream() {
    if (stream_) cudaStreamDestroy(stream_); // a destructor must not throw
  }
  comm_stream(const comm_stream&) = delete;
  comm_stream& operator=(const comm_stream&) = delete;

  operator cudaStream_t() const noexcept { return stream_; }
  //! The device the stream was created on.
  int device() const noexcept { return device_; }

private:
  int device_ = -1;
  cudaStream_t stream_ = nullptr;
};

//! An event that orders work between streams (no timing).
class ordering_event {
public:
  ordering_event() {
    RINGATTN_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~ordering_event() {
    if (event_) cudaEventDestroy(event_);
  }
  ordering_event(ordering_event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  ordering_event& operator=(ordering_event&& o) noexcept {
    std::swap(event_, o.event_);
    return *this;
  }
  ordering_event(const ordering_event&) = delete;
  ordering_event& operator=(const ordering_event&) = delete;

  operator cudaEvent_t() const noexcept { return event_; }

private:
  cudaEvent_t event_ = nullptr;
};

} // namespace ringattn::detail
