// The device ring: P virtual ranks on one GPU (threads of an in-process group, each with its own
// stream), every partitioner x {full, causal, windows} x P in {1, 2, 3, 4, 8} against the float64
// oracle; bytes per step; bitwise repeatability. The same for the all-gather schedule, with GQA 1,
// 4 and 8. (Ranks on several GPUs: test/multi_gpu.)
#include "../support/device_ring.cuh"
#include "../support/recording_comm.hpp"

#include <ringattn/partition/balanced.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>

#include <doctest/doctest.h>

#include <cstdlib>
#include <initializer_list>
#include <string>
#include <type_traits>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
} // namespace

TEST_CASE_TEMPLATE("device ring, virtual ranks on one GPU, equals the oracle", P, contiguous,
                   round_robin, zigzag, balanced) {
  test::check_ring_matrix<P, full>({8, 2, 128, 0.0f}, false);
  test::check_ring_matrix<P, causal>({8, 2, 128, 0.0f}, false);
}

template <class P, class Mask, class E = T, class Schedule = ring_pass>
void check_backward(attention_arguments a = {8, 2, 128, 0.0f}) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  std::mt19937_64 draw(seed);
  const auto cu = test::random_cu_seqlens(3, 1, small ? 120 : 400, draw); // the same at every P
  std::array<double, 3> at_p1{};
  for (int ranks : {1, 2, 3, 4, 8}) {
    CAPTURE(ranks);
    std::mt19937_64 rng(seed + 1);
    test::sharded_backward_case<P, E> c(cu, ranks, a, Mask::mask, rng);
    const auto err = test::check_device_backward(
        c, test::device_backward_in_process<Mask, Schedule>(c, /*devices=*/1,
                                                            /*repeat=*/ranks == 3));
    MESSAGE(std::string(Schedule::name), (std::is_same_v<E, __half> ? " fp16, " : " bf16, "),
            a.q_heads, "/", a.kv_heads, " heads, ", ranks, " ranks: dq ", err[0], ", dk ", err[1],
            ", dv ", err[2]);
    for (std::size_t i = 0; i < 3; ++i) {
      if (ranks == 1) at_p1[i] = err[i];
      if (ranks == 8) CHECK(err[i] <= 1.2 * at_p1[i]);
    }
  }
}

TEST_CASE_TEMPLATE("device ring backward, virtual ranks on one GPU, equals the oracle", P,
                   contiguous, round_robin, zigzag, balanced) {
  check_backward<P, full>();
  check_backward<P, causal>();
  check_backward<P, full, __half>();
  check_backward<P, causal, __half>();
}

TEST_CASE_TEMPLATE("device all-gather, virtual ranks on one GPU, equals the oracle", P, contiguous,
                   round_robin, zigzag) {
  for (int group : {1, 4, 8}) {
    CAPTURE(group);
    const attention_arguments a{8, 8 / group, 128, 0.0f};
    test::check_ring_matrix<P, full, all_gather_kv>(a, false);
    test::check_ring_matrix<P, causal, all_gather_kv>(a, false);
  }
}

TEST_CASE_TEMPLATE("device all-gather backward, virtual ranks on one GPU, equals the oracle", P,
                   contiguous, round_robin, zigzag) {
  for (int group : {1, 4, 8}) {
    CAPTURE(group);
    const attention_arguments a{8, 8 / group, 128, 0.0f};
    check_backward<P, full, T, all_gather_kv>(a);
    check_backward<P, causal, T, all_gather_kv>(a);
  }
}

TEST_CASE_TEMPLATE("device ring with windows, virtual ranks on one GPU, equals the oracle", P,
                   contiguous, round_robin, zigzag) {
  // A causal window shorter than a shard, one longer than every sequence, and a two-sided one.
  test::check_ring_matrix<P, causal_window>({8, 2, 128, 0.0f, 24, 0}, false);
  test::check_ring_matrix<P, causal_window>({8, 2, 128, 0.0f, 5000, 0}, false);
  test::check_ring_matrix<P, sliding_window>({8, 2, 128, 0.0f, 40, 16}, false);
  test::check_ring_matrix<P, sliding_window, all_gather_kv>({8, 2, 128, 0.0f, 40, 16}, false);
  check_backward<P, causal_window>({8, 2, 128, 0.0f, 24, 0});
  check_backward<P, sliding_window>({8, 2, 128, 0.0f, 40, 16});
  check_backward<P, sliding_window, T, all_gather_kv>({8, 8, 128, 0.0f, 7, 70});
}

TEST_CASE_TEMPLATE("device ring with head_dim 192 and head_dim_v 128 equals the oracle", P,
                   contiguous, round_robin, zigzag) {
  const attention_arguments gqa{.q_heads = 8, .kv_heads = 2, .head_dim = 192, .head_dim_v = 128};
  const attention_arguments mha{.q_heads = 4, .kv_heads = 4, .head_dim = 192, .head_dim_v = 128};
  if (!forward_path_available(forward_path::wgmma, 192, 128)) {
    // No sm_90a image for this device: the plan refuses the widths with a sentence.
    std::mt19937_64 rng(1);
    test::sharded_case<P, T> c({0, 64}, 1, gqa, mask_kind::causal, rng);
    in_process_group group(1);
    const auto errors = test::on_ranks(group, [&](int, in_process_communicator& comm) {
      ring_attention<P, in_process_communicator, causal> attn(comm, gqa, c.plan.cu_seqlens());
      attn.prepare_device();
    });
    CHECK(test::message(errors[0]).find("runs only on the wgmma block kernel") !=
          std::string::npos);
    MESSAGE("no sm_90a device: 192/128 refused at plan time as it should be");
    return;
  }
  for (const attention_arguments& a : {gqa, mha}) {
    CAPTURE(a.q_heads);
    CAPTURE(a.kv_heads);
    test::check_ring_matrix<P, causal>(a, false);
    test::check_ring_matrix<P, full>(a, false);
    check_backward<P, causal>(a);
    check_backward<P, full>(a);
  }
  test::check_ring_matrix<P, causal, all_gather_kv>(gqa, false);
  check_backward<P, causal, T, all_gather_kv>(gqa);
  check_backward<P, causal, __half>(gqa);
}

// The device path runs the schedules' programs (ring/program.cuh) as the host path does: what
// each rank sent on the device, forward then backward, is what it sent on the host path for the
// same call, and, for a schedule that names a program (the ring, the all-gather), its programs'
// messages in their order. The all-to-all and its hybrid run one program over both engines
// (ring/all_to_all_program.cuh).
template <class Schedule, class P, class Mask>
void check_device_programs(attention_arguments a, std::initializer_list<int> rank_counts) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const auto cu = test::random_cu_seqlens(3, 1, 61, rng);
  std::size_t messages = 0; // over every run: the programs are not empty
  for (int ranks : rank_counts) {
    CAPTURE(ranks);
    test::sharded_backward_case<P, T> c(cu, ranks, a, Mask::mask, rng);
    using recorder = test::recording_communicator<in_process_communicator>;
    struct seen {
      std::vector<test::sent> device, host, program;
    };
    const auto runs =
        test::on_device_ranks<seen>(ranks, 1, [&](int r, in_process_communicator& comm) {
          recorder rec(comm);
          test::device_backward_rank<Mask, Schedule>(c, r, rec, /*repeat=*/false);
          seen s{rec.log, {}, {}};
          rec.log.clear();
          ring_attention<P, recorder, Mask, Schedule> attn(rec, c.args, c.plan.cu_seqlens());
          c.backward_rank(attn, r, c.forward_rank(attn, r));
          s.host = rec.log;
          if constexpr (requires { typename Schedule::program; }) {
            auto [forward, backward] = test::program_messages<Schedule, T>(attn.schedule(), c.args);
            s.program = std::move(forward);
            s.program.insert(s.program.end(), backward.begin(), backward.end());
          } else {
            s.program = s.host;
          }
          return s;
        });
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      const seen& s = runs[static_cast<std::size_t>(r)];
      CHECK(s.device == s.program);
      CHECK(s.host == s.program);
      messages += s.program.size();
    }
  }
  CHECK(messages > 0);
}

template <class Schedule, class P>
void check_device_programs_of(attention_arguments a,
                              std::initializer_list<int> rank_counts = {1, 2, 3, 4, 8}) {
  check_device_programs<Schedule, P, full>(a, rank_counts);
  check_device_programs<Schedule, P, causal>(a, rank_counts);
  a.window_left = 9;
  check_device_programs<Schedule, P, causal_window>(a, rank_counts);
}

TEST_CASE_TEMPLATE("device ring, all-gather, all-to-all and hybrid: what every rank sends is "
                   "what it sends on the host path, in the same order, and the ring's and the "
                   "all-gather's programs' messages (full, causal, causal window; P = 1, 2, 3, "
                   "4, 8)",
                   P, contiguous, round_robin, zigzag, balanced) {
  check_device_programs_of<ring_pass, P>({4, 2, 64, 0.0f});
  check_device_programs_of<all_gather_kv, P>({4, 2, 64, 0.0f});
  // 24 query heads and one kv head split over every P of the list.
  check_device_programs_of<all_to_all_heads, P>({24, 1, 64, 0.0f});
  check_device_programs_of<all_to_all_heads_x_all_gather<2>, P>({24, 1, 64, 0.0f}, {2, 4, 8});
}
