// The host ring backward: in-process communicator (ranks are threads), every partitioner x mask
// x P x GQA x packed odd lengths, dq, dk and dv against the float64 oracle's backward of the
// gathered batch; bytes on the wire; the device path's messages in its order; bitwise
// repeatability; workspace size.
#include "../support/ranks.hpp"
#include "../support/recording_comm.hpp"
#include "../support/sharded_backward_case.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/partition/balanced.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <cstring>
#include <string>
#include <vector>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
using test::message;
using test::on_ranks;

struct backward_run {
  std::array<double, 3> error{}; // relative L2 of dq, dk, dv against the oracle
  std::uint64_t bytes = 0, expected_bytes = 0;
  bool repeatable = true;
};

template <class P, class Mask>
backward_run run_ring(const test::sharded_backward_case<P, T>& c, bool repeat) {
  const int ranks = c.plan.ranks();
  const auto ref = c.oracle_backward();
  using grads = typename test::sharded_backward_case<P, T>::rank_grads;
  std::vector<typename test::sharded_backward_case<P, T>::grad_parts> parts(
      static_cast<std::size_t>(ranks));
  std::vector<std::uint64_t> sent(static_cast<std::size_t>(ranks), 0), want(sent);
  std::vector<int> same(static_cast<std::size_t>(ranks), 1);
  in_process_group group(ranks);
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<P, in_process_communicator, Mask> attn(comm, c.args, c.plan.cu_seqlens());
    const auto fwd = c.forward_rank(attn, r);
    const std::uint64_t before = comm.bytes_sent();
    const grads g = c.backward_rank(attn, r, fwd);
    sent[static_cast<std::size_t>(r)] = comm.bytes_sent() - before;
    if (repeat) {
      const grads again = c.backward_rank(attn, r, fwd);
      same[static_cast<std::size_t>(r)] =
          std::memcmp(g.dq.data(), again.dq.data(), g.dq.size() * sizeof(T)) == 0 &&
          std::memcmp(g.dk.data(), again.dk.data(), g.dk.size() * sizeof(T)) == 0 &&
          std::memcmp(g.dv.data(), again.dv.data(), g.dv.size() * sizeof(T)) == 0;
    }
    parts[static_cast<std::size_t>(r)] = c.rank_grad_error(r, g, ref);
    // Every step but the last passes the block's travelling rows with their dK/dV on; then the
    // dK/dV of the block held last (rank r + 1's after P steps) go home.
    const int steps = attn.schedule().step_count();
    for (int t = 0; t + 1 < steps; ++t)
      want[static_cast<std::size_t>(r)] +=
          attn.template backward_block_bytes<T>((r - t + ranks) % ranks);
    if (steps > 1)
      want[static_cast<std::size_t>(r)] += 2 * sizeof(float) *
                                           static_cast<std::size_t>(attn.schedule().travel_tokens(
                                               attn.schedule().source_of(steps - 1))) *
                                           c.args.kv_heads * c.args.head_dim;
  });
  for (const auto& e : errors)
    REQUIRE(message(e) == "");
  backward_run res;
  std::array<double, 3> num{}, den{};
  for (int r = 0; r < ranks; ++r) {
    for (std::size_t i = 0; i < 3; ++i) {
      num[i] += parts[static_cast<std::size_t>(r)].num[i];
      den[i] += parts[static_cast<std::size_t>(r)].den[i];
    }
    res.bytes += sent[static_cast<std::size_t>(r)];
    res.expected_bytes += want[static_cast<std::size_t>(r)];
    res.repeatable = res.repeatable && same[static_cast<std::size_t>(r)] == 1;
  }
  for (std::size_t i = 0; i < 3; ++i)
    res.error[i] = std::sqrt(num[i] / den[i]);
  return res;
}

template <class P, class Mask>
void check_matrix() {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  for (int group : {1, 4}) {
    std::mt19937_64 draw(seed + static_cast<std::uint64_t>(group));
    const auto cu = test::random_cu_seqlens(3, 1, 61, draw); // the same batch at every P
    std::array<double, 3> error_p1{};
    for (int ranks : {1, 2, 3, 4, 8}) {
      CAPTURE(group);
      CAPTURE(ranks);
      std::mt19937_64 rng(seed + 7);
      test::sharded_backward_case<P, T> c(cu, ranks, {4, 4 / group, 64, 0.0f}, Mask::mask, rng);
      const backward_run res = run_ring<P, Mask>(c, /*repeat=*/ranks == 3);
      // Tolerance (bf16 in and out): the gradients are written in bf16 (relative 2^-9 per element
      // at worst) and D = rowsum(dO * O) uses the forward's bf16 output, whose rounding enters
      // dS = P (dP - D): 4e-3 relative L2 for each of dq, dk, dv (seen: 1.4e-3 to 1.9e-3, the same
      // at every P).
      for (std::size_t i = 0; i < 3; ++i) {
        CAPTURE(i);
        CHECK(res.error[i] < 4e-3);
        if (ranks == 1) error_p1[i] = res.error[i];
        if (ranks == 8) CHECK(res.error[i] <= 1.2 * error_p1[i]);
      }
      CHECK(res.bytes == res.expected_bytes);
      CHECK(res.repeatable);
    }
  }
}
} // namespace

TEST_CASE_TEMPLATE("host ring backward equals the oracle: full and causal, P = 1, 2, 3, 4, 8", P,
                   contiguous, round_robin, zigzag, balanced) {
  check_matrix<P, full>();
  check_matrix<P, causal>();
}

TEST_CASE("ring backward: documents kept whole send nothing; a block travels with the rows others "
          "see") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  for (int ranks : {2, 4, 8}) {
    CAPTURE(ranks);
    std::mt19937_64 rng(seed);
    // Short documents, each kept on one rank: no rank sees another's keys.
    std::vector<std::int32_t> cu{0};
    for (int i = 0; i < 300; ++i)
      cu.push_back(cu.back() + 2 + i % 3);
    test::sharded_backward_case<balanced, T> whole(cu, ranks, {4, 2, 64, 0.0f}, mask_kind::causal,
                                                   rng);
    for (int s = 0; s < whole.plan.batch(); ++s)
      REQUIRE(whole.plan.placement_of(s).ranks == 1);
    const backward_run none = run_ring<balanced, causal>(whole, false);
    for (std::size_t i = 0; i < 3; ++i)
      CHECK(none.error[i] < 4e-3);
    CHECK(none.bytes == 0);
    // One sequence under zigzag: rank 0's last chunk is seen by no other rank and stays home.
    const std::vector<std::int32_t> one = {0, 32 * ranks};
    test::sharded_backward_case<zigzag, T> z(one, ranks, {4, 2, 64, 0.0f}, mask_kind::causal, rng);
    const backward_run half = run_ring<zigzag, causal>(z, false);
    for (std::size_t i = 0; i < 3; ++i)
      CHECK(half.error[i] < 4e-3);
    CHECK(half.bytes == half.expected_bytes);
    // Every rank sends its own block, with its dK/dV, P - 1 hops and the block it holds home:
    // 16 of rank 0's 32 rows travel, all of the others'.
    // Bytes per row: 2 kv heads of k and v, 64 wide each (bf16, and the fp32 sums).
    const std::uint64_t row = 2 * 128 * (sizeof(T) + sizeof(float)), home = 2 * 128 * sizeof(float);
    const std::uint64_t travelling = 16 + 32 * static_cast<std::uint64_t>(ranks - 1);
    CHECK(half.bytes == travelling * (ranks - 1) * row + travelling * home);
  }
}

TEST_CASE("ring backward workspace: host and device sizes") {
  in_process_group group(3);
  const std::vector<std::int32_t> cu = {0, 100, 161};
  const attention_arguments a{8, 2, 64, 0.0f};
  const auto errors = on_ranks(group, [&](int, in_process_communicator& comm) {
    ring_attention<zigzag, in_process_communicator, causal> attn(comm, a, cu);
    const std::size_t n = static_cast<std::size_t>(attn.local_tokens());
    const ring_schedule& s = attn.schedule();
    const std::size_t most = static_cast<std::size_t>(s.max_kv_tokens());
    CHECK(s.max_kv_tokens() <= attn.plan().max_local_tokens());
    // K, V (bf16) and dK, dV (fp32) of the largest block that travels, twice; dQ fp32; the
    // shard's fp32 dK, dV where it does not travel whole; D fp32; one fp32 dK/dV of the largest
    // block (a step's share); 256-byte alignment of the pieces. The host and device paths take the
    // same.
    const std::size_t blocks = 2 * (2 * most * 2 * 64 * (2 + 4));
    const std::size_t own = s.own_travel().whole ? 0 : n * 2 * 64 * 2 * 4;
    const std::size_t rest = n * 8 * 64 * 4 + own + n * 8 * 4;
    const std::size_t share = 2 * most * 2 * 64 * 4;
    const std::size_t bytes = attn.host_backward_workspace_bytes<T>();
    CHECK(bytes >= blocks + rest + share);
    CHECK(bytes <= blocks + rest + share + 6 * 256);
    CHECK(attn.device_backward_workspace_bytes<T>() == bytes);
  });
  for (const auto& e : errors)
    REQUIRE(message(e) == "");
}

namespace {
using recorder = test::recording_communicator<in_process_communicator>;
static_assert(host_communicator<recorder>);
} // namespace

// The device ring's protocol (ring/program.cuh, run by ring/device_engine.cuh), which the host path
// follows so that CI runs the messages the GPU exchanges: per step but the last, block t's K/V on
// (tag t), then its dK/dV on (tag t); after the last step the held block's dK/dV home (tag: the
// step count).
TEST_CASE_TEMPLATE("host ring backward: the device path's messages in its order", P, contiguous,
                   zigzag, balanced) {
  std::mt19937_64 rng(test::fresh_seed());
  const auto cu = test::random_cu_seqlens(3, 1, 61, rng);
  for (int ranks : {1, 2, 3, 4}) {
    CAPTURE(ranks);
    test::sharded_backward_case<P, T> c(cu, ranks, {4, 2, 64, 0.0f}, mask_kind::causal, rng);
    in_process_group group(ranks);
    const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
      recorder rec(comm);
      ring_attention<P, recorder, causal> attn(rec, c.args, c.plan.cu_seqlens());
      const auto fwd = c.forward_rank(attn, r);
      rec.log.clear();
      c.backward_rank(attn, r, fwd);
      const ring_schedule& s = attn.schedule();
      const ring_workspace w(s.q_tokens(), s.max_kv_tokens(), c.args, sizeof(T));
      std::vector<test::sent> want;
      for (const ring_step& step : s.steps())
        if (const ring_step* next = s.next(step.index)) {
          const std::int64_t held = s.travel_tokens(step.source);
          want.push_back({w.block_bytes(held), w.block_bytes(next->kv_tokens), s.send_to(),
                          s.receive_from(), step.index});
          want.push_back({w.grad_bytes(held), w.grad_bytes(next->kv_tokens), s.send_to(),
                          s.receive_from(), step.index});
        }
      if (const int steps = s.step_count(); steps > 1) {
        const ring_step& held = s.step(steps - 1);
        want.push_back({w.grad_bytes(held.kv_tokens), w.grad_bytes(s.own_travel().tokens),
                        held.source, s.holder_of_own(), steps});
      }
      CHECK(rec.log == want);
    });
    for (const auto& e : errors)
      REQUIRE(message(e) == "");
  }
}

// The host path runs the schedules' programs (ring/program.cuh) as the device path does: what
// each rank sent, forward and backward, is its programs' messages, in their order (the device
// suite compares the device path's with the same programs).
template <class Schedule, class P, class Mask>
void check_programs(attention_arguments a) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const auto cu = test::random_cu_seqlens(3, 1, 61, rng);
  std::atomic<std::size_t> messages{0}; // over every run: the programs are not empty
  for (int ranks : {1, 2, 3, 4, 8}) {
    CAPTURE(ranks);
    test::sharded_backward_case<P, T> c(cu, ranks, a, Mask::mask, rng);
    in_process_group group(ranks);
    std::vector<int> same(static_cast<std::size_t>(ranks), 0);
    const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
      recorder rec(comm);
      ring_attention<P, recorder, Mask, Schedule> attn(rec, c.args, c.plan.cu_seqlens());
      const auto [forward, backward] = test::program_messages<Schedule, T>(attn.schedule(), c.args);
      const auto fwd = c.forward_rank(attn, r);
      const bool forward_same = rec.log == forward;
      rec.log.clear();
      c.backward_rank(attn, r, fwd);
      same[static_cast<std::size_t>(r)] = forward_same && rec.log == backward;
      messages += forward.size() + backward.size();
    });
    for (const auto& e : errors)
      REQUIRE(message(e) == "");
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      CHECK(same[static_cast<std::size_t>(r)] == 1);
    }
  }
  CHECK(messages > 0);
}

template <class Schedule, class P>
void check_programs_of() {
  check_programs<Schedule, P, full>({4, 2, 64, 0.0f});
  check_programs<Schedule, P, causal>({4, 2, 64, 0.0f});
  attention_arguments windowed{4, 2, 64, 0.0f};
  windowed.window_left = 9;
  check_programs<Schedule, P, causal_window>(windowed);
}

TEST_CASE_TEMPLATE("host ring and all-gather: what every rank sends is its programs' messages, in "
                   "their order (full, causal, causal window; P = 1, 2, 3, 4, 8)",
                   P, contiguous, round_robin, zigzag, balanced) {
  check_programs_of<ring_pass, P>();
  check_programs_of<all_gather_kv, P>();
}

TEST_CASE("host ring backward: a rank that never arrives makes the others fail, naming it") {
  in_process_group group(3, std::chrono::milliseconds(200));
  const attention_arguments a{2, 1, 64, 0.0f};
  std::mt19937_64 rng(test::fresh_seed());
  test::sharded_backward_case<zigzag, T> c({0, 30}, 3, a, mask_kind::causal, rng);
  const auto start = std::chrono::steady_clock::now();
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<zigzag, in_process_communicator, causal> attn(comm, a, c.plan.cu_seqlens());
    const auto fwd = c.forward_rank(attn, r);
    if (r == 2) return; // ran the forward, never runs the backward
    c.backward_rank(attn, r, fwd);
  });
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(3));
  for (int r : {0, 1}) {
    const std::string m = message(errors[static_cast<std::size_t>(r)]);
    CAPTURE(m);
    CHECK(m.rfind("ringattn: rank " + std::to_string(r) + ", call 2 (backward_host): ", 0) == 0);
    CHECK(m.find("waiting for rank 2 to join") != std::string::npos);
  }
  CHECK(message(errors[2]) == "");
}
