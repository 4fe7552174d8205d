// The all-to-all schedule on the device: P virtual ranks on one GPU (threads of an in-process
// group, each with its own stream), every partitioner x {full, causal, sliding and causal
// windows} x P in {1, 2, 4, 8} x GQA 1, 4, 8 (P above the kv heads included: replicated kv heads)
// x packed odd lengths, forward and backward against the float64 oracle; bytes per rank against
// the formula (all_to_all_bytes.hpp); bitwise repeatability. The hybrid (all-to-all in groups,
// K/V gathered across them) at 2 x 2, 2 x 4 and 4 x 2.
#include "../support/device_ring.cuh"

#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>

#include <doctest/doctest.h>

#include <cstdlib>
#include <initializer_list>
#include <string>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;

template <class P, class Mask, class Schedule = all_to_all_heads>
void check_all_to_all(attention_arguments a, std::initializer_list<int> ranks_list = {1, 2, 4, 8}) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  std::mt19937_64 draw(seed);
  const auto cu = test::random_cu_seqlens(3, 1, small ? 120 : 500, draw); // the same at every P
  for (int ranks : ranks_list) {
    CAPTURE(ranks);
    std::mt19937_64 rng(seed + 1);
    test::sharded_backward_case<P, T> c(cu, ranks, a, Mask::mask, rng);
    test::check_device_ring(
        c, test::device_ring_in_process<Mask, Schedule>(c, 1, /*repeat=*/ranks == 4));
    const auto err = test::check_device_backward(
        c, test::device_backward_in_process<Mask, Schedule>(c, 1, /*repeat=*/ranks == 4));
    MESSAGE(std::string(Schedule::name), " ", std::string(Mask::name), ", ", a.q_heads, "/",
            a.kv_heads, " heads, ", ranks, " ranks: dq ", err[0], ", dk ", err[1], ", dv ", err[2]);
  }
}
} // namespace

TEST_CASE_TEMPLATE("device all-to-all, virtual ranks on one GPU, equals the oracle", P, contiguous,
                   round_robin, zigzag) {
  for (int group : {1, 4, 8}) {
    CAPTURE(group);
    attention_arguments a{8, 8 / group, 128, 0.0f};
    check_all_to_all<P, full>(a);
    check_all_to_all<P, causal>(a);
    a.window_left = 40, a.window_right = 16;
    check_all_to_all<P, sliding_window>(a);
    a.window_left = 24, a.window_right = 0;
    check_all_to_all<P, causal_window>(a);
  }
}

TEST_CASE_TEMPLATE("device hybrid (all-to-all in groups, all-gather across), virtual ranks: "
                   "2 x 2, 2 x 4, 4 x 2",
                   P, contiguous, round_robin, zigzag) {
  for (int group : {1, 4, 8}) {
    CAPTURE(group);
    const attention_arguments a{8, 8 / group, 128, 0.0f};
    check_all_to_all<P, causal, all_to_all_heads_x_all_gather<2>>(a, {4, 8});
    check_all_to_all<P, full, all_to_all_heads_x_all_gather<4>>(a, {8});
  }
}

TEST_CASE("device all-to-all with head_dim 64 and with head_dim 192 / head_dim_v 128") {
  check_all_to_all<zigzag, causal>({8, 2, 64, 0.0f});
  if (forward_path_available(forward_path::wgmma, 192, 128))
    check_all_to_all<zigzag, causal>(
        {.q_heads = 8, .kv_heads = 2, .head_dim = 192, .head_dim_v = 128});
}
