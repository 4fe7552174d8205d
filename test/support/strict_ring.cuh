#pragma once
// Device rings checked element by element (strict_check.hpp) with the bf16 tolerances of
// check_device_ring / check_device_backward: 8e-3 relative L2 on out, 2e-3 absolute on lse, 1e-2
// on each gradient; sparse batches and planted NaN / inf.
#include "device_ring.cuh"
#include "strict_check.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <initializer_list>
#include <random>
#include <vector>

namespace ringattn::test {

inline constexpr strict_bounds device_bf16_bounds{8e-3, 2e-3, 1e-2};

//! `member` of every run (the outputs of forward runs, the gradients of backward runs).
template <class Run, class Member>
auto members_of(const std::vector<Run>& runs, Member Run::*member) {
  std::vector<Member> all;
  for (const Run& r : runs)
    all.push_back(r.*member);
  return all;
}
template <class P, class T>
auto outputs_of(const std::vector<device_rank_run<P, T>>& runs) {
  return members_of(runs, &device_rank_run<P, T>::output);
}
template <class P, class T>
auto grads_of(const std::vector<device_backward_run<P, T>>& runs) {
  return members_of(runs, &device_backward_run<P, T>::grads);
}

//! Every batch of `sparse_batches` through `Kernel` under `Schedule` at every P in `ranks_list`,
//! forward and backward, against the oracle element by element (`check_strict`), with the norms
//! of check_device_ring, and bytes and repeatability in both directions.
template <class P, class Kernel, class Schedule = ring_pass>
void check_sparse_batches(attention_arguments a, std::initializer_list<int> ranks_list) {
  using T = __nv_bfloat16;
  const auto seed = fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 draw(seed);
  for (const auto& cu : sparse_batches(draw)) {
    CAPTURE(cu.size());
    CAPTURE(cu.back());
    for (int ranks : ranks_list) {
      CAPTURE(ranks);
      std::mt19937_64 rng(seed + static_cast<std::uint64_t>(ranks));
      sharded_backward_case<P, T> c(cu, ranks, a, Kernel::mask, rng);
      // check_device_ring's norms and bytes; the gradients only element by element (one-token
      // sequences have dq = dk = 0, where a relative error means nothing).
      const auto fwd = device_ring_in_process<Kernel, Schedule>(c, 1, /*repeat=*/true);
      check_device_ring(c, fwd);
      const auto bwd = device_backward_in_process<Kernel, Schedule>(c, 1, /*repeat=*/true);
      for (const auto& run : bwd) {
        CHECK(run.repeatable);
        CHECK(run.sent == run.expected);
      }
      check_strict(strict_forward(c, outputs_of(fwd)), strict_backward(c, grads_of(bwd)), false,
                   false, device_bf16_bounds);
    }
  }
}

//! One element of q, k, v or dout set to NaN or +inf (`for_each_planted`), through `Kernel` under
//! `Schedule` at every P in `ranks_list`, forward and backward: element by element against the
//! oracle (`check_strict`), and the max logit NaN on every rank for exactly the heads whose logits
//! the planted element reached.
template <class P, class Kernel, class Schedule = ring_pass>
void check_planted(attention_arguments a, std::initializer_list<int> ranks_list) {
  using T = __nv_bfloat16;
  for_each_planted<P, T>(
      a, Kernel::mask, ranks_list, 60,
      [](const sharded_backward_case<P, T>& c, std::int64_t t, planted_in where) {
        const auto fwd = device_ring_in_process<Kernel, Schedule>(c, 1, false);
        const auto bwd = device_backward_in_process<Kernel, Schedule>(c, 1, false);
        // The tensor cores may spread the NaN within the planted token's sequence (0 x NaN in a
        // shared tile, strict_check.hpp); never beyond it.
        const int seq = sequence_of(c, t);
        const auto want = c.oracle().max_logit;
        for (const auto& run : fwd)
          CHECK(c.max_logit_error(run.max_logit, want) < 2e-3);
        check_strict(strict_forward(c, outputs_of(fwd), seq),
                     strict_backward(c, grads_of(bwd), seq), where != planted_in::dout, true,
                     device_bf16_bounds);
      });
}

} // namespace ringattn::test
