// NaN and inf in an input reach what they reach on the device, as in the float64 oracle: one
// element of q, k, v or dout set to NaN or +inf, every schedule (ring, all-gather, all-to-all) x
// {full, causal} x P in {1, 3, 4} virtual ranks (the all-to-all at 1 and 4), forward and backward,
// compared element by element (strict_check.hpp): every output and gradient the oracle makes
// non-finite is non-finite, every other one outside the planted token's sequence finite and
// within the bf16 tolerances (inside it, the tensor cores' 0 x NaN may spread a NaN to a masked
// neighbour in the same tile); a row's NaN is never taken for "saw no key". The max logit is NaN
// on every rank for exactly the heads whose logits the planted element reached.
#include "../support/strict_ring.cuh"

#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/zigzag.cuh>

#include <doctest/doctest.h>

using namespace ringattn;

namespace {
template <class P, class Kernel>
void check_schedules(attention_arguments a) {
  test::check_planted<P, Kernel, ring_pass>(a, {1, 3, 4});
  test::check_planted<P, Kernel, all_gather_kv>(a, {3, 4});
  test::check_planted<P, Kernel, all_to_all_heads>(a, {4});
}
} // namespace

TEST_CASE_TEMPLATE("device: NaN and inf in q, k, v or dout reach what the oracle's reach", P,
                   contiguous, zigzag) {
  check_schedules<P, causal>({4, 2, 64, 0.0f});
  check_schedules<P, full>({4, 2, 128, 0.0f});
}
