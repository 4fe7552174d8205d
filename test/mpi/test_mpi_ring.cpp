// The host ring under mpirun: one process per rank, mpi_communicator, every partitioner x mask
// (windows included) x GQA 1, 4, 8 x packed odd lengths (and q/k 192 with v 128), forward and
// backward, against the float64 oracle (each rank checks its own shard), on every schedule (the
// ring, the all-gather and the all-to-all), the max logit over every rank included; bytes per
// rank; plan-time disagreement.
#include "../support/all_to_all_bytes.hpp"
#include "../support/ring_bytes.hpp"
#include "../support/sharded_backward_case.hpp"
#include "shared_seed.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/mpi.cuh>
#include <ringattn/partition/balanced.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>

using namespace ringattn;

namespace {
// The ring schedule's numbers (only asked of the ring and the all-gather).
template <class Ring>
int step_count(const Ring& attn) {
  if constexpr (requires { attn.schedule().source_of(0); }) return attn.schedule().step_count();
  return 0;
}
template <class Ring>
int source_of(const Ring& attn, int t) {
  if constexpr (requires { attn.schedule().source_of(0); }) return attn.schedule().source_of(t);
  return t;
}

// q/k `head_dim` wide, v `head_dim_v` (0: as wide); a window where the mask takes one.
template <class P, class Mask, class Schedule = ring_pass>
void check_ring(mpi_communicator& comm, std::uint64_t seed, std::int64_t window_left = -1,
                std::int64_t window_right = -1, int head_dim = 64, int head_dim_v = 0) {
  constexpr bool gather = std::is_same_v<Schedule, all_gather_kv>;
  constexpr bool heads = std::is_same_v<typename Schedule::plan_type, all_to_all_plan>;
  // The all-to-all splits the heads over the ranks: 24 of them over 3.
  const int q_heads = heads && comm.size() == 3 ? 24 : 8;
  for (int group : {1, 4, 8}) {
    CAPTURE(group);
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(group)); // same inputs on every rank
    const auto cu = test::random_cu_seqlens(3, 1, 61, rng);
    const attention_arguments shape{.q_heads = q_heads,
                                    .kv_heads = q_heads / group,
                                    .head_dim = head_dim,
                                    .window_left = window_left,
                                    .window_right = window_right,
                                    .head_dim_v = head_dim_v};
    test::sharded_backward_case<P, __nv_bfloat16> c(cu, comm.size(), shape, Mask::mask, rng);
    const auto ref = c.oracle();
    const attention_arguments a = c.args;
    ring_attention<P, mpi_communicator, Mask, Schedule> attn(comm, a, cu);
    const int r = comm.rank(), p = comm.size();
    const std::uint64_t before = comm.bytes_sent();
    std::vector<float> max_logit;
    const auto out = c.forward_rank(attn, r, false, &max_logit);
    // The ring: the blocks some later rank sees go on (ring_bytes.hpp). The all-gather: the own
    // block to each of the others.
    std::vector<std::int64_t> tokens;
    for (int s = 0; s < p; ++s)
      tokens.push_back(c.plan.local_tokens(s));
    int group_size = 0;
    if constexpr (heads) group_size = attn.schedule().group_size();
    const auto by_heads =
        test::all_to_all_bytes_of(tokens, r, a, sizeof(__nv_bfloat16), group_size);
    std::uint64_t want = by_heads.forward;
    const int steps = heads ? 0 : step_count(attn);
    if constexpr (!heads) {
      want = gather ? test::all_gather_bytes<__nv_bfloat16>(attn, r, Mask::mask)
                    : test::ring_forward_bytes<__nv_bfloat16>(attn, r, Mask::mask);
    }
    CHECK(comm.bytes_sent() - before == want);
    // The relative error of the whole output: every rank's sums, reduced over ranks.
    const auto part = c.rank_error(r, out, ref);
    double sums[2] = {part.num, part.den}, total[2] = {0.0, 0.0}, lse_err = 0.0;
    MPI_Allreduce(sums, total, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&part.lse, &lse_err, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    // Tolerances as in the threaded test: bf16 output 4e-3 relative, LSE 1e-5.
    CHECK(std::sqrt(total[0] / total[1]) < 4e-3);
    CHECK(lse_err < 1e-5);
    // The max logit over every rank, on every rank: the oracle's within fp32 rounding, and the
    // same bits as rank 0's.
    CHECK(c.max_logit_error(max_logit, ref.max_logit) < 1e-6);
    std::vector<float> first = max_logit;
    MPI_Bcast(first.data(), static_cast<int>(first.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
    CHECK(std::memcmp(first.data(), max_logit.data(), first.size() * sizeof(float)) == 0);

    // Backward from this forward's output: dq, dk, dv of every rank against the oracle's backward.
    const std::uint64_t before_backward = comm.bytes_sent();
    const auto g = c.backward_rank(attn, r, out);
    std::uint64_t want_backward = 0;
    if constexpr (heads) {
      want_backward = by_heads.backward;
    } else if constexpr (gather) { // the gather again, the dK/dV share of each block seen home
      want_backward = want + test::all_gather_share_bytes(attn, r, Mask::mask);
    } else { // blocks travel with their dK/dV; the last one's go home
      for (int t = 0; t + 1 < steps; ++t)
        want_backward += attn.template backward_block_bytes<__nv_bfloat16>((r - t + p) % p);
      if (steps > 1) // the fp32 dK/dV of the block held last go home: its travelling rows
        want_backward +=
            sizeof(float) *
            static_cast<std::size_t>(attn.schedule().travel_tokens(source_of(attn, steps - 1))) *
            a.kv_heads * (a.qk_dim() + a.v_dim());
    }
    CHECK(comm.bytes_sent() - before_backward == want_backward);
    const auto gp = c.rank_grad_error(r, g, c.oracle_backward());
    double gs[6] = {gp.num[0], gp.num[1], gp.num[2], gp.den[0], gp.den[1], gp.den[2]}, gt[6] = {};
    MPI_Allreduce(gs, gt, 6, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    // Tolerance as in the threaded test: 4e-3 relative L2 for each of dq, dk, dv.
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(std::sqrt(gt[i] / gt[i + 3]) < 4e-3);
    }
  }
}

} // namespace

TEST_CASE_TEMPLATE("MPI ring equals the oracle on every rank: full and causal", P, contiguous,
                   round_robin, zigzag, balanced) {
  mpi_communicator comm(MPI_COMM_WORLD);
  const auto seed = test::shared_seed();
  CAPTURE(seed);
  check_ring<P, full>(comm, seed);
  check_ring<P, causal>(comm, seed);
}

TEST_CASE_TEMPLATE("MPI all-gather equals the oracle on every rank: full and causal", P, contiguous,
                   round_robin, zigzag, balanced) {
  mpi_communicator comm(MPI_COMM_WORLD);
  const auto seed = test::shared_seed();
  CAPTURE(seed);
  check_ring<P, full, all_gather_kv>(comm, seed);
  check_ring<P, causal, all_gather_kv>(comm, seed);
}

TEST_CASE_TEMPLATE("MPI ring and all-gather with windows equal the oracle on every rank", P,
                   contiguous, round_robin, zigzag, balanced) {
  mpi_communicator comm(MPI_COMM_WORLD);
  const auto seed = test::shared_seed();
  CAPTURE(seed);
  check_ring<P, causal_window>(comm, seed, 3, 0); // shorter than a shard: the ring stops early
  check_ring<P, sliding_window>(comm, seed, 5, 2);
  check_ring<P, causal_window, all_gather_kv>(comm, seed, 3, 0);
  check_ring<P, sliding_window, all_gather_kv>(comm, seed, 5, 2);
}

TEST_CASE_TEMPLATE("MPI ring and all-gather with head_dim 192 and head_dim_v 128 equal the oracle",
                   P, contiguous, round_robin, zigzag) {
  mpi_communicator comm(MPI_COMM_WORLD);
  const auto seed = test::shared_seed();
  CAPTURE(seed);
  check_ring<P, causal>(comm, seed, -1, -1, 192, 128); // GQA 1, 4, 8 (MHA included)
  check_ring<P, full, all_gather_kv>(comm, seed, -1, -1, 192, 128);
}

TEST_CASE_TEMPLATE("MPI all-to-all equals the oracle on every rank: every mask, GQA 1, 4, 8", P,
                   contiguous, round_robin, zigzag) {
  mpi_communicator comm(MPI_COMM_WORLD);
  const auto seed = test::shared_seed();
  CAPTURE(seed);
  check_ring<P, full, all_to_all_heads>(comm, seed);
  check_ring<P, causal, all_to_all_heads>(comm, seed);
  check_ring<P, causal_window, all_to_all_heads>(comm, seed, 3, 0);
  check_ring<P, sliding_window, all_to_all_heads>(comm, seed, 5, 2);
  check_ring<P, causal, all_to_all_heads>(comm, seed, -1, -1, 192, 128);
}

TEST_CASE_TEMPLATE("MPI hybrid (all-to-all in pairs, all-gather across) equals the oracle", P,
                   contiguous, round_robin, zigzag) {
  mpi_communicator comm(MPI_COMM_WORLD);
  if (comm.size() % 2 != 0) return; // pairs of ranks only
  const auto seed = test::shared_seed();
  CAPTURE(seed);
  check_ring<P, causal, all_to_all_heads_x_all_gather<2>>(comm, seed);
  check_ring<P, full, all_to_all_heads_x_all_gather<2>>(comm, seed);
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

TEST_CASE("MPI: a rank with invalid arguments makes every rank fail at plan time") {
  mpi_communicator comm(MPI_COMM_WORLD, std::chrono::seconds(20));
  const int last = comm.size() - 1;
  if (last == 0) return;
  const std::vector<std::int32_t> cu = {0, 64};
  const attention_arguments a{8, 8, comm.rank() == last ? 96 : 64, 0.0f};
  const std::string expected =
      comm.rank() == last ? "ringattn: head_dim 96 is not supported (supported: 64, 128, 192, 256)"
                          : "ringattn: rank " + std::to_string(last) +
                                " rejected its arguments (its own error says why)";
  CHECK_THROWS_WITH_AS((ring_attention<round_robin, mpi_communicator, full>(comm, a, cu)),
                       expected.c_str(), invalid_argument);
}

namespace {
// The relative L2 error of every rank's output together (reduced over the ranks).
template <class Case, class Output>
double ring_error(const Case& c, int r, const Output& out) {
  const auto part = c.rank_error(r, out, c.oracle());
  double sums[2] = {part.num, part.den}, total[2] = {0.0, 0.0};
  MPI_Allreduce(sums, total, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return std::sqrt(total[0] / total[1]);
}
double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
} // namespace

// Fault injection and recovery (docs/reliability.md): the last rank plans with the others, then
// arrives late. The others fail at the call's agreement within the timeout; the late rank fails
// at its first step. Every communicator is then broken: a retry on any rank fails at once (it
// never takes the late rank's messages), and a new communicator runs the ring correctly.
TEST_CASE("MPI: a late rank: the others fail within the timeout; a retry fails at once; a new "
          "communicator works") {
  const int size = [] {
    int s = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &s);
    return s;
  }();
  if (size < 2) return;
  const auto timeout = std::chrono::milliseconds(300);
  std::mt19937_64 rng(7);
  const auto cu = test::random_cu_seqlens(2, 20, 61, rng);
  test::sharded_case<zigzag, __nv_bfloat16> c(cu, size, {4, 2, 64, 0.0f}, mask_kind::causal, rng);
  {
    mpi_communicator comm(MPI_COMM_WORLD, timeout);
    const int r = comm.rank(), last = size - 1;
    ring_attention<zigzag, mpi_communicator, causal> attn(comm, c.args, cu);
    if (r == last) std::this_thread::sleep_for(timeout * 3);
    const auto start = std::chrono::steady_clock::now();
    std::string what;
    try {
      (void)c.forward_rank(attn, r);
    } catch (const communication_error& e) {
      what = e.what();
    }
    CAPTURE(what);
    if (r != last) {
      CHECK(what == "ringattn: rank " + std::to_string(r) +
                        ", call 1 (forward_host): timed out after 300 ms waiting for every rank "
                        "to join a collective");
      CHECK(seconds_since(start) < 1.0);
    } else {
      CHECK(what.find("ringattn: rank " + std::to_string(r) + ", step 0: timed out after 300 ms") ==
            0);
    }
    const auto retry = std::chrono::steady_clock::now();
    std::string again;
    try {
      (void)c.forward_rank(attn, r);
    } catch (const communication_error& e) {
      again = e.what();
    }
    CAPTURE(again);
    CHECK(again.find("this MPI communicator is broken (") != std::string::npos);
    CHECK(again.find("create a new mpi_communicator") != std::string::npos);
    // The retry names itself once, and the cause as it happened (a call's all-gather or a step).
    CHECK(again.starts_with("ringattn: rank " + std::to_string(r) +
                            ", call 2 (forward_host): this MPI communicator is broken (rank "));
    CHECK(again.find("at plan time") == std::string::npos);
    CHECK(again.find("ringattn:", 1) == std::string::npos);
    if (r != last)
      CHECK(again.find("(rank " + std::to_string(r) + ", all-gather: timed out after 300 ms") !=
            std::string::npos);
    CHECK(seconds_since(retry) < 0.1);
  }
  MPI_Barrier(MPI_COMM_WORLD); // everyone, the late rank included, goes on together
  mpi_communicator fresh(MPI_COMM_WORLD, std::chrono::seconds(20));
  ring_attention<zigzag, mpi_communicator, causal> attn(fresh, c.args, cu);
  CHECK(ring_error(c, fresh.rank(), c.forward_rank(attn, fresh.rank())) < 4e-3);
}

// A rank late at plan time: the others' plan-time all-gather times out with an error (MPI's
// collective is left pending, never cancelled: a cancelled collective ends the whole job), and the
// job goes on; the late rank's own all-gather then completes against the kept buffers.
TEST_CASE("MPI: a rank late at plan time makes the others fail with an error, not a job abort") {
  const auto timeout = std::chrono::milliseconds(300);
  {
    mpi_communicator comm(MPI_COMM_WORLD, timeout);
    const int r = comm.rank(), last = comm.size() - 1;
    if (last == 0) return;
    if (r == last) std::this_thread::sleep_for(timeout * 3);
    const std::vector<std::int32_t> cu = {0, 64};
    std::string what;
    try {
      ring_attention<zigzag, mpi_communicator, causal> attn(comm, {4, 2, 64, 0.0f}, cu);
    } catch (const communication_error& e) {
      what = e.what();
    }
    if (r != last)
      CHECK(what == "ringattn: rank " + std::to_string(r) +
                        ", all-gather: timed out after 300 ms waiting for every rank to join a "
                        "collective");
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// Call-time agreement over MPI: a rank calling with another dtype, or rejecting its arguments,
// fails every rank before anything is sent, naming both sides; the next agreed call runs.
TEST_CASE("MPI: a call one rank rejects or calls with another dtype fails everywhere; the retry "
          "runs") {
  mpi_communicator comm(MPI_COMM_WORLD, std::chrono::seconds(20));
  const int r = comm.rank(), last = comm.size() - 1;
  if (last == 0) return;
  std::mt19937_64 rng(11);
  const auto cu = test::random_cu_seqlens(2, 20, 61, rng);
  test::sharded_case<zigzag, __nv_bfloat16> c(cu, comm.size(), {4, 2, 64, 0.0f}, mask_kind::causal,
                                              rng);
  test::sharded_case<zigzag, __half> h(cu, comm.size(), {4, 2, 64, 0.0f}, mask_kind::causal, rng);
  ring_attention<zigzag, mpi_communicator, causal> attn(comm, c.args, cu);
  const std::string rank_last = "rank " + std::to_string(last);
  CHECK_THROWS_WITH_AS((r == last ? (void)h.forward_rank(attn, r) : (void)c.forward_rank(attn, r)),
                       ("ringattn: " + rank_last +
                        " calls forward_host with fp16 but rank 0 with "
                        "bf16")
                           .c_str(),
                       invalid_argument);
  CHECK_THROWS_WITH_AS((void)c.forward_rank(attn, r, /*null_lse=*/r == last),
                       (r == last ? std::string("ringattn: lse is a null pointer")
                                  : "ringattn: " + rank_last +
                                        " rejected call 2 (forward_host): lse is a null pointer")
                           .c_str(),
                       invalid_argument);
  CHECK(comm.bytes_sent() == 0);
  CHECK(ring_error(c, r, c.forward_rank(attn, r)) < 4e-3);
}

// MPI counts are ints: a plan whose forward blocks exceed 2^31 - 1 bytes is refused at plan time
// on every rank, before any call.
TEST_CASE("MPI: blocks beyond MPI's int count are refused at plan time on every rank") {
  mpi_communicator comm(MPI_COMM_WORLD, std::chrono::seconds(20));
  const std::int32_t tokens = 600'000 * comm.size(); // 600,000 a rank: 2.46 GB blocks in bf16
  const std::vector<std::int32_t> cu = {0, tokens};
  const attention_arguments a{8, 8, 128, 0.0f};
  CHECK_THROWS_WITH_AS((ring_attention<contiguous, mpi_communicator, full>(comm, a, cu)),
                       "ringattn: the forward would send blocks of up to 2457600000 bytes; this "
                       "communicator's messages hold at most 2147483647 (use more ranks, or fewer "
                       "kv heads per ring)",
                       invalid_argument);
}
