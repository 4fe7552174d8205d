// The CUDA block backward over one whole sequence (one block = the single-GPU attention
// backward), bf16, batch 1, 32 query heads with 32 or 8 kv heads, head_dim 128, full and causal;
// the issue's shapes are 8K and 32K tokens. LSE comes from a forward of the same inputs, so P is
// what training sees. Timed is the whole backward a single-GPU user runs: D = rowsum(dO . O),
// zeroing the fp32 accumulators, the block backward and writing dQ, dK, dV in bf16 (PyTorch's
// backward figure includes its own equivalents). FLOPs: 2.5x the forward's (the FlashAttention
// convention). PyTorch SDPA's backward at the same shapes: `bench/sdpa_baseline.py OUT.json
// --backward`, same device run.
//
// "path": 2 the Hopper (wgmma) kernels and 1 the mma.sync ones (the issue's 8K and 32K), 0 the
// CUDA-core ones (2K and 8K only: one 32K call would take seconds).
#include "single_gpu.cuh"

namespace {
using T = __nv_bfloat16;

// range: tokens, kv_heads, causal, path (0 CUDA cores, 1 mma.sync, 2 wgmma)
void block_backward(benchmark::State& state) {
  if (!ringattn::bench::require_gpu(state)) return;
  const std::int64_t s = state.range(0);
  const int q_heads = 32, kv_heads = static_cast<int>(state.range(1)), d = 128;
  const bool causal = state.range(2) != 0;
  constexpr ringattn::backward_path paths[] = {ringattn::backward_path::cuda_cores,
                                               ringattn::backward_path::tensor_cores,
                                               ringattn::backward_path::wgmma};
  constexpr const char* names[] = {"cuda-core", "mma.sync", "wgmma"};
  const auto path = static_cast<std::size_t>(state.range(3));
  if (!ringattn::backward_path_available(paths[path])) {
    state.SkipWithError("the wgmma kernels need an sm_90a image on a compute capability 9.0 GPU");
    return;
  }
  const ringattn::bench::single_gpu_attention<T> attention(s, q_heads, kv_heads, d, causal,
                                                           paths[path]);
  attention.forward(nullptr);
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  ringattn::bench::gpu_timer timer;
  timer.time(
      state, [&](cudaStream_t stream) { attention.backward(stream); }, 1);
  ringattn::bench::report_flops(
      state, 2.5 * ringattn::bench::attention_forward_flops(1, q_heads, s, s, d, causal));
  state.SetLabel(std::string(names[path]) + " backward" + (causal ? " causal" : " full"));
}
BENCHMARK(block_backward)
    ->ArgNames({"tokens", "kv_heads", "causal", "path"})
    ->ArgsProduct({{8192, 32768}, {32, 8}, {0, 1}, {2, 1}})
    ->ArgsProduct({{2048, 8192}, {8}, {0, 1}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.2);
} // namespace

int main(int argc, char** argv) { return ringattn::bench::run_benchmarks(argc, argv); }
