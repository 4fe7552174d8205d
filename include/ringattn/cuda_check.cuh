#pragma once
//! \file
//! Checked CUDA runtime calls. Usable from plain C++ (the runtime API is a host library).
//!
//! \code
//! RINGATTN_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream));
//! kernel<<<grid, block, smem, stream>>>(args);
//! RINGATTN_CUDA_CHECK_LAUNCH();   // reports a bad launch; with RINGATTN_DEBUG_SYNC also syncs
//! \endcode

#include <ringattn/error.cuh>

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace ringattn::detail {
//! Throws `cuda_error` naming the call, CUDA's text and name for the code, and the rank.
inline void check_cuda(cudaError_t code, const char* call, const char* file, int line) {
  if (code == cudaSuccess) return;
  std::string text = std::string(cudaGetErrorString(code)) + " (" + cudaGetErrorName(code) + ")";
  throw cuda_error(call_failure(call, text, file, line), static_cast<int>(code));
}
} // namespace ringattn::detail

//! Evaluates a CUDA runtime call and throws `ringattn::cuda_error` if it fails.
#define RINGATTN_CUDA_CHECK(call) ::ringattn::detail::check_cuda((call), #call, __FILE__, __LINE__)

// RINGATTN_COUNT_LAUNCHES (tests): every launch the library makes is counted in
// `ringattn::detail::kernel_launches`, so a test can show that a rejected call launched nothing.
#if defined(RINGATTN_COUNT_LAUNCHES)
namespace ringattn::detail {
inline std::atomic<std::uint64_t> kernel_launches{0};
} // namespace ringattn::detail
#define RINGATTN_NOTE_LAUNCH() (void)::ringattn::detail::kernel_launches.fetch_add(1)
#else
#define RINGATTN_NOTE_LAUNCH() (void)0
#endif

// RINGATTN_COUNT_ALLOCATIONS (tests): every device or pinned allocation the library makes, and
// every kernel attribute it sets, is counted, so a test can show that a warmed-up run path makes
// neither.
#if defined(RINGATTN_COUNT_ALLOCATIONS)
namespace ringattn::detail {
inline std::atomic<std::uint64_t> device_allocations{0};
inline std::atomic<std::uint64_t> attribute_sets{0};
} // namespace ringattn::detail
#define RINGATTN_NOTE_ALLOCATION() (void)::ringattn::detail::device_allocations.fetch_add(1)
#define RINGATTN_NOTE_ATTRIBUTE() (void)::ringattn::detail::attribute_sets.fetch_add(1)
#else
#define RINGATTN_NOTE_ALLOCATION() (void)0
#define RINGATTN_NOTE_ATTRIBUTE() (void)0
#endif

namespace ringattn::detail {
//! cudaMalloc, counted under RINGATTN_COUNT_ALLOCATIONS (plan-time paths only).
template <class T>
cudaError_t device_malloc(T** p, std::size_t bytes) {
  RINGATTN_NOTE_ALLOCATION();
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
//! cudaHostAlloc, likewise.
template <class T>
cudaError_t pinned_malloc(T** p, std::size_t bytes) {
  RINGATTN_NOTE_ALLOCATION();
  return cudaHostAlloc(reinterpret_cast<void**>(p), bytes, cudaHostAllocDefault);
}
} // namespace ringattn::detail

#if defined(RINGATTN_DEBUG_SYNC)
#define RINGATTN_CUDA_CHECK_LAUNCH()                                                               \
  do {                                                                                             \
    RINGATTN_NOTE_LAUNCH();                                                                        \
    RINGATTN_CUDA_CHECK(cudaGetLastError());                                                       \
    RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());                                                  \
  } while (0)
#else
//! Checks that the last kernel launch was accepted (bad configuration, missing image, ...).
#define RINGATTN_CUDA_CHECK_LAUNCH()                                                               \
  do {                                                                                             \
    RINGATTN_NOTE_LAUNCH();                                                                        \
    RINGATTN_CUDA_CHECK(cudaGetLastError());                                                       \
  } while (0)
#endif
