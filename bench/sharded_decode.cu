// A decode step over a KV cache sharded across P virtual ranks on one GPU (threads of an
// in-process group, a stream each): 32 sequences of 1 or 8 new tokens each (the 8 causal among
// themselves, as speculative or multi-token decoding) against 32768 cached tokens each (1M
// tokens in all), bf16, 32 query heads, 8 kv heads, head_dim 128. Each rank
// holds the cached tokens it owns by position mod P (the round-robin layout), attends to them
// with every new query, and the ranks exchange and merge their partial states
// (sharded_attention). P = 1 is one GPU attending the whole cache with the same code. Time of a
// step: CUDA events recorded on each rank's stream before and after its `forward` (the host work
// of the call included, as in the PyTorch baseline's timing), from the earliest start to the
// latest end over the ranks; the `plan` rows time the per-step plan (the ranks' agreement and the
// kernel schedules) on its own, by host wall clock in each rank's thread around its call, the
// longest over the ranks.
// Counters: `bytes_per_rank` (what a rank sends per step), `cache_tokens`, and the cache's K/V
// bytes read per second (`cache_bytes_per_second`). bench/baselines/sdpa_baseline.py --decode
// times PyTorch SDPA over the whole cache at the same shape.
// Variants: the cache paged (pages of 16 tokens, each rank's pages in a seeded shuffled order of
// its pool, the page table copied to the device by `plan`); one sequence of 131072 cached
// tokens instead of 32 of 32768; the cache in FP8 (e4m3, quantised from the bf16 cache with a
// scale per kv head, or per page and kv head; `cache_bytes_per_second` then counts its bytes).
#include "harness.cuh"

#include <ringattn/block/device/kv_quantize.cuh>
#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/sharded_attention.cuh>
#if defined(RINGATTN_BENCH_CUDNN)
#include <ringattn/cudnn.cuh>
#endif

#include <algorithm>
#include <barrier>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace {
using T = __nv_bfloat16;
constexpr int q_heads = 32, kv_heads = 8, head_dim = 128;
constexpr int page_size = 16;

// One thread per rank for the whole benchmark: `run(job)` has every rank run `job(rank)` and
// returns when all are done (two barrier phases; no thread is started per step).
class rank_threads {
public:
  explicit rank_threads(int ranks) : start_(ranks + 1), done_(ranks + 1) {
    for (int r = 0; r < ranks; ++r)
      threads_.emplace_back([this, r] {
        for (;;) {
          start_.arrive_and_wait();
          if (stop_) return;
          job_(r);
          done_.arrive_and_wait();
        }
      });
  }
  ~rank_threads() {
    stop_ = true;
    start_.arrive_and_wait();
    for (auto& t : threads_)
      t.join();
  }
  void run(std::function<void(int)> job) {
    job_ = std::move(job);
    start_.arrive_and_wait();
    done_.arrive_and_wait();
  }

private:
  std::barrier<> start_, done_;
  std::function<void(int)> job_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

// range(0): ranks; range(1): 1 times the plan alone, 0 the step; range(2): new tokens per
// sequence; range(3): 1 pages the cache; range(4): 1 for one sequence of 131072 cached tokens,
// 0 for 32 of 32768; range(5): the cache's elements, 0 bf16, 1 FP8 with head scales, 2 FP8 with
// page scales.
template <class Kernel>
void decode_step(benchmark::State& state) {
  if (!ringattn::bench::require_gpu(state)) return;
  const int ranks = static_cast<int>(state.range(0));
  const bool plan_only = state.range(1) != 0;
  const int fresh = static_cast<int>(state.range(2));
  const bool paged = state.range(3) != 0;
  const int sequences = state.range(4) != 0 ? 1 : 32;
  const std::int32_t cache_per_sequence = state.range(4) != 0 ? 131072 : 32768;
  const int fp8 = static_cast<int>(state.range(5)); // 0 bf16, 1 head scales, 2 page scales
  const ringattn::attention_arguments args{q_heads, kv_heads, head_dim, 0.0f};
  using decoder = ringattn::sharded_attention<ringattn::in_process_communicator, Kernel>;
  ringattn::in_process_group group(ranks, std::chrono::seconds(120));
  struct rank_state {
    std::unique_ptr<ringattn::in_process_communicator> comm;
    std::unique_ptr<decoder> dec;
    std::vector<std::int32_t> cu_cache;
    std::vector<std::int32_t> cu_pages, table, length; // paged: the page table
    std::int64_t pages = 0;
    T *q = nullptr, *k = nullptr, *v = nullptr, *kc = nullptr, *vc = nullptr, *out = nullptr;
    ringattn::fp8_e4m3 *kc8 = nullptr, *vc8 = nullptr;
    float *lse = nullptr, *scales = nullptr;
    void* ws = nullptr;
    cudaEvent_t start = nullptr, stop = nullptr;
    std::size_t ws_bytes = 0;
    std::int64_t cached = 0;
    cudaStream_t stream = nullptr;
  };
  std::vector<rank_state> rs(static_cast<std::size_t>(ranks));
  auto plan = [paged](rank_state& s, std::span<const std::int32_t> cu_new) {
    if (paged)
      s.dec->plan(cu_new, ringattn::paged_cache{page_size, s.pages, s.cu_pages, s.table, s.length});
    else
      s.dec->plan(cu_new, s.cu_cache);
  };
  std::vector<std::int32_t> cu_new{0};
  for (int b = 0; b < sequences; ++b)
    cu_new.push_back((b + 1) * fresh);
  const std::int64_t n = static_cast<std::int64_t>(sequences) * fresh;
  std::string refused;
  {
    rank_threads setup(ranks);
    std::mutex m;
    setup.run([&](int r) {
      rank_state& s = rs[static_cast<std::size_t>(r)];
      RINGATTN_CUDA_CHECK(cudaSetDevice(0));
      try {
        s.comm = std::make_unique<ringattn::in_process_communicator>(group.communicator(r));
        s.dec = std::make_unique<decoder>(*s.comm, args);
        s.dec->prepare_device();
        // Positions 0 .. cache - 1 of every sequence, kept by position mod P.
        s.cu_cache = {0};
        for (int b = 0; b < sequences; ++b)
          s.cu_cache.push_back(s.cu_cache.back() + (cache_per_sequence - r + ranks - 1) / ranks);
        s.cached = s.cu_cache.back();
        if (paged) {
          // Each sequence's pages drawn from a shuffled pool (a fixed seed per rank).
          s.cu_pages = {0};
          for (int b = 0; b < sequences; ++b) {
            s.length.push_back(s.cu_cache[b + 1] - s.cu_cache[b]);
            s.cu_pages.push_back(s.cu_pages.back() + (s.length.back() + page_size - 1) / page_size);
          }
          s.pages = s.cu_pages.back();
          s.table.resize(static_cast<std::size_t>(s.pages));
          std::iota(s.table.begin(), s.table.end(), 0);
          std::shuffle(s.table.begin(), s.table.end(),
                       std::mt19937(17u + static_cast<unsigned>(r)));
          s.cached = s.pages * page_size;
        }
        plan(s, cu_new);
      } catch (const std::exception& e) { // a plan the BlockKernel refuses: the row is skipped
        const std::lock_guard lock(m);
        refused = e.what();
        return;
      }
      const auto kv = static_cast<std::size_t>(s.cached) * kv_heads * head_dim;
      s.q = ringattn::bench::device_uniform<T>(n * q_heads * head_dim, 1);
      s.k = ringattn::bench::device_uniform<T>(n * kv_heads * head_dim, 2);
      s.v = ringattn::bench::device_uniform<T>(n * kv_heads * head_dim, 3);
      s.kc = ringattn::bench::device_uniform<T>(kv, 4 + static_cast<std::uint64_t>(r));
      s.vc = ringattn::bench::device_uniform<T>(kv, 40 + static_cast<std::uint64_t>(r));
      if (fp8) {
        // The cache quantised (the values are uniform in [-1, 1]: every scale 1/448), then the
        // bf16 copy freed.
        const std::int64_t entries = fp8 == 2 ? s.cached / page_size * kv_heads : kv_heads;
        const std::vector<float> scale(static_cast<std::size_t>(entries), 1.0f / 448.0f);
        RINGATTN_CUDA_CHECK(cudaMalloc(&s.scales, sizeof(float) * scale.size()));
        RINGATTN_CUDA_CHECK(cudaMemcpy(s.scales, scale.data(), sizeof(float) * scale.size(),
                                       cudaMemcpyHostToDevice));
        RINGATTN_CUDA_CHECK(cudaMalloc(&s.kc8, kv));
        RINGATTN_CUDA_CHECK(cudaMalloc(&s.vc8, kv));
        auto quantize = [&](const T* from, ringattn::fp8_e4m3* to, bool key) {
          const ringattn::thd_view<const T> src(from, s.cached, kv_heads, head_dim);
          const ringattn::thd_view<ringattn::fp8_e4m3> dst(to, s.cached, kv_heads, head_dim);
          if (fp8 == 2)
            ringattn::quantize_into_cache(src, nullptr, dst,
                                          ringattn::page_scales{s.scales, s.scales}, key, page_size,
                                          nullptr);
          else
            ringattn::quantize_into_cache(
                src, nullptr, dst, ringattn::head_scales{s.scales, s.scales}, key, 1, nullptr);
        };
        quantize(s.kc, s.kc8, true);
        quantize(s.vc, s.vc8, false);
        RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
        cudaFree(s.kc), cudaFree(s.vc);
        s.kc = s.vc = nullptr;
      }
      RINGATTN_CUDA_CHECK(cudaMalloc(&s.out, sizeof(T) * n * q_heads * head_dim));
      RINGATTN_CUDA_CHECK(cudaMalloc(&s.lse, sizeof(float) * n * q_heads));
      s.ws_bytes = s.dec->template device_workspace_bytes<T>();
      RINGATTN_CUDA_CHECK(cudaMalloc(&s.ws, s.ws_bytes));
      RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
      RINGATTN_CUDA_CHECK(cudaEventCreate(&s.start));
      RINGATTN_CUDA_CHECK(cudaEventCreate(&s.stop));
    });
  }
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  if (!refused.empty()) {
    state.SkipWithError(refused.c_str());
  } else {
    rank_threads threads(ranks);
    std::vector<double> plan_seconds(static_cast<std::size_t>(ranks));
    auto step = [&](int r) {
      rank_state& s = rs[static_cast<std::size_t>(r)];
      if (plan_only) {
        const auto t0 = std::chrono::steady_clock::now();
        plan(s, cu_new);
        plan_seconds[static_cast<std::size_t>(r)] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        return;
      }
      const std::int64_t m = s.cached;
      const ringattn::thd_view<const T> q(s.q, n, q_heads, head_dim), k(s.k, n, kv_heads, head_dim),
          v(s.v, n, kv_heads, head_dim);
      const ringattn::thd_view<T> out(s.out, n, q_heads, head_dim);
      RINGATTN_CUDA_CHECK(cudaEventRecord(s.start, s.stream));
      if constexpr (std::is_same_v<Kernel, ringattn::causal>) {
        const ringattn::thd_view<const ringattn::fp8_e4m3> kc8(s.kc8, m, kv_heads, head_dim),
            vc8(s.vc8, m, kv_heads, head_dim);
        if (fp8 == 1)
          s.dec->forward(q, k, v, kc8, vc8, ringattn::head_scales{s.scales, s.scales}, out, s.lse,
                         s.ws, s.ws_bytes, s.stream);
        if (fp8 == 2)
          s.dec->forward(q, k, v, kc8, vc8, ringattn::page_scales{s.scales, s.scales}, out, s.lse,
                         s.ws, s.ws_bytes, s.stream);
      }
      if (!fp8)
        s.dec->forward(q, k, v, ringattn::thd_view<const T>(s.kc, m, kv_heads, head_dim),
                       ringattn::thd_view<const T>(s.vc, m, kv_heads, head_dim), out, s.lse, s.ws,
                       s.ws_bytes, s.stream);
      RINGATTN_CUDA_CHECK(cudaEventRecord(s.stop, s.stream));
      RINGATTN_CUDA_CHECK(cudaStreamSynchronize(s.stream));
    };
    // The step's span on the device: earliest start to latest end over the ranks (milliseconds
    // relative to rank 0's start).
    auto span_seconds = [&] {
      float first = 0.0f, last = 0.0f;
      for (std::size_t r = 0; r < rs.size(); ++r) {
        float a = 0.0f, b = 0.0f;
        RINGATTN_CUDA_CHECK(cudaEventElapsedTime(&a, rs[0].start, rs[r].start));
        RINGATTN_CUDA_CHECK(cudaEventElapsedTime(&b, rs[0].start, rs[r].stop));
        first = r == 0 ? a : std::min(first, a);
        last = r == 0 ? b : std::max(last, b);
      }
      return (last - first) * 1e-3;
    };
    for (int warm = 0; warm < 3; ++warm)
      threads.run(step);
    for (auto _ : state) {
      threads.run(step);
      state.SetIterationTime(plan_only ? *std::max_element(plan_seconds.begin(), plan_seconds.end())
                                       : span_seconds());
    }
    const double cache_bytes = 2.0 * sequences * cache_per_sequence * kv_heads * head_dim *
                               (fp8 ? sizeof(ringattn::fp8_e4m3) : sizeof(T));
    state.counters["bytes_per_rank"] = static_cast<double>(rs[0].dec->template step_bytes<T>());
    state.counters["cache_tokens"] = static_cast<double>(sequences) * cache_per_sequence;
    if (!plan_only)
      state.counters["cache_bytes_per_second"] =
          benchmark::Counter(cache_bytes, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["new_per_sequence"] = fresh;
    std::string label = std::string(plan_only ? "plan, " : "step, ") + std::to_string(fresh) +
                        " new, " + std::to_string(ranks) + (ranks == 1 ? " rank" : " ranks") +
                        (std::is_same_v<Kernel, ringattn::causal> ? ", native" : ", cuDNN") +
                        (paged ? ", pages of 16" : "") + (sequences == 1 ? ", 1 x 128K" : "") +
                        (fp8 == 1   ? ", FP8 head scales"
                         : fp8 == 2 ? ", FP8 page scales"
                                    : "");
    state.SetLabel(label);
  }
  for (auto& s : rs) {
    cudaFree(s.q), cudaFree(s.k), cudaFree(s.v), cudaFree(s.kc), cudaFree(s.vc);
    cudaFree(s.out), cudaFree(s.lse), cudaFree(s.ws);
    cudaFree(s.kc8), cudaFree(s.vc8), cudaFree(s.scales);
    if (s.stream) cudaStreamDestroy(s.stream);
    if (s.start) cudaEventDestroy(s.start);
    if (s.stop) cudaEventDestroy(s.stop);
  }
  // The decoders first (their device resources), then the communicators they refer to.
  for (auto& s : rs)
    s.dec.reset();
}
} // namespace

BENCHMARK(decode_step<ringattn::causal>)
    ->Name("decode/native")
    ->ArgsProduct({{1, 8}, {0, 1}, {1, 8}, {0}, {0}, {0}})
    ->ArgsProduct({{1, 8}, {0, 1}, {1}, {1}, {0}, {0}})
    ->Args({1, 0, 1, 0, 1, 0})
    ->ArgsProduct({{1, 8}, {0}, {1, 8}, {0}, {0}, {1}})
    ->ArgsProduct({{1, 8}, {0}, {1}, {1}, {0}, {1, 2}})
    ->Args({1, 0, 1, 0, 1, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);
#if defined(RINGATTN_BENCH_CUDNN)
BENCHMARK(decode_step<ringattn::cudnn_kernel<ringattn::causal_mask, T>>)
    ->Name("decode/cudnn")
    ->ArgsProduct({{1, 8}, {0, 1}, {1, 8}, {0}, {0}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);
#endif

int main(int argc, char** argv) { return ringattn::bench::run_benchmarks(argc, argv); }
