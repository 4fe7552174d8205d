// doctest main for GPU tests (label gpu). Without a usable CUDA device the whole executable
// reports itself skipped: it returns 77, which CTest maps to "Skipped" (SKIP_RETURN_CODE), so a
// machine without a GPU never counts these tests as passed. The multigpu suite does the same with
// fewer than RINGATTN_TEST_MIN_GPUS devices.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cstdio>

#ifndef RINGATTN_TEST_MIN_GPUS
#define RINGATTN_TEST_MIN_GPUS 1 // the multigpu suite: 2
#endif

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("SKIPPED: no usable CUDA device (%s)\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 77;
  }
  if (devices < RINGATTN_TEST_MIN_GPUS) {
    std::printf("SKIPPED: %d CUDA device(s); these tests need %d\n", devices,
                RINGATTN_TEST_MIN_GPUS);
    return 77;
  }
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) == cudaSuccess)
    std::printf("GPU tests on %s (sm_%d%d, %d SMs)\n", p.name, p.major, p.minor,
                p.multiProcessorCount);
  doctest::Context context(argc, argv);
  return context.run();
}
