#pragma once
// One thread per GPU of this process: running a body on each (rank r on device r), and making
// and releasing one NCCL communicator per GPU (creation and finalisation are collective, so
// every rank's call runs at the same time on its own thread).
#include "../support/ranks.hpp"

#include <ringattn/comm/nccl.cuh>
#include <ringattn/cuda_check.cuh>

#include <doctest/doctest.h>

#include <exception>
#include <optional>
#include <thread>
#include <vector>

namespace ringattn::test {

inline int gpu_count() {
  int n = 0;
  RINGATTN_CUDA_CHECK(cudaGetDeviceCount(&n));
  return n;
}

//! Runs `body(r)` for r in [0, n) on n threads, each with device r current; returns what each
//! threw.
template <class Body>
std::vector<std::exception_ptr> on_gpus(int n, Body body) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        RINGATTN_CUDA_CHECK(cudaSetDevice(r));
        body(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads)
    t.join();
  return errors;
}

//! One NCCL communicator per GPU (rank r on device r), released together on destruction.
struct nccl_per_gpu {
  std::vector<std::optional<nccl_communicator>> comms;

  explicit nccl_per_gpu(int n, std::chrono::milliseconds timeout = std::chrono::seconds(60))
      : comms(static_cast<std::size_t>(n)) {
    ncclUniqueId id;
    RINGATTN_NCCL_CHECK(ncclGetUniqueId(&id));
    for (const auto& e :
         on_gpus(n, [&](int r) { comms[static_cast<std::size_t>(r)].emplace(id, n, r, timeout); }))
      REQUIRE(message(e) == "");
  }
  ~nccl_per_gpu() {
    on_gpus(size(), [&](int r) { comms[static_cast<std::size_t>(r)].reset(); });
  }
  nccl_per_gpu(const nccl_per_gpu&) = delete;
  nccl_per_gpu& operator=(const nccl_per_gpu&) = delete;
  int size() const { return static_cast<int>(comms.size()); }
  nccl_communicator& operator[](int r) { return *comms[static_cast<std::size_t>(r)]; }
};

} // namespace ringattn::test
