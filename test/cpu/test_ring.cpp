// The host ring: in-process communicator (ranks are threads), every partitioner x mask x P x GQA
// x packed odd lengths against the float64 oracle; bytes per step; plan-time agreement; bounded
// waits and abort.
#include "../support/ranks.hpp"
#include "../support/ring_bytes.hpp"
#include "../support/sharded_case.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/partition/balanced.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>

using namespace ringattn;

namespace {
using test::message;
using test::on_ranks;

struct ring_result {
  double out_error = 0.0;       // relative L2 of the bf16 output against the oracle
  double lse_error = 0.0;       // max |lse - oracle|
  double max_logit_error = 0.0; // the largest on any rank (sharded_case::max_logit_error)
  bool max_logit_agrees = true; // every rank got the same bits
  std::uint64_t bytes = 0, expected_bytes = 0;
  std::uint64_t unskipped_bytes = 0; // were every block forwarded at every step but the last
  std::vector<std::uint64_t> sent;   // per rank
};

template <class P, class Mask>
ring_result run_ring(const test::sharded_case<P, __nv_bfloat16>& c) {
  const int ranks = c.plan.ranks();
  const auto ref = c.oracle();
  std::vector<typename test::sharded_case<P, __nv_bfloat16>::error_parts> parts(
      static_cast<std::size_t>(ranks));
  std::vector<std::uint64_t> sent(static_cast<std::size_t>(ranks), 0), want(sent), every(sent);
  std::vector<std::vector<float>> max_logits(static_cast<std::size_t>(ranks));
  in_process_group group(ranks);
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<P, in_process_communicator, Mask> attn(comm, c.args, c.plan.cu_seqlens());
    const auto out = c.forward_rank(attn, r, false, &max_logits[static_cast<std::size_t>(r)]);
    parts[static_cast<std::size_t>(r)] = c.rank_error(r, out, ref);
    sent[static_cast<std::size_t>(r)] = comm.bytes_sent();
    // The blocks some later rank sees go on.
    want[static_cast<std::size_t>(r)] =
        test::ring_forward_bytes<__nv_bfloat16>(attn, r, Mask::mask);
    CHECK(attn.template forward_bytes<__nv_bfloat16>() == want[static_cast<std::size_t>(r)]);
    for (int t = 0; t + 1 < attn.schedule().step_count(); ++t)
      every[static_cast<std::size_t>(r)] +=
          attn.template block_bytes<__nv_bfloat16>((r - t + ranks) % ranks);
  });
  for (const auto& e : errors)
    REQUIRE(message(e) == "");
  ring_result res;
  double num = 0.0, den = 0.0;
  for (int r = 0; r < ranks; ++r) {
    num += parts[static_cast<std::size_t>(r)].num;
    den += parts[static_cast<std::size_t>(r)].den;
    res.lse_error = std::max(res.lse_error, parts[static_cast<std::size_t>(r)].lse);
    res.bytes += sent[static_cast<std::size_t>(r)];
    res.expected_bytes += want[static_cast<std::size_t>(r)];
    res.unskipped_bytes += every[static_cast<std::size_t>(r)];
    const auto& ml = max_logits[static_cast<std::size_t>(r)];
    res.max_logit_error = std::max(res.max_logit_error, c.max_logit_error(ml, ref.max_logit));
    res.max_logit_agrees =
        res.max_logit_agrees && std::memcmp(ml.data(), max_logits[0].data(), ml.size() * 4) == 0;
  }
  res.out_error = std::sqrt(num / den);
  res.sent = sent;
  return res;
}

template <class P, class Mask>
void check_matrix() {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  for (int group : {1, 4}) {
    // The same batch at every P, so the errors compare.
    std::mt19937_64 draw(seed + static_cast<std::uint64_t>(group));
    const auto cu = test::random_cu_seqlens(3, 1, 61, draw);
    double error_p1 = 0.0;
    for (int ranks : {1, 2, 3, 4, 8}) {
      CAPTURE(group);
      CAPTURE(ranks);
      std::mt19937_64 rng(seed + 7);
      test::sharded_case<P, __nv_bfloat16> c(cu, ranks, {4, 4 / group, 64, 0.0f}, Mask::mask, rng);
      const ring_result res = run_ring<P, Mask>(c);
      // Tolerances: fp64 blocks, fp32 state, bf16 output (relative 2^-9 per element at worst).
      CHECK(res.out_error < 4e-3);
      CHECK(res.lse_error < 1e-5);
      // fp64 logits rounded to fp32 once.
      CHECK(res.max_logit_error < 1e-6);
      CHECK(res.max_logit_agrees);
      CHECK(res.bytes == res.expected_bytes);
      if (ranks == 1) error_p1 = res.out_error;
      if (ranks == 8) CHECK(res.out_error <= 1.2 * error_p1);
    }
  }
}
} // namespace

TEST_CASE_TEMPLATE("host ring equals the oracle: full and causal, P = 1, 2, 3, 4, 8", P, contiguous,
                   round_robin, zigzag, balanced) {
  check_matrix<P, full>();
  check_matrix<P, causal>();
}

TEST_CASE("causal, contiguous: a block goes only as far as a rank sees it; the last rank sends "
          "nothing") {
  // One sequence in equal shards: rank s's block is seen by ranks s + 1 .. P - 1 only, so it
  // travels P - 1 - s hops instead of P - 1: half the bytes of a ring that forwards every block,
  // and rank P - 1, whose every block after its own is seen by no later rank, sends nothing.
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  for (int ranks : {2, 3, 4, 8}) {
    CAPTURE(ranks);
    std::mt19937_64 rng(seed);
    const std::vector<std::int32_t> cu = {0, 16 * ranks};
    test::sharded_case<contiguous, __nv_bfloat16> c(cu, ranks, {4, 2, 64, 0.0f}, mask_kind::causal,
                                                    rng);
    const ring_result res = run_ring<contiguous, causal>(c);
    CHECK(res.out_error < 4e-3);
    CHECK(res.bytes == res.expected_bytes);
    CHECK(2 * res.bytes == res.unskipped_bytes);
    CHECK(res.sent.back() == 0);
  }
}

TEST_CASE("balanced: documents kept whole send nothing; whole and split ones equal the oracle") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  for (int ranks : {2, 4, 8}) {
    CAPTURE(ranks);
    // Many documents shorter than P: the loads even out with each kept on one rank, so the ring
    // takes one step and no byte moves.
    std::vector<std::int32_t> cu{0};
    for (int i = 0; i < 600; ++i)
      cu.push_back(cu.back() + 1 + i % std::max(1, ranks - 1));
    std::mt19937_64 rng(seed);
    test::sharded_case<balanced, __nv_bfloat16> few(cu, ranks, {4, 2, 64, 0.0f}, mask_kind::causal,
                                                    rng);
    for (int s = 0; s < few.plan.batch(); ++s)
      REQUIRE(few.plan.placement_of(s).ranks == 1);
    const ring_result whole = run_ring<balanced, causal>(few);
    CHECK(whole.out_error < 4e-3);
    CHECK(whole.lse_error < 1e-5);
    CHECK(whole.bytes == 0);
    // One long document over several ranks among short ones kept whole.
    std::vector<std::int32_t> mixed{0, 97};
    for (int i = 0; i < 20; ++i)
      mixed.push_back(mixed.back() + 2 + i % 5);
    test::sharded_case<balanced, __nv_bfloat16> c(mixed, ranks, {4, 2, 64, 0.0f}, mask_kind::causal,
                                                  rng);
    REQUIRE(c.plan.placement_of(0).ranks > 1);
    const ring_result res = run_ring<balanced, causal>(c);
    CHECK(res.out_error < 4e-3);
    CHECK(res.lse_error < 1e-5);
    CHECK(res.bytes == res.expected_bytes);
  }
}

TEST_CASE("ranks that disagree are rejected at plan time, on every rank, without a hang") {
  in_process_group group(3, std::chrono::seconds(5));
  const std::vector<std::int32_t> cu = {0, 100};
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    const attention_arguments a{r == 2 ? 16 : 32, 8, 128, 0.0f};
    ring_attention<zigzag, in_process_communicator, causal> attn(comm, a, cu);
  });
  for (const auto& e : errors)
    CHECK(message(e) == "ringattn: rank 2 disagrees with rank 0 on q_heads (16 vs 32)");
  in_process_group group2(2, std::chrono::seconds(5));
  const auto errors2 = on_ranks(group2, [&](int r, in_process_communicator& comm) {
    const std::vector<std::int32_t> mine = {0, r == 0 ? 100 : 101};
    ring_attention<round_robin, in_process_communicator, full> attn(comm, {8, 8, 64, 0.0f}, mine);
  });
  for (const auto& e : errors2)
    CHECK(message(e) ==
          "ringattn: rank 1 disagrees with rank 0 on the total token count (101 vs 100)");
}

TEST_CASE("a rank that never arrives: the others fail within the timeout, naming it and the call") {
  in_process_group group(3, std::chrono::milliseconds(200));
  std::vector<std::int32_t> cu = {0, 30};
  const attention_arguments a{2, 1, 64, 0.0f};
  std::mt19937_64 rng(test::fresh_seed());
  test::sharded_case<zigzag, __nv_bfloat16> c(cu, 3, a, mask_kind::causal, rng);
  const auto start = std::chrono::steady_clock::now();
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<zigzag, in_process_communicator, causal> attn(comm, a, cu);
    if (r == 2) return; // planned, then never runs the ring
    c.forward_rank(attn, r);
  });
  const auto elapsed = std::chrono::steady_clock::now() - start;
  CHECK(elapsed < std::chrono::seconds(3));
  // Ranks 0 and 1 wait at the call's agreement for rank 2. Whichever times out first breaks the
  // group, so the other may report that instead of its own timeout (both timers run out within
  // microseconds): either way the error names this rank, the call and the missing rank 2.
  for (int r : {0, 1}) {
    const std::string m = message(errors[static_cast<std::size_t>(r)]);
    CAPTURE(m);
    CHECK(m.rfind("ringattn: rank " + std::to_string(r) + ", call 1 (forward_host): ", 0) == 0);
    CHECK(m.find("timed out after 200 ms waiting for rank 2 to join") != std::string::npos);
  }
  CHECK(!errors[2]);
}

TEST_CASE("a rank that rejects its call makes every rank fail at once with its reason") {
  in_process_group group(2, std::chrono::seconds(30));
  std::vector<std::int32_t> cu = {0, 20};
  const attention_arguments a{2, 2, 64, 0.0f};
  std::mt19937_64 rng(test::fresh_seed());
  test::sharded_case<round_robin, __nv_bfloat16> c(cu, 2, a, mask_kind::full, rng);
  const auto start = std::chrono::steady_clock::now();
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<round_robin, in_process_communicator, full> attn(comm, a, cu);
    c.forward_rank(attn, r, /*null_lse=*/r == 1);
  });
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  CHECK(message(errors[1]) == "ringattn: lse is a null pointer");
  CHECK(message(errors[0]) ==
        "ringattn: rank 1 rejected call 1 (forward_host): lse is a null pointer");
}

TEST_CASE("the max logit: asked by one rank alone, every rank refuses; asked or not, the same "
          "output") {
  in_process_group group(3, std::chrono::seconds(30));
  std::mt19937_64 rng(test::fresh_seed());
  const auto cu = test::random_cu_seqlens(3, 0, 40, rng);
  const attention_arguments a{4, 2, 64, 0.0f};
  test::sharded_case<zigzag, __nv_bfloat16> c(cu, 3, a, mask_kind::causal, rng);
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<zigzag, in_process_communicator, causal> attn(comm, a, cu);
    std::vector<float> max_logit;
    const bool refused = [&] {
      try {
        (void)c.forward_rank(attn, r, false, r == 2 ? &max_logit : nullptr);
      } catch (const invalid_argument& e) {
        const std::string m = e.what();
        const std::string want =
            r == 0 ? "ringattn: rank 2 asks for the max logit but rank 0 does not (every rank "
                     "passes a buffer, or none does)"
                   : "ringattn: rank 2 asks for the max logit but rank 0 does not";
        if (m.rfind(want, 0) != 0) throw std::runtime_error("rank " + std::to_string(r) + ": " + m);
        return true;
      }
      return false;
    }();
    if (!refused) throw std::runtime_error("rank " + std::to_string(r) + " ran the call");
    // The communicator is still usable; the max logit changes nothing else.
    const auto plain = c.forward_rank(attn, r);
    const auto asked = c.forward_rank(attn, r, false, &max_logit);
    if (plain.out.size() != asked.out.size() ||
        std::memcmp(plain.out.data(), asked.out.data(), plain.out.size() * 2) != 0 ||
        std::memcmp(plain.lse.data(), asked.lse.data(), plain.lse.size() * 4) != 0)
      throw std::runtime_error("rank " + std::to_string(r) + ": the outputs differ");
  });
  for (const auto& e : errors)
    CHECK(message(e) == "");
}

TEST_CASE("a rank whose own arguments are invalid makes every rank fail at once, at plan time") {
  in_process_group group(3, std::chrono::seconds(30));
  const std::vector<std::int32_t> cu = {0, 100};
  const auto start = std::chrono::steady_clock::now();
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    const attention_arguments a{8, 8, r == 1 ? 96 : 64, 0.0f};
    ring_attention<zigzag, in_process_communicator, causal> attn(comm, a, cu);
  });
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  CHECK(message(errors[1]) ==
        "ringattn: head_dim 96 is not supported (supported: 64, 128, 192, 256)");
  CHECK(message(errors[0]) == "ringattn: rank 1 rejected its arguments (its own error says why)");
  CHECK(message(errors[2]) == "ringattn: rank 1 rejected its arguments (its own error says why)");
}

TEST_CASE(
    "in-process exchange: a size the sender did not send fails both ranks, naming the sizes") {
  in_process_group group(2, std::chrono::seconds(30));
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    std::vector<char> send(r == 0 ? 8 : 4, 'x'), recv(8);
    // Rank 1 expects 8 bytes from rank 0 (right); rank 0 expects 8 from rank 1, which sends 4.
    comm.exchange(send.data(), send.size(), 1 - r, recv.data(), 8, 1 - r, 5);
  });
  const std::string why = "rank 0, step 5: rank 1 sent 4 bytes, 8 expected";
  CHECK(message(errors[0]) == "ringattn: " + why);
  // Rank 1 waits for rank 0 to take its data and learns why instead of timing out.
  CHECK(message(errors[1]).find(why) != std::string::npos);
}

// Determinism (docs/reliability.md): the same inputs give bitwise the same output and lse, run
// after run — the ring's order of steps and merges is fixed, whatever the threads' timing.
TEST_CASE("host ring: two forwards are bitwise equal") {
  std::mt19937_64 rng(test::fresh_seed());
  const auto cu = test::random_cu_seqlens(3, 1, 200, rng);
  const test::sharded_case<zigzag, __nv_bfloat16> c(cu, 4, {8, 2, 64, 0.0f}, mask_kind::causal,
                                                    rng);
  in_process_group group(4);
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<zigzag, in_process_communicator, causal> attn(comm, c.args, cu);
    const auto first = c.forward_rank(attn, r);
    const auto second = c.forward_rank(attn, r);
    if (std::memcmp(first.out.data(), second.out.data(),
                    first.out.size() * sizeof(__nv_bfloat16)) != 0 ||
        std::memcmp(first.lse.data(), second.lse.data(), first.lse.size() * sizeof(float)) != 0)
      throw std::runtime_error("rank " + std::to_string(r) + ": the two forwards differ");
  });
  for (const auto& e : errors)
    CHECK(message(e) == "");
}

// A rank whose exchange failed takes back its offer: a peer arriving later must not copy from a
// buffer its owner has since reused or freed (ThreadSanitizer found that in an earlier version).
TEST_CASE("in-process exchange: a failed rank's offer is withdrawn; a late peer fails at once") {
  in_process_group group(2, std::chrono::milliseconds(100));
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    std::vector<char> send(8, r == 0 ? 'a' : 'b'), recv(8, '-');
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(400)); // arrives late
    try {
      comm.exchange(send.data(), 8, 1 - r, recv.data(), 8, 1 - r, 0);
    } catch (...) {
      std::fill(send.begin(), send.end(), 'z'); // reused after the failure
      throw;
    }
  });
  CHECK(message(errors[0]) ==
        "ringattn: rank 0, step 0: timed out after 100 ms waiting for rank 1 to send");
  // Rank 0's timeout broke the group: rank 1, late, fails at once naming it.
  CHECK(message(errors[1]) ==
        "ringattn: rank 1, step 0: this in-process group is broken (rank 0, step 0: timed out "
        "after 100 ms waiting for rank 1 to send); create a new in_process_group and take new "
        "communicators");
}
