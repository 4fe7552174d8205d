// The host ring under mpirun: one process per rank, mpi_communicator, every partitioner x mask x
// GQA x packed odd lengths against the float64 oracle (each rank checks its own shard); bytes per
// step; plan-time disagreement.
#include "../sharded_case.hpp"

#include <ringattn/comm/mpi.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>
#include <mpi.h>

using namespace ringattn;

namespace {
template <class P, class Mask>
void check_ring(mpi_communicator& comm, std::uint64_t seed) {
  for (int group : {1, 4}) {
    CAPTURE(group);
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(group)); // same inputs on every rank
    const auto cu = test::random_cu_seqlens(3, 1, 61, rng);
    test::sharded_case<P, __nv_bfloat16> c(cu, comm.size(), {4, 4 / group, 64, 0.0f}, Mask::mask,
                                           rng);
    const auto ref = c.oracle();
    const attention_arguments a = c.args;
    ring_attention<P, mpi_communicator, Mask> attn(comm, a, cu);
    const int r = comm.rank();
    const std::int64_t n = attn.local_tokens();
    std::vector<__nv_bfloat16> out(static_cast<std::size_t>(n * a.q_heads * a.head_dim),
                                   test::poison<__nv_bfloat16>());
    std::vector<float> lse(static_cast<std::size_t>(n * a.q_heads), -7.0f);
    std::vector<std::byte> ws(attn.template host_workspace_bytes<__nv_bfloat16>() + 16);
    auto aligned = std::span<std::byte>(ws).subspan(
        (16 - reinterpret_cast<std::uintptr_t>(ws.data()) % 16) % 16,
        attn.template host_workspace_bytes<__nv_bfloat16>());
    const std::uint64_t before = comm.bytes_sent();
    attn.forward_host(thd_view<const __nv_bfloat16>(c.qs[r].data(), n, a.q_heads, a.head_dim),
                      thd_view<const __nv_bfloat16>(c.ks[r].data(), n, a.kv_heads, a.head_dim),
                      thd_view<const __nv_bfloat16>(c.vs[r].data(), n, a.kv_heads, a.head_dim),
                      thd_view<__nv_bfloat16>(out.data(), n, a.q_heads, a.head_dim), lse.data(),
                      aligned);
    std::uint64_t want = 0;
    for (int t = 0; t + 1 < comm.size(); ++t)
      want += attn.template block_bytes<__nv_bfloat16>((r - t + comm.size()) % comm.size());
    CHECK(comm.bytes_sent() - before == want);
    std::vector<double> got, exp;
    double lse_err = 0.0;
    for (std::int64_t l = 0; l < n; ++l) {
      const std::int64_t g = c.plan.global_token(r, l);
      for (int h = 0; h < a.q_heads; ++h) {
        lse_err = std::max(
            lse_err, std::abs(double(lse[static_cast<std::size_t>(h * n + l)]) - ref.lse_at(h, g)));
        for (int e = 0; e < a.head_dim; ++e) {
          got.push_back(
              to_float(out[static_cast<std::size_t>((l * a.q_heads + h) * a.head_dim + e)]));
          exp.push_back(ref.out(g, h, e));
        }
      }
    }
    // Tolerances as in the threaded test: bf16 output 4e-3 relative, LSE 1e-5.
    if (n > 0) CHECK(reference::relative_error(got, exp) < 4e-3);
    CHECK(lse_err < 1e-5);
  }
}

std::uint64_t shared_seed() {
  std::uint64_t seed = test::fresh_seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  return seed;
}
} // namespace

TEST_CASE_TEMPLATE("MPI ring equals the oracle on every rank: full and causal", P, contiguous,
                   round_robin, zigzag) {
  mpi_communicator comm(MPI_COMM_WORLD);
  const auto seed = shared_seed();
  CAPTURE(seed);
  check_ring<P, full>(comm, seed);
  check_ring<P, causal>(comm, seed);
}

TEST_CASE("MPI: ranks that disagree are rejected at plan time on every rank") {
  mpi_communicator comm(MPI_COMM_WORLD, std::chrono::seconds(20));
  const std::vector<std::int32_t> cu = {0, 64};
  const int last = comm.size() - 1;
  const attention_arguments a{8, comm.rank() == last && last > 0 ? 4 : 8, 64, 0.0f};
  if (last == 0) return;
  CHECK_THROWS_WITH_AS(
      (ring_attention<zigzag, mpi_communicator, causal>(comm, a, cu)),
      ("ringattn: rank " + std::to_string(last) + " disagrees with rank 0 on kv_heads (4 vs 8)")
          .c_str(),
      invalid_argument);
}
