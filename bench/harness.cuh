#pragma once
// Shared benchmark harness: CUDA-event timing inside Google Benchmark, and the counters every
// ringattn benchmark reports (TFLOP/s, GB/s). Times are device times between two events on the
// benchmark's stream, after warm-up; Google Benchmark's manual-time mode aggregates them.
#include <ringattn/cuda_check.cuh>

#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace ringattn::bench {

namespace detail {
template <class T>
__global__ void fill_uniform(T* p, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    std::uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    p[i] = static_cast<T>(static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f);
  }
}
} // namespace detail

//! Fills `n` elements at `p` (device memory) with values uniform in [-1, 1) from a counter hash
//! of `seed`, on the device (generating long inputs on the host would dominate a benchmark).
template <class T>
void fill_uniform(T* p, std::size_t n, std::uint64_t seed) {
  detail::fill_uniform<<<1024, 256>>>(p, n, seed);
  RINGATTN_CUDA_CHECK_LAUNCH();
}

//! `n` such elements in new device memory (cudaFree it).
template <class T>
T* device_uniform(std::size_t n, std::uint64_t seed) {
  T* p = nullptr;
  RINGATTN_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T) + 16));
  fill_uniform(p, n, seed);
  return p;
}

//! FLOPs of attention forward over `q_tokens` x `k_tokens` per head: 4 b h s_q s_k d, half of that
//! for causal (the convention of the FlashAttention papers and PyTorch's benchmarks).
inline double attention_forward_flops(double batch, double heads, double q_tokens, double k_tokens,
                                      double head_dim, bool causal) {
  const double f = 4.0 * batch * heads * q_tokens * k_tokens * head_dim;
  return causal ? f / 2 : f;
}

//! Owns a stream and an event pair; `time(state, fn)` runs `fn(stream)` once per iteration and
//! reports the event-measured time.
class gpu_timer {
public:
  gpu_timer() {
    RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    RINGATTN_CUDA_CHECK(cudaEventCreate(&start_));
    RINGATTN_CUDA_CHECK(cudaEventCreate(&stop_));
  }
  ~gpu_timer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    cudaStreamDestroy(stream_);
  }
  gpu_timer(const gpu_timer&) = delete;
  gpu_timer& operator=(const gpu_timer&) = delete;
  cudaStream_t stream() const { return stream_; }

  template <class Fn>
  void time(benchmark::State& state, Fn&& fn, int warmup = 3) {
    for (int i = 0; i < warmup; ++i)
      fn(stream_);
    RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (auto _ : state) {
      RINGATTN_CUDA_CHECK(cudaEventRecord(start_, stream_));
      fn(stream_);
      RINGATTN_CUDA_CHECK(cudaEventRecord(stop_, stream_));
      RINGATTN_CUDA_CHECK(cudaEventSynchronize(stop_));
      float ms = 0.0f;
      RINGATTN_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      state.SetIterationTime(static_cast<double>(ms) / 1e3);
    }
  }

private:
  cudaStream_t stream_{};
  cudaEvent_t start_{}, stop_{};
};

//! Per-iteration work as rates over the measured (manual) time.
inline void report_flops(benchmark::State& state, double flops) {
  state.counters["TFLOP/s"] =
      benchmark::Counter(flops / 1e12, benchmark::Counter::kIsIterationInvariantRate);
}
inline void report_bytes(benchmark::State& state, double bytes) {
  state.counters["GB/s"] =
      benchmark::Counter(bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

//! True when a CUDA device is usable; otherwise the benchmark is skipped with the reason.
inline bool require_gpu(benchmark::State& state) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    state.SkipWithError("no CUDA device");
    return false;
  }
  return true;
}

//! Adds machine context (device name, SMs, clocks) to the benchmark's JSON output.
inline void add_device_context() {
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return;
  benchmark::AddCustomContext("device", p.name);
  benchmark::AddCustomContext("sm", std::to_string(p.major * 10 + p.minor));
  benchmark::AddCustomContext("multiprocessors", std::to_string(p.multiProcessorCount));
  benchmark::AddCustomContext("l2_bytes", std::to_string(p.l2CacheSize));
}

//! main() of every ringattn benchmark: Google Benchmark's, plus the device context in the output.
inline int run_benchmarks(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  add_device_context();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

} // namespace ringattn::bench
