// The device ring: P virtual ranks on one GPU (threads of an in-process group, each with its own
// stream), every partitioner x {full, causal} x P in {1, 2, 3, 4, 8} against the float64 oracle;
// bytes per step; bitwise repeatability.
#include "../ranks.hpp"
#include "../sharded_case.hpp"
#include "device_buffer.cuh"

#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>

#include <cstdlib>
#include <cstring>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;

template <class P, class Mask>
struct device_ring_run {
  std::vector<typename test::sharded_case<P, T>::rank_output> outputs;
  std::uint64_t bytes = 0, expected = 0;
};

// One forward on every rank (twice when `repeat`, checking the two are bitwise equal).
template <class P, class Mask>
device_ring_run<P, Mask> run(const test::sharded_case<P, T>& c, bool repeat) {
  const int ranks = c.plan.ranks();
  const attention_arguments a = c.args;
  device_ring_run<P, Mask> res;
  res.outputs.resize(static_cast<std::size_t>(ranks));
  std::vector<std::uint64_t> sent(static_cast<std::size_t>(ranks)), want(sent);
  std::vector<int> same(static_cast<std::size_t>(ranks), 1);
  in_process_group group(ranks, std::chrono::seconds(60));
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<P, in_process_communicator, Mask> attn(comm, a, c.plan.cu_seqlens());
    attn.prepare_device();
    const std::int64_t n = attn.local_tokens();
    test::device_buffer<T> q(c.qs[static_cast<std::size_t>(r)]),
        k(c.ks[static_cast<std::size_t>(r)]), v(c.vs[static_cast<std::size_t>(r)]);
    test::device_buffer<T> out(
        std::vector<T>(c.qs[static_cast<std::size_t>(r)].size(), test::poison<T>()));
    test::device_buffer<float> lse(
        std::vector<float>(static_cast<std::size_t>(n * a.q_heads), -7.0f));
    const std::size_t bytes = attn.template device_workspace_bytes<T>();
    test::device_buffer<std::byte> ws(bytes);
    cudaStream_t stream;
    RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto once = [&] {
      attn.forward(thd_view<const T>(q.get(), n, a.q_heads, a.head_dim),
                   thd_view<const T>(k.get(), n, a.kv_heads, a.head_dim),
                   thd_view<const T>(v.get(), n, a.kv_heads, a.head_dim),
                   thd_view<T>(out.get(), n, a.q_heads, a.head_dim), lse.get(), ws.get(), bytes,
                   stream);
      RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
      return std::pair{out.download(), lse.download()};
    };
    auto [o1, l1] = once();
    if (repeat) {
      auto [o2, l2] = once();
      same[static_cast<std::size_t>(r)] =
          std::memcmp(o1.data(), o2.data(), o1.size() * sizeof(T)) == 0 &&
          std::memcmp(l1.data(), l2.data(), l1.size() * sizeof(float)) == 0;
    }
    RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
    res.outputs[static_cast<std::size_t>(r)] = {std::move(o1), std::move(l1)};
    sent[static_cast<std::size_t>(r)] = comm.bytes_sent() / (repeat ? 2 : 1);
    for (int t = 0; t + 1 < ranks; ++t)
      want[static_cast<std::size_t>(r)] += attn.template block_bytes<T>((r - t + ranks) % ranks);
  });
  for (const auto& e : errors)
    REQUIRE(test::message(e) == "");
  for (int r = 0; r < ranks; ++r) {
    CHECK(same[static_cast<std::size_t>(r)] == 1);
    res.bytes += sent[static_cast<std::size_t>(r)];
    res.expected += want[static_cast<std::size_t>(r)];
  }
  return res;
}

template <class P, class Mask>
void check() {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  for (int ranks : {1, 2, 3, 4, 8}) {
    CAPTURE(ranks);
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(ranks));
    test::sharded_case<P, T> c(test::random_cu_seqlens(3, 1, small ? 150 : 700, rng), ranks,
                               {8, 2, 128, 0.0f}, Mask::mask, rng);
    const auto ref = c.oracle();
    const auto res = run<P, Mask>(c, /*repeat=*/ranks == 3);
    double num = 0.0, den = 0.0, lse = 0.0;
    for (int r = 0; r < ranks; ++r) {
      const auto e = c.rank_error(r, res.outputs[static_cast<std::size_t>(r)], ref);
      num += e.num, den += e.den, lse = std::max(lse, e.lse);
    }
    // The block kernel's tolerances (test_block_forward.cu): bf16 8e-3 relative, LSE 2e-3.
    CHECK(std::sqrt(num / den) < 8e-3);
    CHECK(lse < 2e-3);
    CHECK(res.bytes == res.expected);
  }
}
} // namespace

TEST_CASE_TEMPLATE("device ring, virtual ranks on one GPU, equals the oracle", P, contiguous,
                   round_robin, zigzag) {
  check<P, full>();
  check<P, causal>();
}
