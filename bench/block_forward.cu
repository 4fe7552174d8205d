// The CUDA block kernel over one whole sequence (one block = the single-GPU attention), bf16,
// batch 1, 32 query heads with 32 or 8 kv heads, head_dim 128 and 64, 2K/8K/32K tokens, full and
// causal. "merge" merges into the fp32 state (the ring's mode); "plain" writes O and LSE directly.
// "path": 0 the mma.sync kernel, 1 the Hopper wgmma kernel (skipped where it cannot run).
// PyTorch SDPA's cuDNN and flash backends run at the same shapes in the same device run
// (bench/baselines/sdpa_baseline.py).
// block_forward_merge_cost: what merging into the state costs against plain output, the two
// timed alternately in one loop (plain, merge, plain, ...; each call between its own pair of
// events) so that clock and temperature drift fall on both alike; medians of each, and the cost
// merge / plain - 1 as a counter. "l2": 0 calls back to back (each call finds in L2 what the
// previous one left: the inputs, and for merge the state it wrote), 1 the L2 flushed before each
// call (a write of twice its size, outside the timed interval), as in a ring step, where the
// state was last touched a whole step earlier and the K/V block has just arrived; 2 the state
// restored before each call (outside the timed interval) to one block's result, so that every
// merge combines two halves of equal weight, as a ring step does (back to back, the state's
// weight grows with every call and the block's share shrinks).
#include "harness.cuh"

#include <ringattn/block/device/forward.cuh>

#include <algorithm>
#include <vector>

namespace {
using T = __nv_bfloat16;

//! One whole sequence as one block: inputs, state and plain output on the device, the schedule,
//! and the two calls the benchmarks time (merge into the state, or write O and LSE plainly).
struct whole_sequence {
  std::int64_t s;
  int q_heads, kv_heads, d;
  T *q, *k, *v, *out = nullptr;
  float *o = nullptr, *lse = nullptr, *sum = nullptr;
  ringattn::device_block_schedule sched;
  ringattn::block_forward_args<T> a;

  static std::vector<ringattn::block_group> groups(std::int64_t s, bool causal) {
    ringattn::block_group g{0, s, 1, {}};
    g.kv[0] = {0, s, causal ? ringattn::band{-ringattn::unbounded, 0} : ringattn::band{}};
    return {g};
  }
  whole_sequence(std::int64_t tokens, int kv, int dim, bool causal, ringattn::forward_path path,
                 ringattn::merge_path merge = ringattn::merge_path::automatic)
      : s(tokens), q_heads(32), kv_heads(kv), d(dim),
        q(ringattn::bench::device_uniform<T>(static_cast<std::size_t>(s * q_heads * d), 1)),
        k(ringattn::bench::device_uniform<T>(static_cast<std::size_t>(s * kv_heads * d), 2)),
        v(ringattn::bench::device_uniform<T>(static_cast<std::size_t>(s * kv_heads * d), 3)),
        sched(groups(s, causal), s, s, d, {.path = path, .merge = merge}) {
    RINGATTN_CUDA_CHECK(cudaMalloc(&o, sizeof(float) * s * q_heads * d));
    RINGATTN_CUDA_CHECK(cudaMalloc(&lse, sizeof(float) * s * q_heads));
    RINGATTN_CUDA_CHECK(cudaMalloc(&sum, sizeof(float) * s * q_heads));
    RINGATTN_CUDA_CHECK(cudaMalloc(&out, sizeof(T) * s * q_heads * d));
    const ringattn::attention_state st{o, lse, sum, s, q_heads, d};
    a = {{q, s, q_heads, d},
         {k, s, kv_heads, d},
         {v, s, kv_heads, d},
         {q_heads, kv_heads, d, 0.0f},
         st};
    ringattn::reset(st, nullptr);
  }
  ~whole_sequence() {
    cudaFree(q), cudaFree(k), cudaFree(v), cudaFree(o), cudaFree(lse), cudaFree(sum), cudaFree(out);
  }
  whole_sequence(const whole_sequence&) = delete;
  whole_sequence& operator=(const whole_sequence&) = delete;

  //! What a timed call writes: plain O and LSE; a merge into the state (reads and writes its fp32
  //! o and lse); a ring's first step (writes the state, reads nothing); a ring's last step (reads
  //! the state, writes O in T and the merged lse).
  enum class kind { plain, merge, first, last };
  void call(kind k, cudaStream_t stream) const {
    const ringattn::thd_view<T> o_view(out, s, q_heads, d);
    switch (k) {
    case kind::plain: ringattn::block_forward_plain(a, sched, o_view, lse, stream); break;
    case kind::merge: ringattn::block_forward(a, sched, stream); break;
    case kind::first: ringattn::block_forward_first(a, sched, stream); break;
    case kind::last: ringattn::block_forward_last(a, sched, o_view, stream); break;
    }
  }
  void call(bool merge, cudaStream_t stream) const {
    call(merge ? kind::merge : kind::plain, stream);
  }
  double flops(bool causal) const {
    return ringattn::bench::attention_forward_flops(1, q_heads, s, s, d, causal);
  }
};

// range: tokens, kv_heads, head_dim, causal, merge, path
void block_forward(benchmark::State& state) {
  if (!ringattn::bench::require_gpu(state)) return;
  const int d = static_cast<int>(state.range(2));
  const bool causal = state.range(3) != 0, merge = state.range(4) != 0;
  const auto path =
      state.range(5) ? ringattn::forward_path::wgmma : ringattn::forward_path::mma_sync;
  if (!ringattn::forward_path_available(path, d)) {
    state.SkipWithError("the wgmma kernel cannot run here");
    return;
  }
  const whole_sequence w(state.range(0), static_cast<int>(state.range(1)), d, causal, path);
  ringattn::bench::gpu_timer timer;
  timer.time(state, [&](cudaStream_t stream) { w.call(merge, stream); });
  ringattn::bench::report_flops(state, w.flops(causal));
  state.SetLabel(std::string(ringattn::to_string(path)) + (causal ? " causal" : " full") +
                 (merge ? " merge" : " plain"));
}
BENCHMARK(block_forward)
    ->ArgNames({"tokens", "kv_heads", "head_dim", "causal", "merge", "path"})
    ->ArgsProduct({{2048, 8192, 32768}, {32, 8}, {128, 64}, {0, 1}, {1}, {1, 0}})
    ->ArgsProduct({{2048, 8192, 32768}, {32, 8}, {128, 64}, {0, 1}, {0}, {1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.2);

// range: tokens, kv_heads, head_dim, causal, l2 (see the top of the file), epilogue (0 merge,
// 1 a ring's first step, 2 its last step: which of the state's reads and writes cost), merge
// path (0 automatic, 1 rewrite, 2 reduce: how a merge adds to the state; first and last steps
// always rewrite); the wgmma kernel
void block_forward_merge_cost(benchmark::State& state) {
  if (!ringattn::bench::require_gpu(state)) return;
  const int d = static_cast<int>(state.range(2));
  const bool causal = state.range(3) != 0, flush = state.range(4) == 1,
             restore = state.range(4) == 2;
  using kind = whole_sequence::kind;
  const kind other = state.range(5) == 1   ? kind::first
                     : state.range(5) == 2 ? kind::last
                                           : kind::merge;
  if (!ringattn::forward_path_available(ringattn::forward_path::wgmma, d)) {
    state.SkipWithError("the wgmma kernel cannot run here");
    return;
  }
  const ringattn::merge_path how = state.range(6) == 1   ? ringattn::merge_path::rewrite
                                   : state.range(6) == 2 ? ringattn::merge_path::reduce
                                                         : ringattn::merge_path::automatic;
  const whole_sequence w(state.range(0), static_cast<int>(state.range(1)), d, causal,
                         ringattn::forward_path::wgmma, how);
  int device = 0, l2 = 0;
  RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
  RINGATTN_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  const std::size_t scrub_bytes = 2 * static_cast<std::size_t>(l2);
  void* scrub = nullptr;
  RINGATTN_CUDA_CHECK(cudaMalloc(&scrub, scrub_bytes));
  ringattn::bench::gpu_timer timer;
  cudaStream_t stream = timer.stream();
  // One block's result as the state to restore: a reset state merged with the block once.
  const std::size_t o_bytes = sizeof(float) * w.s * w.q_heads * w.d,
                    lse_bytes = sizeof(float) * w.s * w.q_heads;
  float *o0 = nullptr, *lse0 = nullptr, *sum0 = nullptr;
  RINGATTN_CUDA_CHECK(cudaMalloc(&o0, o_bytes));
  RINGATTN_CUDA_CHECK(cudaMalloc(&lse0, lse_bytes));
  RINGATTN_CUDA_CHECK(cudaMalloc(&sum0, lse_bytes));
  ringattn::reset(w.a.state, stream);
  w.call(true, stream);
  RINGATTN_CUDA_CHECK(cudaMemcpyAsync(o0, w.o, o_bytes, cudaMemcpyDeviceToDevice, stream));
  RINGATTN_CUDA_CHECK(cudaMemcpyAsync(lse0, w.lse, lse_bytes, cudaMemcpyDeviceToDevice, stream));
  RINGATTN_CUDA_CHECK(cudaMemcpyAsync(sum0, w.sum, lse_bytes, cudaMemcpyDeviceToDevice, stream));
  cudaEvent_t ev[2];
  for (auto& e : ev)
    RINGATTN_CUDA_CHECK(cudaEventCreate(&e));
  auto timed = [&](bool merge) {
    if (flush) RINGATTN_CUDA_CHECK(cudaMemsetAsync(scrub, merge ? 1 : 2, scrub_bytes, stream));
    if (restore) {
      RINGATTN_CUDA_CHECK(cudaMemcpyAsync(w.o, o0, o_bytes, cudaMemcpyDeviceToDevice, stream));
      RINGATTN_CUDA_CHECK(
          cudaMemcpyAsync(w.lse, lse0, lse_bytes, cudaMemcpyDeviceToDevice, stream));
      RINGATTN_CUDA_CHECK(
          cudaMemcpyAsync(w.sum, sum0, lse_bytes, cudaMemcpyDeviceToDevice, stream));
    }
    RINGATTN_CUDA_CHECK(cudaEventRecord(ev[0], stream));
    w.call(merge ? other : kind::plain, stream);
    RINGATTN_CUDA_CHECK(cudaEventRecord(ev[1], stream));
    RINGATTN_CUDA_CHECK(cudaEventSynchronize(ev[1]));
    float ms = 0.0f;
    RINGATTN_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
    return static_cast<double>(ms);
  };
  for (int i = 0; i < 10; ++i) // warm-up
    timed(i % 2 == 0);
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<double> plain, merged;
  for (auto _ : state) {
    plain.push_back(timed(false));
    merged.push_back(timed(true));
    state.SetIterationTime((plain.back() + merged.back()) / 1e3);
  }
  auto median = [](std::vector<double> x) {
    std::nth_element(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(x.size() / 2), x.end());
    return x[x.size() / 2];
  };
  const double mp = median(plain), mm = median(merged);
  state.counters["plain_us"] = mp * 1e3;
  state.counters["merge_us"] = mm * 1e3;
  state.counters["merge_cost_pct"] = (mm / mp - 1.0) * 100.0;
  state.counters["plain_TFLOP/s"] = w.flops(causal) / (mp * 1e-3) / 1e12;
  state.SetLabel(std::string(causal ? "causal" : "full") +
                 (flush     ? ", L2 flushed"
                  : restore ? ", state restored"
                            : ", L2 warm") +
                 (other == kind::first ? ", first step (writes the state only)"
                  : other == kind::last
                      ? ", last step (reads the state, writes O)"
                      : std::string(", merge: ") + ringattn::to_string(w.sched.merge())));
  for (auto& e : ev)
    cudaEventDestroy(e);
  cudaFree(scrub), cudaFree(o0), cudaFree(lse0), cudaFree(sum0);
}
BENCHMARK(block_forward_merge_cost)
    ->ArgNames({"tokens", "kv_heads", "head_dim", "causal", "l2", "epilogue", "merge_path"})
    ->ArgsProduct({{2048, 8192}, {32, 8}, {128, 64}, {0, 1}, {0, 1, 2}, {0}, {0, 1, 2}})
    ->ArgsProduct({{2048, 8192}, {32, 8}, {128, 64}, {0, 1}, {0, 2}, {1, 2}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(300);
} // namespace

int main(int argc, char** argv) { return ringattn::bench::run_benchmarks(argc, argv); }
