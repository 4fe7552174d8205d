// The device ring under mpirun with mpi_communicator: device buffers through pinned staging (or
// straight to a CUDA-aware MPI), every partitioner x {full, causal}, bf16, each rank's shard
// against the float64 oracle, bytes per step; two forwards bitwise equal. Runs where a GPU exists
// (several ranks may share one).
#include "../support/device_ring.cuh"
#include "shared_seed.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/mpi.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>
#include <mpi.h>

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
  const int r = comm.rank();
  // One forward, then a second that must give the same bits; bytes against the plan.
  const auto run = test::device_ring_rank<Mask>(c, r, comm, /*repeat=*/true);
  CHECK(run.repeatable);
  CHECK(run.sent == run.expected);
  const auto part = c.rank_error(r, run.output, ref);
  double sums[2] = {part.num, part.den}, total[2] = {0.0, 0.0}, lse_err = 0.0;
  MPI_Allreduce(sums, total, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(&part.lse, &lse_err, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  // The block kernel's tolerances (test_block_forward.cu): bf16 8e-3 relative, LSE 2e-3.
  CHECK(std::sqrt(total[0] / total[1]) < 8e-3);
  CHECK(lse_err < 2e-3);
}

} // namespace

TEST_CASE_TEMPLATE("MPI device ring (staged through pinned memory) equals the oracle", P,
                   contiguous, round_robin, zigzag) {
  mpi_communicator comm(MPI_COMM_WORLD, std::chrono::seconds(60), cuda_awareness::no);
  const auto seed = test::shared_seed();
  CAPTURE(seed);
  check<P, causal>(comm, seed);
  check<P, full>(comm, seed + 1);
  CHECK_FALSE(comm.cuda_aware());
}

// The path detection picks (Open MPI's MPIX_Query_cuda_support, unless RINGATTN_MPI_CUDA_AWARE
// is set): device pointers straight to MPI where it says CUDA-aware, staging otherwise.
TEST_CASE("MPI device ring with detected CUDA-awareness equals the oracle") {
  mpi_communicator comm(MPI_COMM_WORLD);
  const auto seed = test::shared_seed();
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
