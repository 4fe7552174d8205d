#pragma once
// A minimal RAII device buffer for tests.
#include <ringattn/cuda_check.cuh>

#include <cuda_runtime_api.h>

#include <vector>

namespace ringattn::test {
template <class T>
class device_buffer {
public:
  explicit device_buffer(std::size_t n) : n_(n) {
    RINGATTN_CUDA_CHECK(cudaMalloc(&p_, (n ? n : 1) * sizeof(T)));
  }
  explicit device_buffer(const std::vector<T>& h) : device_buffer(h.size()) { upload(h); }
  ~device_buffer() { cudaFree(p_); }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  T* get() const { return p_; }
  std::size_t size() const { return n_; }
  void upload(const std::vector<T>& h) {
    RINGATTN_CUDA_CHECK(cudaMemcpy(p_, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    RINGATTN_CUDA_CHECK(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }

private:
  T* p_ = nullptr;
  std::size_t n_;
};
} // namespace ringattn::test
