// The CUDA block backward over one whole sequence (one block = the single-GPU attention
// backward), bf16, batch 1, 32 query heads with 32 or 8 kv heads, head_dim 128, full and causal;
// the issue's shapes are 8K and 32K tokens. LSE and D come from a forward of the same inputs, so
// P is what training sees. FLOPs: 2.5x the forward's (the FlashAttention convention). PyTorch
// SDPA's backward at the same shapes: `bench/sdpa_baseline.py OUT.json --backward`, same device
// run.
//
// "tc": 1 the tensor-core kernels (the issue's 8K and 32K), 0 the CUDA-core ones (2K and 8K only:
// one 32K call would take seconds).
#include "harness.cuh"

#include <ringattn/kernel/backward.cuh>
#include <ringattn/kernel/forward.cuh>

#include <vector>

namespace {
using T = __nv_bfloat16;

// range: tokens, kv_heads, causal, tensor cores
void block_backward(benchmark::State& state) {
  if (!ringattn::bench::require_gpu(state)) return;
  const std::int64_t s = state.range(0);
  const int q_heads = 32, kv_heads = static_cast<int>(state.range(1)), d = 128;
  const bool causal = state.range(2) != 0, tc = state.range(3) != 0;
  const auto nq = static_cast<std::size_t>(s * q_heads * d),
             nk = static_cast<std::size_t>(s * kv_heads * d);
  T* q = ringattn::bench::device_uniform<T>(nq, 1);
  T* k = ringattn::bench::device_uniform<T>(nk, 2);
  T* v = ringattn::bench::device_uniform<T>(nk, 3);
  T* dout = ringattn::bench::device_uniform<T>(nq, 4);
  T* out = nullptr;
  float *lse = nullptr, *delta = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
  RINGATTN_CUDA_CHECK(cudaMalloc(&out, sizeof(T) * nq));
  RINGATTN_CUDA_CHECK(cudaMalloc(&lse, sizeof(float) * s * q_heads));
  RINGATTN_CUDA_CHECK(cudaMalloc(&delta, sizeof(float) * s * q_heads));
  RINGATTN_CUDA_CHECK(cudaMalloc(&dq, sizeof(float) * nq));
  RINGATTN_CUDA_CHECK(cudaMalloc(&dk, sizeof(float) * nk));
  RINGATTN_CUDA_CHECK(cudaMalloc(&dv, sizeof(float) * nk));
  const ringattn::attention_arguments args{q_heads, kv_heads, d, 0.0f};
  ringattn::block_group g{0, s, 1, {}};
  g.kv[0] = {0, s, causal ? ringattn::band{-ringattn::unbounded, 0} : ringattn::band{}};
  const std::vector<ringattn::block_group> groups{g};
  {
    // The forward of the same inputs: out and lse.
    ringattn::device_block_schedule fs(groups, s, s, d);
    const ringattn::attention_state st{dq, lse, s, q_heads, d}; // o unused by the plain kernel
    ringattn::block_forward_plain<T>(
        {{q, s, q_heads, d}, {k, s, kv_heads, d}, {v, s, kv_heads, d}, args, st}, fs,
        ringattn::thd_view<T>(out, s, q_heads, d), lse, nullptr);
    ringattn::compute_delta<T>({out, s, q_heads, d}, {dout, s, q_heads, d}, delta, nullptr);
    RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  }
  const ringattn::device_backward_schedule sched(groups, s, s,
                                                 tc ? ringattn::backward_path::tensor_cores
                                                    : ringattn::backward_path::cuda_cores);
  const ringattn::block_backward_args<T> a{{q, s, q_heads, d},
                                           {k, s, kv_heads, d},
                                           {v, s, kv_heads, d},
                                           {dout, s, q_heads, d},
                                           lse,
                                           delta,
                                           args,
                                           {dq, dk, dv}};
  ringattn::bench::gpu_timer timer;
  timer.time(
      state, [&](cudaStream_t stream) { ringattn::block_backward(a, sched, stream); }, 1);
  ringattn::bench::report_flops(
      state, 2.5 * ringattn::bench::attention_forward_flops(1, q_heads, s, s, d, causal));
  state.SetLabel(std::string(tc ? "tensor-core" : "cuda-core") + " backward" +
                 (causal ? " causal" : " full"));
  cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(dout), cudaFree(out);
  cudaFree(lse), cudaFree(delta), cudaFree(dq), cudaFree(dk), cudaFree(dv);
}
BENCHMARK(block_backward)
    ->ArgNames({"tokens", "kv_heads", "causal", "tc"})
    ->ArgsProduct({{8192, 32768}, {32, 8}, {0, 1}, {1}})
    ->ArgsProduct({{2048, 8192}, {8}, {0, 1}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.2);
} // namespace

int main(int argc, char** argv) { return ringattn::bench::run_benchmarks(argc, argv); }
