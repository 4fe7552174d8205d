#pragma once
//! \file
//! Launch helpers of the host-side launchers: a kernel's dynamic shared-memory limit is set once
//! per (kernel, device), on its first launch there, never again on the run path.

#include <ringattn/cuda_check.cuh>

#include <cuda_runtime_api.h>

#include <mutex>

namespace ringattn::detail {

//! Lets `kernel` take `bytes` of dynamic shared memory on the current device. The first call for
//! a (kernel, device) pair sets the attribute; later ones find it in a fixed table (no
//! allocation). Past the table's size (more kernels than any build instantiates) it is set each
//! time, which stays correct.
inline void allow_dynamic_smem(const void* kernel, int bytes) {
  struct entry {
    const void* kernel;
    int device;
    int bytes;
  };
  constexpr int capacity = 512;
  static std::mutex mutex;
  static entry seen[capacity];
  static int count = 0;
  int device = 0;
  RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard lock(mutex);
  for (int i = 0; i < count; ++i)
    if (seen[i].kernel == kernel && seen[i].device == device && seen[i].bytes >= bytes) return;
  RINGATTN_NOTE_ATTRIBUTE();
  RINGATTN_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  if (count < capacity) seen[count++] = {kernel, device, bytes};
}

} // namespace ringattn::detail
