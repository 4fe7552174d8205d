// Bad input that needs two GPUs (docs/reliability.md): a stream, a current device or a buffer of
// another device than the one the rank prepared is refused before any kernel runs, with nothing
// sent or written.
#include "../support/bad_device_call.cuh"

#include <doctest/doctest.h>

using namespace ringattn;

TEST_CASE("a stream, current device or buffer of another device is refused") {
  using test::device_call;
  using test::forward_with;
  RINGATTN_CUDA_CHECK(cudaSetDevice(0));
  bool clean = false;
  cudaStream_t other = nullptr;
  std::string what = forward_with(
      [&](device_call& c) {
        RINGATTN_CUDA_CHECK(cudaSetDevice(1));
        RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
        RINGATTN_CUDA_CHECK(cudaSetDevice(0));
        c.stream = other;
      },
      clean);
  CHECK(what.find("the stream belongs to device 1; this rank runs on device 0") !=
        std::string::npos);
  CHECK(clean);
  RINGATTN_CUDA_CHECK(cudaStreamDestroy(other));

  what = forward_with([](device_call& c) { c.device_at_call = 1; }, clean);
  CHECK(what.find("the current device is 1 but prepare_device() ran on 0") != std::string::npos);
  CHECK(clean);

  void* far = nullptr; // q's bytes on device 1
  RINGATTN_CUDA_CHECK(cudaSetDevice(1));
  RINGATTN_CUDA_CHECK(cudaMalloc(&far, device_call::n * 8 * 64 * sizeof(__nv_bfloat16)));
  RINGATTN_CUDA_CHECK(cudaSetDevice(0));
  what = forward_with([&](device_call& c) { c.qv.data = static_cast<const __nv_bfloat16*>(far); },
                      clean);
  CHECK(what.find("q is device memory of another device (1; this rank runs on device 0)") !=
        std::string::npos);
  CHECK(clean);
  RINGATTN_CUDA_CHECK(cudaFree(far));

  // The unbroken call on the same set-up runs and writes (so the checks above can fail).
  CHECK(forward_with([](device_call&) {}, clean) == "");
  CHECK_FALSE(clean);
}
