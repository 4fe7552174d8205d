// 02_mpi_nccl: ring attention across GPUs, one MPI rank per GPU, K/V moving over NCCL.
//
//   mpirun -np <GPUs> mpi_nccl [--tokens N] [--sequences B] [--heads H] [--kv-heads K]
//                              [--head-dim 64|128] [--mask causal|full] [--iterations I]
//                              [--partitioner zigzag|round_robin|contiguous|balanced]
//
// Every rank builds the same synthetic packed batch (one seed, broadcast), keeps its shard
// on its GPU, and runs the device ring forward; rank 0 gathers the output shards and checks a
// sample of rows against the float64 oracle. Exit code 77 (skipped) where there is no GPU.
#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/nccl_mpi.cuh>
#include <ringattn/partition/balanced.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/scatter.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/reference/attention.cuh>
#include <ringattn/ring_attention.cuh>

#include "../common/example.hpp"

#include <cuda_runtime_api.h>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace {
using T = __nv_bfloat16;

struct options {
  int tokens = 16384;
  int sequences = 3, heads = 16, kv_heads = 4, head_dim = 128, iterations = 5;
  std::string mask = "causal", partitioner = "zigzag";
};

options parse(int argc, char** argv) {
  options o;
  example::flags("mpi_nccl", "The ring over NCCL, one MPI process per GPU (mpirun -np P "
                             "mpi_nccl): forward, timed, sampled rows against the float64 oracle.")
      .add("tokens", o.tokens, "tokens of the packed batch")
      .add("sequences", o.sequences, "sequences packed in it")
      .add("heads", o.heads, "query heads")
      .add("kv-heads", o.kv_heads, "key/value heads (a divisor of --heads)")
      .add("head-dim", o.head_dim, "head dimension: 64, 128 or 256", 64, 256)
      .add("mask", o.mask, {"causal", "full"}, "which keys a query sees")
      .add("iterations", o.iterations, "timed forwards after a warm-up")
      .add("partitioner", o.partitioner, {"zigzag", "round_robin", "contiguous", "balanced"},
           "how the tokens are split over the ranks")
      .parse(argc, argv);
  return o;
}

template <class P, class Mask>
int run(const options& o, int rank, int size) {
  // The same batch on every rank: rank 0's seed, broadcast.
  unsigned long long seed = std::random_device{}();
  RINGATTN_MPI_CHECK(MPI_Bcast(&seed, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD));
  std::mt19937_64 rng(seed);
  const std::vector<std::int32_t> cu = example::packed_batch(o.tokens, o.sequences);
  const ringattn::attention_arguments args{o.heads, o.kv_heads, o.head_dim, 0.0f};
  auto random = [&](int heads) {
    return example::random_values<T>(static_cast<std::size_t>(o.tokens) * heads * o.head_dim, rng);
  };
  const auto q = random(o.heads), k = random(o.kv_heads), v = random(o.kv_heads);

  auto comm = ringattn::make_nccl_communicator(MPI_COMM_WORLD);
  ringattn::ring_attention<P, ringattn::nccl_communicator, Mask> attn(comm, args, cu);
  attn.prepare_device();
  const ringattn::partition_plan<P> plan(cu, size);
  const std::int64_t m = attn.local_tokens();
  auto to_device = [&](const std::vector<T>& full, int heads) {
    std::vector<T> s(static_cast<std::size_t>(m) * heads * o.head_dim);
    ringattn::scatter(plan, rank,
                      ringattn::thd_view<const T>(full.data(), o.tokens, heads, o.head_dim),
                      ringattn::thd_view<T>(s.data(), m, heads, o.head_dim));
    T* d = nullptr;
    RINGATTN_CUDA_CHECK(cudaMalloc(&d, sizeof(T) * (s.size() + 1)));
    RINGATTN_CUDA_CHECK(cudaMemcpy(d, s.data(), sizeof(T) * s.size(), cudaMemcpyHostToDevice));
    return d;
  };
  T* dq = to_device(q, o.heads);
  T* dk = to_device(k, o.kv_heads);
  T* dv = to_device(v, o.kv_heads);
  T* dout = nullptr;
  float* dlse = nullptr;
  void* ws = nullptr;
  const std::size_t ws_bytes = attn.template device_workspace_bytes<T>();
  RINGATTN_CUDA_CHECK(cudaMalloc(&dout, sizeof(T) * (m * o.heads * o.head_dim + 1)));
  RINGATTN_CUDA_CHECK(cudaMalloc(&dlse, sizeof(float) * (m * o.heads + 1)));
  RINGATTN_CUDA_CHECK(cudaMalloc(&ws, ws_bytes + 1));
  cudaStream_t stream;
  cudaEvent_t start, stop;
  RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  RINGATTN_CUDA_CHECK(cudaEventCreate(&start));
  RINGATTN_CUDA_CHECK(cudaEventCreate(&stop));
  auto forward = [&] {
    attn.forward(ringattn::thd_view<const T>(dq, m, o.heads, o.head_dim),
                 ringattn::thd_view<const T>(dk, m, o.kv_heads, o.head_dim),
                 ringattn::thd_view<const T>(dv, m, o.kv_heads, o.head_dim),
                 ringattn::thd_view<T>(dout, m, o.heads, o.head_dim), dlse, ws, ws_bytes, stream);
  };
  forward(); // warm-up
  comm.wait(stream);
  RINGATTN_CUDA_CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < o.iterations; ++i)
    forward();
  RINGATTN_CUDA_CHECK(cudaEventRecord(stop, stream));
  comm.wait(stream); // bounded: a lost peer becomes an error naming this rank
  float ms = 0.0f;
  RINGATTN_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  ms /= static_cast<float>(o.iterations);

  // Output shards to rank 0 (bytes, rank-major), then back to their places in the batch.
  std::vector<T> os(static_cast<std::size_t>(m) * o.heads * o.head_dim);
  std::vector<float> ls(static_cast<std::size_t>(m) * o.heads);
  RINGATTN_CUDA_CHECK(cudaMemcpy(os.data(), dout, sizeof(T) * os.size(), cudaMemcpyDeviceToHost));
  RINGATTN_CUDA_CHECK(
      cudaMemcpy(ls.data(), dlse, sizeof(float) * ls.size(), cudaMemcpyDeviceToHost));
  std::vector<int> counts(static_cast<std::size_t>(size)), lcounts(counts), displs(counts),
      ldispls(counts);
  for (int r = 0, at = 0, lat = 0; r < size; ++r) {
    counts[r] = static_cast<int>(plan.local_tokens(r) * o.heads * o.head_dim * sizeof(T));
    lcounts[r] = static_cast<int>(plan.local_tokens(r) * o.heads);
    displs[r] = at, ldispls[r] = lat;
    at += counts[r], lat += lcounts[r];
  }
  std::vector<T> all_o(rank == 0 ? static_cast<std::size_t>(o.tokens) * o.heads * o.head_dim : 0);
  std::vector<float> all_l(rank == 0 ? static_cast<std::size_t>(o.tokens) * o.heads : 0);
  RINGATTN_MPI_CHECK(MPI_Gatherv(os.data(), counts[rank], MPI_BYTE, all_o.data(), counts.data(),
                                 displs.data(), MPI_BYTE, 0, MPI_COMM_WORLD));
  RINGATTN_MPI_CHECK(MPI_Gatherv(ls.data(), lcounts[rank], MPI_FLOAT, all_l.data(), lcounts.data(),
                                 ldispls.data(), MPI_FLOAT, 0, MPI_COMM_WORLD));
  float worst_ms = ms;
  RINGATTN_MPI_CHECK(MPI_Reduce(&ms, &worst_ms, 1, MPI_FLOAT, MPI_MAX, 0, MPI_COMM_WORLD));
  for (void* p : {static_cast<void*>(dq), static_cast<void*>(dk), static_cast<void*>(dv),
                  static_cast<void*>(dout), static_cast<void*>(dlse), ws})
    cudaFree(p);
  cudaStreamDestroy(stream);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (rank != 0) return 0;

  // Sample rows against the oracle.
  const std::vector<std::int64_t> rows = example::sample_rows(cu, 16, rng);
  namespace ref = ringattn::reference;
  const auto want = ref::attention_forward_rows(
      ref::to_tensor(ringattn::thd_view<const T>(q.data(), o.tokens, o.heads, o.head_dim)),
      ref::to_tensor(ringattn::thd_view<const T>(k.data(), o.tokens, o.kv_heads, o.head_dim)),
      ref::to_tensor(ringattn::thd_view<const T>(v.data(), o.tokens, o.kv_heads, o.head_dim)), cu,
      args, ringattn::position_window::of(Mask::mask), rows);
  double max_err = 0.0, max_lse = 0.0;
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto own = plan.locate(rows[i]); // (rank, local row) of the sample
    const std::int64_t base_rows =
        displs[own.rank] / static_cast<int>(o.heads * o.head_dim * sizeof(T));
    const std::int64_t at = base_rows + own.local;
    for (int h = 0; h < o.heads; ++h) {
      const float l = all_l[static_cast<std::size_t>(ldispls[own.rank] +
                                                     h * plan.local_tokens(own.rank) + own.local)];
      max_lse =
          std::max(max_lse, std::abs(double(l) - want.lse_at(h, static_cast<std::int64_t>(i))));
      for (int d = 0; d < o.head_dim; ++d)
        max_err = std::max(
            max_err,
            std::abs(double(ringattn::to_float(
                         all_o[static_cast<std::size_t>((at * o.heads + h) * o.head_dim + d)])) -
                     want.out(static_cast<std::int64_t>(i), h, d)));
    }
  }
  const std::int64_t work = [&] {
    std::int64_t w = 0;
    for (int r = 0; r < size; ++r)
      w += plan.work(r, ringattn::position_window::of(Mask::mask));
    return w;
  }();
  const double tflops = 4.0 * o.heads * static_cast<double>(work) * o.head_dim / worst_ms / 1e9;
  const bool ok = max_err < 1e-2 && max_lse < 2e-3; // bf16 output, fp32 LSE
  std::printf("%d ranks (one GPU each), %s %s, %d tokens, %d:%d heads x %d: %.3f ms a "
              "forward (slowest rank), %.1f TFLOP/s\n",
              size, P::name, Mask::name, o.tokens, o.heads, o.kv_heads, o.head_dim, worst_ms,
              tflops);
  std::printf("%zu sample rows x %d heads against the float64 oracle: max |err| %.2e, lse err "
              "%.2e: %s\n",
              rows.size(), o.heads, max_err, max_lse, ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
} // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1, code = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  try {
    options o;
    try {
      o = parse(argc, argv);
    } catch (const example::help_requested& h) {
      if (rank == 0) std::printf("%s", h.text.c_str());
      MPI_Finalize();
      return 0;
    }
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      if (rank == 0) std::printf("no CUDA device: skipped\n");
      MPI_Finalize();
      return 77;
    }
    RINGATTN_CUDA_CHECK(cudaSetDevice(rank % devices));
    auto with_mask = [&]<class P>() {
      return o.mask == "full" ? run<P, ringattn::full>(o, rank, size)
                              : run<P, ringattn::causal>(o, rank, size);
    };
    code = o.partitioner == "zigzag"        ? with_mask.template operator()<ringattn::zigzag>()
           : o.partitioner == "round_robin" ? with_mask.template operator()<ringattn::round_robin>()
           : o.partitioner == "balanced"    ? with_mask.template operator()<ringattn::balanced>()
                                            : with_mask.template operator()<ringattn::contiguous>();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return code;
}
