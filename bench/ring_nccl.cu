// The ring over NCCL, one MPI process per GPU:
//
//   mpirun -np P bench_ring_nccl [--benchmark_out=ring_nccl_P.json --benchmark_out_format=json]
//
// ring_nccl: forward of one sequence of P x tokens_per_gpu tokens (bf16, 32 query heads, 8 kv
//   heads, head_dim 128) for each partitioner x {causal, full} x {8K, 32K} tokens per GPU, with
//   the K/V exchange on ("comm 1") and replaced by nothing ("comm 0": the same schedule, kernels
//   and merges on stale K/V — what the ring would cost if communication were free; the workspace
//   holds random data, so stale K/V are not zeros, which tensor cores process faster). Time: the
//   slowest rank's CUDA-event time of one forward. Counters: TFLOP/s per GPU from the plan's exact
//   work (what "parallel efficiency" divides by our single-GPU kernel at the local size, see
//   bench/scripts/report_multi_gpu.py) and, with comm 1 against comm 0 in the same run, the exposed
//   communication.
// ring_exchange: raw ring send/recv of one step's K/V block (both directions' bytes per rank per
//   second), the link number to compare the exposed time with.
//
// Every rank runs the same benchmarks with a fixed iteration count (collectives inside); only
// rank 0 reports. With one process (P = 1) it is the dry run the single-GPU machine allows.
#include "harness.cuh"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/nccl_mpi.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <mpi.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ringattn_bench {
//! The NCCL communicator with device exchanges turned into nothing (the buffers keep what they
//! held): for measuring the ring without communication. Everything else is forwarded.
class no_exchange {
public:
  explicit no_exchange(ringattn::nccl_communicator& c) : c_(c) {}
  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  std::uint64_t bytes_sent() const { return 0; }
  void exchange(const void* s, std::size_t sb, int to, void* r, std::size_t rb, int from,
                std::int64_t step) {
    c_.exchange(s, sb, to, r, rb, from, step);
  }
  void all_gather(const void* s, std::size_t n, void* r) { c_.all_gather(s, n, r); }
  void barrier() { c_.barrier(); }
  void abort(const std::string& why) { c_.abort(why); }
  void prepare_device() { c_.prepare_device(); }
  void exchange_async(const void*, std::size_t, int, void*, std::size_t, int, std::int64_t,
                      cudaStream_t) {}

private:
  ringattn::nccl_communicator& c_;
};

} // namespace ringattn_bench

namespace {
using T = __nv_bfloat16;
using ringattn_bench::no_exchange;
constexpr int q_heads = 32, kv_heads = 8, head_dim = 128;
constexpr int iterations = 20; // per benchmark; comm 1 and comm 0 differ by a few percent
constexpr int training_iterations = 5;

int world_rank = 0, world_size = 1;
std::optional<ringattn::nccl_communicator> comm; // one per process, made in main

struct device_array {
  void* p = nullptr;
  explicit device_array(std::size_t bytes) { RINGATTN_CUDA_CHECK(cudaMalloc(&p, bytes + 16)); }
  ~device_array() { cudaFree(p); }
  template <class U>
  U* as() const {
    return static_cast<U*>(p);
  }
};

float slowest(float ms) {
  float worst = ms;
  RINGATTN_MPI_CHECK(MPI_Allreduce(&ms, &worst, 1, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD));
  return worst;
}

// Times `call(stream)`, a collective step every rank runs: `warmups` untimed calls, then per
// iteration the slowest rank's CUDA-event time (joined through the communicator's bounded wait:
// a lost peer is an error, not a hang). Reports TFLOP/s per GPU counting `flops_per_score` FLOPs
// for each visible score of the plan.
template <class Mask, class Attn, class Call>
void time_ring(benchmark::State& state, const Attn& attn, int warmups, double flops_per_score,
               Call call) {
  cudaStream_t stream;
  cudaEvent_t start, stop;
  RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  RINGATTN_CUDA_CHECK(cudaEventCreate(&start));
  RINGATTN_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < warmups; ++i)
    call(stream);
  comm->wait(stream);
  comm->barrier();
  for (auto _ : state) {
    RINGATTN_CUDA_CHECK(cudaEventRecord(start, stream));
    call(stream);
    RINGATTN_CUDA_CHECK(cudaEventRecord(stop, stream));
    comm->wait(stream);
    float ms = 0.0f;
    RINGATTN_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(slowest(ms) / 1e3);
  }
  std::int64_t work = 0;
  for (int r = 0; r < world_size; ++r)
    work += attn.plan().work(r, ringattn::position_window::of(Mask::mask));
  state.counters["TFLOP/s/GPU"] =
      benchmark::Counter(flops_per_score * static_cast<double>(work) / world_size,
                         benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GPUs"] = world_size;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
}

// range: tokens per GPU, causal, exchange on
template <class P>
void ring_nccl(benchmark::State& state) {
  const std::int64_t per_gpu = state.range(0);
  const bool causal = state.range(1) != 0, exchange = state.range(2) != 0;
  const std::int64_t tokens = per_gpu * world_size;
  const std::vector<std::int32_t> cu = {0, static_cast<std::int32_t>(tokens)};
  const ringattn::attention_arguments args{q_heads, kv_heads, head_dim, 0.0f};
  auto run = [&]<class Comm, class Mask>(Comm& c, Mask) {
    ringattn::ring_attention<P, Comm, Mask> attn(c, args, cu);
    attn.prepare_device();
    const std::int64_t n = attn.local_tokens();
    device_array q(sizeof(T) * n * q_heads * head_dim), k(sizeof(T) * n * kv_heads * head_dim),
        v(sizeof(T) * n * kv_heads * head_dim), out(sizeof(T) * n * q_heads * head_dim),
        lse(sizeof(float) * n * q_heads);
    const std::size_t ws_bytes = attn.template device_workspace_bytes<T>();
    device_array ws(ws_bytes);
    ringattn::bench::fill_uniform(q.as<T>(), n * q_heads * head_dim, 1 + 3 * world_rank);
    ringattn::bench::fill_uniform(k.as<T>(), n * kv_heads * head_dim, 2 + 3 * world_rank);
    ringattn::bench::fill_uniform(v.as<T>(), n * kv_heads * head_dim, 3 + 3 * world_rank);
    // Random bytes in the whole workspace too: without the exchange, steps after the first
    // compute on whatever the receive buffer holds, and tensor cores run faster (cooler) on
    // zeros than on data, which would flatter "comm 0".
    ringattn::bench::fill_uniform(ws.as<T>(), ws_bytes / sizeof(T), 4 + 3 * world_rank);
    // Warm-up of at least ~100 ms of work, so clocks have settled before the first timed
    // forward.
    time_ring<Mask>(state, attn, per_gpu <= 8192 ? 20 : 4, 4.0 * q_heads * head_dim,
                    [&](cudaStream_t stream) {
                      attn.forward(ringattn::thd_view<const T>(q.as<T>(), n, q_heads, head_dim),
                                   ringattn::thd_view<const T>(k.as<T>(), n, kv_heads, head_dim),
                                   ringattn::thd_view<const T>(v.as<T>(), n, kv_heads, head_dim),
                                   ringattn::thd_view<T>(out.as<T>(), n, q_heads, head_dim),
                                   lse.as<float>(), ws.p, ws_bytes, stream);
                    });
    state.SetLabel(std::string(P::name) + (causal ? " causal" : " full") +
                   (exchange ? "" : ", no exchange"));
  };
  if (exchange) {
    if (causal)
      run(*comm, ringattn::causal{});
    else
      run(*comm, ringattn::full{});
  } else {
    no_exchange quiet(*comm);
    if (causal)
      run(quiet, ringattn::causal{});
    else
      run(quiet, ringattn::full{});
  }
}

// range: tokens per GPU, causal. Forward + backward of the ring over NCCL (the backward from the
// forward's out and lse and a random dO), slowest rank's CUDA-event time of the pair. Counter:
// TFLOP/s per GPU counting 3.5x the forward's FLOPs (forward 1, backward 2.5).
template <class P>
void ring_nccl_training(benchmark::State& state) {
  const std::int64_t per_gpu = state.range(0);
  const bool causal = state.range(1) != 0;
  const std::int64_t tokens = per_gpu * world_size;
  const std::vector<std::int32_t> cu = {0, static_cast<std::int32_t>(tokens)};
  const ringattn::attention_arguments args{q_heads, kv_heads, head_dim, 0.0f};
  auto run = [&]<class Mask>(Mask) {
    ringattn::ring_attention<P, ringattn::nccl_communicator, Mask> attn(*comm, args, cu);
    attn.prepare_device();
    const std::int64_t n = attn.local_tokens();
    const std::size_t nq = sizeof(T) * n * q_heads * head_dim,
                      nk = sizeof(T) * n * kv_heads * head_dim;
    device_array q(nq), k(nk), v(nk), out(nq), dout(nq), dq(nq), dk(nk), dv(nk),
        lse(sizeof(float) * n * q_heads);
    const std::size_t ws_bytes = std::max(attn.template device_workspace_bytes<T>(),
                                          attn.template device_backward_workspace_bytes<T>());
    device_array ws(ws_bytes);
    ringattn::bench::fill_uniform(q.as<T>(), n * q_heads * head_dim, 1 + 5 * world_rank);
    ringattn::bench::fill_uniform(k.as<T>(), n * kv_heads * head_dim, 2 + 5 * world_rank);
    ringattn::bench::fill_uniform(v.as<T>(), n * kv_heads * head_dim, 3 + 5 * world_rank);
    ringattn::bench::fill_uniform(dout.as<T>(), n * q_heads * head_dim, 4 + 5 * world_rank);
    using ringattn::thd_view;
    // Warm-up: about 100 ms of work or more, as for the forward.
    const int warmups = per_gpu <= 8192 ? 6 : 1;
    time_ring<Mask>(state, attn, warmups, 3.5 * 4.0 * q_heads * head_dim, [&](cudaStream_t stream) {
      attn.forward(thd_view<const T>(q.as<T>(), n, q_heads, head_dim),
                   thd_view<const T>(k.as<T>(), n, kv_heads, head_dim),
                   thd_view<const T>(v.as<T>(), n, kv_heads, head_dim),
                   thd_view<T>(out.as<T>(), n, q_heads, head_dim), lse.as<float>(), ws.p, ws_bytes,
                   stream);
      attn.backward(thd_view<const T>(q.as<T>(), n, q_heads, head_dim),
                    thd_view<const T>(k.as<T>(), n, kv_heads, head_dim),
                    thd_view<const T>(v.as<T>(), n, kv_heads, head_dim),
                    thd_view<const T>(out.as<T>(), n, q_heads, head_dim), lse.as<float>(),
                    thd_view<const T>(dout.as<T>(), n, q_heads, head_dim),
                    thd_view<T>(dq.as<T>(), n, q_heads, head_dim),
                    thd_view<T>(dk.as<T>(), n, kv_heads, head_dim),
                    thd_view<T>(dv.as<T>(), n, kv_heads, head_dim), ws.p, ws_bytes, stream);
    });
    state.SetLabel(std::string(P::name) + (causal ? " causal" : " full") + ", forward + backward");
  };
  if (causal)
    run(ringattn::causal{});
  else
    run(ringattn::full{});
}

// range: tokens per GPU; one step's K/V block (2 x tokens x kv_heads x head_dim bf16) to the
// next rank, from the previous one.
void ring_exchange(benchmark::State& state) {
  const std::size_t bytes = 2 * sizeof(T) * state.range(0) * kv_heads * head_dim;
  device_array a(bytes), b(bytes);
  cudaStream_t stream;
  cudaEvent_t start, stop;
  RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  RINGATTN_CUDA_CHECK(cudaEventCreate(&start));
  RINGATTN_CUDA_CHECK(cudaEventCreate(&stop));
  const int to = (world_rank + 1) % world_size, from = (world_rank - 1 + world_size) % world_size;
  comm->exchange_async(a.p, bytes, to, b.p, bytes, from, 0, stream); // warm-up
  comm->wait(stream);
  for (auto _ : state) {
    RINGATTN_CUDA_CHECK(cudaEventRecord(start, stream));
    comm->exchange_async(a.p, bytes, to, b.p, bytes, from, 0, stream);
    RINGATTN_CUDA_CHECK(cudaEventRecord(stop, stream));
    comm->wait(stream);
    float ms = 0.0f;
    RINGATTN_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    state.SetIterationTime(slowest(ms) / 1e3);
  }
  state.counters["GB/s"] = benchmark::Counter(static_cast<double>(bytes) / 1e9,
                                              benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GPUs"] = world_size;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
}

BENCHMARK(ring_nccl<ringattn::zigzag>)
    ->ArgNames({"tokens_per_gpu", "causal", "comm"})
    ->ArgsProduct({{8192, 32768}, {1, 0}, {1, 0}})
    ->UseManualTime()
    ->Iterations(iterations)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(ring_nccl<ringattn::round_robin>)
    ->ArgNames({"tokens_per_gpu", "causal", "comm"})
    ->ArgsProduct({{8192, 32768}, {1, 0}, {1, 0}})
    ->UseManualTime()
    ->Iterations(iterations)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(ring_nccl<ringattn::contiguous>)
    ->ArgNames({"tokens_per_gpu", "causal", "comm"})
    ->ArgsProduct({{8192, 32768}, {1, 0}, {1, 0}})
    ->UseManualTime()
    ->Iterations(iterations)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(ring_nccl_training<ringattn::zigzag>)
    ->ArgNames({"tokens_per_gpu", "causal"})
    ->ArgsProduct({{8192, 32768}, {1, 0}})
    ->UseManualTime()
    ->Iterations(training_iterations)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(ring_nccl_training<ringattn::round_robin>)
    ->ArgNames({"tokens_per_gpu", "causal"})
    ->ArgsProduct({{8192, 32768}, {1, 0}})
    ->UseManualTime()
    ->Iterations(training_iterations)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(ring_nccl_training<ringattn::contiguous>)
    ->ArgNames({"tokens_per_gpu", "causal"})
    ->ArgsProduct({{8192, 32768}, {1, 0}})
    ->UseManualTime()
    ->Iterations(training_iterations)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(ring_exchange)
    ->ArgNames({"tokens_per_gpu"})
    ->Arg(8192)
    ->Arg(32768)
    ->UseManualTime()
    ->Iterations(20)
    ->Unit(benchmark::kMillisecond);

//! Ranks other than 0 run every benchmark (they are collective) but report nothing.
class silent_reporter : public benchmark::BenchmarkReporter {
public:
  bool ReportContext(const Context&) override { return true; }
  void ReportRuns(const std::vector<Run>&) override {}
};
} // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  int code = 0;
  try {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      if (world_rank == 0) std::printf("no CUDA device: nothing to measure\n");
      MPI_Finalize();
      return 0;
    }
    RINGATTN_CUDA_CHECK(cudaSetDevice(world_rank % devices));
    comm.emplace(ringattn::make_nccl_communicator(MPI_COMM_WORLD));
    if (world_rank == 0) {
      code = ringattn::bench::run_benchmarks(argc, argv);
    } else {
      // Same benchmarks, same order, no output files.
      std::vector<char*> args{argv[0]};
      for (int i = 1; i < argc; ++i)
        if (std::string(argv[i]).rfind("--benchmark_out", 0) != 0) args.push_back(argv[i]);
      int n = static_cast<int>(args.size());
      benchmark::Initialize(&n, args.data());
      silent_reporter quiet;
      benchmark::RunSpecifiedBenchmarks(&quiet);
      benchmark::Shutdown();
    }
    comm.reset();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", world_rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return code;
}
