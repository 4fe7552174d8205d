// The all-gather schedule on the host (in-process communicator, ranks are threads): every
// partitioner x mask x P in {1, 2, 3, 4, 8} x GQA 1, 4, 8 x packed odd lengths, forward and
// backward against the float64 oracle; bytes per rank ((P - 1) x its own K/V forward; that
// again plus the dK/dV shares it returns, backward); the forward equal bit for bit to the ring's;
// the backward repeatable bit for bit; ranks on different schedules refused at plan time.
#include "../support/ranks.hpp"
#include "../support/ring_bytes.hpp"
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

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
using test::message;
using test::on_ranks;

template <class P, class Mask>
using gathered = ring_attention<P, in_process_communicator, Mask, all_gather_kv>;

struct run_result {
  double out_error = 0.0, lse_error = 0.0, max_logit_error = 0.0;
  std::array<double, 3> grad_error{};
  bool ring_equal = true, repeatable = true;
  std::uint64_t forward_bytes = 0, backward_bytes = 0, want_forward = 0, want_backward = 0;
};

template <class P, class Mask>
run_result run(const test::sharded_backward_case<P, T>& c) {
  const int ranks = c.plan.ranks();
  const auto ref = c.oracle();
  const auto ref_grads = c.oracle_backward();
  const auto at = [](int r) { return static_cast<std::size_t>(r); };
  std::vector<typename test::sharded_case<P, T>::error_parts> parts(at(ranks));
  std::vector<typename test::sharded_backward_case<P, T>::grad_parts> grads(at(ranks));
  std::vector<double> max_logit_errors(at(ranks), 0.0);
  std::vector<std::array<std::uint64_t, 4>> bytes(at(ranks));
  std::vector<int> ring_equal(at(ranks), 1), repeatable(at(ranks), 1);
  in_process_group group(ranks);
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    gathered<P, Mask> attn(comm, c.args, c.plan.cu_seqlens());
    ring_attention<P, in_process_communicator, Mask> ring(comm, c.args, c.plan.cu_seqlens());
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
    // Forward: the own block to each other rank that sees some of it. Backward: the same
    // gather, then the fp32 dK/dV share of every block this rank sees back to its owner.
    const std::uint64_t gather = test::all_gather_bytes<T>(attn, r, Mask::mask);
    CHECK(attn.template forward_bytes<T>() == gather);
    bytes[at(r)] = {after_forward, after_backward - after_forward, gather,
                    gather + test::all_gather_share_bytes(attn, r, Mask::mask)};
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
    res.forward_bytes += bytes[at(r)][0], res.backward_bytes += bytes[at(r)][1];
    res.want_forward += bytes[at(r)][2], res.want_backward += bytes[at(r)][3];
  }
  res.out_error = std::sqrt(num / den);
  for (std::size_t i = 0; i < 3; ++i)
    res.grad_error[i] = std::sqrt(gnum[i] / gden[i]);
  return res;
}

template <class P, class Mask>
void check_matrix() {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  for (int group : {1, 4, 8}) {
    std::mt19937_64 draw(seed + static_cast<std::uint64_t>(group));
    const auto cu = test::random_cu_seqlens(3, 1, 61, draw); // the same batch at every P
    for (int ranks : {1, 2, 3, 4, 8}) {
      CAPTURE(group);
      CAPTURE(ranks);
      std::mt19937_64 rng(seed + 7);
      test::sharded_backward_case<P, T> c(cu, ranks, {8, 8 / group, 64, 0.0f}, Mask::mask, rng);
      const run_result res = run<P, Mask>(c);
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
      CHECK(res.forward_bytes == res.want_forward);
      CHECK(res.backward_bytes == res.want_backward);
    }
  }
}
} // namespace

TEST_CASE_TEMPLATE("host all-gather equals the oracle: full and causal, P = 1, 2, 3, 4, 8", P,
                   contiguous, round_robin, zigzag, balanced) {
  check_matrix<P, full>();
  check_matrix<P, causal>();
}

TEST_CASE("all-gather: ranks on different schedules are refused at plan time, on every rank") {
  in_process_group group(2, std::chrono::seconds(5));
  const std::vector<std::int32_t> cu = {0, 40};
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    const attention_arguments a{8, 2, 64, 0.0f};
    if (r == 0)
      ring_attention<zigzag, in_process_communicator, causal> attn(comm, a, cu);
    else
      gathered<zigzag, causal> attn(comm, a, cu);
  });
  CHECK(message(errors[0]) ==
        "ringattn: rank 1 disagrees with rank 0 on the schedule (this rank's is ring_pass)");
  CHECK(message(errors[1]) ==
        "ringattn: rank 1 disagrees with rank 0 on the schedule (this rank's is all_gather_kv)");
}

TEST_CASE("all-gather workspace: a slot for every rank's block") {
  in_process_group group(4);
  const std::vector<std::int32_t> cu = {0, 64};
  const auto errors = on_ranks(group, [&](int, in_process_communicator& comm) {
    const attention_arguments a{8, 2, 64, 0.0f};
    ring_attention<contiguous, in_process_communicator, causal> ring(comm, a, cu);
    gathered<contiguous, causal> all(comm, a, cu);
    // 16 tokens a rank: a K/V slot is 2 x 16 x 2 x 64 x 2 bytes = 8 KiB; the ring keeps two.
    const std::size_t slot = 2 * 16 * 2 * 64 * 2;
    CHECK(all.host_workspace_bytes<T>() == ring.host_workspace_bytes<T>() + 2 * slot);
    CHECK(all.host_backward_workspace_bytes<T>() > ring.host_backward_workspace_bytes<T>());
  });
  for (const auto& e : errors)
    CHECK(message(e) == "");
}
