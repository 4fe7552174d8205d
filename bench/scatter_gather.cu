// Device scatter/gather of a 1M-token x 8 heads x 128 bf16 tensor (2 GiB) against a plain
// device-to-device copy of the same bytes, measured in the same run.
// Bytes counted: every byte read plus every byte written (scatter of all ranks reads and writes
// the tensor once; gather likewise).
#include "harness.cuh"

#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/scatter.cuh>
#include <ringattn/partition/zigzag.cuh>

#include <memory>
#include <vector>

namespace {
using T = __nv_bfloat16;
constexpr std::int64_t tokens = 1 << 20;
constexpr int heads = 8, dim = 128;
constexpr std::size_t bytes = static_cast<std::size_t>(tokens) * heads * dim * sizeof(T);

// Three device buffers, allocated once for all benchmarks, filled with non-zero data.
struct buffers {
  T* full = nullptr;
  T* shards = nullptr;
  T* back = nullptr;
  buffers() {
    RINGATTN_CUDA_CHECK(cudaMalloc(&full, bytes));
    RINGATTN_CUDA_CHECK(cudaMalloc(&shards, bytes));
    RINGATTN_CUDA_CHECK(cudaMalloc(&back, bytes));
    std::vector<unsigned short> h(bytes / 2);
    for (std::size_t i = 0; i < h.size(); ++i)
      h[i] = static_cast<unsigned short>(0x3c00 + (i * 2654435761u >> 20) % 512);
    RINGATTN_CUDA_CHECK(cudaMemcpy(full, h.data(), bytes, cudaMemcpyHostToDevice));
  }
  static buffers& get() {
    static buffers b;
    return b;
  }
};

void device_copy(benchmark::State& state) {
  if (!ringattn::bench::require_gpu(state)) return;
  auto& b = buffers::get();
  ringattn::bench::gpu_timer timer;
  timer.time(state, [&](cudaStream_t s) {
    RINGATTN_CUDA_CHECK(cudaMemcpyAsync(b.shards, b.full, bytes, cudaMemcpyDeviceToDevice, s));
  });
  ringattn::bench::report_bytes(state, 2.0 * bytes);
}
BENCHMARK(device_copy)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(0.3);

// mode 0: scatter every rank's shard; 1: gather all shards; 2: both.
template <class P>
void scatter_gather(benchmark::State& state) {
  if (!ringattn::bench::require_gpu(state)) return;
  const int ranks = static_cast<int>(state.range(0));
  const int mode = static_cast<int>(state.range(1));
  auto& b = buffers::get();
  // A packed batch of 4 sequences of unequal length, none divisible by 2P.
  const std::vector<std::int32_t> cu = {0, 300001, 300001 + 250003, 300001 + 250003 + 400009,
                                        static_cast<std::int32_t>(tokens)};
  ringattn::partition_plan<P> plan(cu, ranks);
  ringattn::device_partition_plan<P> dplan(plan);
  ringattn::thd_view<const T> full(b.full, tokens, heads, dim);
  ringattn::bench::gpu_timer timer;
  timer.time(state, [&](cudaStream_t s) {
    if (mode != 1)
      for (int r = 0; r < ranks; ++r)
        ringattn::scatter(dplan, r, full,
                          ringattn::thd_view<T>(b.shards + plan.rank_offset(r) * heads * dim,
                                                plan.local_tokens(r), heads, dim),
                          s);
    if (mode != 0)
      ringattn::gather(dplan, ringattn::thd_view<const T>(b.shards, tokens, heads, dim),
                       ringattn::thd_view<T>(b.back, tokens, heads, dim), s);
  });
  ringattn::bench::report_bytes(state, (mode == 2 ? 4.0 : 2.0) * bytes);
  state.SetLabel(mode == 0 ? "scatter" : mode == 1 ? "gather" : "scatter+gather");
}
#define RINGATTN_SG(P)                                                                             \
  BENCHMARK(scatter_gather<ringattn::P>)                                                           \
      ->ArgsProduct({{4, 8}, {0, 1, 2}})                                                           \
      ->ArgNames({"ranks", "mode"})                                                                \
      ->UseManualTime()                                                                            \
      ->Unit(benchmark::kMillisecond)                                                              \
      ->MinTime(0.3)
RINGATTN_SG(contiguous);
RINGATTN_SG(round_robin);
RINGATTN_SG(zigzag);
} // namespace

int main(int argc, char** argv) { return ringattn::bench::run_benchmarks(argc, argv); }
