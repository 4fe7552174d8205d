// After its plan and a first call, the host ring allocates nothing: a second forward and backward
// make no heap allocation on any rank's thread (global operator new counted per thread).
#include "../support/allocation_counter.hpp"
#include "../support/ranks.hpp"
#include "../support/sharded_backward_case.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>

#include <cstring>
#include <memory>
#include <vector>

using namespace ringattn;

TEST_CASE("the allocation counter sees an allocation on its own thread") {
  test::allocation_scope scope;
  auto p = std::make_unique<int>(7);
  CHECK(scope.count() == 1);
  CHECK(*p == 7);
}

namespace {
template <class P, class Kernel>
void check_no_allocation(int ranks) {
  using T = __nv_bfloat16;
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(ranks);
  std::mt19937_64 rng(seed);
  const std::vector<std::int32_t> cu = {0, 37, 101, 160};
  test::sharded_backward_case<P, T> c(cu, ranks, {4, 2, 64, 0.0f}, Kernel::mask, rng);
  const int qh = 4, kvh = 2, d = 64;
  std::vector<std::uint64_t> counted(static_cast<std::size_t>(ranks), 99);
  std::vector<int> same(static_cast<std::size_t>(ranks), 0);
  in_process_group group(ranks);
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<P, in_process_communicator, Kernel> attn(comm, c.args, c.plan.cu_seqlens());
    const auto at = static_cast<std::size_t>(r);
    const std::int64_t n = c.plan.local_tokens(r);
    std::vector<std::byte> wf(attn.template host_workspace_bytes<T>() + 16);
    std::vector<std::byte> wb(attn.template host_backward_workspace_bytes<T>() + 16);
    auto aligned = [](std::vector<std::byte>& w, std::size_t bytes) {
      const std::size_t pad = (16 - reinterpret_cast<std::uintptr_t>(w.data()) % 16) % 16;
      return std::span<std::byte>(w).subspan(pad, bytes);
    };
    const auto fws = aligned(wf, attn.template host_workspace_bytes<T>());
    const auto bws = aligned(wb, attn.template host_backward_workspace_bytes<T>());
    std::vector<T> out[2], dq[2], dk[2], dv[2];
    std::vector<float> lse[2];
    for (int i = 0; i < 2; ++i) {
      out[i].assign(static_cast<std::size_t>(n * qh * d), test::poison<T>());
      dq[i].assign(static_cast<std::size_t>(n * qh * d), test::poison<T>());
      dk[i].assign(static_cast<std::size_t>(n * kvh * d), test::poison<T>());
      dv[i].assign(static_cast<std::size_t>(n * kvh * d), test::poison<T>());
      lse[i].assign(static_cast<std::size_t>(n * qh), -7.0f);
    }
    const thd_view<const T> q(c.qs[at].data(), n, qh, d), k(c.ks[at].data(), n, kvh, d),
        v(c.vs[at].data(), n, kvh, d), dout(c.douts[at].data(), n, qh, d);
    std::uint64_t during = 0;
    for (int i = 0; i < 2; ++i) {
      test::allocation_scope scope;
      attn.forward_host(q, k, v, thd_view<T>(out[i].data(), n, qh, d), lse[i].data(), fws);
      attn.backward_host(q, k, v, thd_view<const T>(out[i].data(), n, qh, d), lse[i].data(), dout,
                         thd_view<T>(dq[i].data(), n, qh, d), thd_view<T>(dk[i].data(), n, kvh, d),
                         thd_view<T>(dv[i].data(), n, kvh, d), bws);
      if (i == 1) during = scope.count();
    }
    counted[at] = during;
    auto bits_equal = [](const auto& a, const auto& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
    };
    same[at] = bits_equal(out[0], out[1]) && bits_equal(lse[0], lse[1]) &&
               bits_equal(dq[0], dq[1]) && bits_equal(dk[0], dk[1]) && bits_equal(dv[0], dv[1]);
  });
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(test::message(errors[static_cast<std::size_t>(r)]) == "");
    CHECK(counted[static_cast<std::size_t>(r)] == 0);
    CHECK(same[static_cast<std::size_t>(r)] == 1); // the second call is the same computation
  }
}
} // namespace

TEST_CASE_TEMPLATE("a warmed-up host ring allocates nothing: forward and backward", P, contiguous,
                   round_robin, zigzag) {
  for (int ranks : {1, 2, 3}) {
    check_no_allocation<P, causal>(ranks);
    check_no_allocation<P, full>(ranks);
  }
}
