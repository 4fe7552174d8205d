// Sliding and causal windows on the host ring and the all-gather schedule: every partitioner x
// P x window (shorter than a shard, longer than the whole batch, two-sided, one side unbounded,
// the diagonal alone) against the float64 oracle, forward and backward; the steps the ring takes,
// the blocks it computes, the scores they hold and the bytes it sends against a prediction made
// by brute force over token pairs; plan-time errors for windows that do not fit the mask.
#include "../support/ranks.hpp"
#include "../support/ring_bytes.hpp"
#include "../support/sharded_backward_case.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/partition/balanced.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
using test::message;
using test::on_ranks;

// The host twin under Mask, counting the blocks it computes (one per step with work) and the
// score elements they hold.
template <class Mask>
struct counting_kernel : host_reference<Mask> {
  static inline std::atomic<std::int64_t> calls{0}, scores{0};
  static std::int64_t visible(std::span<const block_group> groups) {
    std::int64_t n = 0;
    for (const block_group& g : groups)
      for (int b = 0; b < g.count; ++b)
        n += g.kv[b].mask.visible(g.q_count, g.kv[b].kv_count);
    return n;
  }
  template <element U>
  static void host_forward(const block_forward_args<U>& a, std::span<const block_group> groups) {
    ++calls;
    scores += visible(groups);
    host_reference<Mask>::host_forward(a, groups);
  }
  template <element U>
  static void host_backward(const block_backward_args<U>& a, std::span<const block_group> groups) {
    ++calls;
    scores += visible(groups);
    host_reference<Mask>::host_backward(a, groups);
  }
};

struct window_case {
  mask_kind mask;
  std::int64_t left, right;
};

// What the ring must do, counted over token pairs: the steps (one past the largest ring distance
// (rank(q) - rank(k)) mod P of a visible pair), the (rank, step) blocks with a visible pair, and
// the visible pairs.
struct prediction {
  int steps = 1;
  std::int64_t blocks = 0, scores = 0;
};
template <class P>
prediction predict(const partition_plan<P>& plan, const position_window& w) {
  const int p = plan.ranks();
  std::vector<char> seen(static_cast<std::size_t>(p * p), 0); // [q rank][distance]
  prediction out;
  const auto cu = plan.cu_seqlens();
  for (std::size_t s = 0; s + 1 < cu.size(); ++s)
    for (std::int64_t i = cu[s]; i < cu[s + 1]; ++i)
      for (std::int64_t j = cu[s]; j < cu[s + 1]; ++j) {
        if (!w.sees(i - cu[s], j - cu[s])) continue;
        ++out.scores;
        const int rq = plan.locate(i).rank, rk = plan.locate(j).rank;
        const int t = ((rq - rk) % p + p) % p;
        seen[static_cast<std::size_t>(rq * p + t)] = 1;
        out.steps = std::max(out.steps, t + 1);
      }
  for (char c : seen)
    out.blocks += c;
  return out;
}

struct run_result {
  test::ring_errors errors;
  std::uint64_t bytes = 0, expected_bytes = 0;
  int steps = 0;
  bool steps_agree = true;
  std::int64_t forward_calls = 0, forward_scores = 0;
};

template <class P, class Mask, class Schedule>
run_result run(const test::sharded_backward_case<P, T>& c) {
  using kernel = counting_kernel<Mask>;
  const int ranks = c.plan.ranks();
  const auto ref = c.oracle();
  const auto ref_b = c.oracle_backward();
  using parts_t = typename test::sharded_case<P, T>::error_parts;
  using grad_parts_t = typename test::sharded_backward_case<P, T>::grad_parts;
  std::vector<parts_t> parts(static_cast<std::size_t>(ranks));
  std::vector<grad_parts_t> grad_parts(static_cast<std::size_t>(ranks));
  std::vector<std::uint64_t> sent(static_cast<std::size_t>(ranks), 0), want(sent);
  std::vector<int> steps(static_cast<std::size_t>(ranks), 0);
  kernel::calls = 0;
  kernel::scores = 0;
  std::atomic<std::int64_t> calls_after_forward{0}, scores_after_forward{0};
  std::atomic<int> forwards_done{0};
  in_process_group group(ranks);
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<P, in_process_communicator, kernel, Schedule> attn(comm, c.args,
                                                                      c.plan.cu_seqlens());
    const auto at = static_cast<std::size_t>(r);
    steps[at] = attn.schedule().step_count();
    const auto fwd = c.forward_rank(attn, r);
    sent[at] = comm.bytes_sent();
    // The forward's counts, read once every rank's forward is done (they meet in the backward's
    // agreement before any backward block runs).
    if (++forwards_done == ranks) {
      calls_after_forward = kernel::calls.load();
      scores_after_forward = kernel::scores.load();
    }
    const auto g = c.backward_rank(attn, r, fwd);
    parts[at] = c.rank_error(r, fwd, ref);
    grad_parts[at] = c.rank_grad_error(r, g, ref_b);
    // Forward: the ring forwards the blocks some later rank sees; the all-gather sends the own
    // block to every rank that sees some of it.
    if constexpr (std::is_same_v<Schedule, ring_pass>)
      want[at] += test::ring_forward_bytes<T>(attn, r, kernel::mask);
    else
      want[at] += test::all_gather_bytes<T>(attn, r, kernel::mask);
  });
  for (const auto& e : errors)
    REQUIRE(message(e) == "");
  run_result res;
  res.steps = steps[0];
  res.errors = test::total_errors(parts, grad_parts);
  for (int r = 0; r < ranks; ++r) {
    const auto at = static_cast<std::size_t>(r);
    res.steps_agree = res.steps_agree && steps[at] == res.steps;
    res.bytes += sent[at];
    res.expected_bytes += want[at];
  }
  res.forward_calls = calls_after_forward;
  res.forward_scores = scores_after_forward;
  // The backward computes the same blocks again.
  CHECK(kernel::calls.load() == 2 * res.forward_calls);
  CHECK(kernel::scores.load() == 2 * res.forward_scores);
  return res;
}

constexpr window_case windows[] = {
    {mask_kind::causal_window, 3, 0},     // shorter than a shard at every P
    {mask_kind::causal_window, 1000, 0},  // longer than the whole batch: causal
    {mask_kind::causal_window, 0, -1},    // the diagonal alone
    {mask_kind::sliding_window, 5, 2},    // both sides
    {mask_kind::sliding_window, -1, 4},   // unbounded behind
    {mask_kind::sliding_window, 17, 17},  // wider than a shard at P = 8
    {mask_kind::sliding_window, 1000, 0}, // longer than the batch, one-sided
};

template <class P, class Mask, class Schedule = ring_pass>
void check_windows(mask_kind kind) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  for (const window_case& w : windows) {
    if (w.mask != kind) continue;
    for (int group : {1, 4}) {
      std::mt19937_64 draw(seed + static_cast<std::uint64_t>(group));
      const auto cu = test::random_cu_seqlens(3, 1, 61, draw); // the same batch at every P
      test::error_growth growth;
      for (int ranks : {1, 2, 3, 4, 8}) {
        CAPTURE(w.left);
        CAPTURE(w.right);
        CAPTURE(group);
        CAPTURE(ranks);
        std::mt19937_64 rng(seed + 7);
        attention_arguments args{4, 4 / group, 64, 0.0f, w.left, w.right};
        test::sharded_backward_case<P, T> c(cu, ranks, args, kind, rng);
        const prediction want = predict(c.plan, args.window(kind));
        const run_result res = run<P, Mask, Schedule>(c);
        growth.check(ranks, res.errors);
        CHECK(res.steps_agree);
        CHECK(res.steps == want.steps);
        CHECK(res.forward_calls == want.blocks);
        CHECK(res.forward_scores == want.scores);
        CHECK(res.bytes == res.expected_bytes);
      }
    }
  }
}
} // namespace

TEST_CASE_TEMPLATE("host ring with windows equals the oracle, in the steps and blocks predicted", P,
                   contiguous, round_robin, zigzag, balanced) {
  check_windows<P, causal_window_mask>(mask_kind::causal_window);
  check_windows<P, sliding_window_mask>(mask_kind::sliding_window);
}

TEST_CASE_TEMPLATE("all-gather schedule with windows equals the oracle", P, contiguous, zigzag) {
  check_windows<P, causal_window_mask, all_gather_kv>(mask_kind::causal_window);
  check_windows<P, sliding_window_mask, all_gather_kv>(mask_kind::sliding_window);
}

TEST_CASE("a short window stops the ring early where the partitioner keeps neighbours close") {
  // 8 ranks, one sequence of 800 tokens (100 a rank): a causal window of 50 keys needs the own
  // block and the previous rank's under contiguous (2 steps), 51 steps of distance under
  // round-robin (every rank: 8 steps), and under zigzag the next rank's chunk too (8 steps).
  const std::vector<std::int32_t> cu{0, 800};
  const position_window w = position_window::of(mask_kind::causal_window, 50);
  CHECK(ring_schedule(partition_plan<contiguous>(cu, 8), 0, w).step_count() == 2);
  CHECK(ring_schedule(partition_plan<round_robin>(cu, 8), 0, w).step_count() == 8);
  CHECK(ring_schedule(partition_plan<zigzag>(cu, 8), 0, w).step_count() == 8);
  // Round-robin with a window of 3 keys behind: distances 0..3.
  CHECK(ring_schedule(partition_plan<round_robin>(cu, 8), 5,
                      position_window::of(mask_kind::causal_window, 3))
            .step_count() == 4);
  // The diagonal alone needs no exchange; a full mask needs every step.
  const std::vector<std::int32_t> four{0, 400};
  CHECK(ring_schedule(partition_plan<contiguous>(four, 4), 1,
                      position_window::of(mask_kind::sliding_window, 0, 0))
            .step_count() == 1);
  CHECK(ring_schedule(partition_plan<contiguous>(four, 4), 0, position_window::of(mask_kind::full))
            .step_count() == 4);
}

TEST_CASE("windows that do not fit the mask are refused at plan time, on every rank") {
  const std::vector<std::int32_t> cu{0, 64};
  // Each layout planned once; every part must be in every rank's message.
  auto refused = [&](auto kernel, attention_arguments a, std::initializer_list<std::string> parts) {
    using K = decltype(kernel);
    in_process_group group(2);
    const auto errors = on_ranks(group, [&](int, in_process_communicator& comm) {
      ring_attention<contiguous, in_process_communicator, K> attn(comm, a, cu);
    });
    for (const auto& e : errors)
      for (const std::string& part : parts) {
        CAPTURE(part);
        CHECK(message(e).find(part) != std::string::npos);
      }
  };
  refused(host_reference<causal_mask>{}, {4, 4, 64, 0.0f, 8, 0},
          {"takes no window",
           "use the BlockKernel ringattn::sliding_window or ringattn::causal_window"});
  refused(host_reference<full_mask>{}, {4, 4, 64, 0.0f, -1, 3}, {"takes no window"});
  refused(host_reference<causal_window_mask>{}, {4, 4, 64, 0.0f, -1, 0},
          {"needs window_left >= 0", "without one it is the BlockKernel ringattn::causal"});
  refused(host_reference<causal_window_mask>{}, {4, 4, 64, 0.0f, 8, 2},
          {"sees no key ahead", "or use the BlockKernel ringattn::sliding_window)"});
  refused(host_reference<sliding_window_mask>{}, {4, 4, 64, 0.0f, -2, 0}, {"must be >= 0, or -1"});
  // Ranks that disagree on the window fail together.
  in_process_group group(2);
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<contiguous, in_process_communicator, host_reference<sliding_window_mask>> attn(
        comm, {4, 4, 64, 0.0f, r == 0 ? 8 : 9, 0}, cu);
  });
  for (const auto& e : errors)
    CHECK(message(e).find("disagrees with rank 0 on window_left (9 vs 8)") != std::string::npos);
}
