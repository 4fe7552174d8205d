// The band algebra against brute-force position comparison.
#include "../support/common.hpp"

#include <ringattn/core/segment.cuh>

#include <doctest/doctest.h>

#include <random>

using namespace ringattn;

TEST_CASE("floor_div and ceil_div round toward -inf and +inf for every sign") {
  for (std::int64_t a = -20; a <= 20; ++a)
    for (std::int64_t b : {-7, -3, -1, 1, 2, 5}) {
      const double q = static_cast<double>(a) / static_cast<double>(b);
      CHECK(detail::floor_div(a, b) == static_cast<std::int64_t>(std::floor(q)));
      CHECK(detail::ceil_div(a, b) == static_cast<std::int64_t>(std::ceil(q)));
    }
}

TEST_CASE("classify: every (q segment, k segment, window) agrees with position comparison") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> start(0, 40), count(0, 12), stride(1, 6), win(1, 30);
  for (int trial = 0; trial < 4000; ++trial) {
    const std::int64_t s = stride(rng);
    const segment q{start(rng), s, count(rng), 0}, k{start(rng), s, count(rng), 0};
    position_window w;
    switch (trial % 4) {
    case 0: w = position_window::of(mask_kind::full); break;
    case 1: w = position_window::of(mask_kind::causal); break;
    case 2: w = position_window::of(mask_kind::causal_window, win(rng) - 1); break;
    default: w = position_window{win(rng), win(rng) - 10}; break; // general window, may be empty
    }
    CAPTURE(trial);
    const block b = classify(q, k, w);
    std::int64_t seen = 0;
    for (std::int64_t i = 0; i < q.count; ++i)
      for (std::int64_t j = 0; j < k.count; ++j) {
        const bool truth = w.sees(q.position(i), k.position(j));
        REQUIRE(b.mask.sees(i, j) == truth);
        seen += truth;
      }
    CHECK(b.visible() == seen);
    const std::int64_t all = q.count * k.count;
    CHECK((b.kind == block_kind::empty) == (seen == 0));
    CHECK((b.kind == block_kind::full) == (seen == all && all > 0));
  }
}

TEST_CASE(
    "band::kv_tiles: visited tiles hold every visible column, unmasked tiles are all-visible") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> lo(-40, 20), width(0, 40), rows(1, 70), cols(1, 70),
      tile(1, 16);
  for (int trial = 0; trial < 3000; ++trial) {
    band b{lo(rng), 0};
    b.hi = b.lo + width(rng);
    if (trial % 5 == 0) b.lo = -unbounded;
    if (trial % 7 == 0) b.hi = unbounded;
    const std::int64_t n = rows(rng), m = cols(rng), bn = tile(rng);
    std::uniform_int_distribution<std::int64_t> row(0, n - 1);
    std::int64_t i0 = row(rng), i1 = row(rng);
    if (i0 > i1) std::swap(i0, i1);
    ++i1;
    CAPTURE(trial);
    const tile_trips t = b.kv_tiles(i0, i1, m, bn);
    REQUIRE(t.begin <= t.unmasked_begin);
    REQUIRE(t.unmasked_begin <= t.unmasked_end);
    REQUIRE(t.unmasked_end <= t.end);
    for (std::int64_t j = 0; j < m; ++j) {
      bool any = false, all = true;
      for (std::int64_t i = i0; i < i1; ++i) {
        any = any || b.sees(i, j);
        all = all && b.sees(i, j);
      }
      const std::int64_t tj = j / bn;
      if (any) REQUIRE((tj >= t.begin && tj < t.end));
      if (tj >= t.unmasked_begin && tj < t.unmasked_end) REQUIRE(all);
    }
    // Tight: the first and last visited tiles hold a visible column.
    if (t.end > t.begin) {
      const index_range c = b.columns(i0, i1, m);
      CHECK(c.begin / bn == t.begin);
      CHECK((c.end - 1) / bn == t.end - 1);
    }
  }
}
