// Ring forward, and forward + backward, with P virtual ranks on one GPU (threads of an in-process
// group, a stream each) over 64K tokens against the single-GPU block-kernel calls over the whole
// sequence (single_call), in the same run: bf16, 32 query heads, 8 kv heads, head_dim 128; causal
// (zigzag) and full (contiguous). With ringattn::cudnn (RINGATTN_BENCH_CUDNN) the same rings run
// on the cuDNN block kernel too (cudnn_ring), and cudnn_block and native_block time one rank's
// ring (a single block, written directly) at 2K, 8K and 32K tokens. The schedules rows run the
// ring, the all-gather, the all-to-all and the hybrid (all-to-all in groups of 4, K/V gathered
// across the 2 groups) side by side (8 ranks, 8K-64K tokens, 8 and 32 kv heads). The documents
// rows run the ring over packed document mixes with each partitioner (8 ranks, causal).
// Time: host wall clock from launching every rank until every rank's stream has drained
// (manual time), so it covers the ring's exchanges, the merges and the load balance; the single
// call is timed the same way. A ring of one rank (the block benchmarks) is timed with CUDA events
// on its stream, as PyTorch's side is.
#include "single_gpu.cuh"

#include "../test/support/document_mixes.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/partition/balanced.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/scatter.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>
#if defined(RINGATTN_BENCH_CUDNN)
#include <ringattn/cudnn.cuh>
#endif

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace {
using T = __nv_bfloat16;
constexpr std::int64_t ring_tokens = 65536;
constexpr int q_heads = 32, kv_heads = 8, head_dim = 128;

// Host wall time of `fn()` per iteration (after one warm-up call).
template <class Fn>
void time_host(benchmark::State& state, Fn&& fn) {
  fn();
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
}

// FLOPs of the forward, or of forward + backward (3.5x the forward's).
void report(benchmark::State& state, bool causal, bool backward,
            std::int64_t tokens = ring_tokens) {
  ringattn::bench::report_flops(state, (backward ? 3.5 : 1.0) *
                                           ringattn::bench::attention_forward_flops(
                                               1, q_heads, tokens, tokens, head_dim, causal));
}

// range(0): causal; range(1): forward + backward
void single_call(benchmark::State& state) {
  if (!ringattn::bench::require_gpu(state)) return;
  const std::int64_t tokens = ring_tokens;
  const bool causal = state.range(0) != 0, backward = state.range(1) != 0;
  const ringattn::bench::single_gpu_attention<T> attention(tokens, q_heads, kv_heads, head_dim,
                                                           causal);
  ringattn::bench::gpu_timer timer; // for its stream
  time_host(state, [&] {
    attention.forward(timer.stream());
    if (backward) attention.backward(timer.stream());
    RINGATTN_CUDA_CHECK(cudaStreamSynchronize(timer.stream()));
  });
  report(state, causal, backward);
  state.SetLabel(std::string("single call") + (causal ? " causal" : " full"));
}

// The ring over the packed sequences `cu` on `ranks` virtual ranks, forward or forward +
// backward. `Causal` and `Full` are the BlockKernels of the two masks; with `Window` > 0, `Causal`
// is a causal window of that many keys (the query's own included) and the FLOPs count its work.
template <class P, class Causal, class Full, class Schedule, int KvHeads, std::int64_t Window>
void ring_on(benchmark::State& state, const std::vector<std::int32_t>& cu, int ranks, bool causal,
             bool backward) {
  const std::int64_t tokens = cu.back();
  ringattn::attention_arguments args{q_heads, KvHeads, head_dim, 0.0f};
  if constexpr (Window > 0) args.window_left = Window - 1;
  T* q =
      ringattn::bench::device_uniform<T>(static_cast<std::size_t>(tokens * q_heads * head_dim), 1);
  T* k =
      ringattn::bench::device_uniform<T>(static_cast<std::size_t>(tokens * KvHeads * head_dim), 2);
  T* v =
      ringattn::bench::device_uniform<T>(static_cast<std::size_t>(tokens * KvHeads * head_dim), 3);
  ringattn::partition_plan<P> plan(cu, ranks);
  ringattn::device_partition_plan<P> dplan(plan);
  ringattn::in_process_group group(ranks);
  struct rank_state {
    T *q, *k, *v, *out, *dout, *dq, *dk, *dv;
    float* lse;
    void* ws;
    std::size_t ws_bytes;
    cudaStream_t stream;
  };
  std::vector<rank_state> rs(static_cast<std::size_t>(ranks));
  std::vector<ringattn::in_process_communicator> comms;
  using causal_ring =
      ringattn::ring_attention<P, ringattn::in_process_communicator, Causal, Schedule>;
  using full_ring = ringattn::ring_attention<P, ringattn::in_process_communicator, Full, Schedule>;
  std::vector<std::unique_ptr<causal_ring>> cr;
  std::vector<std::unique_ptr<full_ring>> fr;
  ringattn::bench::gpu_timer timer; // one rank: its stream and events
  for (int r = 0; r < ranks; ++r)
    comms.push_back(group.communicator(r));
  // Construction is collective (an all-gather): one thread per rank.
  cr.resize(static_cast<std::size_t>(ranks));
  fr.resize(static_cast<std::size_t>(ranks));
  std::string refused; // a plan a rank's BlockKernel cannot run (the benchmark is skipped)
  {
    std::mutex m;
    std::vector<std::thread> th;
    for (int r = 0; r < ranks; ++r)
      th.emplace_back([&, r] {
        try {
          if (causal)
            cr[r] = std::make_unique<causal_ring>(comms[r], args, cu), cr[r]->prepare_device();
          else
            fr[r] = std::make_unique<full_ring>(comms[r], args, cu), fr[r]->prepare_device();
        } catch (const ringattn::invalid_argument& e) {
          const std::lock_guard lock(m);
          refused = e.what();
        }
      });
    for (auto& t : th)
      t.join();
  }
  if (!refused.empty()) {
    cudaFree(q), cudaFree(k), cudaFree(v);
    state.SkipWithError(refused.c_str());
    return;
  }
  for (int r = 0; r < ranks; ++r) {
    rank_state& s = rs[static_cast<std::size_t>(r)];
    const std::int64_t n = plan.local_tokens(r);
    RINGATTN_CUDA_CHECK(cudaMalloc(&s.q, sizeof(T) * n * q_heads * head_dim));
    RINGATTN_CUDA_CHECK(cudaMalloc(&s.k, sizeof(T) * n * KvHeads * head_dim));
    RINGATTN_CUDA_CHECK(cudaMalloc(&s.v, sizeof(T) * n * KvHeads * head_dim));
    RINGATTN_CUDA_CHECK(cudaMalloc(&s.out, sizeof(T) * n * q_heads * head_dim));
    RINGATTN_CUDA_CHECK(cudaMalloc(&s.dq, sizeof(T) * n * q_heads * head_dim));
    RINGATTN_CUDA_CHECK(cudaMalloc(&s.dk, sizeof(T) * n * KvHeads * head_dim));
    RINGATTN_CUDA_CHECK(cudaMalloc(&s.dv, sizeof(T) * n * KvHeads * head_dim));
    s.dout = ringattn::bench::device_uniform<T>(static_cast<std::size_t>(n * q_heads * head_dim),
                                                10 + static_cast<std::uint64_t>(r));
    RINGATTN_CUDA_CHECK(cudaMalloc(&s.lse, sizeof(float) * n * q_heads));
    s.ws_bytes = causal ? std::max(cr[r]->template device_workspace_bytes<T>(),
                                   cr[r]->template device_backward_workspace_bytes<T>())
                        : std::max(fr[r]->template device_workspace_bytes<T>(),
                                   fr[r]->template device_backward_workspace_bytes<T>());
    RINGATTN_CUDA_CHECK(cudaMalloc(&s.ws, s.ws_bytes));
    if (ranks == 1)
      s.stream = timer.stream();
    else
      RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking));
    ringattn::scatter(dplan, r, ringattn::thd_view<const T>(q, tokens, q_heads, head_dim),
                      ringattn::thd_view<T>(s.q, n, q_heads, head_dim), nullptr);
    ringattn::scatter(dplan, r, ringattn::thd_view<const T>(k, tokens, KvHeads, head_dim),
                      ringattn::thd_view<T>(s.k, n, KvHeads, head_dim), nullptr);
    ringattn::scatter(dplan, r, ringattn::thd_view<const T>(v, tokens, KvHeads, head_dim),
                      ringattn::thd_view<T>(s.v, n, KvHeads, head_dim), nullptr);
  }
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  auto enqueue = [&](int r) {
    rank_state& s = rs[static_cast<std::size_t>(r)];
    const std::int64_t n = plan.local_tokens(r);
    const ringattn::thd_view<const T> qv(s.q, n, q_heads, head_dim), kv(s.k, n, KvHeads, head_dim),
        vv(s.v, n, KvHeads, head_dim);
    const ringattn::thd_view<T> ov(s.out, n, q_heads, head_dim), dq(s.dq, n, q_heads, head_dim),
        dk(s.dk, n, KvHeads, head_dim), dv(s.dv, n, KvHeads, head_dim);
    const ringattn::thd_view<const T> dout(s.dout, n, q_heads, head_dim);
    auto run = [&](auto& ring) {
      ring.forward(qv, kv, vv, ov, s.lse, s.ws, s.ws_bytes, s.stream);
      if (backward)
        ring.backward(qv, kv, vv, ov, s.lse, dout, dq, dk, dv, s.ws, s.ws_bytes, s.stream);
    };
    if (causal)
      run(*cr[r]);
    else
      run(*fr[r]);
  };
  if (ranks == 1) {
    timer.time(state, [&](cudaStream_t) { enqueue(0); });
  } else {
    time_host(state, [&] {
      std::vector<std::thread> th;
      for (int r = 0; r < ranks; ++r)
        th.emplace_back([&, r] {
          enqueue(r);
          RINGATTN_CUDA_CHECK(cudaStreamSynchronize(rs[static_cast<std::size_t>(r)].stream));
        });
      for (auto& t : th)
        t.join();
    });
  }
  if constexpr (Window > 0) {
    // Query p sees min(p + 1, Window) keys.
    const double w = static_cast<double>(std::min<std::int64_t>(Window, tokens));
    const double pairs = w * (w + 1) / 2 + (static_cast<double>(tokens) - w) * w;
    ringattn::bench::report_flops(state, (backward ? 3.5 : 1.0) * 4.0 * q_heads * pairs * head_dim);
  } else { // each sequence's own work
    double flops = 0.0;
    for (std::size_t i = 1; i < cu.size(); ++i)
      flops += ringattn::bench::attention_forward_flops(1, q_heads, cu[i] - cu[i - 1],
                                                        cu[i] - cu[i - 1], head_dim, causal);
    ringattn::bench::report_flops(state, (backward ? 3.5 : 1.0) * flops);
  }
  std::string label = std::string(P::name) + (causal ? " causal" : " full") +
                      ", P = " + std::to_string(ranks) +
                      (requires { typename Causal::backward_algorithm; } ? ", cuDNN" : ", native");
  if constexpr (requires { typename Causal::backward_algorithm; })
    label += std::string(" ") + Causal::backward_algorithm::name;
  if constexpr (std::is_same_v<Schedule, ringattn::all_gather_kv>) label += ", all-gather";
  if constexpr (std::is_same_v<Schedule, ringattn::all_to_all_heads>) label += ", all-to-all";
  if constexpr (std::is_same_v<typename Schedule::plan_type, ringattn::all_to_all_plan> &&
                !std::is_same_v<Schedule, ringattn::all_to_all_heads>)
    label += ", hybrid";
  if constexpr (KvHeads != kv_heads) label += ", " + std::to_string(KvHeads) + " kv heads";
  if constexpr (Window > 0) label += ", window " + std::to_string(Window);
  const int steps = causal ? cr[0]->schedule().step_count() : fr[0]->schedule().step_count();
  state.SetLabel(label + ", " + std::to_string(steps) + " steps");
  for (auto& s : rs) {
    cudaFree(s.q), cudaFree(s.k), cudaFree(s.v), cudaFree(s.out), cudaFree(s.lse), cudaFree(s.ws);
    cudaFree(s.dout), cudaFree(s.dq), cudaFree(s.dk), cudaFree(s.dv);
    if (ranks > 1) cudaStreamDestroy(s.stream);
  }
  cudaFree(q), cudaFree(k), cudaFree(v);
}

// One sequence. range(0): ranks; range(1): causal; range(2): forward + backward; range(3): tokens
// (default 64K).
template <class P, class Causal = ringattn::causal, class Full = ringattn::full,
          class Schedule = ringattn::ring_pass, int KvHeads = kv_heads, std::int64_t Window = 0>
void ring_forward(benchmark::State& state) {
  if (!ringattn::bench::require_gpu(state)) return;
  const std::int64_t tokens = state.range(3) > 0 ? state.range(3) : ring_tokens;
  ring_on<P, Causal, Full, Schedule, KvHeads, Window>(state, {0, static_cast<std::int32_t>(tokens)},
                                                      static_cast<int>(state.range(0)),
                                                      state.range(1) != 0, state.range(2) != 0);
}

// A document mix of 64K tokens (test/support/document_mixes.hpp), causal, over 8 ranks; its
// FLOPs are the documents' own, so the rate compares with one 64K document's (the rows
// ring_forward<zigzag>/ranks:8/causal:1). The counters say the partitioner's work max/mean.
template <class P>
void documents(benchmark::State& state, const ringattn::test::document_mix& mix, bool backward) {
  if (!ringattn::bench::require_gpu(state)) return;
  constexpr int ranks = 8;
  ring_on<P, ringattn::causal, ringattn::full, ringattn::ring_pass, kv_heads, 0>(
      state, mix.cu_seqlens, ranks, true, backward);
  const ringattn::partition_plan<P> plan(mix.cu_seqlens, ranks);
  state.counters["work_max_over_mean"] =
      plan.work_imbalance(ringattn::position_window::of(ringattn::mask_kind::causal));
  state.counters["documents"] = static_cast<double>(mix.cu_seqlens.size() - 1);
}
template <class P>
void register_documents() {
  for (const ringattn::test::document_mix& mix : ringattn::test::document_mixes(ring_tokens, 8))
    for (const bool backward : {false, true})
      benchmark::RegisterBenchmark(
          ("documents/" + mix.name + "/" + P::name + (backward ? "/fwd_bwd" : "/fwd")).c_str(),
          [mix, backward](benchmark::State& st) { documents<P>(st, mix, backward); })
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(3);
}
const int documents_registered = [] {
  register_documents<ringattn::zigzag>();
  register_documents<ringattn::round_robin>();
  register_documents<ringattn::contiguous>();
  register_documents<ringattn::balanced>();
  return 0;
}();

BENCHMARK(single_call)
    ->ArgNames({"causal", "backward"})
    ->ArgsProduct({{1, 0}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(ring_forward<ringattn::zigzag>)
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{1, 4, 8}, {1}, {0, 1}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(ring_forward<ringattn::contiguous>)
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{1, 4, 8}, {0}, {0, 1}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
// A causal window of 4,096 keys over 64K tokens, 8 ranks, against the causal ring rows above:
// contiguous (the ring stops after 2 steps) and zigzag (8 steps).
BENCHMARK(ring_forward<ringattn::contiguous, ringattn::causal_window, ringattn::full,
                       ringattn::ring_pass, kv_heads, 4096>)
    ->Name("windows/contiguous/4096")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{8}, {1}, {0, 1}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(ring_forward<ringattn::zigzag, ringattn::causal_window, ringattn::full,
                       ringattn::ring_pass, kv_heads, 4096>)
    ->Name("windows/zigzag/4096")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{8}, {1}, {0, 1}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
// The schedules side by side: 8 ranks, 8K-64K tokens, 8 and 32 kv heads (32 query heads).
BENCHMARK(ring_forward<ringattn::zigzag>)
    ->Name("schedules/ring/zigzag/kv8")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{8}, {1}, {0, 1}, {8192, 16384, 32768, 65536}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(ring_forward<ringattn::zigzag, ringattn::causal, ringattn::full, ringattn::all_gather_kv>)
    ->Name("schedules/all_gather/zigzag/kv8")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{8}, {1}, {0, 1}, {8192, 16384, 32768, 65536}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(ring_forward<ringattn::zigzag, ringattn::causal, ringattn::full, ringattn::ring_pass, 32>)
    ->Name("schedules/ring/zigzag/kv32")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{8}, {1}, {0, 1}, {8192, 16384, 32768, 65536}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(
    ring_forward<ringattn::zigzag, ringattn::causal, ringattn::full, ringattn::all_gather_kv, 32>)
    ->Name("schedules/all_gather/zigzag/kv32")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{8}, {1}, {0, 1}, {8192, 16384, 32768, 65536}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(
    ring_forward<ringattn::zigzag, ringattn::causal, ringattn::full, ringattn::all_to_all_heads>)
    ->Name("schedules/all_to_all/zigzag/kv8")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{8}, {1}, {0, 1}, {8192, 16384, 32768, 65536}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(ring_forward<ringattn::zigzag, ringattn::causal, ringattn::full,
                       ringattn::all_to_all_heads, 32>)
    ->Name("schedules/all_to_all/zigzag/kv32")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{8}, {1}, {0, 1}, {8192, 16384, 32768, 65536}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
// The hybrid: the all-to-all in groups of 4 ranks, K/V gathered across the 2 groups.
using hybrid_4x2 = ringattn::all_to_all_heads_x_all_gather<4>;
BENCHMARK(ring_forward<ringattn::zigzag, ringattn::causal, ringattn::full, hybrid_4x2>)
    ->Name("schedules/hybrid_4x2/zigzag/kv8")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{8}, {1}, {0, 1}, {8192, 16384, 32768, 65536}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(ring_forward<ringattn::zigzag, ringattn::causal, ringattn::full, hybrid_4x2, 32>)
    ->Name("schedules/hybrid_4x2/zigzag/kv32")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{8}, {1}, {0, 1}, {8192, 16384, 32768, 65536}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
#if defined(RINGATTN_BENCH_CUDNN)
using cudnn_causal = ringattn::cudnn_causal;
using cudnn_full = ringattn::cudnn_full;
BENCHMARK(ring_forward<ringattn::zigzag, cudnn_causal, cudnn_full>)
    ->Name("cudnn_ring/zigzag")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{1, 4, 8}, {1}, {0, 1}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(ring_forward<ringattn::contiguous, cudnn_causal, cudnn_full>)
    ->Name("cudnn_ring/contiguous")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{1, 4, 8}, {0}, {0, 1}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
using atomic_causal =
    ringattn::cudnn_kernel<ringattn::causal_mask, __nv_bfloat16, ringattn::cudnn_atomic>;
using atomic_full =
    ringattn::cudnn_kernel<ringattn::full_mask, __nv_bfloat16, ringattn::cudnn_atomic>;
BENCHMARK(ring_forward<ringattn::zigzag, atomic_causal, atomic_full>)
    ->Name("cudnn_atomic_ring/zigzag")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{1, 4, 8}, {1}, {1}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(ring_forward<ringattn::contiguous, atomic_causal, atomic_full>)
    ->Name("cudnn_atomic_ring/contiguous")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{1, 4, 8}, {0}, {1}, {0}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(3);
BENCHMARK(ring_forward<ringattn::contiguous, atomic_causal, atomic_full>)
    ->Name("cudnn_atomic_block")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{1}, {0, 1}, {1}, {2048, 8192, 32768}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(10);
// One rank: the block itself, cuDNN and native side by side.
BENCHMARK(ring_forward<ringattn::contiguous, cudnn_causal, cudnn_full>)
    ->Name("cudnn_block")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{1}, {0, 1}, {0, 1}, {2048, 8192, 32768}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(10);
BENCHMARK(ring_forward<ringattn::contiguous>)
    ->Name("native_block")
    ->ArgNames({"ranks", "causal", "backward", "tokens"})
    ->ArgsProduct({{1}, {0, 1}, {0, 1}, {2048, 8192, 32768}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(10);
#endif
} // namespace

int main(int argc, char** argv) { return ringattn::bench::run_benchmarks(argc, argv); }
