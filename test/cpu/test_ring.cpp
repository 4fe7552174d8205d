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
  std::uint64_t unskipped_bytes = 0; // were every whole shard forwarded at every step but the last
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
    for (int t = 0; t + 1 < attn.schedule().step_count(); ++t) // whole shards
      every[static_cast<std::size_t>(r)] +=
          sizeof(__nv_bfloat16) *
          static_cast<std::uint64_t>(c.plan.local_tokens((r - t + ranks) % ranks)) *
          c.args.kv_heads * (c.args.qk_dim() + c.args.v_dim());
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

namespace {
// Which rows of rank `src`'s shard some query of another rank sees, token by token.
template <class P>
std::vector<char> seen_elsewhere(const partition_plan<P>& plan, int src, const position_window& w) {
  struct token {
    int sequence;
    std::int32_t position;
  };
  auto tokens_of = [&](int r) {
    std::vector<token> out;
    const auto pos = plan.position_ids(r);
    const auto lc = plan.local_cu_seqlens(r);
    for (int s = 0; s < plan.batch(); ++s)
      for (std::int32_t i = lc[s]; i < lc[s + 1]; ++i)
        out.push_back({s, pos[static_cast<std::size_t>(i)]});
    return out;
  };
  const std::vector<token> keys = tokens_of(src);
  std::vector<char> seen(keys.size(), 0);
  for (int q = 0; q < plan.ranks(); ++q) {
    if (q == src) continue;
    for (const token& x : tokens_of(q))
      for (std::size_t j = 0; j < keys.size(); ++j)
        if (keys[j].sequence == x.sequence && w.sees(x.position, keys[j].position)) seen[j] = 1;
  }
  return seen;
}

// travelling_rows against the token-by-token oracle: every row another rank sees travels; a
// shard that does not travel whole sends only whole key segments with a row seen elsewhere, in
// shard order, and `row()` counts the travelling rows before it.
template <class P>
void check_travel(const std::vector<std::int32_t>& cu, int ranks, const position_window& w) {
  const partition_plan<P> plan(cu, ranks);
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    const kv_travel t = travelling_rows(plan, r, w);
    const std::vector<char> seen = seen_elsewhere(plan, r, w);
    const auto n = static_cast<std::int64_t>(seen.size());
    std::vector<char> travels(seen.size(), t.whole ? 1 : 0);
    std::int64_t at = 0;
    for (const travel_run& run : t.runs) {
      CHECK(run.count > 0);
      CHECK(run.travel_begin == at);
      for (std::int64_t i = 0; i < run.count; ++i) {
        travels[static_cast<std::size_t>(run.local_begin + i)] = 1;
        CHECK(t.row(run.local_begin + i) == at + i);
      }
      at += run.count;
    }
    CHECK(t.tokens == (t.whole ? n : at));
    if (!t.whole) CHECK(t.runs.size() <= static_cast<std::size_t>(kv_travel::max_runs));
    for (std::int64_t j = 0; j < n; ++j)
      if (seen[static_cast<std::size_t>(j)]) CHECK(travels[static_cast<std::size_t>(j)] == 1);
    // What travels beyond the rows seen: the rest of their segments.
    if (!t.whole)
      for (int s = 0; s < plan.batch(); ++s)
        for (const segment& g : plan.segments(r, s)) {
          if (g.count == 0) continue;
          bool any = false, all = true;
          for (std::int64_t i = 0; i < g.count; ++i) {
            any = any || seen[static_cast<std::size_t>(g.local_begin + i)];
            all = all && travels[static_cast<std::size_t>(g.local_begin + i)];
          }
          CHECK(all == any);
        }
  }
}
} // namespace

TEST_CASE_TEMPLATE("the rows of a shard that travel are those another rank sees", P, contiguous,
                   round_robin, zigzag, balanced) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const position_window windows[] = {position_window::of(mask_kind::full),
                                     position_window::of(mask_kind::causal),
                                     position_window::of(mask_kind::causal_window, 5),
                                     position_window::of(mask_kind::sliding_window, 3, 2)};
  for (int ranks : {1, 2, 3, 4, 8})
    for (const position_window& w : windows) {
      CAPTURE(ranks);
      CAPTURE(w.max_behind);
      CAPTURE(w.max_ahead);
      check_travel<P>(test::random_cu_seqlens(4, 1, 70, rng), ranks, w);
      std::vector<std::int32_t> docs{0, 120}; // one long document and short ones
      for (int i = 0; i < 12; ++i)
        docs.push_back(docs.back() + 1 + static_cast<std::int32_t>(rng() % 9));
      check_travel<P>(docs, ranks, w);
    }
}

TEST_CASE(
    "what travels: zigzag's last chunk stays on rank 0, contiguous's last rank sends nothing, "
    "a full mask moves every row, documents kept whole none") {
  const position_window causal_w = position_window::of(mask_kind::causal);
  const std::vector<std::int32_t> one = {0, 64};
  const partition_plan<zigzag> z(one, 4); // chunks of 8: rank 0 holds 0-7 and 56-63
  const kv_travel z0 = travelling_rows(z, 0, causal_w);
  CHECK_FALSE(z0.whole);
  CHECK(z0.tokens == 8);
  CHECK(z0.runs == std::vector<travel_run>{{0, 8, 0}});
  for (int r = 1; r < 4; ++r)
    CHECK(travelling_rows(z, r, causal_w).whole);
  const partition_plan<contiguous> c(one, 4);
  CHECK(travelling_rows(c, 0, causal_w).whole);
  const kv_travel last = travelling_rows(c, 3, causal_w);
  CHECK_FALSE(last.whole);
  CHECK(last.tokens == 0);
  for (int r = 0; r < 4; ++r)
    CHECK(travelling_rows(c, r, position_window::of(mask_kind::full)).whole);
  std::vector<std::int32_t> short_docs{0};
  for (int i = 0; i < 64; ++i)
    short_docs.push_back(short_docs.back() + 1 + i % 3);
  const partition_plan<balanced> b(short_docs, 4);
  for (int r = 0; r < 4; ++r)
    CHECK(travelling_rows(b, r, causal_w).tokens == 0);
  // One run per document piece on zigzag's rank 0 with many documents: more than max_runs, so
  // the shard travels whole.
  std::vector<std::int32_t> many{0};
  for (int i = 0; i < 3 * kv_travel::max_runs; ++i)
    many.push_back(many.back() + 16);
  CHECK(travelling_rows(partition_plan<zigzag>(many, 2), 0, causal_w).whole);
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
