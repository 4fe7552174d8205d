// The device ring under mpirun with mpi_communicator: device buffers through pinned staging (or
// straight to a CUDA-aware MPI), every partitioner x {full, causal}, bf16, each rank's shard
// against the float64 oracle, bytes per step; two forwards bitwise equal. Runs where a GPU exists
// (several ranks may share one).
#include "../gpu/device_buffer.cuh"
#include "../sharded_case.hpp"

#include <ringattn/comm/mpi.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>
#include <mpi.h>

#include <cstring>
#include <string>

using namespace ringattn;

static_assert(device_communicator_for<mpi_communicator, cudaStream_t>);

namespace {
using T = __nv_bfloat16;

template <class P, class Mask>
void check(mpi_communicator& comm, std::uint64_t seed) {
  std::mt19937_64 rng(seed); // the same inputs on every rank
  const auto cu = test::random_cu_seqlens(3, 1, 400, rng);
  test::sharded_case<P, T> c(cu, comm.size(), {8, 2, 128, 0.0f}, Mask::mask, rng);
  const auto ref = c.oracle();
  const attention_arguments a = c.args;
  ring_attention<P, mpi_communicator, Mask> attn(comm, a, cu);
  attn.prepare_device();
  const int r = comm.rank();
  const std::int64_t n = attn.local_tokens();
  test::device_buffer<T> q(c.qs[static_cast<std::size_t>(r)]), k(c.ks[static_cast<std::size_t>(r)]),
      v(c.vs[static_cast<std::size_t>(r)]);
  test::device_buffer<T> out(
      std::vector<T>(c.qs[static_cast<std::size_t>(r)].size(), test::poison<T>()));
  test::device_buffer<float> lse(
      std::vector<float>(static_cast<std::size_t>(n * a.q_heads), -7.0f));
  const std::size_t bytes = attn.template device_workspace_bytes<T>();
  test::device_buffer<std::byte> ws(bytes);
  cudaStream_t stream;
  RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const std::uint64_t before = comm.bytes_sent();
  auto once = [&] {
    attn.forward(thd_view<const T>(q.get(), n, a.q_heads, a.head_dim),
                 thd_view<const T>(k.get(), n, a.kv_heads, a.head_dim),
                 thd_view<const T>(v.get(), n, a.kv_heads, a.head_dim),
                 thd_view<T>(out.get(), n, a.q_heads, a.head_dim), lse.get(), ws.get(), bytes,
                 stream);
    RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
    return typename test::sharded_case<P, T>::rank_output{out.download(), lse.download()};
  };
  const auto first = once();
  const auto second = once();
  RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  CHECK(std::memcmp(first.out.data(), second.out.data(), first.out.size() * sizeof(T)) == 0);
  std::uint64_t want = 0;
  for (int t = 0; t + 1 < comm.size(); ++t)
    want += attn.template block_bytes<T>((r - t + comm.size()) % comm.size());
  CHECK(comm.bytes_sent() - before == 2 * want);
  const auto part = c.rank_error(r, first, ref);
  double sums[2] = {part.num, part.den}, total[2] = {0.0, 0.0}, lse_err = 0.0;
  MPI_Allreduce(sums, total, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(&part.lse, &lse_err, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  // The block kernel's tolerances (test_block_forward.cu): bf16 8e-3 relative, LSE 2e-3.
  CHECK(std::sqrt(total[0] / total[1]) < 8e-3);
  CHECK(lse_err < 2e-3);
}

std::uint64_t shared_seed() {
  std::uint64_t seed = test::fresh_seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return seed;
}
} // namespace

TEST_CASE_TEMPLATE("MPI device ring (staged through pinned memory) equals the oracle", P,
                   contiguous, round_robin, zigzag) {
  mpi_communicator comm(MPI_COMM_WORLD, std::chrono::seconds(60), cuda_awareness::no);
  const auto seed = shared_seed();
  CAPTURE(seed);
  check<P, causal>(comm, seed);
  check<P, full>(comm, seed + 1);
  CHECK_FALSE(comm.cuda_aware());
}

// The path detection picks (Open MPI's MPIX_Query_cuda_support, unless RINGATTN_MPI_CUDA_AWARE
// is set): device pointers straight to MPI where it says CUDA-aware, staging otherwise.
TEST_CASE("MPI device ring with detected CUDA-awareness equals the oracle") {
  mpi_communicator comm(MPI_COMM_WORLD);
  const auto seed = shared_seed();
  CAPTURE(seed);
  check<zigzag, causal>(comm, seed);
  int aware = comm.cuda_aware() ? 1 : 0, all = 0;
  MPI_Allreduce(&aware, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  CHECK((all == 0 || all == comm.size())); // every rank resolved the same path
  if (comm.rank() == 0) {
    const std::string path = aware ? "yes (device pointers to MPI)" : "no (staged)";
    MESSAGE("MPI CUDA-aware: " << path);
  }
}

TEST_CASE("MPI device exchange before prepare_device is refused") {
  mpi_communicator comm(MPI_COMM_WORLD);
  int x = 0;
  CHECK_THROWS_AS(comm.exchange_async(&x, 4, 0, &x, 4, 0, 0, nullptr), invalid_argument);
}
