// Block groups as library pieces (block/device/pieces.cuh): for every partitioner, mask (windows
// included), rank count and packed batch, each step's pieces hold every visible (query, key) pair
// of its groups exactly once, no piece row sees no key, and the row reductions name every packed
// row once, in order.
#include "../support/common.hpp"

#include <ringattn/block/device/block.cuh>
#include <ringattn/block/device/pieces.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>

#include <doctest/doctest.h>

#include <map>
#include <random>
#include <utility>

using namespace ringattn;

namespace {
// Visible pairs of a step's groups, counted: (query row, key row) -> times.
using pairs = std::map<std::pair<std::int64_t, std::int64_t>, int>;

pairs of_groups(const std::vector<block_group>& groups) {
  pairs p;
  for (const block_group& g : groups)
    for (int s = 0; s < g.count; ++s)
      for (std::int64_t i = 0; i < g.q_count; ++i)
        for (std::int64_t j = 0; j < g.kv[s].kv_count; ++j)
          if (g.kv[s].mask.sees(i, j)) ++p[{g.q_begin + i, g.kv[s].kv_begin + j}];
  return p;
}

pairs of_pieces(const std::vector<attention_piece>& pieces) {
  pairs p;
  for (const attention_piece& x : pieces)
    for (std::int64_t i = 0; i < x.q_count; ++i) {
      std::int64_t seen = 0;
      for (std::int64_t j = 0; j < x.kv_count; ++j)
        if (x.sees(i, j)) ++p[{x.q_begin + i, x.kv_begin + j}], ++seen;
      CHECK(seen > 0); // a finite lse for every row of a piece
    }
  return p;
}
} // namespace

TEST_CASE_TEMPLATE("pieces hold every visible pair of a step exactly once", P, contiguous,
                   round_robin, zigzag) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 6; ++trial)
    for (int ranks : {1, 2, 3, 4, 8}) {
      const auto cu = test::random_cu_seqlens(1 + trial % 3, 1, 90, rng);
      partition_plan<P> plan(cu, ranks);
      const std::int64_t left = static_cast<std::int64_t>(rng() % 40),
                         right = static_cast<std::int64_t>(rng() % 20);
      for (mask_kind m : {mask_kind::full, mask_kind::causal, mask_kind::sliding_window,
                          mask_kind::causal_window})
        for (int r = 0; r < ranks; ++r)
          for (int src = 0; src < ranks; ++src) {
            const int mask = static_cast<int>(m);
            CAPTURE(ranks);
            CAPTURE(r);
            CAPTURE(src);
            CAPTURE(mask);
            CAPTURE(left);
            CAPTURE(right);
            const auto groups =
                group_blocks(plan.blocks(r, src, position_window::of(m, left, right)));
            const auto pieces = pieces_of(groups);
            const pairs want = of_groups(groups), got = of_pieces(pieces);
            CHECK(got == want);
            for (const auto& [at, times] : got)
              CHECK(times == 1);
            std::int64_t rows = 0;
            for (const piece_call& c : calls_of(pieces)) {
              rows += c.q_rows;
              for (bool keys : {false, true}) {
                const row_reduction red = reduction_of(c, keys);
                REQUIRE(red.first.size() == red.dest.size() + 1);
                CHECK(red.source.size() == static_cast<std::size_t>(keys ? c.kv_rows : c.q_rows));
                for (std::size_t e = 1; e < red.dest.size(); ++e)
                  CHECK(red.dest[e] > red.dest[e - 1]);
              }
              CHECK(packed_query_rows(c).size() == static_cast<std::size_t>(c.q_rows));
              const row_reduction in_place = in_place_reduction_of(c); // throws on a row twice
              CHECK(in_place.dest.size() == static_cast<std::size_t>(c.q_rows));
              CHECK(in_place.source == in_place.dest);
            }
            CHECK(rows == [&] {
              std::int64_t n = 0;
              for (const attention_piece& x : pieces)
                n += x.q_count;
              return n;
            }());
          }
    }
}

TEST_CASE("pieces: zigzag's own block is one causal piece") {
  // Rank 0 of 2 against itself, one sequence of 8: chunk 0 sees itself causally, chunk 3 sees
  // chunk 0 fully and itself causally; locally that is one causal 4 x 4 piece.
  partition_plan<zigzag> plan(std::vector<std::int32_t>{0, 8}, 2);
  const auto groups = group_blocks(plan.blocks(0, 0, position_window::of(mask_kind::causal)));
  const auto pieces = pieces_of(groups);
  REQUIRE(pieces.size() == 1);
  CHECK(pieces[0] == attention_piece{0, 4, 0, 4, piece_mask::causal_bottom_right});
}

TEST_CASE("pieces: a chunk that sees an earlier chunk whole and its own causally is one piece") {
  // Rank 0 of 2 against rank 1's block (chunks 1 and 2), one sequence of 8: chunk 3 sees chunk 1
  // and chunk 2 whole; chunk 0 sees neither. Rank 1 against rank 0's block: chunk 1 sees chunk
  // 0, chunk 2 sees chunk 0 (both whole).
  partition_plan<zigzag> plan(std::vector<std::int32_t>{0, 8}, 2);
  const auto a = pieces_of(group_blocks(plan.blocks(0, 1, position_window::of(mask_kind::causal))));
  REQUIRE(a.size() == 1);
  CHECK(a[0] == attention_piece{2, 2, 0, 4, piece_mask::full});
  // Rows of one sequence that continue a causal diagonal (bottom-right, 2 keys ahead) join too.
  const std::vector<attention_piece> diagonal{{0, 2, 0, 4, piece_mask::causal_bottom_right},
                                              {2, 3, 0, 7, piece_mask::causal_bottom_right}};
  std::vector<block_group> groups(2);
  for (int i = 0; i < 2; ++i) {
    groups[i] = {diagonal[i].q_begin, diagonal[i].q_count, 1, {}};
    groups[i].kv[0] = {0, diagonal[i].kv_count,
                       band{-unbounded, diagonal[i].kv_count - diagonal[i].q_count}};
  }
  const auto b = pieces_of(groups);
  REQUIRE(b.size() == 1);
  CHECK(b[0] == attention_piece{0, 5, 0, 7, piece_mask::causal_bottom_right});
}

TEST_CASE("pieces: zigzag's two chunks that both see an earlier chunk whole are one full piece") {
  // Rank 1 of 2 (chunks 1 and 2 of 4, c = 2) against rank 0's block (chunks 0 and 3): both
  // query chunks see chunk 0 whole and chunk 3 not at all.
  partition_plan<zigzag> plan(std::vector<std::int32_t>{0, 8}, 2);
  const auto groups = group_blocks(plan.blocks(1, 0, position_window::of(mask_kind::causal)));
  REQUIRE(groups.size() == 2);
  const auto pieces = pieces_of(groups);
  REQUIRE(pieces.size() == 1);
  CHECK(pieces[0] == attention_piece{0, 4, 0, 2, piece_mask::full});
}

TEST_CASE("calls: pieces that compute one query row go to different calls") {
  const std::vector<attention_piece> pieces{{0, 4, 0, 4, piece_mask::full},
                                            {2, 4, 8, 3, piece_mask::full},
                                            {6, 2, 0, 2, piece_mask::full},
                                            {0, 3, 4, 3, piece_mask::causal_bottom_right}};
  const auto calls = calls_of(pieces);
  REQUIRE(calls.size() == 3);
  CHECK(calls[0].pieces == std::vector<attention_piece>{pieces[0], pieces[2]});
  CHECK(calls[0].q_rows == 6);
  CHECK(calls[1].pieces == std::vector<attention_piece>{pieces[1]});
  CHECK(calls[2].mask == piece_mask::causal_bottom_right);
  const row_reduction r = in_place_reduction_of(calls[0]);
  CHECK(r.dest == std::vector<std::int32_t>{0, 1, 2, 3, 6, 7});
  CHECK(r.first == std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 6});
  piece_call twice;
  twice.pieces = {pieces[0], pieces[1]};
  CHECK_THROWS_AS((void)in_place_reduction_of(twice), invalid_argument);
}

TEST_CASE("pieces: a band that binds below is one band piece of the rows that see a key") {
  // 4 rows against their own 4 keys, a window of one key behind: one band piece as it is.
  block_group g{0, 4, 1, {}};
  g.kv[0] = {0, 4, band{-1, 0}};
  const auto own = pieces_of(std::vector<block_group>{g});
  REQUIRE(own.size() == 1);
  CHECK(own[0] == attention_piece{0, 4, 0, 4, piece_mask::band, -1, 0});
  // 3 rows against the 5 keys before them, keys j >= i + 3: rows 0 and 1 against keys 3 and 4,
  // row 0 seeing both and row 1 the last (lo 0 on the piece, no upper bound).
  block_group before{0, 3, 1, {}};
  before.kv[0] = {0, 5, band{3, unbounded}};
  const auto corner = pieces_of(std::vector<block_group>{before});
  REQUIRE(corner.size() == 1);
  CHECK(corner[0] == attention_piece{0, 2, 3, 2, piece_mask::band, 0, unbounded});
  // Band pieces with different bands go to different calls, even on other rows.
  const std::vector<attention_piece> both{own[0], {4, 2, 3, 2, piece_mask::band, 0, unbounded}};
  const auto calls = calls_of(both);
  REQUIRE(calls.size() == 2);
  CHECK((calls[0].lo == -1 && calls[0].hi == 0));
  CHECK((calls[1].lo == 0 && calls[1].hi == unbounded));
}
