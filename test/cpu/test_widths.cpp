// Separate widths for Q/K and V (head_dim 192, head_dim_v 128: multi-head latent attention) on the
// host ring and the all-gather schedule: every partitioner x P x GQA and MHA, forward and
// backward against the float64 oracle; the bytes each rank sends, counted from the widths by
// hand; errors for views of the wrong width and for ranks that disagree on head_dim_v.
#include "../support/ranks.hpp"
#include "../support/ring_bytes.hpp"
#include "../support/sharded_backward_case.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>

#include <array>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
using test::message;
using test::on_ranks;

struct run_result {
  test::ring_errors errors;
  std::uint64_t forward_bytes = 0, backward_bytes = 0;
  std::uint64_t want_forward = 0, want_backward = 0;
};

// Bytes of a block of `tokens` keys on the wire: k (head_dim wide) and v (head_dim_v) in T, and,
// in the backward, their fp32 gradients.
std::uint64_t kv_bytes(std::int64_t tokens, const attention_arguments& a, std::size_t element) {
  return static_cast<std::uint64_t>(tokens) * a.kv_heads * (a.head_dim + a.head_dim_v) * element;
}

template <class P, class Mask, class Schedule>
run_result run(const test::sharded_backward_case<P, T>& c) {
  const int ranks = c.plan.ranks();
  const auto ref = c.oracle();
  const auto ref_b = c.oracle_backward();
  using parts_t = typename test::sharded_case<P, T>::error_parts;
  using grad_parts_t = typename test::sharded_backward_case<P, T>::grad_parts;
  std::vector<parts_t> parts(static_cast<std::size_t>(ranks));
  std::vector<grad_parts_t> grad_parts(static_cast<std::size_t>(ranks));
  std::vector<std::uint64_t> fwd_sent(static_cast<std::size_t>(ranks), 0), all_sent(fwd_sent),
      ring_forward(fwd_sent), shares(fwd_sent);
  std::vector<int> steps(static_cast<std::size_t>(ranks), 0);
  in_process_group group(ranks);
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<P, in_process_communicator, host_reference<Mask>, Schedule> attn(
        comm, c.args, c.plan.cu_seqlens());
    const auto at = static_cast<std::size_t>(r);
    steps[at] = attn.schedule().step_count();
    if constexpr (std::is_same_v<Schedule, ring_pass>) {
      ring_forward[at] = test::ring_forward_bytes<T>(attn, r, host_reference<Mask>::mask);
    } else {
      ring_forward[at] = test::all_gather_bytes<T>(attn, r, host_reference<Mask>::mask);
      shares[at] = test::all_gather_share_bytes(attn, r, host_reference<Mask>::mask);
    }
    const auto fwd = c.forward_rank(attn, r);
    fwd_sent[at] = comm.bytes_sent();
    const auto g = c.backward_rank(attn, r, fwd);
    all_sent[at] = comm.bytes_sent();
    parts[at] = c.rank_error(r, fwd, ref);
    grad_parts[at] = c.rank_grad_error(r, g, ref_b);
  });
  for (const auto& e : errors)
    REQUIRE(message(e) == "");
  run_result res;
  res.errors = test::total_errors(parts, grad_parts);
  for (int r = 0; r < ranks; ++r) {
    const auto at = static_cast<std::size_t>(r);
    res.forward_bytes += fwd_sent[at];
    res.backward_bytes += all_sent[at] - fwd_sent[at];
    // Of n steps (all P under a full mask; a causal one may need fewer), ring: the forward sends
    // on the blocks some later rank sees (ring_bytes.hpp); the backward sends step t's block of
    // rank r - t on with its fp32 dk, dv, every step but the last, then the last block's dk, dv
    // go home: the rows of each block that travel. All-gather: the own block to the ranks that see
    // some of it (in the forward, and again in the backward), then the dk, dv share of every block
    // this rank sees home.
    const attention_arguments& a = c.args;
    const int n = steps[at];
    // The rows of a shard that some other rank sees travel (ring/schedule.cuh).
    auto tokens = [&](int src) {
      return travelling_rows(c.plan, ((src % ranks) + ranks) % ranks,
                             c.args.window(host_reference<Mask>::mask))
          .tokens;
    };
    if constexpr (std::is_same_v<Schedule, ring_pass>) {
      res.want_forward += ring_forward[at];
      for (int t = 0; t + 1 < n; ++t)
        res.want_backward += kv_bytes(tokens(r - t), a, sizeof(T) + sizeof(float));
      if (n > 1) res.want_backward += kv_bytes(tokens(r - (n - 1)), a, sizeof(float));
    } else {
      res.want_forward += ring_forward[at];
      res.want_backward += ring_forward[at] + shares[at];
    }
  }
  return res;
}

template <class P, class Mask, class Schedule = ring_pass>
void check_widths(mask_kind kind, int q_heads, int kv_heads) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(q_heads);
  CAPTURE(kv_heads);
  std::mt19937_64 draw(seed);
  const auto cu = test::random_cu_seqlens(3, 1, 45, draw); // the same batch at every P
  test::error_growth growth;
  for (int ranks : {1, 2, 3, 4, 8}) {
    CAPTURE(ranks);
    std::mt19937_64 rng(seed + 7);
    attention_arguments args{
        .q_heads = q_heads, .kv_heads = kv_heads, .head_dim = 192, .head_dim_v = 128};
    test::sharded_backward_case<P, T> c(cu, ranks, args, kind, rng);
    REQUIRE(c.v.size() * 192 == c.k.size() * 128);
    const run_result res = run<P, Mask, Schedule>(c);
    growth.check(ranks, res.errors);
    CHECK(res.forward_bytes == res.want_forward);
    CHECK(res.backward_bytes == res.want_backward);
  }
}
} // namespace

TEST_CASE_TEMPLATE("host ring with head_dim 192 and head_dim_v 128 equals the oracle", P,
                   contiguous, round_robin, zigzag) {
  check_widths<P, causal_mask>(mask_kind::causal, 8, 2); // GQA
  check_widths<P, causal_mask>(mask_kind::causal, 4, 4); // MHA
  check_widths<P, full_mask>(mask_kind::full, 4, 1);     // MQA
}

TEST_CASE_TEMPLATE("all-gather schedule with head_dim 192 and head_dim_v 128 equals the oracle", P,
                   contiguous, zigzag) {
  check_widths<P, causal_mask, all_gather_kv>(mask_kind::causal, 8, 2);
  check_widths<P, full_mask, all_gather_kv>(mask_kind::full, 4, 4);
}

TEST_CASE("separate widths: the workspace and messages follow each width") {
  const attention_arguments mla{.q_heads = 8, .kv_heads = 2, .head_dim = 192, .head_dim_v = 128};
  const attention_arguments same{.q_heads = 8, .kv_heads = 2, .head_dim = 128};
  CHECK(mla.v_dim() == 128);
  CHECK(mla.separate_widths());
  CHECK(same.v_dim() == 128);
  CHECK_FALSE(same.separate_widths());
  const ring_workspace w(100, 120, mla, 2);
  CHECK(w.k_elements(10) == 10u * 2 * 192);
  CHECK(w.v_elements(10) == 10u * 2 * 128);
  CHECK(w.block_bytes(10) == 10u * 2 * (192 + 128) * 2);
  CHECK(w.grad_bytes(10) == 10u * 2 * (192 + 128) * 4);
  // The state's o is as wide as the output, dQ as q.
  std::vector<std::byte> buf(w.host_backward_bytes() + w.forward_bytes());
  std::vector<float> lse(800);
  const attention_state s = w.state(buf.data(), lse.data());
  CHECK(s.head_dim == 128);
  CHECK(w.state_o_bytes() == ring_workspace::align(100u * 8 * 128 * 4));
  CHECK(w.dq_bytes() == ring_workspace::align(100u * 8 * 192 * 4));
  const auto b = w.grad_slot_views<T>(buf.data(), 1, 10);
  CHECK(b.k.head_dim == 192);
  CHECK(b.v.head_dim == 128);
  CHECK(reinterpret_cast<std::byte*>(b.v.data) - reinterpret_cast<std::byte*>(b.k.data) ==
        10 * 2 * 192 * 2);
  CHECK(b.dv - b.dk == 10 * 2 * 192);
}

TEST_CASE("a K/V slot keeps its block's scales after v: none for 16-bit elements, a k and a v "
          "scale per kv head for e4m3, in the same message") {
  static_assert(std::is_same_v<scales_for<T>, no_scales> &&
                std::is_same_v<scales_for<const __half>, no_scales> &&
                std::is_same_v<scales_for<fp8_e4m3>, head_scales>);
  // The 16-bit elements' place takes no space in the block arguments.
  static_assert(sizeof(block_forward_args<T>) == sizeof(block_forward_args<float>));
  static_assert(element_format::of<T>().scale_bytes_per_kv_head == 0);
  const attention_arguments a{.q_heads = 8, .kv_heads = 2, .head_dim = 192, .head_dim_v = 128};
  const ring_workspace plain(100, 120, a, element_format::of<T>());
  CHECK(plain.block_bytes(10) == 10u * 2 * (192 + 128) * 2);
  CHECK(plain.scale_bytes(10) == 0);

  constexpr element_format e4m3 = element_format::of<fp8_e4m3>();
  static_assert(e4m3.bytes == 1 && e4m3.scale_bytes_per_kv_head == 2 * sizeof(float));
  const ring_workspace w(100, 120, a, e4m3);
  CHECK(w.scale_bytes(10) == 2u * 2 * 4);
  CHECK(w.scale_bytes(0) == 0); // an empty block sends nothing
  CHECK(w.block_bytes(10) == 10u * 2 * (192 + 128) + 2u * 2 * 4);
  CHECK(w.largest_message(false) == w.block_bytes(120));
  CHECK(w.kv_slot() == ring_workspace::align(w.block_bytes(120)));
  std::vector<std::byte> buf(w.host_backward_bytes() + w.forward_bytes());
  const auto kv = w.kv_slot_views<fp8_e4m3>(buf.data(), 1, 10);
  const auto* slot = buf.data() + w.kv_slot();
  CHECK(reinterpret_cast<const std::byte*>(kv.k.data) == slot);
  CHECK(reinterpret_cast<const std::byte*>(kv.scales.k) == slot + 10 * 2 * (192 + 128));
  CHECK(kv.scales.v == kv.scales.k + 2);
  // In a grad slot the scales sit between v and the fp32 sums, which stay 4-byte aligned.
  const auto g = w.grad_slot_views<fp8_e4m3>(buf.data(), 0, 10);
  CHECK(reinterpret_cast<const std::byte*>(g.scales.k) ==
        reinterpret_cast<const std::byte*>(g.v.data) + 10 * 2 * 128);
  CHECK(reinterpret_cast<const std::byte*>(g.dk) ==
        reinterpret_cast<const std::byte*>(g.k.data) + w.block_bytes(10));
  CHECK(reinterpret_cast<std::uintptr_t>(g.dk) % alignof(float) == 0);
}

TEST_CASE("separate widths: views of the wrong width and unsupported widths are refused") {
  const attention_arguments bad{.q_heads = 4, .kv_heads = 4, .head_dim = 192, .head_dim_v = 96};
  CHECK(bad.validate().reason() ==
        "head_dim_v 96 is not supported (supported: 64, 128, 192, 256, or 0 for head_dim)");
  // A v (and out) as wide as q instead of head_dim_v: the ring names the tensor and both shapes.
  const std::vector<std::int32_t> cu{0, 30};
  std::mt19937_64 rng(3);
  const attention_arguments mla{.q_heads = 4, .kv_heads = 2, .head_dim = 192, .head_dim_v = 128};
  test::sharded_case<contiguous, T> c(cu, 1, mla, mask_kind::causal, rng);
  in_process_group group(1);
  const auto errors = on_ranks(group, [&](int, in_process_communicator& comm) {
    ring_attention<contiguous, in_process_communicator, host_reference<causal_mask>> attn(
        comm, mla, std::span<const std::int32_t>(cu));
    std::vector<T> v_wide(30 * 2 * 192), out(30 * 4 * 128);
    std::vector<float> lse(30 * 4);
    std::vector<std::byte> ws(attn.host_workspace_bytes<T>());
    attn.forward_host(thd_view<const T>(c.qs[0].data(), 30, 4, 192),
                      thd_view<const T>(c.ks[0].data(), 30, 2, 192),
                      thd_view<const T>(v_wide.data(), 30, 2, 192),
                      thd_view<T>(out.data(), 30, 4, 128), lse.data(), ws);
  });
  CHECK(message(errors[0]) == "ringattn: v is [30, 2, 192] but rank 0's shard is [30, 2, 128]");
}

TEST_CASE("ranks that disagree on head_dim_v fail on every rank at plan time") {
  const std::vector<std::int32_t> cu{0, 40};
  in_process_group group(3);
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    const attention_arguments a{
        .q_heads = 4, .kv_heads = 2, .head_dim = 192, .head_dim_v = r == 2 ? 192 : 128};
    ring_attention<zigzag, in_process_communicator, host_reference<causal_mask>> attn(
        comm, a, std::span<const std::int32_t>(cu));
  });
  for (int r = 0; r < 3; ++r)
    CHECK(message(errors[static_cast<std::size_t>(r)]) ==
          "ringattn: rank 2 disagrees with rank 0 on head_dim_v (192 vs 128)");
}
