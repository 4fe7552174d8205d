// Planning scales as n log n in the number of packed sequences: a rank's ring schedule (its
// plan, the blocks and groups of every step) and the backward's work lists for 65,536 sequences
// over 8 ranks, within a bound generous enough for sanitizer builds (the quadratic grouping took
// minutes here).
#include <ringattn/block/device/backward.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring/schedule.cuh>

#include <doctest/doctest.h>

#include <chrono>
#include <vector>

using namespace ringattn;

TEST_CASE("planning 65,536 packed sequences over 8 ranks is near-linear") {
  std::vector<std::int32_t> cu{0};
  for (int i = 0; i < 65536; ++i)
    cu.push_back(cu.back() + 17 + (i * 7919) % 200); // lengths 17..216, uneven
  const auto start = std::chrono::steady_clock::now();
  const partition_plan<zigzag> plan(cu, 8);
  const ring_schedule schedule(plan, 3, position_window::of(mask_kind::causal));
  std::int64_t rows = 0, covers = 0;
  for (const ring_step& s : schedule.steps()) {
    rows += s.rows;
    covers += static_cast<std::int64_t>(plan_backward(s.groups).covers.size());
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  MESSAGE("65,536 sequences, P = 8, one rank's schedule and backward lists: ", seconds, " s");
  CHECK(rows > 0);
  CHECK(covers > 0);
  CHECK(seconds < 20.0);
}
