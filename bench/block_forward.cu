// The CUDA block kernel over one whole sequence (one block = the single-GPU attention), bf16,
// batch 1, 32 query heads with 32 or 8 kv heads, head_dim 128 and 64, 2K/8K/32K tokens, full and
// causal. "merge" merges into the fp32 state (the ring's mode); "plain" writes O and LSE directly.
// "path": 0 the mma.sync kernel, 1 the Hopper wgmma kernel (skipped where it cannot run).
// PyTorch SDPA's cuDNN and flash backends run at the same shapes in the same device run
// (bench/sdpa_baseline.py).
#include "harness.cuh"

#include <ringattn/kernel/forward.cuh>

#include <vector>

namespace {
using T = __nv_bfloat16;

// range: tokens, kv_heads, head_dim, causal, merge, path
void block_forward(benchmark::State& state) {
  if (!ringattn::bench::require_gpu(state)) return;
  const std::int64_t s = state.range(0);
  const int q_heads = 32, kv_heads = static_cast<int>(state.range(1)),
            d = static_cast<int>(state.range(2));
  const bool causal = state.range(3) != 0, merge = state.range(4) != 0;
  const auto path =
      state.range(5) ? ringattn::forward_path::wgmma : ringattn::forward_path::mma_sync;
  if (!ringattn::forward_path_available(path, d)) {
    state.SkipWithError("the wgmma kernel cannot run here");
    return;
  }
  T* q = ringattn::bench::device_uniform<T>(static_cast<std::size_t>(s * q_heads * d), 1);
  T* k = ringattn::bench::device_uniform<T>(static_cast<std::size_t>(s * kv_heads * d), 2);
  T* v = ringattn::bench::device_uniform<T>(static_cast<std::size_t>(s * kv_heads * d), 3);
  float *o = nullptr, *lse = nullptr;
  T* out = nullptr;
  RINGATTN_CUDA_CHECK(cudaMalloc(&o, sizeof(float) * s * q_heads * d));
  RINGATTN_CUDA_CHECK(cudaMalloc(&lse, sizeof(float) * s * q_heads));
  RINGATTN_CUDA_CHECK(cudaMalloc(&out, sizeof(T) * s * q_heads * d));
  const ringattn::attention_arguments args{q_heads, kv_heads, d, 0.0f};
  ringattn::block_group g{0, s, 1, {}};
  g.kv[0] = {0, s, causal ? ringattn::band{-ringattn::unbounded, 0} : ringattn::band{}};
  const std::vector<ringattn::block_group> groups{g};
  ringattn::device_block_schedule sched(groups, s, s, d, {path});
  const ringattn::attention_state st{o, lse, s, q_heads, d};
  const ringattn::block_forward_args<T> a{
      {q, s, q_heads, d}, {k, s, kv_heads, d}, {v, s, kv_heads, d}, args, st};
  ringattn::reset(st, nullptr);
  ringattn::bench::gpu_timer timer;
  timer.time(state, [&](cudaStream_t stream) {
    if (merge)
      ringattn::block_forward(a, sched, stream);
    else
      ringattn::block_forward_plain(a, sched, ringattn::thd_view<T>(out, s, q_heads, d), lse,
                                    stream);
  });
  ringattn::bench::report_flops(
      state, ringattn::bench::attention_forward_flops(1, q_heads, s, s, d, causal));
  state.SetLabel(std::string(ringattn::to_string(path)) + (causal ? " causal" : " full") +
                 (merge ? " merge" : " plain"));
  cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(o), cudaFree(lse), cudaFree(out);
}
BENCHMARK(block_forward)
    ->ArgNames({"tokens", "kv_heads", "head_dim", "causal", "merge", "path"})
    ->ArgsProduct({{2048, 8192, 32768}, {32, 8}, {128, 64}, {0, 1}, {1}, {1, 0}})
    ->ArgsProduct({{2048, 8192, 32768}, {32, 8}, {128, 64}, {0, 1}, {0}, {1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.2);
} // namespace

int main(int argc, char** argv) { return ringattn::bench::run_benchmarks(argc, argv); }
