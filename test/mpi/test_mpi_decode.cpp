// Attention over a sharded KV cache under mpirun: one process per rank, mpi_communicator, the
// cache of each partitioner's prefill, three decode steps with appends, GQA 1, 4, 8, against the
// float64 oracle; every rank's result bitwise equal to rank 0's; bytes per rank. The same over
// a paged cache.
#include "../support/decode_case.hpp"
#include "shared_seed.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/mpi.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/sharded_attention.cuh>

#include <doctest/doctest.h>
#include <mpi.h>

#include <cstring>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;

// Whether `out` and `lse` hold rank 0's bits (collective).
bool same_as_rank0(const std::vector<T>& out, const std::vector<float>& lse) {
  std::vector<T> out0 = out;
  std::vector<float> lse0 = lse;
  MPI_Bcast(out0.data(), static_cast<int>(out0.size() * sizeof(T)), MPI_BYTE, 0, MPI_COMM_WORLD);
  MPI_Bcast(lse0.data(), static_cast<int>(lse0.size() * sizeof(float)), MPI_BYTE, 0,
            MPI_COMM_WORLD);
  return test::same_bits(out0, lse0, out, lse);
}

template <class P>
void check_decode(mpi_communicator& comm, std::uint64_t seed) {
  const int r = comm.rank(), p = comm.size();
  for (int group : {1, 4, 8}) {
    CAPTURE(group);
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(group)); // the same case on every rank
    const attention_arguments a{8, 8 / group, 64, 0.0f};
    const int qh = a.q_heads, kvh = a.kv_heads, d = a.head_dim;
    test::decode_case<P, T> c(test::random_cu_seqlens(3, 1, 61, rng), p, a, rng);
    sharded_attention<mpi_communicator, host_reference<causal_mask>> dec(comm, a);
    for (int step = 0; step < 3; ++step) {
      CAPTURE(step);
      const auto s = c.draw(rng, step == 2 ? 0 : 1, 4);
      const std::int64_t n = s.tokens;
      const auto sh = c.rank_shard(r);
      dec.plan(s.cu_new, sh.cu);
      std::vector<std::byte> ws(dec.host_workspace_bytes<T>());
      std::vector<T> out(n * qh * d, test::poison<T>());
      std::vector<float> lse(n * qh, -7.0f);
      const std::uint64_t before = comm.bytes_sent();
      dec.forward_host(thd_view<const T>(s.q.data(), n, qh, d),
                       thd_view<const T>(s.k.data(), n, kvh, d),
                       thd_view<const T>(s.v.data(), n, kvh, d),
                       thd_view<const T>(sh.k.data(), sh.tokens(), kvh, d),
                       thd_view<const T>(sh.v.data(), sh.tokens(), kvh, d),
                       thd_view<T>(out.data(), n, qh, d), lse.data(), ws);
      CHECK(comm.bytes_sent() - before ==
            static_cast<std::uint64_t>(p - 1) * test::finished_partial_bytes(n * qh, d, sizeof(T)));
      const auto [err, lse_err] = c.error(s, out, lse);
      CHECK(err < 4e-3); // the host tolerances: bf16 output 4e-3 relative L2, LSE 1e-5
      CHECK(lse_err < 1e-5);
      CHECK(same_as_rank0(out, lse));
      CHECK(c.append(s) == n);
    }
  }
}
} // namespace

TEST_CASE_TEMPLATE("MPI sharded decode equals the oracle, the same bits on every rank", P,
                   contiguous, round_robin, zigzag) {
  mpi_communicator comm(MPI_COMM_WORLD);
  const auto seed = test::shared_seed();
  CAPTURE(seed);
  check_decode<P>(comm, seed);
}

TEST_CASE_TEMPLATE("MPI sharded decode over a paged cache equals the oracle, the same bits on "
                   "every rank",
                   P, contiguous, zigzag) {
  // Each rank's shard in a shuffled pool of 16- or 32-token pages (rows no sequence owns hold
  // NaN), two steps with appends, GQA 1 and 4.
  mpi_communicator comm(MPI_COMM_WORLD);
  const auto seed = test::shared_seed();
  CAPTURE(seed);
  const int r = comm.rank(), p = comm.size();
  for (int page_size : {16, 32})
    for (int group : {1, 4}) {
      CAPTURE(page_size);
      CAPTURE(group);
      // The same case, and the same pools, on every rank.
      std::mt19937_64 rng(seed + static_cast<std::uint64_t>(page_size * 10 + group));
      const attention_arguments a{8, 8 / group, 64, 0.0f};
      const int qh = a.q_heads, kvh = a.kv_heads, d = a.head_dim;
      test::decode_case<P, T> c(test::random_cu_seqlens(3, 1, 90, rng), p, a, rng);
      sharded_attention<mpi_communicator, host_reference<causal_mask>> dec(comm, a);
      for (int step = 0; step < 2; ++step) {
        CAPTURE(step);
        const auto s = c.draw(rng, 1, 4);
        const std::int64_t n = s.tokens;
        std::vector<test::paged_shard<T>> shards;
        for (int q = 0; q < p; ++q)
          shards.push_back(test::page_out(c, c.rank_shard(q), page_size, rng));
        const test::paged_shard<T>& sh = shards[r];
        dec.plan(s.cu_new, paged_cache{page_size, sh.pages, sh.cu_pages, sh.table, sh.length});
        std::vector<std::byte> ws(dec.host_workspace_bytes<T>());
        std::vector<T> out(n * qh * d, test::poison<T>());
        std::vector<float> lse(n * qh, -7.0f);
        const std::int64_t rows = sh.pages * page_size;
        dec.forward_host(
            thd_view<const T>(s.q.data(), n, qh, d), thd_view<const T>(s.k.data(), n, kvh, d),
            thd_view<const T>(s.v.data(), n, kvh, d), thd_view<const T>(sh.k.data(), rows, kvh, d),
            thd_view<const T>(sh.v.data(), rows, kvh, d), thd_view<T>(out.data(), n, qh, d),
            lse.data(), ws);
        const auto [err, lse_err] = c.error(s, out, lse);
        CHECK(err < 4e-3); // the host tolerances: bf16 output 4e-3 relative L2, LSE 1e-5
        CHECK(lse_err < 1e-5);
        CHECK(same_as_rank0(out, lse));
        CHECK(c.append(s) == n);
      }
    }
}
