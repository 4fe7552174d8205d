// The host block kernel against the float64 oracle, and the merge of split K/V ranges.
#include "../support/block_case.hpp"

#include <ringattn/block/device/host_forward.cuh>

#include <doctest/doctest.h>

using namespace ringattn;

namespace {
struct host_state {
  std::vector<float> o, lse, sum;
  attention_state view;
  host_state(std::int64_t tokens, const attention_arguments& a)
      : o(static_cast<std::size_t>(tokens * a.q_heads * a.head_dim), -7.0f),
        lse(static_cast<std::size_t>(tokens * a.q_heads), -7.0f),
        sum(static_cast<std::size_t>(tokens * a.q_heads), -7.0f), view{o.data(),   lse.data(),
                                                                       sum.data(), tokens,
                                                                       a.q_heads,  a.head_dim} {
    reset(view); // poisoned first: reset must write every element
  }
  // The attention output and lse the state holds (o / sum, reference + log(sum)), indexed by the
  // documented layout (o [q_heads, tokens, head_dim], lse and sum [q_heads, tokens]), not through
  // the state's accessors, so that a change of layout cannot go unnoticed.
  double out(std::int64_t t, int h, int e) const {
    const std::size_t r = static_cast<std::size_t>(h * view.tokens + t);
    return sum[r] > 0.0f ? double(o[r * static_cast<std::size_t>(view.head_dim) + e]) / sum[r]
                         : 0.0;
  }
  double lse_of(std::int64_t t, int h) const {
    const std::size_t r = static_cast<std::size_t>(h * view.tokens + t);
    return sum[r] > 0.0f ? double(lse[r]) + std::log(double(sum[r]))
                         : -std::numeric_limits<double>::infinity();
  }
};

template <class T>
host_state run(const test::block_case<T>& c, const std::vector<std::vector<block_group>>& calls) {
  host_state s(c.tokens(), c.args);
  for (const auto& groups : calls)
    host_block_forward<T>({c.qv(), c.kv(), c.vv(), c.args, s.view}, groups);
  return s;
}
} // namespace

// Tolerances: the host kernel computes each block in fp64 and keeps the state in fp32, so the
// state is within fp32 rounding of the oracle (1e-5 relative; LSE within 1e-5 absolute). The
// finalised bf16 output adds bf16 rounding (relative 2^-9 per element at worst): 4e-3.
TEST_CASE("host block forward equals the oracle: bands x GQA x head_dim x packed odd lengths") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for (int group : {1, 4, 8})
    for (int d : {64, 128})
      for (const band& b : test::test_bands(rng)) {
        CAPTURE(group);
        CAPTURE(d);
        CAPTURE(b.lo);
        CAPTURE(b.hi);
        const attention_arguments a{8, 8 / group, d, 0.0f};
        test::block_case<__nv_bfloat16> c(test::random_cu_seqlens(3, 1, 37, rng), a, b, rng);
        const auto ref = c.oracle();
        auto s = run(c, c.calls(1));
        CHECK(test::out_error(ref, [&](auto t, int h, int e) { return s.out(t, h, e); }) < 1e-5);
        CHECK(test::lse_error(ref, [&](auto t, int h) { return s.lse_of(t, h); }) < 1e-5);
        std::vector<__nv_bfloat16> out(c.q.size(), test::poison<__nv_bfloat16>());
        thd_view<__nv_bfloat16> ov(out.data(), c.tokens(), a.q_heads, d);
        finalize(s.view, ov);
        CHECK(test::out_error(ref, [&](auto t, int h, int e) { return to_float(ov(t, h, e)); }) <
              4e-3);
        // finalize replaced the reference by the rows' lse
        CHECK(test::lse_error(ref, [&](auto t, int h) {
                return s.lse[static_cast<std::size_t>(h * c.tokens() + t)];
              }) < 1e-5);
      }
}

TEST_CASE("host block forward: K/V split into 1..8 blocks merges to the single-block result") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const attention_arguments a{4, 2, 64, 0.0f};
  for (const band& b : test::test_bands(rng)) {
    test::block_case<__half> c(test::random_cu_seqlens(2, 9, 61, rng), a, b, rng);
    const auto one = run(c, c.calls(1));
    for (int pieces = 2; pieces <= 8; ++pieces)
      for (bool together : {false, true}) {
        CAPTURE(pieces);
        CAPTURE(together);
        const auto split = run(c, c.calls(pieces, together));
        // Same function, different order of fp32 merges: equal to fp32 rounding.
        std::vector<double> so, oo;
        for (std::int64_t t = 0; t < c.tokens(); ++t)
          for (int h = 0; h < a.q_heads; ++h) {
            for (int e = 0; e < a.head_dim; ++e) {
              so.push_back(split.out(t, h, e));
              oo.push_back(one.out(t, h, e));
            }
            const double l1 = one.lse_of(t, h), ls = split.lse_of(t, h);
            if (std::isinf(l1))
              REQUIRE(ls == l1);
            else
              REQUIRE(std::abs(ls - l1) < 1e-5);
          }
        CHECK(reference::relative_error(so, oo) < 1e-6);
      }
  }
}

TEST_CASE("rows that see no key: o = 0, lse = -inf, never NaN; the state survives empty blocks") {
  std::mt19937_64 rng(test::fresh_seed());
  const attention_arguments a{2, 1, 64, 0.0f};
  // Keys strictly after the query (1 <= j - i <= 7): the last row of each sequence sees nothing.
  test::block_case<__nv_bfloat16> c({0, 5, 12}, a, band{1, 7}, rng);
  auto s = run(c, c.calls(3));
  for (int h = 0; h < 2; ++h)
    for (std::int64_t t : {4, 11}) {
      CHECK(std::isinf(s.view.lse_at(t, h)));
      CHECK(s.view.lse_at(t, h) < 0);
      CHECK(s.view.sum_at(t, h) == 0.0f);
      for (int e = 0; e < 64; ++e)
        CHECK(s.view.o_row(t, h)[e] == 0.0f);
    }
  for (float x : s.o)
    CHECK_FALSE(std::isnan(x));
  // Huge logits: exp would overflow without the running maximum, and the blocks' lse differ by
  // far more than `rescale_above`, so rows move their reference (both ways round).
  test::block_case<__nv_bfloat16> big({0, 9}, {2, 2, 64, 1000.0f}, band{}, rng);
  auto sb = run(big, big.calls(4));
  for (float x : sb.o)
    CHECK(std::isfinite(x));
  for (float x : sb.lse)
    CHECK(std::isfinite(x));
  const auto ref = big.oracle();
  // fp32 state whose rows move their reference, each move a multiplication by exp(ref - lse_b)
  // rounded in fp32: 2e-5 relative L2 (seen up to 1.03e-5 over random inputs).
  CHECK(test::out_error(ref, [&](auto t, int h, int e) { return sb.out(t, h, e); }) < 2e-5);
  // lse is of the order of 1e3 here: fp32 keeps it to about 1e-4
  CHECK(test::lse_error(ref, [&](auto t, int h) { return sb.lse_of(t, h); }) < 1e-3);
}

TEST_CASE("merge_into: the state only adds unless the reference has to move") {
  constexpr float inf = std::numeric_limits<float>::infinity();
  // nothing seen in the block: the row is unchanged, whatever it holds
  for (float ref : {-inf, 0.0f, 50.0f}) {
    const row_merge w = merge_into(ref, -inf);
    CHECK(w.old == 1.0f);
    CHECK(w.block == 0.0f);
    CHECK(w.new_ref == ref);
    CHECK_FALSE(w.moves);
  }
  // nothing seen before: the block is taken as it is
  const row_merge first = merge_into(-inf, 3.0f);
  CHECK(first.old == 0.0f);
  CHECK(first.block == 1.0f);
  CHECK(first.new_ref == 3.0f);
  CHECK(first.moves);
  // within rescale_above of the reference, above or below: an add
  for (float d : {-80.0f, -1.0f, 0.0f, 5.0f, rescale_above}) {
    const row_merge w = merge_into(2.0f, 2.0f + d);
    CHECK(w.old == 1.0f);
    CHECK(w.block == doctest::Approx(std::exp(double(d))).epsilon(1e-6));
    CHECK(w.new_ref == 2.0f);
    CHECK_FALSE(w.moves);
  }
  // beyond it: the reference moves to the block's lse
  const row_merge up = merge_into(2.0f, 2.0f + rescale_above + 1.0f);
  CHECK(up.old == doctest::Approx(std::exp(-double(rescale_above) - 1.0)).epsilon(1e-6));
  CHECK(up.block == 1.0f);
  CHECK(up.new_ref == 2.0f + rescale_above + 1.0f);
  CHECK(up.moves);
}

TEST_CASE("host block forward validates before writing anything") {
  std::mt19937_64 rng(test::fresh_seed());
  const attention_arguments a{4, 2, 64, 0.0f};
  test::block_case<__nv_bfloat16> c({0, 10}, a, band{}, rng);
  host_state s(10, a);
  const std::vector<float> before = s.o;
  auto groups = c.calls(1)[0];
  groups[0].kv[0].kv_count = 11; // reads past the K/V block
  CHECK_THROWS_WITH_AS(
      host_block_forward<__nv_bfloat16>({c.qv(), c.kv(), c.vv(), a, s.view}, groups),
      "ringattn: group 0 reads key rows [0, 11) outside the K/V block of 10 tokens",
      invalid_argument);
  auto overlap = c.calls(1)[0];
  overlap.push_back(overlap[0]);
  CHECK_THROWS_WITH_AS(
      host_block_forward<__nv_bfloat16>({c.qv(), c.kv(), c.vv(), a, s.view}, overlap),
      "ringattn: two groups share query rows (0 < 10)", invalid_argument);
  const attention_arguments wrong{4, 4, 64, 0.0f};
  CHECK_THROWS_WITH_AS(
      host_block_forward<__nv_bfloat16>({c.qv(), c.kv(), c.vv(), wrong, s.view}, c.calls(1)[0]),
      "ringattn: k/v have 2/2 heads but kv_heads is 4", invalid_argument);
  const attention_arguments odd{4, 2, 96, 0.0f};
  CHECK_THROWS_WITH_AS(
      host_block_forward<__nv_bfloat16>({c.qv(), c.kv(), c.vv(), odd, s.view}, c.calls(1)[0]),
      "ringattn: head_dim 96 is not supported (supported: 64, 128, 192, 256)", invalid_argument);
  CHECK(s.o == before);
}

TEST_CASE("group_blocks turns a plan's blocks into groups the kernel takes") {
  // Zigzag over 2 ranks (4 chunks of 4), causal: rank 1 holds chunks 1 and 2, rank 0 chunks 0
  // and 3. Each of rank 1's chunks sees chunk 0 fully and nothing of chunk 3.
  std::vector<block> blocks;
  const segment q1{4, 1, 4, 0}, q2{8, 1, 4, 4}, k0{0, 1, 4, 0}, k3{12, 1, 4, 4};
  const auto w = position_window::of(mask_kind::causal);
  for (const segment& q : {q1, q2})
    for (const segment& k : {k0, k3})
      blocks.push_back(classify(q, k, w));
  const auto groups = group_blocks(blocks);
  REQUIRE(groups.size() == 2);
  CHECK(groups[0].q_begin == 0);
  CHECK(groups[0].count == 1); // chunk 1 sees chunk 0 only
  CHECK(groups[1].q_begin == 4);
  CHECK(groups[1].count == 1); // chunk 2 sees chunk 0; chunk 3 is after it
  CHECK(validate_groups(groups, 8, 8).is_ok());
}

#include "../support/sharded_case.hpp"

#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>

// Partitioner -> plan blocks -> block groups -> host kernel over every source rank, against the
// oracle on the gathered batch: a ring's arithmetic without its communication.
TEST_CASE_TEMPLATE("every rank's shard against every rank's K/V equals the oracle", P, contiguous,
                   round_robin, zigzag) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for (int ranks : {1, 2, 3, 4, 8})
    for (mask_kind m : {mask_kind::full, mask_kind::causal}) {
      CAPTURE(ranks);
      CAPTURE(std::string(to_string(m)));
      // MQA (4 query heads on 1 kv head) on even rank counts, plain MHA on odd ones.
      test::sharded_case<P, __nv_bfloat16> c(test::random_cu_seqlens(3, 1, 45, rng), ranks,
                                             {4, ranks % 2 == 0 ? 1 : 4, 64, 0.0f}, m, rng);
      const auto ref = c.oracle();
      double worst_o = 0.0, worst_l = 0.0;
      for (int r = 0; r < ranks; ++r) {
        const std::int64_t n = c.plan.local_tokens(r);
        host_state s(n, c.args);
        const thd_view<const __nv_bfloat16> qv(c.qs[r].data(), n, c.args.q_heads, 64);
        for (int step = 0; step < ranks; ++step) {
          const int src = (r - step + ranks) % ranks; // the ring's order
          const std::int64_t nk = c.plan.local_tokens(src);
          host_block_forward<__nv_bfloat16>({qv,
                                             {c.ks[src].data(), nk, c.args.kv_heads, 64},
                                             {c.vs[src].data(), nk, c.args.kv_heads, 64},
                                             c.args,
                                             s.view},
                                            c.groups(r, src));
        }
        for (std::int64_t l = 0; l < n; ++l) {
          const std::int64_t g = c.plan.global_token(r, l);
          for (int h = 0; h < c.args.q_heads; ++h) {
            worst_l = std::max(worst_l, std::abs(s.lse_of(l, h) - ref.lse_at(h, g)));
            for (int e = 0; e < 64; ++e)
              worst_o = std::max(worst_o, std::abs(s.out(l, h, e) - ref.out(g, h, e)));
          }
        }
      }
      // fp32 state, fp64 blocks: fp32 rounding of values of magnitude <= 1.
      CHECK(worst_o < 1e-5);
      CHECK(worst_l < 1e-5);
    }
}
