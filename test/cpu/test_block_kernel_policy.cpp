// The BlockKernel policy: its concepts accept the shipped models and reject other types; a
// host-only model runs the host ring and gives the native model's bits; the ring's entry points
// take mutable input views; a rank's lse goes back to global order (place_lse) and matches the
// oracle.
#include "../support/ranks.hpp"
#include "../support/sharded_backward_case.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/scatter.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

using namespace ringattn;

namespace {
struct not_a_kernel {
  static constexpr const char* name = "nothing";
};
struct mask_only {
  static constexpr mask_kind mask = mask_kind::full;
  static constexpr const char* name = "mask only";
};
} // namespace

static_assert(block_kernel<full> && block_kernel<causal>);
static_assert(device_block_kernel_for<full, cudaStream_t> &&
              device_block_kernel_for<causal, cudaStream_t>);
static_assert(block_kernel<host_reference<full_mask>> &&
              !device_block_kernel_for<host_reference<full_mask>, cudaStream_t>);
static_assert(!block_kernel<int> && !block_kernel<not_a_kernel> && !block_kernel<mask_only>);
static_assert(mask_policy<full_mask> && mask_policy<causal_mask> && !mask_policy<int>);
// Element types: views hold fp16, bf16 and fp32 (const or not); the device path takes the 16-bit
// ones exactly.
static_assert(element<__half> && element<const __nv_bfloat16> && element<float> &&
              !element<double> && !element<int>);
static_assert(device_element<__half> && device_element<__nv_bfloat16> && !device_element<float> &&
              !device_element<const __half> && !device_element<double>);

namespace {
using T = __nv_bfloat16;

// Every rank's forward and backward through `Kernel`; the views passed are mutable where
// `mutable_inputs` (the entry points convert them).
template <class P, class Kernel>
std::vector<std::vector<T>> run(const test::sharded_backward_case<P, T>& c, bool mutable_inputs,
                                std::vector<std::vector<float>>* lse_out = nullptr) {
  const int ranks = c.plan.ranks();
  std::vector<std::vector<T>> results(static_cast<std::size_t>(ranks));
  if (lse_out) lse_out->assign(static_cast<std::size_t>(ranks), {});
  in_process_group group(ranks);
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<P, in_process_communicator, Kernel> attn(comm, c.args, c.plan.cu_seqlens());
    const auto at = static_cast<std::size_t>(r);
    const std::int64_t n = attn.local_tokens();
    const int qh = c.args.q_heads, kvh = c.args.kv_heads, d = c.args.head_dim;
    std::vector<T> q = c.qs[at], k = c.ks[at], v = c.vs[at], dout = c.douts[at];
    std::vector<T> out(q.size(), test::poison<T>()), dq(q.size(), test::poison<T>()),
        dk(k.size(), test::poison<T>()), dv(k.size(), test::poison<T>());
    std::vector<float> lse(static_cast<std::size_t>(n * qh), -7.0f);
    std::vector<std::byte> wf(attn.template host_workspace_bytes<T>() + 16),
        wb(attn.template host_backward_workspace_bytes<T>() + 16);
    auto aligned = [](std::vector<std::byte>& w, std::size_t bytes) {
      const std::size_t pad = (16 - reinterpret_cast<std::uintptr_t>(w.data()) % 16) % 16;
      return std::span<std::byte>(w).subspan(pad, bytes);
    };
    const thd_view<T> qm(q.data(), n, qh, d), km(k.data(), n, kvh, d), vm(v.data(), n, kvh, d),
        om(out.data(), n, qh, d), dom(dout.data(), n, qh, d);
    const auto fws = aligned(wf, attn.template host_workspace_bytes<T>());
    const auto bws = aligned(wb, attn.template host_backward_workspace_bytes<T>());
    if (mutable_inputs) {
      attn.forward_host(qm, km, vm, om, lse.data(), fws);
      attn.backward_host(qm, km, vm, om, lse.data(), dom, thd_view<T>(dq.data(), n, qh, d),
                         thd_view<T>(dk.data(), n, kvh, d), thd_view<T>(dv.data(), n, kvh, d), bws);
    } else {
      const thd_view<const T> qc(qm), kc(km), vc(vm), oc(om), doc(dom);
      attn.forward_host(qc, kc, vc, om, lse.data(), fws);
      attn.backward_host(qc, kc, vc, oc, lse.data(), doc, thd_view<T>(dq.data(), n, qh, d),
                         thd_view<T>(dk.data(), n, kvh, d), thd_view<T>(dv.data(), n, kvh, d), bws);
    }
    std::vector<T> all = out;
    for (const auto* x : {&dq, &dk, &dv})
      all.insert(all.end(), x->begin(), x->end());
    results[at] = std::move(all);
    if (lse_out) (*lse_out)[at] = lse;
  });
  for (const auto& e : errors)
    REQUIRE(test::message(e) == "");
  return results;
}

template <class P, class Mask>
void check_models(int ranks) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(ranks);
  std::mt19937_64 rng(seed);
  test::sharded_backward_case<P, T> c(test::random_cu_seqlens(3, 1, 60, rng), ranks,
                                      {4, 2, 64, 0.0f}, Mask::kind, rng);
  std::vector<std::vector<float>> lse;
  const auto native = run<P, native_kernel<Mask>>(c, false, &lse);
  const auto reference = run<P, host_reference<Mask>>(c, false);
  const auto mutable_views = run<P, native_kernel<Mask>>(c, true);
  for (int r = 0; r < ranks; ++r) {
    const auto& a = native[static_cast<std::size_t>(r)];
    CHECK(std::memcmp(a.data(), reference[static_cast<std::size_t>(r)].data(),
                      a.size() * sizeof(T)) == 0);
    CHECK(std::memcmp(a.data(), mutable_views[static_cast<std::size_t>(r)].data(),
                      a.size() * sizeof(T)) == 0);
  }
  // Every rank's lse back in global order against the oracle's.
  const int qh = c.args.q_heads;
  std::vector<float> global(static_cast<std::size_t>(c.plan.tokens() * qh),
                            std::numeric_limits<float>::quiet_NaN());
  for (int r = 0; r < ranks; ++r)
    place_lse(c.plan, r, std::span<const float>(lse[static_cast<std::size_t>(r)]), qh,
              std::span<float>(global));
  const auto oracle = c.oracle();
  double worst = 0.0;
  for (std::size_t i = 0; i < global.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(global[i]) - oracle.lse[i]));
  CHECK(worst < 1e-5);
}
} // namespace

TEST_CASE_TEMPLATE("host_reference and the native model give the same bits; mutable views; "
                   "place_lse",
                   P, contiguous, round_robin, zigzag) {
  for (int ranks : {1, 3}) {
    check_models<P, causal_mask>(ranks);
    check_models<P, full_mask>(ranks);
  }
}

TEST_CASE("place_lse names a wrong size") {
  const partition_plan<zigzag> plan(std::vector<std::int32_t>{0, 10}, 2);
  std::vector<float> local(5 * 4), global(10 * 4);
  CHECK_NOTHROW(place_lse(plan, 0, std::span<const float>(local), 4, std::span<float>(global)));
  std::vector<float> short_local(3);
  CHECK_THROWS_WITH_AS(
      place_lse(plan, 1, std::span<const float>(short_local), 4, std::span<float>(global)),
      "ringattn: the local lse has 3 entries; rank 1's [q_heads, tokens] is 20", invalid_argument);
}
