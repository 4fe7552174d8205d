// The CUDA block backward over one whole sequence (one block = the single-GPU attention
// backward), bf16, batch 1, 32 query heads with 32 or 8 kv heads, head_dim 128, full and causal;
// the shapes measured are 8K and 32K tokens. LSE comes from a forward of the same inputs, so P is
// what training sees. Timed is the whole backward a single-GPU user runs: D = rowsum(dO . O),
// zeroing the fp32 accumulators, the block backward and writing dQ, dK, dV in bf16 (PyTorch's
// backward figure includes its own equivalents). FLOPs: 2.5x the forward's (the FlashAttention
// convention). PyTorch SDPA's backward at the same shapes: `bench/baselines/sdpa_baseline.py
// OUT.json
// --backward`, same device run.
//
// "path": 5 the Hopper five-product kernel (backward_options::deterministic = false: dQ added in
// the L2), 4 the Hopper (wgmma) kernel with three warpgroups a thread block (a producer), 3 with
// two, 2 with one, 1 the
// mma.sync ones (8K and 32K), 0 the CUDA-core ones (2K and 8K only: one 32K call
// would take seconds). "kernels": 0 the whole backward, 1 the dK/dV kernel alone, 2 the dQ
// kernel alone (where the time goes; tensor-core paths only); for path 5, 1 the kernel with its
// dQ reduction left out and 2 with it (what the reduction costs).
#include "single_gpu.cuh"

namespace {
using T = __nv_bfloat16;

// range: tokens, kv_heads, causal, path, kernels (see above)
void block_backward(benchmark::State& state) {
  if (!ringattn::bench::require_gpu(state)) return;
  const std::int64_t s = state.range(0);
  const int q_heads = 32, kv_heads = static_cast<int>(state.range(1)), d = 128;
  const bool causal = state.range(2) != 0;
  using ringattn::backward_path;
  constexpr ringattn::backward_options paths[] = {
      {backward_path::cuda_cores, 0}, {backward_path::tensor_cores, 0},
      {backward_path::wgmma, 1},      {backward_path::wgmma, 2},
      {backward_path::wgmma, 3},      {backward_path::wgmma, 3, false}};
  constexpr const char* names[] = {"cuda-core", "mma.sync", "wgmma x1",
                                   "wgmma x2",  "wgmma x3", "wgmma five-product"};
  const auto path = static_cast<std::size_t>(state.range(3));
  const int kernels = static_cast<int>(state.range(4));
  if (!ringattn::backward_path_available(paths[path].path)) {
    state.SkipWithError("the wgmma kernels need an sm_90a image on a compute capability 9.0 GPU");
    return;
  }
  const ringattn::bench::single_gpu_attention<T> attention(s, q_heads, kv_heads, d, causal,
                                                           paths[path]);
  if (kernels != 0 && !attention.tensor_cores()) {
    state.SkipWithError("one kernel alone: tensor-core paths only");
    return;
  }
  attention.forward(nullptr);
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  ringattn::bench::gpu_timer timer;
  timer.time(
      state,
      [&](cudaStream_t stream) {
        if (kernels == 0)
          attention.backward(stream);
        else
          attention.backward_kernel(kernels, stream);
      },
      1);
  // FLOPs: the whole backward's (2.5x the forward's) for the whole call; a kernel alone reports
  // the same figure, so its TFLOP/s is "what the backward would reach if it were all like this".
  ringattn::bench::report_flops(
      state, 2.5 * ringattn::bench::attention_forward_flops(1, q_heads, s, s, d, causal));
  static constexpr const char* parts[] = {"", " (dK/dV kernel)", " (dQ kernel)"};
  static constexpr const char* five_parts[] = {"", " (kernel, dQ reduction left out)",
                                               " (kernel with dQ reduction)"};
  state.SetLabel(std::string(names[path]) + " backward" + (causal ? " causal" : " full") +
                 (path == 5 ? five_parts : parts)[kernels]);
}
BENCHMARK(block_backward)
    ->ArgNames({"tokens", "kv_heads", "causal", "path", "kernels"})
    ->ArgsProduct({{8192, 32768}, {32, 8}, {0, 1}, {5, 4, 3, 2, 1}, {0}})
    ->ArgsProduct({{8192}, {8}, {0, 1}, {5, 4, 3, 2, 1}, {1, 2}})
    ->ArgsProduct({{2048, 8192}, {8}, {0, 1}, {0}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.2);

// Multi-head latent attention's widths (q and k 192, v and the output 128) on the Hopper kernels:
// the forward (block_forward_plain) or the whole backward as above, 8K tokens, 32 query heads
// with 32 or 8 kv heads. FLOPs 2 s^2 h (192 + 128) for the forward (half of it causal), 2.5x
// that for the backward. PyTorch SDPA at the same shapes: `bench/baselines/sdpa_baseline.py
// OUT.json --widths`, same device run.
// range: tokens, kv_heads, causal, backward
void block_mla(benchmark::State& state) {
  if (!ringattn::bench::require_gpu(state)) return;
  const std::int64_t s = state.range(0);
  const int q_heads = 32, kv_heads = static_cast<int>(state.range(1));
  const bool causal = state.range(2) != 0, backward = state.range(3) != 0;
  if (!ringattn::forward_path_available(ringattn::forward_path::wgmma, 192, 128)) {
    state.SkipWithError("192/128 runs on the wgmma kernels: an sm_90a image on a compute "
                        "capability 9.0 GPU");
    return;
  }
  const ringattn::bench::single_gpu_attention<T> attention(s, q_heads, kv_heads, 192, causal, {},
                                                           128);
  attention.forward(nullptr);
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  ringattn::bench::gpu_timer timer;
  timer.time(
      state,
      [&](cudaStream_t stream) {
        if (backward)
          attention.backward(stream);
        else
          attention.forward(stream);
      },
      1);
  // attention_forward_flops counts 4 s^2 h d: d = (192 + 128) / 2.
  const double forward = ringattn::bench::attention_forward_flops(1, q_heads, s, s, 160, causal);
  ringattn::bench::report_flops(state, backward ? 2.5 * forward : forward);
  state.SetLabel(std::string("192/128 wgmma ") + (backward ? "backward" : "forward") +
                 (causal ? " causal" : " full"));
}
BENCHMARK(block_mla)
    ->ArgNames({"tokens", "kv_heads", "causal", "backward"})
    ->ArgsProduct({{8192}, {32, 8}, {0, 1}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.2);
} // namespace

int main(int argc, char** argv) { return ringattn::bench::run_benchmarks(argc, argv); }
