// The device ring over NCCL with one MPI process per GPU (rank r on GPU r), forward and backward,
// every partitioner x {full, causal}, bf16, against the float64 oracle on the gathered batch:
// each rank checks its shard (errors summed over ranks through MPI), its bytes against the plan
// and the bitwise repeat of two calls. Skipped (77) with fewer GPUs than ranks: NCCL refuses two
// ranks on one GPU.
#include "../support/device_ring.cuh"
#include "shared_seed.hpp"

#include <ringattn/comm/nccl_mpi.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>

#include <doctest/doctest.h>
#include <mpi.h>

#include <array>
#include <cstdlib>
#include <string>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;

double sum_over_ranks(double x) {
  double total = 0.0;
  MPI_Allreduce(&x, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return total;
}

std::vector<std::int32_t> batch(std::mt19937_64& rng) {
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  return test::random_cu_seqlens(3, 1, small ? 150 : 600, rng);
}

template <class P, class Mask>
void check_forward(nccl_communicator& comm, std::uint64_t seed) {
  std::mt19937_64 rng(seed); // the same batch on every rank
  test::sharded_case<P, T> c(batch(rng), comm.size(), {8, 2, 128, 0.0f}, Mask::mask, rng);
  const auto run = test::device_ring_rank<Mask>(c, comm.rank(), comm, /*repeat=*/true);
  CHECK(run.repeatable);
  CHECK(run.sent == run.expected);
  const auto e = c.rank_error(comm.rank(), run.output, c.oracle());
  double lse = 0.0;
  MPI_Allreduce(&e.lse, &lse, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  // The block kernel's bf16 tolerances (test_block_forward.cu): 8e-3 relative, LSE 2e-3.
  CHECK(std::sqrt(sum_over_ranks(e.num) / sum_over_ranks(e.den)) < 8e-3);
  CHECK(lse < 2e-3);
}

template <class P, class Mask>
void check_backward(nccl_communicator& comm, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  test::sharded_backward_case<P, T> c(batch(rng), comm.size(), {8, 2, 128, 0.0f}, Mask::mask, rng);
  const auto run = test::device_backward_rank<Mask>(c, comm.rank(), comm, /*repeat=*/true);
  CHECK(run.repeatable);
  CHECK(run.sent == run.expected);
  const auto e = c.rank_grad_error(comm.rank(), run.grads, c.oracle_backward());
  // The device ring backward's bf16 tolerance (device_ring.cuh): 1e-2 relative for each of dq,
  // dk, dv.
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    const double err = std::sqrt(sum_over_ranks(e.num[i]) / sum_over_ranks(e.den[i]));
    if (comm.rank() == 0)
      MESSAGE(std::string(P::name), " ", std::string(Mask::name), " gradient ", i, ": ", err);
    CHECK(err < 1e-2);
  }
}
} // namespace

TEST_CASE_TEMPLATE("NCCL ring, one process per GPU: forward equals the oracle", P, contiguous,
                   round_robin, zigzag) {
  auto comm = make_nccl_communicator(MPI_COMM_WORLD);
  const auto seed = test::shared_seed();
  CAPTURE(seed);
  check_forward<P, causal>(comm, seed);
  check_forward<P, full>(comm, seed + 1);
}

TEST_CASE_TEMPLATE("NCCL ring, one process per GPU: backward equals the oracle", P, contiguous,
                   round_robin, zigzag) {
  auto comm = make_nccl_communicator(MPI_COMM_WORLD);
  const auto seed = test::shared_seed();
  CAPTURE(seed);
  check_backward<P, causal>(comm, seed);
  check_backward<P, full>(comm, seed + 1);
}
