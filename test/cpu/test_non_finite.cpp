// NaN and inf in an input on the host path reach what they reach in the float64 oracle, and
// only a row that saw no key reports lse = -inf: one element of q, k, v or dout set to NaN or +inf
// through the ring, the all-gather and the all-to-all (every partitioner, full and causal, P in
// {1, 3, 4}; the all-to-all at 1 and 4), forward and backward, element by element
// (strict_check.hpp); the merge of partial states; the sharded decode with NaN in q_new, k_new,
// v_new and in one rank's cache. Packed batches with empty and one-token sequences element by
// element too. The max logit, asked for in every forward: NaN on every rank for a head whose
// logits met a NaN or an infinity, the oracle's value elsewhere.
#include "../support/decode_case.hpp"
#include "../support/ranks.hpp"
#include "../support/strict_check.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/core/state.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>
#include <ringattn/sharded_attention.cuh>

#include <doctest/doctest.h>

#include <cmath>
#include <initializer_list>
#include <limits>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
constexpr float nan_value = std::numeric_limits<float>::quiet_NaN();
constexpr float inf_value = std::numeric_limits<float>::infinity();
// The host ring's tolerances (test_ring.cpp, test_ring_backward.cpp).
constexpr test::strict_bounds host_bounds{4e-3, 1e-5, 4e-3};

// Every rank's max logits against the oracle's (sharded_case::max_logit_error: NaN where a
// head's logits met a NaN, not finite where they met +inf, fp32 rounding elsewhere).
template <class P>
void check_max_logit(const test::sharded_case<P, T>& c,
                     const std::vector<std::vector<float>>& max_logits) {
  const auto want = c.oracle().max_logit;
  for (const auto& got : max_logits)
    CHECK(c.max_logit_error(got, want) < 1e-6);
}

// Every rank's host forward and backward of `c` under `Mask` and `Schedule`.
template <class P, class Mask, class Schedule>
std::pair<std::vector<typename test::sharded_case<P, T>::rank_output>,
          std::vector<typename test::sharded_backward_case<P, T>::rank_grads>>
host_run(const test::sharded_backward_case<P, T>& c) {
  const int ranks = c.plan.ranks();
  std::vector<typename test::sharded_case<P, T>::rank_output> outs(ranks);
  std::vector<typename test::sharded_backward_case<P, T>::rank_grads> grads(ranks);
  std::vector<std::vector<float>> max_logits(ranks);
  in_process_group group(ranks);
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<P, in_process_communicator, Mask, Schedule> attn(comm, c.args,
                                                                    c.plan.cu_seqlens());
    outs[r] = c.forward_rank(attn, r, false, &max_logits[r]);
    grads[r] = c.backward_rank(attn, r, outs[r]);
  });
  for (const auto& e : errors)
    REQUIRE(test::message(e) == "");
  check_max_logit(c, max_logits);
  return {outs, grads};
}

template <class P, class Mask, class Schedule>
void check_planted(attention_arguments a, std::initializer_list<int> ranks_list) {
  test::for_each_planted<P, T>(
      a, Mask::mask, ranks_list, 30,
      [](const test::sharded_backward_case<P, T>& c, std::int64_t, test::planted_in where) {
        const auto [outs, grads] = host_run<P, Mask, Schedule>(c);
        test::check_strict(test::strict_forward(c, outs), test::strict_backward(c, grads),
                           where != test::planted_in::dout, true, host_bounds);
      });
}

template <class P, class Mask>
void check_schedules(attention_arguments a) {
  check_planted<P, Mask, ring_pass>(a, {1, 3, 4});
  check_planted<P, Mask, all_gather_kv>(a, {3, 4});
  check_planted<P, Mask, all_to_all_heads>(a, {4});
}
} // namespace

TEST_CASE_TEMPLATE("host: NaN and inf in q, k, v or dout reach what the oracle's reach", P,
                   contiguous, round_robin, zigzag) {
  check_schedules<P, host_reference<causal_mask>>({4, 2, 64, 0.0f});
  check_schedules<P, host_reference<full_mask>>({4, 2, 64, 0.0f});
}

TEST_CASE_TEMPLATE("host: packed batches with empty and one-token sequences, element by element", P,
                   contiguous, round_robin, zigzag) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 draw(seed);
  for (const auto& cu : test::sparse_batches(draw))
    for (int ranks : {1, 2, 3, 4, 8}) {
      CAPTURE(cu.back());
      CAPTURE(ranks);
      std::mt19937_64 rng(seed + static_cast<std::uint64_t>(ranks));
      test::sharded_backward_case<P, T> c(cu, ranks, {8, 2, 64, 0.0f}, mask_kind::causal, rng);
      const auto [outs, grads] = host_run<P, host_reference<causal_mask>, ring_pass>(c);
      test::check_strict(test::strict_forward(c, outs), test::strict_backward(c, grads), false,
                         false, host_bounds);
      if (8 % ranks != 0) continue; // the all-to-all splits the 8 query heads over the ranks
      const auto [o2, g2] = host_run<P, host_reference<causal_mask>, all_to_all_heads>(c);
      test::check_strict(test::strict_forward(c, o2), test::strict_backward(c, g2), false, false,
                         host_bounds);
    }
}

TEST_CASE("merging finished partials: NaN in a partial's lse or output reaches the result; "
          "-inf is a partial that saw no key") {
  // Two partials of one element: slot 0 then slot 1 (stride 1).
  const float lse_of[2] = {0.5f, 0.25f}, o[2] = {1.0f, 0.5f};
  float lse = 0.0f;
  CHECK(std::isfinite(merge_finished(2, lse_of, 1, o, 1, lse)));
  CHECK(std::isfinite(lse));
  for (int which = 0; which < 2; ++which)
    for (int p = 0; p < 2; ++p) {
      CAPTURE(which);
      CAPTURE(p);
      float l2[2] = {lse_of[0], lse_of[1]}, o2[2] = {o[0], o[1]};
      (which == 0 ? l2 : o2)[p] = nan_value;
      const float x = merge_finished(2, l2, 1, o2, 1, lse);
      CHECK(std::isnan(x));
      if (which == 0) CHECK(std::isnan(lse));
      if (which == 1) CHECK(std::isfinite(lse)); // an output element's NaN stays in that element
    }
  // A partial that saw no key (lse -inf) changes nothing; only -inf everywhere is "no key".
  const float one_none[2] = {-inf_value, 0.25f}, none[2] = {-inf_value, -inf_value};
  CHECK(merge_finished(2, one_none, 1, o, 1, lse) == o[1]);
  CHECK(lse == 0.25f);
  CHECK(merge_finished(2, none, 1, o, 1, lse) == 0.0f);
  CHECK(lse == -inf_value);
  // Finishing a state: a NaN sum gives a NaN lse (never -inf), a sum of 0 gives -inf and 0.
  float so[2] = {1.0f, 1.0f}, sref[2] = {0.5f, -inf_value}, ssum[2] = {nan_value, 0.0f};
  const attention_state st{so, sref, ssum, 2, 1, 1};
  float fo[2] = {}, fl[2] = {};
  finish_partial(st, fo, fl);
  CHECK(std::isnan(fl[0]));
  CHECK(std::isnan(fo[0]));
  CHECK(fl[1] == -inf_value);
  CHECK(fo[1] == 0.0f);
  CHECK(std::isnan(final_lse(0.0f, nan_value)));
  CHECK(final_lse(-inf_value, 0.0f) == -inf_value);
}

namespace {
using decoder = sharded_attention<in_process_communicator, host_reference<causal_mask>>;

// One decode step on every rank; rank 0's out and lse (every rank's must be the same bits).
template <class P>
std::pair<std::vector<T>, std::vector<float>>
decode_step(const test::decode_case<P, T>& c, const typename test::decode_case<P, T>::step& s) {
  const attention_arguments a = c.args;
  const int qh = a.q_heads, kvh = a.kv_heads, d = a.head_dim, dv = a.v_dim();
  const std::int64_t n = s.tokens;
  std::vector<std::vector<T>> outs(c.ranks);
  std::vector<std::vector<float>> lses(c.ranks);
  in_process_group group(c.ranks);
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    decoder dec(comm, a);
    const auto sh = c.rank_shard(r);
    dec.plan(s.cu_new, sh.cu);
    std::vector<std::byte> ws(dec.host_workspace_bytes<T>());
    outs[r].assign(n * qh * dv, test::poison<T>());
    lses[r].assign(n * qh, -7.0f);
    dec.forward_host(thd_view<const T>(s.q.data(), n, qh, d),
                     thd_view<const T>(s.k.data(), n, kvh, d),
                     thd_view<const T>(s.v.data(), n, kvh, dv),
                     thd_view<const T>(sh.k.data(), sh.tokens(), kvh, d),
                     thd_view<const T>(sh.v.data(), sh.tokens(), kvh, dv),
                     thd_view<T>(outs[r].data(), n, qh, dv), lses[r].data(), ws);
  });
  for (const auto& e : errors)
    REQUIRE(test::message(e) == "");
  for (int r = 1; r < c.ranks; ++r)
    CHECK(test::same_bits(outs[r], lses[r], outs[0], lses[0]));
  return {outs[0], lses[0]};
}

} // namespace

TEST_CASE_TEMPLATE("sharded decode: NaN in q_new, k_new, v_new or a rank's cache reaches the "
                   "result",
                   P, contiguous, zigzag) {
  test::for_each_nan_decode<P, T>(
      {4, 2, 64, 0.0f}, 40,
      [](const test::decode_case<P, T>& c, const typename test::decode_case<P, T>::step& s) {
        const auto [out, lse] = decode_step(c, s);
        CHECK(c.check_strict(s, out, lse, 4e-3, 1e-5) > 0);
      });
}
