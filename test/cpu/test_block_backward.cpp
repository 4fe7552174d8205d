// The host block backward against the float64 oracle's backward, and the sum of split K/V ranges.
#include "../support/block_case.hpp"

#include <ringattn/block/device/backward.cuh>
#include <ringattn/block/device/host_backward.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>

#include <doctest/doctest.h>

#include <string>
#include <vector>

using namespace ringattn;

namespace {

template <class T>
test::block_grads run(const test::block_backward_case<T>& c,
                      const std::vector<std::vector<block_group>>& calls) {
  const auto n = static_cast<std::size_t>(c.tokens());
  test::block_grads g{std::vector<float>(n * c.args.q_heads * c.args.head_dim, 0.0f),
                      std::vector<float>(n * c.args.kv_heads * c.args.head_dim, 0.0f),
                      std::vector<float>(n * c.args.kv_heads * c.args.head_dim, 0.0f)};
  for (const auto& groups : calls)
    host_block_backward<T>({c.qv(),
                            c.kv(),
                            c.vv(),
                            c.doutv(),
                            c.lse.data(),
                            c.delta.data(),
                            c.args,
                            {g.dq.data(), g.dk.data(), g.dv.data()}},
                           groups);
  return g;
}

double grad_err(const std::vector<float>& got, const reference::tensor& want) {
  return test::grad_error(got, want.data);
}
double grad_err(const std::vector<float>& got, const std::vector<float>& want) {
  return test::grad_error(got, std::vector<double>(want.begin(), want.end()));
}
} // namespace

// Tolerance: each (row, key) term in fp64, the accumulators in fp32, P from the fp32 lse (relative
// error ~1e-7 times |lse|): within 1e-5 relative of the oracle.
TEST_CASE("host block backward equals the oracle: bands x GQA x head_dim x packed odd lengths") {
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
        test::block_backward_case<__nv_bfloat16> c(test::random_cu_seqlens(3, 1, 37, rng), a, b,
                                                   rng);
        const test::block_grads g = run(c, c.calls(1));
        CHECK(grad_err(g.dq, c.ref.dq) < 1e-5);
        CHECK(grad_err(g.dk, c.ref.dk) < 1e-5);
        CHECK(grad_err(g.dv, c.ref.dv) < 1e-5);
      }
}

TEST_CASE("host block backward: K/V split into 1..8 blocks sums to the single-block gradients") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const attention_arguments a{4, 2, 64, 0.0f};
  for (const band& b : test::test_bands(rng)) {
    test::block_backward_case<__half> c(test::random_cu_seqlens(2, 9, 61, rng), a, b, rng);
    const test::block_grads one = run(c, c.calls(1));
    for (int pieces = 2; pieces <= 8; ++pieces)
      for (bool together : {false, true}) {
        CAPTURE(pieces);
        CAPTURE(together);
        const test::block_grads split = run(c, c.calls(pieces, together));
        // dq sums the pieces in another order (fp32); dk and dv of a key come from one piece.
        CHECK(grad_err(split.dq, one.dq) < 1e-6);
        CHECK(grad_err(split.dk, one.dk) < 1e-6);
        CHECK(grad_err(split.dv, one.dv) < 1e-6);
      }
  }
}

TEST_CASE("host block backward: rows that see no key give no gradient and never NaN") {
  std::mt19937_64 rng(test::fresh_seed());
  // Keys strictly after the query (1 <= j - i <= 7): the last row of each sequence sees nothing
  // (lse = -inf) and contributes nothing.
  test::block_backward_case<__nv_bfloat16> c({0, 5, 12}, {2, 1, 64, 0.0f}, band{1, 7}, rng);
  const test::block_grads g = run(c, c.calls(3));
  for (int h = 0; h < 2; ++h)
    for (std::int64_t t : {4, 11})
      for (int e = 0; e < 64; ++e)
        CHECK(g.dq[static_cast<std::size_t>((t * 2 + h) * 64 + e)] == 0.0f);
  for (const auto* x : {&g.dq, &g.dk, &g.dv})
    for (float y : *x)
      CHECK(std::isfinite(y));
  CHECK(grad_err(g.dq, c.ref.dq) < 1e-5);
  CHECK(grad_err(g.dk, c.ref.dk) < 1e-5);
}

TEST_CASE("host block backward validates before writing anything") {
  std::mt19937_64 rng(test::fresh_seed());
  const attention_arguments a{4, 2, 64, 0.0f};
  test::block_backward_case<__nv_bfloat16> c({0, 20}, a, band{}, rng);
  std::vector<float> dq(20 * 4 * 64, -7.0f), dk(20 * 2 * 64, -7.0f), dv(dk);
  const auto groups = c.calls(1)[0];
  auto args = [&] {
    return block_backward_args<__nv_bfloat16>{
        c.qv(),       c.kv(),         c.vv(), c.doutv(),
        c.lse.data(), c.delta.data(), a,      {dq.data(), dk.data(), dv.data()}};
  };
  auto x = args();
  x.delta = nullptr;
  CHECK_THROWS_WITH_AS(host_block_backward(x, groups),
                       "ringattn: lse, delta or dq is a null pointer", invalid_argument);
  x = args();
  x.grad.dv = nullptr;
  CHECK_THROWS_WITH_AS(host_block_backward(x, groups), "ringattn: dk or dv is a null pointer",
                       invalid_argument);
  x = args();
  x.dout.tokens = 19;
  CHECK_THROWS_WITH_AS(host_block_backward(x, groups), "ringattn: dout has 19 tokens but q has 20",
                       invalid_argument);
  x = args();
  x.dout.heads = 2;
  CHECK_THROWS_WITH_AS(host_block_backward(x, groups), doctest::Contains("q/dout have 4/2 heads"),
                       invalid_argument);
  for (const auto* g : {&dq, &dk, &dv})
    for (float y : *g)
      REQUIRE(y == -7.0f);
}

// The tensor-core kernels' thread-block tiles: every column of every interval in one key tile,
// every row of every group with blocks in one row tile; both lists heaviest first, with each
// tile's steps counted here by brute force over the band (the planner uses closed forms).
void check_backward_tiles(const std::vector<block_group>& groups, const backward_plan& bp,
                          int tile) {
  CAPTURE(tile);
  const backward_tiles t = plan_backward_tiles(groups, bp, tile, tile);
  REQUIRE(t.key_steps.size() == t.key_tiles.size());
  REQUIRE(t.row_steps.size() == t.row_tiles.size());
  std::vector<std::int64_t> seen(bp.intervals.size(), 0);
  for (std::size_t k = 0; k < t.key_tiles.size(); ++k) {
    const auto kt = t.key_tiles[k];
    const auto& in = bp.intervals[static_cast<std::size_t>(kt.interval)];
    REQUIRE(kt.begin >= in.begin);
    REQUIRE(kt.begin < in.end);
    CHECK((kt.begin - in.begin) % tile == 0);
    const std::int64_t end = std::min<std::int64_t>(in.end, kt.begin + tile);
    seen[static_cast<std::size_t>(kt.interval)] += end - kt.begin;
    if (k > 0) CHECK(t.key_steps[k] <= t.key_steps[k - 1]);
    std::int64_t steps = 0;
    for (int c = 0; c < in.cover_count; ++c) {
      const auto cv = bp.covers[static_cast<std::size_t>(in.cover_begin + c)];
      const block_group& g = groups[static_cast<std::size_t>(cv.group)];
      const kv_block& kb = g.kv[cv.segment];
      std::int64_t lo = -1, hi = -1; // first and last row that sees a column of the tile
      for (std::int64_t i = 0; i < g.q_count; ++i)
        for (std::int64_t j = kt.begin; j < end; ++j)
          if (kb.mask.sees(i, j - kb.kv_begin)) {
            if (lo < 0) lo = i;
            hi = i;
          }
      if (lo >= 0) steps += (hi - lo + 64) / 64;
    }
    CHECK(t.key_steps[k] == steps);
  }
  for (std::size_t i = 0; i < bp.intervals.size(); ++i)
    CHECK(seen[i] == bp.intervals[i].end - bp.intervals[i].begin);
  std::vector<std::int64_t> rows(groups.size(), 0);
  for (std::size_t k = 0; k < t.row_tiles.size(); ++k) {
    const auto rt = t.row_tiles[k];
    const block_group& g = groups[static_cast<std::size_t>(rt.group)];
    REQUIRE(rt.row_begin < g.q_count);
    CHECK(rt.row_begin % tile == 0);
    const std::int64_t end = std::min<std::int64_t>(g.q_count, rt.row_begin + tile);
    rows[static_cast<std::size_t>(rt.group)] += end - rt.row_begin;
    if (k > 0) CHECK(t.row_steps[k] <= t.row_steps[k - 1]);
    std::int64_t steps = 0;
    for (int s = 0; s < g.count; ++s) {
      std::int64_t lo = -1, hi = -1; // first and last column a row of the tile sees
      for (std::int64_t i = rt.row_begin; i < end; ++i)
        for (std::int64_t j = 0; j < g.kv[s].kv_count; ++j)
          if (g.kv[s].mask.sees(i, j)) {
            if (lo < 0 || j < lo) lo = j;
            hi = std::max(hi, j);
          }
      if (lo >= 0) steps += hi / 64 - lo / 64 + 1;
    }
    CHECK(t.row_steps[k] == steps);
  }
  for (std::size_t gi = 0; gi < groups.size(); ++gi)
    CHECK(rows[gi] == (groups[gi].count > 0 ? groups[gi].q_count : 0));
}

// The device backward's work lists (planned on the host): for every rank and step of every
// layout, each key column that a group sees lies in exactly one interval, whose covers are exactly
// the (group, segment) pairs holding it; intervals are sorted, disjoint and count the columns;
// every query row of every group is listed once.
template <class P>
void check_backward_plans(mask_kind m) {
  std::mt19937_64 rng(test::fresh_seed());
  for (int ranks : {1, 2, 3, 4, 8}) {
    const auto cu = test::random_cu_seqlens(4, 1, 97, rng);
    const partition_plan<P> plan(cu, ranks);
    for (int r = 0; r < ranks; ++r)
      for (int src = 0; src < ranks; ++src) {
        CAPTURE(ranks);
        CAPTURE(r);
        CAPTURE(src);
        const auto groups = group_blocks(plan.blocks(r, src, position_window::of(m)));
        const backward_plan bp = plan_backward(groups);
        std::int64_t columns = 0, last_end = -1;
        for (const auto& in : bp.intervals) {
          CHECK(in.begin >= last_end);
          CHECK(in.end > in.begin);
          CHECK(in.first_item == columns);
          CHECK(in.cover_count > 0);
          columns += in.end - in.begin;
          last_end = in.end;
          for (int c = 0; c < in.cover_count; ++c) {
            const auto cv = bp.covers[static_cast<std::size_t>(in.cover_begin + c)];
            const kv_block& kb = groups[static_cast<std::size_t>(cv.group)].kv[cv.segment];
            CHECK(kb.kv_begin <= in.begin);
            CHECK(in.end <= kb.kv_begin + kb.kv_count);
            if (c > 0) { // in (group, segment) order: the kernels add in this order
              const auto pv = bp.covers[static_cast<std::size_t>(in.cover_begin + c - 1)];
              CHECK((pv.group < cv.group || (pv.group == cv.group && pv.segment < cv.segment)));
            }
          }
        }
        CHECK(columns == bp.key_items);
        for (std::size_t gi = 0; gi < groups.size(); ++gi)
          for (int b = 0; b < groups[gi].count; ++b) {
            const kv_block& kb = groups[gi].kv[b];
            if (groups[gi].q_count == 0) continue;
            for (std::int64_t j = kb.kv_begin; j < kb.kv_begin + kb.kv_count; ++j) {
              int found = 0;
              for (const auto& in : bp.intervals)
                if (in.begin <= j && j < in.end)
                  for (int c = 0; c < in.cover_count; ++c) {
                    const auto cv = bp.covers[static_cast<std::size_t>(in.cover_begin + c)];
                    found += cv.group == static_cast<std::int32_t>(gi) && cv.segment == b;
                  }
              REQUIRE(found == 1);
            }
          }
        std::int64_t rows = 0;
        for (const block_group& g : groups)
          rows += g.q_count;
        CHECK(static_cast<std::int64_t>(bp.rows.size()) == rows);
        for (int tile : {64, 128})
          check_backward_tiles(groups, bp, tile);
      }
  }
}

TEST_CASE_TEMPLATE("the device backward's work lists cover every seen key once", P, contiguous,
                   round_robin, zigzag) {
  check_backward_plans<P>(mask_kind::causal);
  check_backward_plans<P>(mask_kind::full);
}

TEST_CASE(
    "the wgmma backward's 1- and 2-warpgroup variants are refused outside experiment builds") {
#if defined(RINGATTN_EXPERIMENTS)
  MESSAGE("built with RINGATTN_EXPERIMENTS: the variants exist");
#else
  block_group g{0, 16, 1, {}};
  g.kv[0] = {0, 16, band{}};
  const std::vector<block_group> groups{g};
  for (int w : {1, 2, 4})
    CHECK_THROWS_WITH_AS(
        device_backward_schedule(groups, 16, 16, backward_options{backward_path::wgmma, w}),
        ("ringattn: the wgmma block backward takes 3 warpgroups a thread block (got " +
         std::to_string(w) + "; 1 and 2 are tuning experiments, built with RINGATTN_EXPERIMENTS)")
            .c_str(),
        invalid_argument);
#endif
}
