// Tile-shape experiments for the block-forward kernel (not a product benchmark): the kernel
// launched with different warps / row tiles / key tile / Q placement (each with a schedule of its
// own tile shape), bf16, 32 heads, 8K tokens. Used to choose core/tuning.cuh's values.
#include "harness.cuh"

#include <ringattn/block/device/forward.cuh>

#include <random>
#include <vector>

namespace {
using T = __nv_bfloat16;

template <int D, ringattn::forward_tuning Tune>
void variant(benchmark::State& state) {
  if (!ringattn::bench::require_gpu(state)) return;
  const std::int64_t s = 8192;
  const int heads = 32;
  const bool causal = state.range(0) != 0;
  std::mt19937_64 rng(1);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<T> h(static_cast<std::size_t>(s * heads * D));
  for (auto& x : h)
    x = ringattn::from_float<T>(u(rng));
  T *q, *k, *v;
  float *o, *lse, *sum;
  for (T** p : {&q, &k, &v}) {
    RINGATTN_CUDA_CHECK(cudaMalloc(p, h.size() * sizeof(T)));
    RINGATTN_CUDA_CHECK(cudaMemcpy(*p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  RINGATTN_CUDA_CHECK(cudaMalloc(&o, h.size() * sizeof(float)));
  RINGATTN_CUDA_CHECK(cudaMalloc(&lse, s * heads * sizeof(float)));
  RINGATTN_CUDA_CHECK(cudaMalloc(&sum, s * heads * sizeof(float)));
  ringattn::block_group g{0, s, 1, {}};
  g.kv[0] = {0, s, causal ? ringattn::band{-ringattn::unbounded, 0} : ringattn::band{}};
  const std::vector<ringattn::block_group> groups{g};
  ringattn::device_block_schedule sched(groups, s, s, D,
                                        {.path = ringattn::forward_path::mma_sync,
                                         .block_m = Tune.block_m(),
                                         .block_n = Tune.block_n});
  const ringattn::attention_state st{o, lse, sum, s, heads, D};
  const ringattn::block_forward_args<T> a{
      {q, s, heads, D}, {k, s, heads, D}, {v, s, heads, D}, {heads, heads, D, 0.0f}, st};
  ringattn::reset(st, nullptr);
  const auto p = ringattn::detail::forward_params_of<T>(a, sched, nullptr, nullptr);
  ringattn::bench::gpu_timer timer;
  timer.time(state, [&](cudaStream_t stream) {
    ringattn::detail::launch_block_forward<T, D, Tune, ringattn::kernels::epilogue::merge>(p, sched,
                                                                                           stream);
  });
  ringattn::bench::report_flops(
      state, ringattn::bench::attention_forward_flops(1, heads, s, s, D, causal));
  for (void* x : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)lse, (void*)sum})
    cudaFree(x);
}
using ringattn::forward_tuning;
#define VARIANT(D, W, MT, BN, QR)                                                                  \
  BENCHMARK(variant<D, forward_tuning{W, MT, BN, QR}>)                                             \
      ->Name("d" #D "_w" #W "_mt" #MT "_bn" #BN "_q" #QR)                                          \
      ->ArgName("causal")                                                                          \
      ->Arg(0)                                                                                     \
      ->Arg(1)                                                                                     \
      ->UseManualTime()                                                                            \
      ->Unit(benchmark::kMillisecond)                                                              \
      ->MinTime(0.1)
VARIANT(128, 8, 1, 64, true);
VARIANT(128, 8, 1, 64, false);
VARIANT(128, 4, 2, 64, false);
VARIANT(128, 4, 2, 32, false);
VARIANT(128, 8, 1, 32, true);
VARIANT(128, 4, 2, 48, false);
VARIANT(128, 8, 2, 48, false);
VARIANT(128, 8, 2, 64, false);
VARIANT(64, 8, 1, 64, true);
VARIANT(64, 4, 2, 64, false);
VARIANT(64, 4, 2, 128, false);
VARIANT(64, 8, 2, 128, false);
VARIANT(64, 4, 2, 32, false);
} // namespace

int main(int argc, char** argv) { return ringattn::bench::run_benchmarks(argc, argv); }
