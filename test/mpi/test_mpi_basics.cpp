// Under mpirun: checked MPI calls name the call, MPI's text and the rank; every rank plans the
// same layout and computes the same oracle (the ranks of later ring tests must agree on both).
#include "../support/common.hpp"

#include <ringattn/comm/mpi_error.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/reference/attention.cuh>

#include <doctest/doctest.h>
#include <mpi.h>

#include <string>

using namespace ringattn;

TEST_CASE("a failing MPI call throws communication_error naming the call and the rank") {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  int x = 0;
  try {
    // An invalid count: MPI reports it as an error code instead of aborting.
    RINGATTN_MPI_CHECK(MPI_Bcast(&x, -1, MPI_INT, 0, comm));
    FAIL("no exception");
  } catch (const communication_error& e) {
    const std::string m = e.what();
    CHECK(m.find("MPI_Bcast(&x, -1, MPI_INT, 0, comm) failed") != std::string::npos);
    CHECK(m.find("[rank " + std::to_string(rank) + "]") != std::string::npos);
  }
  MPI_Comm_free(&comm);
  CHECK_NOTHROW(RINGATTN_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD)));
}

TEST_CASE("every rank plans the same layout and its own shard") {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  // Rank 0 draws the batch; the others receive it, as a real job's data loader would agree.
  std::uint64_t seed = test::fresh_seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  std::mt19937_64 rng(seed);
  const auto cu = test::random_cu_seqlens(4, 0, 3000, rng);
  partition_plan<zigzag> plan(cu, size);
  long long mine = plan.local_tokens(rank), total = 0;
  MPI_Allreduce(&mine, &total, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
  CHECK(total == plan.tokens());
  long long first = plan.global_token(rank, 0), lowest = 0;
  MPI_Allreduce(&first, &lowest, 1, MPI_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
  CHECK(lowest == 0); // rank 0 holds position 0 of sequence 0 (when it is not empty)
}

TEST_CASE("the oracle is deterministic across processes") {
  std::uint64_t seed = test::fresh_seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  std::mt19937_64 rng(seed);
  const std::vector<std::int32_t> cu = {0, 13, 30};
  auto q = test::random_buffer<__nv_bfloat16>(30 * 4 * 64, rng);
  auto k = test::random_buffer<__nv_bfloat16>(30 * 2 * 64, rng);
  auto v = test::random_buffer<__nv_bfloat16>(30 * 2 * 64, rng);
  auto r = reference::attention_forward(thd_view<const __nv_bfloat16>(q.data(), 30, 4, 64),
                                        thd_view<const __nv_bfloat16>(k.data(), 30, 2, 64),
                                        thd_view<const __nv_bfloat16>(v.data(), 30, 2, 64), cu,
                                        {4, 2, 64, 0.0f}, mask_kind::causal);
  std::vector<double> root = r.out.data;
  MPI_Bcast(root.data(), static_cast<int>(root.size()), MPI_DOUBLE, 0, MPI_COMM_WORLD);
  CHECK(root == r.out.data);
}
