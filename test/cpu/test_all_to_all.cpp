// The all-to-all schedule on the host (in-process communicator, ranks are threads): every
// partitioner x mask (full, causal, sliding and causal windows) x P in {1, 2, 4, 8} x GQA 1, 4, 8
// (with P above the kv heads: replicated kv heads) x packed odd lengths, forward and backward
// against the float64 oracle; bytes per rank against the formula (all_to_all_bytes.hpp); the
// forward equal bit for bit to the ring's; the backward repeatable bit for bit; head splits that
// cannot be made refused at plan time on every rank.
#include "../support/all_to_all_bytes.hpp"
#include "../support/ranks.hpp"
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
#include <chrono>
#include <cstring>
#include <initializer_list>
#include <string>
#include <type_traits>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
using test::message;
using test::on_ranks;

template <class P, class Mask, class Schedule = all_to_all_heads>
using by_heads = ring_attention<P, in_process_communicator, Mask, Schedule>;

struct run_result {
  double out_error = 0.0, lse_error = 0.0, max_logit_error = 0.0;
  std::array<double, 3> grad_error{};
  bool ring_equal = true, repeatable = true, bytes_match = true;
};

// `group_size`: the schedule's group size (0: all ranks).
template <class P, class Mask, class Schedule = all_to_all_heads>
run_result run(const test::sharded_backward_case<P, T>& c, int group_size = 0) {
  const int ranks = c.plan.ranks();
  const auto ref = c.oracle();
  const auto ref_grads = c.oracle_backward();
  const auto at = [](int r) { return static_cast<std::size_t>(r); };
  std::vector<typename test::sharded_case<P, T>::error_parts> parts(at(ranks));
  std::vector<typename test::sharded_backward_case<P, T>::grad_parts> grads(at(ranks));
  std::vector<double> max_logit_errors(at(ranks), 0.0);
  std::vector<int> ring_equal(at(ranks), 1), repeatable(at(ranks), 1), bytes(at(ranks), 1);
  std::vector<std::int64_t> tokens;
  for (int r = 0; r < ranks; ++r)
    tokens.push_back(c.plan.local_tokens(r));
  in_process_group group(ranks);
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    by_heads<P, Mask, Schedule> attn(comm, c.args, c.plan.cu_seqlens());
    ring_attention<P, in_process_communicator, Mask> ring(comm, c.args, c.plan.cu_seqlens());
    const std::uint64_t before = comm.bytes_sent();
    std::vector<float> max_logit, ring_max_logit;
    const auto fwd = c.forward_rank(attn, r, false, &max_logit);
    const std::uint64_t after_forward = comm.bytes_sent();
    const auto g = c.backward_rank(attn, r, fwd);
    const std::uint64_t after_backward = comm.bytes_sent();
    const auto g2 = c.backward_rank(attn, r, fwd);
    const auto ring_fwd = c.forward_rank(ring, r, false, &ring_max_logit);
    max_logit_errors[at(r)] = c.max_logit_error(max_logit, ref.max_logit);
    parts[at(r)] = c.rank_error(r, fwd, ref);
    grads[at(r)] = c.rank_grad_error(r, g, ref_grads);
    auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() &&
             (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0);
    };
    ring_equal[at(r)] = same(fwd.out, ring_fwd.out) && same(fwd.lse, ring_fwd.lse) &&
                        same(max_logit, ring_max_logit);
    repeatable[at(r)] = same(g.dq, g2.dq) && same(g.dk, g2.dk) && same(g.dv, g2.dv);
    const auto want = test::all_to_all_bytes_of(tokens, r, c.args, sizeof(T), group_size);
    bytes[at(r)] =
        after_forward - before == want.forward && after_backward - after_forward == want.backward;
  });
  for (const auto& e : errors)
    REQUIRE(message(e) == "");
  run_result res;
  double num = 0.0, den = 0.0;
  std::array<double, 3> gnum{}, gden{};
  for (int r = 0; r < ranks; ++r) {
    num += parts[at(r)].num, den += parts[at(r)].den;
    res.lse_error = std::max(res.lse_error, parts[at(r)].lse);
    res.max_logit_error = std::max(res.max_logit_error, max_logit_errors[at(r)]);
    for (std::size_t i = 0; i < 3; ++i)
      gnum[i] += grads[at(r)].num[i], gden[i] += grads[at(r)].den[i];
    res.ring_equal = res.ring_equal && ring_equal[at(r)] == 1;
    res.repeatable = res.repeatable && repeatable[at(r)] == 1;
    res.bytes_match = res.bytes_match && bytes[at(r)] == 1;
  }
  res.out_error = std::sqrt(num / den);
  for (std::size_t i = 0; i < 3; ++i)
    res.grad_error[i] = std::sqrt(gnum[i] / gden[i]);
  return res;
}

void check_result(const run_result& res) {
  // The ring's tolerances (test_ring.cpp, test_ring_backward.cpp): forward 4e-3 relative L2
  // on the bf16 output and 1e-5 on the lse; backward 4e-3 relative L2 on each gradient.
  CHECK(res.out_error < 4e-3);
  CHECK(res.lse_error < 1e-5);
  CHECK(res.max_logit_error < 1e-6); // fp64 logits rounded to fp32 once
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(res.grad_error[i] < 4e-3);
  }
  CHECK(res.ring_equal);
  CHECK(res.repeatable);
  CHECK(res.bytes_match);
}

// `Group` 0: the plain all-to-all at P = 1, 2, 4, 8; else the hybrid of groups of `Group` at
// `ranks_list`.
template <class P, class Mask, int Group = 0>
void check_matrix(std::int64_t left = -1, std::int64_t right = -1,
                  std::initializer_list<int> ranks_list = {1, 2, 4, 8}) {
  using schedule = std::conditional_t<Group == 0, all_to_all_heads,
                                      all_to_all_heads_x_all_gather<(Group > 0 ? Group : 1)>>;
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  for (int group : {1, 4, 8}) {
    std::mt19937_64 draw(seed + static_cast<std::uint64_t>(group));
    const auto cu = test::random_cu_seqlens(3, 1, 61, draw); // the same batch at every P
    for (int ranks : ranks_list) {
      CAPTURE(group);
      CAPTURE(ranks);
      std::mt19937_64 rng(seed + 7);
      attention_arguments a{8, 8 / group, 64, 0.0f};
      a.window_left = left, a.window_right = right;
      test::sharded_backward_case<P, T> c(cu, ranks, a, Mask::mask, rng);
      check_result(run<P, Mask, schedule>(c, Group));
    }
  }
}
} // namespace

TEST_CASE_TEMPLATE("host all-to-all equals the oracle: every mask, P = 1, 2, 4, 8, GQA 1, 4, 8", P,
                   contiguous, round_robin, zigzag, balanced) {
  check_matrix<P, full>();
  check_matrix<P, causal>();
  check_matrix<P, sliding_window>(7, 3);
  check_matrix<P, causal_window>(9, 0);
}

TEST_CASE_TEMPLATE("host hybrid (all-to-all in groups, all-gather across) equals the oracle: "
                   "2 x 2, 2 x 4, 4 x 2",
                   P, contiguous, round_robin, zigzag, balanced) {
  check_matrix<P, full, 2>(-1, -1, {4, 8}); // groups of 2: 2 x 2 and 2 x 4
  check_matrix<P, causal, 2>(-1, -1, {4, 8});
  check_matrix<P, causal, 4>(-1, -1, {8}); // 4 x 2
  check_matrix<P, sliding_window, 4>(7, 3, {8});
  check_matrix<P, causal_window, 2>(9, 0, {4});
}

TEST_CASE("hybrid: a group size that does not divide P is refused at plan time, on every rank") {
  const std::vector<std::int32_t> cu = {0, 40};
  in_process_group group(6, std::chrono::seconds(5));
  const auto errors = on_ranks(group, [&](int, in_process_communicator& comm) {
    by_heads<zigzag, causal, all_to_all_heads_x_all_gather<4>> attn(comm, {8, 8, 64, 0.0f}, cu);
  });
  for (const auto& e : errors)
    CHECK(message(e) == "ringattn: the hybrid schedule splits the 6 ranks into groups of 4 "
                        "consecutive ranks, but 4 does not divide 6 (use a group size that "
                        "divides the ranks)");
  CHECK(std::string(all_to_all_heads_x_all_gather<16>::name) ==
        "all_to_all_heads_x_all_gather<16>");
}

TEST_CASE("all-to-all: heads that do not split are refused at plan time, on every rank") {
  const std::vector<std::int32_t> cu = {0, 40};
  auto refused = [&](int ranks, attention_arguments a) {
    in_process_group group(ranks, std::chrono::seconds(5));
    return on_ranks(group, [&](int, in_process_communicator& comm) {
      by_heads<zigzag, causal> attn(comm, a, cu);
    });
  };
  for (const auto& e : refused(8, {12, 4, 64, 0.0f}))
    CHECK(message(e) == "ringattn: the all-to-all schedule gives every rank q_heads / P query "
                        "heads, but 12 q heads do not split over 8 ranks (use a P that divides "
                        "q_heads, or the ring)");
  for (const auto& e : refused(4, {12, 6, 64, 0.0f}))
    CHECK(message(e) == "ringattn: the all-to-all schedule gives every rank kv_heads / P kv heads, "
                        "or one kv head shared by P / kv_heads ranks, but neither of 6 kv heads "
                        "and 4 ranks divides the other");
  // The same arguments split over 2 ranks.
  for (const auto& e : refused(2, {12, 6, 64, 0.0f}))
    CHECK(message(e) == "");
}

TEST_CASE("all-to-all: a rank's heads, and what a replicated kv head costs") {
  const head_split a = head_split::of({32, 8, 128, 0.0f}, 4);
  CHECK(a.q_per_rank == 8);
  CHECK(a.kv_per_rank == 2);
  CHECK(a.replicas == 1);
  CHECK(a.kv_begin(3) == 6);
  const head_split b = head_split::of({32, 2, 128, 0.0f}, 8);
  CHECK(b.q_per_rank == 4);
  CHECK(b.kv_per_rank == 1);
  CHECK(b.replicas == 4); // each kv head on 4 ranks: K/V cost 4 x a single copy
  for (int r = 0; r < 8; ++r) {
    CAPTURE(r);
    // The kv head of rank r's first query head is the one it holds.
    CHECK(b.kv_begin(r) == b.q_begin(r) / (32 / 2));
  }
}

TEST_CASE(
    "one rank: the all-to-all's gathered schedule runs the ring's program (the device path)") {
  // With one rank the device all-to-all runs ring/program.cuh's ring program over the gathered
  // schedule, whose step has no source rank: its one block is step 0's, whole.
  const std::vector<std::int32_t> cu = {0, 37, 40, 95};
  const attention_arguments a{8, 2, 64, 0.0f};
  for (mask_kind m : {mask_kind::full, mask_kind::causal}) {
    CAPTURE(static_cast<int>(m));
    const partition_plan<zigzag> plan(cu, 1);
    const all_to_all_plan p(plan, 0, position_window::of(m), a);
    const ring_schedule& s = p.local();
    CHECK(s.own_travel().whole);
    CHECK(s.held_tokens(s.step(0)) == plan.tokens());
    const ring_workspace ws = detail::ring_program::workspace(s, a, element_format::of<T>());
    detail::trace_engine e;
    detail::ring_program::forward(e, s, ws);
    detail::ring_program::backward(e, s, ws);
    CHECK(e.messages().empty());
    CHECK(ws.own_sums_bytes() == 0);
  }
}
