// Packed batches with empty and one-token sequences on the device: every partitioner x {full,
// causal, sliding window, causal window} x P in 1..8 virtual ranks (the all-to-all at the P that
// divide its 8 query heads) x the ring, all-gather and all-to-all schedules, forward and backward,
// compared with the float64 oracle element by element (strict_ring.cuh): no inf, no unwritten
// row, out = 0 and lse = -inf exactly where a row sees no key. Ranks that hold no token, and rings
// whose peers hold nothing a rank sees (one step), are among the cases. The cuDNN model's share
// is in test_cudnn.cu.
#include "../support/strict_ring.cuh"

#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>

#include <doctest/doctest.h>

using namespace ringattn;

namespace {
template <class P, class Schedule>
void check_masks(attention_arguments a, std::initializer_list<int> ranks) {
  test::check_sparse_batches<P, full, Schedule>(a, ranks);
  test::check_sparse_batches<P, causal, Schedule>(a, ranks);
  a.window_left = 2, a.window_right = 1;
  test::check_sparse_batches<P, sliding_window, Schedule>(a, ranks);
  a.window_left = 3, a.window_right = 0;
  test::check_sparse_batches<P, causal_window, Schedule>(a, ranks);
}
} // namespace

TEST_CASE_TEMPLATE("device ring: packed batches with empty and one-token sequences", P, contiguous,
                   round_robin, zigzag) {
  check_masks<P, ring_pass>({4, 2, 64, 0.0f}, {1, 2, 3, 4, 5, 6, 7, 8});
}

TEST_CASE_TEMPLATE("device all-gather: packed batches with empty and one-token sequences", P,
                   contiguous, round_robin, zigzag) {
  check_masks<P, all_gather_kv>({4, 2, 64, 0.0f}, {1, 2, 3, 4, 5, 6, 7, 8});
}

TEST_CASE_TEMPLATE("device all-to-all: packed batches with empty and one-token sequences", P,
                   contiguous, round_robin, zigzag) {
  check_masks<P, all_to_all_heads>({8, 2, 64, 0.0f}, {1, 2, 4, 8});
}
