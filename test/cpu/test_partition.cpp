// Partitioners and the partition plan: ownership, index maps, blocks, balance, scatter/gather.
#include "../support/common.hpp"
#include "../support/document_mixes.hpp"

#include <ringattn/partition/balanced.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/scatter.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring/schedule.cuh>

#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <set>
#include <tuple>

using namespace ringattn;

static_assert(partitioner<contiguous> && partitioner<round_robin> && partitioner<zigzag>);
static_assert(!partitioner<int>);
// The index math is constexpr: a layout can be checked at compile time.
static_assert(zigzag::locate(16, 4, 9).rank == 3 && zigzag::locate(16, 4, 9).local == 3);
static_assert(round_robin::position(10, 4, 1, 2) == 9);
static_assert(contiguous::local_length(10, 4, 3) == 1);

#define PARTITIONERS contiguous, round_robin, zigzag, balanced

TEST_CASE_TEMPLATE("every position has exactly one owner; locate and position are inverse", P,
                   PARTITIONERS) {
  std::vector<std::int64_t> lengths = {0, 1, 2, 3, 7, 16, 31, 100, 2999};
  for (int ranks = 1; ranks <= 16; ++ranks)
    for (std::int64_t S : lengths) {
      CAPTURE(ranks);
      CAPTURE(S);
      std::vector<int> owned(static_cast<std::size_t>(S), 0);
      std::int64_t total = 0;
      for (int r = 0; r < ranks; ++r) {
        const auto segs = P::segments(S, ranks, r);
        std::int64_t local = 0;
        for (const segment& g : segs) {
          REQUIRE(g.local_begin == local); // segments tile the rank's local range in order
          REQUIRE(g.count >= 0);
          REQUIRE(g.stride == segs[0].stride); // one stride per partitioner layout
          for (std::int64_t i = 0; i < g.count; ++i) {
            const std::int64_t p = g.position(i);
            REQUIRE((p >= 0 && p < S));
            ++owned[static_cast<std::size_t>(p)];
            REQUIRE(P::position(S, ranks, r, local) == p);
            REQUIRE(P::locate(S, ranks, p) == owner{r, local});
            ++local;
          }
        }
        REQUIRE(local == P::local_length(S, ranks, r));
        total += local;
      }
      CHECK(total == S);
      CHECK(std::all_of(owned.begin(), owned.end(), [](int c) { return c == 1; }));
    }
}

TEST_CASE_TEMPLATE("plan: local cu_seqlens, global <-> local maps and position ids", P,
                   PARTITIONERS) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 30; ++trial) {
    const int ranks = 1 + static_cast<int>(rng() % 16);
    const auto cu = test::random_cu_seqlens(1 + static_cast<int>(rng() % 6), 0, 120, rng);
    CAPTURE(ranks);
    partition_plan<P> plan(cu, ranks);
    std::set<std::int64_t> seen;
    for (int r = 0; r < ranks; ++r) {
      const auto lc = plan.local_cu_seqlens(r);
      REQUIRE(validate_cu_seqlens(lc, plan.local_tokens(r)).is_ok());
      const auto pos = plan.position_ids(r);
      for (std::int64_t l = 0; l < plan.local_tokens(r); ++l) {
        const std::int64_t g = plan.global_token(r, l);
        REQUIRE(plan.locate(g) == owner{r, l});
        REQUIRE(seen.insert(g).second);
        const int s = plan.sequence_of(g);
        REQUIRE(pos[static_cast<std::size_t>(l)] == g - cu[static_cast<std::size_t>(s)]);
      }
    }
    CHECK(static_cast<std::int64_t>(seen.size()) == plan.tokens());
    CHECK(plan.rank_offset(ranks) == plan.tokens());
  }
}

TEST_CASE_TEMPLATE("plan blocks reproduce the mask on every (query rank, key rank) pair", P,
                   PARTITIONERS) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 12; ++trial) {
    const int ranks = 1 + static_cast<int>(rng() % 8);
    const auto cu = test::random_cu_seqlens(1 + static_cast<int>(rng() % 3), 0, 40, rng);
    partition_plan<P> plan(cu, ranks);
    const position_window windows[] = {position_window::of(mask_kind::full),
                                       position_window::of(mask_kind::causal),
                                       position_window::of(mask_kind::causal_window, rng() % 9)};
    for (const position_window& w : windows)
      for (int rq = 0; rq < ranks; ++rq)
        for (int rk = 0; rk < ranks; ++rk) {
          CAPTURE(ranks);
          CAPTURE(rq);
          CAPTURE(rk);
          // Brute force over shard indices: same sequence and the window admits the positions.
          std::set<std::pair<std::int64_t, std::int64_t>> truth, got;
          for (std::int64_t i = 0; i < plan.local_tokens(rq); ++i)
            for (std::int64_t j = 0; j < plan.local_tokens(rk); ++j) {
              const std::int64_t gi = plan.global_token(rq, i), gj = plan.global_token(rk, j);
              const int s = plan.sequence_of(gi);
              if (s == plan.sequence_of(gj) && w.sees(gi - cu[s], gj - cu[s])) truth.insert({i, j});
            }
          for (const block& b : plan.blocks(rq, rk, w)) {
            REQUIRE(b.kind != block_kind::empty);
            for (std::int64_t i = 0; i < b.q.count; ++i)
              for (std::int64_t j = 0; j < b.kv.count; ++j)
                if (b.mask.sees(i, j)) got.insert({b.q.local_begin + i, b.kv.local_begin + j});
          }
          REQUIRE(got == truth);
        }
  }
}

TEST_CASE("causal balance: zigzag and round-robin within rounding of the mean, contiguous not") {
  const auto w = position_window::of(mask_kind::causal);
  for (int ranks : {2, 3, 4, 8, 16})
    for (std::int32_t S : {64, 1000, 2999, 4096, 10007}) {
      CAPTURE(ranks);
      CAPTURE(S);
      const std::vector<std::int32_t> cu = {0, S};
      auto spread = [&](auto plan) {
        std::int64_t lo = INT64_MAX, hi = 0, sum = 0;
        for (int r = 0; r < ranks; ++r) {
          const std::int64_t x = plan.work(r, w);
          lo = std::min(lo, x);
          hi = std::max(hi, x);
          sum += x;
        }
        CHECK(sum == static_cast<std::int64_t>(S) * (S + 1) / 2); // every visible pair counted once
        return std::tuple{lo, hi, static_cast<double>(sum) / ranks};
      };
      // Moving one token between ranks moves at most S visible keys, and rounding of chunk
      // boundaries (zigzag) or of the stripe offset (round-robin) amounts to at most two such
      // tokens: every rank is within 2 S of the mean.
      auto [zl, zh, zm] = spread(partition_plan<zigzag>(cu, ranks));
      CHECK(zh - zm <= 2.0 * S);
      CHECK(zm - zl <= 2.0 * S);
      auto [rl, rh, rm] = spread(partition_plan<round_robin>(cu, ranks));
      CHECK(rh - rm <= 2.0 * S);
      CHECK(rm - rl <= 2.0 * S);
      // Contiguous: the last rank does about 2P - 1 times the first rank's work, and about
      // (2P - 1) / P times the mean.
      auto [cl, ch, cm] = spread(partition_plan<contiguous>(cu, ranks));
      if (S % ranks == 0 && S >= 64 * ranks)
        CHECK(static_cast<double>(ch) / cl > 0.95 * (2 * ranks - 1));
      CHECK(static_cast<double>(ch) / cm > 0.9 * (2 * ranks - 1) / ranks);
    }
}

TEST_CASE(
    "window balance: round-robin within 2 W of the mean, zigzag and contiguous within the ramp") {
  // Under a window (left L, right R) a query sees at most W = L + R + 1 keys, fewer within L of
  // the sequence's start or R of its end (the ramps, L(L+1)/2 + R(R+1)/2 pairs short). Round-robin
  // spreads the ramps over every rank; zigzag and contiguous leave them with the ranks holding the
  // ends, so the others carry ramp / P more than the mean.
  for (int ranks : {2, 3, 4, 8, 16})
    for (std::int32_t S : {64, 1000, 4096, 10007})
      for (auto [left, right] : {std::pair<std::int64_t, std::int64_t>{0, 0},
                                 {3, 0},
                                 {100, 0},
                                 {1000, 0},
                                 {30, 70},
                                 {5000, 5000}}) {
        CAPTURE(ranks);
        CAPTURE(S);
        CAPTURE(left);
        CAPTURE(right);
        const std::vector<std::int32_t> cu = {0, S};
        const auto w = position_window::of(mask_kind::sliding_window, left, right);
        const std::int64_t l = std::min<std::int64_t>(left, S),
                           r = std::min<std::int64_t>(right, S);
        const double width = static_cast<double>(std::min<std::int64_t>(S, l + r + 1));
        const double ramp = (l * (l + 1) + r * (r + 1)) / 2.0;
        auto spread = [&](auto plan) {
          std::int64_t lo = INT64_MAX, hi = 0, sum = 0, pairs = 0;
          for (int k = 0; k < ranks; ++k) {
            const std::int64_t x = plan.work(k, w);
            lo = std::min(lo, x);
            hi = std::max(hi, x);
            sum += x;
          }
          for (std::int64_t i = 0; i < S; ++i) // every visible pair counted once
            pairs +=
                std::min<std::int64_t>(S - 1, i + right) - std::max<std::int64_t>(0, i - left) + 1;
          CHECK(sum == pairs);
          return std::tuple{lo, hi, static_cast<double>(sum) / ranks};
        };
        auto [rl, rh, rm] = spread(partition_plan<round_robin>(cu, ranks));
        CHECK(rh - rm <= 2.0 * width);
        CHECK(rm - rl <= 2.0 * width);
        auto [zl, zh, zm] = spread(partition_plan<zigzag>(cu, ranks));
        CHECK(zh - zm <= ramp / ranks + 2.0 * width);
        auto [cl, ch, cm] = spread(partition_plan<contiguous>(cu, ranks));
        CHECK(ch - cm <= ramp / ranks + 2.0 * width);
      }
}

TEST_CASE_TEMPLATE("host scatter then gather is the identity, dense and strided", P, PARTITIONERS) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 20; ++trial) {
    const int ranks = 1 + static_cast<int>(rng() % 16);
    const auto cu = test::random_cu_seqlens(1 + static_cast<int>(rng() % 5), 0, 90, rng);
    const std::int64_t tokens = cu.back();
    const int heads = 1 + static_cast<int>(rng() % 3), dim = 8;
    const bool strided = trial % 2 == 1;
    const std::int64_t hs = strided ? dim + 4 : dim, ts = strided ? heads * hs + 8 : heads * dim;
    partition_plan<P> plan(cu, ranks);
    auto data = test::random_buffer<__nv_bfloat16>(static_cast<std::size_t>(tokens * ts), rng);
    thd_view<const __nv_bfloat16> full(data.data(), tokens, heads, dim, ts, hs);
    // Shards back to back (dense), as an all-gather of unequal parts lays them out.
    std::vector<__nv_bfloat16> shards(static_cast<std::size_t>(plan.tokens() * heads * dim),
                                      test::poison<__nv_bfloat16>());
    for (int r = 0; r < ranks; ++r)
      scatter(plan, r, full,
              thd_view<__nv_bfloat16>(shards.data() + plan.rank_offset(r) * heads * dim,
                                      plan.local_tokens(r), heads, dim));
    std::vector<__nv_bfloat16> back(data.size(), test::poison<__nv_bfloat16>());
    thd_view<__nv_bfloat16> out(back.data(), tokens, heads, dim, ts, hs);
    gather(plan, thd_view<const __nv_bfloat16>(shards.data(), plan.tokens(), heads, dim), out);
    for (std::int64_t t = 0; t < tokens; ++t)
      for (int h = 0; h < heads; ++h)
        for (int d = 0; d < dim; ++d)
          REQUIRE(to_float(out(t, h, d)) == to_float(full(t, h, d)));
    // The padded layout: rank r's shard at r * rank_stride.
    const std::int64_t stride = plan.max_local_tokens() + 3;
    std::vector<__nv_bfloat16> padded(static_cast<std::size_t>(stride * ranks * heads * dim),
                                      test::poison<__nv_bfloat16>());
    for (int r = 0; r < ranks; ++r)
      scatter(plan, r, full,
              thd_view<__nv_bfloat16>(padded.data() + r * stride * heads * dim,
                                      plan.local_tokens(r), heads, dim));
    std::fill(back.begin(), back.end(), test::poison<__nv_bfloat16>());
    gather(plan, thd_view<const __nv_bfloat16>(padded.data(), stride * ranks, heads, dim), out,
           stride);
    for (std::int64_t t = 0; t < tokens; ++t)
      for (int h = 0; h < heads; ++h)
        for (int d = 0; d < dim; ++d)
          REQUIRE(to_float(out(t, h, d)) == to_float(full(t, h, d)));
  }
}

TEST_CASE("uneven and empty shares: 2999 tokens on 4 ranks, 3 tokens on 8 ranks") {
  const std::vector<std::int32_t> a = {0, 2999};
  partition_plan<zigzag> z(a, 4);
  std::int64_t sum = 0;
  for (int r = 0; r < 4; ++r) {
    CHECK(std::abs(z.local_tokens(r) - 2999.0 / 4) <= 2); // two chunks, each within one token
    sum += z.local_tokens(r);
  }
  CHECK(sum == 2999);
  const std::vector<std::int32_t> b = {0, 3};
  partition_plan<round_robin> rr(b, 8);
  CHECK(rr.local_tokens(0) == 1);
  CHECK(rr.local_tokens(2) == 1);
  CHECK(rr.local_tokens(3) == 0);
  CHECK(rr.blocks(3, 0, position_window::of(mask_kind::causal)).empty());
  partition_plan<contiguous> c(b, 8);
  CHECK(c.local_tokens(0) == 1);
  CHECK(c.local_tokens(7) == 0);
  CHECK(c.position_ids(7).empty());
}

TEST_CASE("bad input is rejected with a clear error") {
  const std::vector<std::int32_t> cu = {0, 10};
  CHECK_THROWS_WITH_AS(partition_plan<zigzag>(cu, 0),
                       "ringattn: the number of ranks must be at least 1 (got 0)",
                       invalid_argument);
  const std::vector<std::int32_t> down = {0, 10, 5};
  CHECK_THROWS_WITH_AS(
      partition_plan<zigzag>(down, 2),
      "ringattn: cu_seqlens is not monotone: cu_seqlens[2] = 5 < cu_seqlens[1] = 10",
      invalid_argument);
  const std::vector<std::int32_t> empty = {};
  CHECK_THROWS_AS(partition_plan<zigzag>(empty, 2), invalid_argument);
  partition_plan<round_robin> plan(cu, 2);
  CHECK_THROWS_WITH_AS(plan.local_cu_seqlens(2), "ringattn: rank 2 is out of range [0, 2)",
                       invalid_argument);
  CHECK_THROWS_AS(plan.position_ids(-1), invalid_argument);
  std::vector<float> full(10 * 8, 1.0f), shard(5 * 8, 0.0f), wrong(4 * 8, 0.0f);
  // Token counts that disagree with cu_seqlens, and a rank out of range: rejected, nothing written.
  CHECK_THROWS_WITH(scatter(plan, 0, thd_view<const float>(full.data(), 9, 1, 8),
                            thd_view<float>(shard.data(), 5, 1, 8)),
                    "ringattn: full has 9 tokens but cu_seqlens describes 10");
  CHECK_THROWS_WITH(scatter(plan, 0, thd_view<const float>(full.data(), 10, 1, 8),
                            thd_view<float>(wrong.data(), 4, 1, 8)),
                    "ringattn: shard has 4 tokens but rank 0 holds 5");
  CHECK_THROWS_WITH(scatter(plan, 5, thd_view<const float>(full.data(), 10, 1, 8),
                            thd_view<float>(shard.data(), 5, 1, 8)),
                    "ringattn: rank 5 is out of range [0, 2)");
  CHECK(std::all_of(shard.begin(), shard.end(), [](float x) { return x == 0.0f; }));
  CHECK_THROWS_WITH(gather(plan, thd_view<const float>(shard.data(), 5, 1, 8),
                           thd_view<float>(full.data(), 10, 1, 8)),
                    "ringattn: gathered has 5 tokens but the shards need 10");
  CHECK_THROWS_WITH(gather(plan, thd_view<const float>(full.data(), 10, 1, 8),
                           thd_view<float>(full.data(), 10, 1, 8), 4),
                    "ringattn: rank_stride 4 is smaller than the largest shard (5)");
}

TEST_CASE("balanced: a pure function of the lengths; a document is whole or over neighbours") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const auto w = position_window::of(mask_kind::causal);
  for (int trial = 0; trial < 40; ++trial) {
    const int ranks = 1 + static_cast<int>(rng() % 9);
    const auto cu = test::random_cu_seqlens(1 + static_cast<int>(rng() % 40), 0, 300, rng);
    CAPTURE(ranks);
    const auto placed = balanced::place(cu, ranks);
    REQUIRE(placed == balanced::place(cu, ranks));
    partition_plan<balanced> plan(cu, ranks);
    REQUIRE(plan.placements().size() == cu.size() - 1);
    for (int s = 0; s < plan.batch(); ++s) {
      const placement pl = plan.placement_of(s);
      REQUIRE(pl == placed[static_cast<std::size_t>(s)]);
      REQUIRE((pl.first >= 0 && pl.first < ranks && pl.ranks >= 1 && pl.ranks <= ranks));
      // Exactly the placement's ranks hold tokens of s (short ones may hold none).
      std::int64_t held = 0;
      for (int r = 0; r < ranks; ++r) {
        const std::int64_t mine = plan.local_cu_seqlens(r)[s + 1] - plan.local_cu_seqlens(r)[s];
        const bool inside = (r - pl.first + ranks) % ranks < pl.ranks;
        if (!inside) REQUIRE(mine == 0);
        held += mine;
      }
      REQUIRE(held == plan.length(s));
      if (pl.ranks == 1 && plan.length(s) > 0) {
        const auto segs = plan.segments(pl.first, s);
        REQUIRE(segs.count == 1); // kept whole: one segment
        // Its keys are seen by its own rank only.
        for (int r = 0; r < ranks; ++r)
          if (r != pl.first)
            for (const block& b : plan.blocks(r, pl.first, w))
              REQUIRE(b.sequence != s);
      }
    }
  }
}

TEST_CASE("balanced: causal work max/mean on document mixes, against zigzag and round-robin") {
  // 64K tokens of each mix over P ranks: the balanced plan within 5 % of the mean at P = 8 on the
  // long-tail mix, and never worse than zigzag's by more than 1 %; zigzag and round-robin are
  // balanced per document, so their rounding adds up over many short ones.
  const auto w = position_window::of(mask_kind::causal);
  for (int ranks : {2, 3, 4, 8})
    for (const test::document_mix& mix : test::document_mixes(65536, ranks)) {
      CAPTURE(ranks);
      CAPTURE(mix.name);
      const double b = partition_plan<balanced>(mix.cu_seqlens, ranks).work_imbalance(w);
      const double z = partition_plan<zigzag>(mix.cu_seqlens, ranks).work_imbalance(w);
      const double r = partition_plan<round_robin>(mix.cu_seqlens, ranks).work_imbalance(w);
      MESSAGE(mix.name, ", P = ", ranks, ": max/mean balanced ", b, ", zigzag ", z,
              ", round-robin ", r);
      CHECK(b <= 1.05);
      CHECK(b <= z + 0.01);
    }
}

TEST_CASE("balanced: every document shorter than P stays whole, and most of a long tail does") {
  const auto causal = position_window::of(mask_kind::causal);
  for (int ranks : {4, 8}) {
    const auto mix = test::all_short_mix(65536, ranks);
    partition_plan<balanced> plan(mix.cu_seqlens, ranks);
    for (int s = 0; s < plan.batch(); ++s)
      REQUIRE(plan.placement_of(s).ranks == 1);
    // No rank sees another's keys: the ring has one step.
    CHECK(ring_schedule::steps_needed(plan, causal) == 1);
  }
  const auto tail = test::long_tail_mix(65536);
  partition_plan<balanced> plan(tail.cu_seqlens, 8);
  std::int64_t whole = 0;
  for (int s = 0; s < plan.batch(); ++s)
    if (plan.placement_of(s).ranks == 1) whole += plan.length(s);
  MESSAGE("long tail over 8 ranks: ", plan.batch(), " documents, ", whole,
          " of 65536 tokens kept whole");
  CHECK(whole >= 65536 / 2);
}
