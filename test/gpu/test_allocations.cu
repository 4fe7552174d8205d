// After prepare_device() and a first forward and backward, the device ring allocates nothing
// (no cudaMalloc, no pinned memory, no heap), sets no kernel attribute, and gives the same bits:
// P virtual ranks on one GPU, every partitioner, both masks.
#include "../support/allocation_counter.hpp"
#include "../support/device_buffer.cuh"
#include "../support/ranks.hpp"
#include "../support/sharded_backward_case.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>

#include <barrier>
#include <cstring>
#include <vector>

#if !defined(RINGATTN_COUNT_ALLOCATIONS) || !defined(RINGATTN_COUNT_LAUNCHES)
#error "the allocation tests count the library's allocations and launches"
#endif

using namespace ringattn;

namespace {
using T = __nv_bfloat16;

template <class P, class Kernel>
void check_warm_calls_allocate_nothing(int ranks) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  CAPTURE(ranks);
  std::mt19937_64 rng(seed);
  const std::vector<std::int32_t> cu = {0, 300, 701, 1024};
  const attention_arguments a{8, 2, 128, 0.0f};
  test::sharded_backward_case<P, T> c(cu, ranks, a, Kernel::mask, rng);
  std::barrier sync(ranks);
  std::uint64_t allocations = 0, attributes = 0, launches = 0;
  std::vector<std::uint64_t> heap(static_cast<std::size_t>(ranks), 99);
  std::vector<int> same(static_cast<std::size_t>(ranks), 0);
  in_process_group group(ranks, std::chrono::seconds(60));
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    RINGATTN_CUDA_CHECK(cudaSetDevice(0));
    const auto at = static_cast<std::size_t>(r);
    ring_attention<P, in_process_communicator, Kernel> attn(comm, a, c.plan.cu_seqlens());
    attn.prepare_device();
    const std::int64_t n = attn.local_tokens();
    test::device_buffer<T> q(c.qs[at]), k(c.ks[at]), v(c.vs[at]), dout(c.douts[at]);
    test::device_buffer<T> out(c.qs[at].size()), dq(c.qs[at].size()), dk(c.ks[at].size()),
        dv(c.ks[at].size());
    test::device_buffer<float> lse(static_cast<std::size_t>(n * a.q_heads));
    const std::size_t fbytes = attn.template device_workspace_bytes<T>();
    const std::size_t bbytes = attn.template device_backward_workspace_bytes<T>();
    test::device_buffer<std::byte> fws(fbytes), bws(bbytes);
    cudaStream_t stream;
    RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const thd_view<const T> qv(q.get(), n, a.q_heads, a.head_dim),
        kv(k.get(), n, a.kv_heads, a.head_dim), vv(v.get(), n, a.kv_heads, a.head_dim),
        dov(dout.get(), n, a.q_heads, a.head_dim);
    std::vector<T> first[4];
    for (int call = 0; call < 2; ++call) {
      sync.arrive_and_wait();
      if (call == 1 && r == 0) {
        allocations = detail::device_allocations.load();
        attributes = detail::attribute_sets.load();
        launches = detail::kernel_launches.load();
      }
      sync.arrive_and_wait();
      {
        test::allocation_scope scope;
        attn.forward(qv, kv, vv, thd_view<T>(out.get(), n, a.q_heads, a.head_dim), lse.get(),
                     fws.get(), fbytes, stream);
        attn.backward(qv, kv, vv, thd_view<const T>(out.get(), n, a.q_heads, a.head_dim), lse.get(),
                      dov, thd_view<T>(dq.get(), n, a.q_heads, a.head_dim),
                      thd_view<T>(dk.get(), n, a.kv_heads, a.head_dim),
                      thd_view<T>(dv.get(), n, a.kv_heads, a.head_dim), bws.get(), bbytes, stream);
        if (call == 1) heap[at] = scope.count();
      }
      RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
      const std::vector<T> now[4] = {out.download(), dq.download(), dk.download(), dv.download()};
      if (call == 0)
        for (int i = 0; i < 4; ++i)
          first[i] = now[i];
      else {
        bool equal = true;
        for (int i = 0; i < 4; ++i)
          equal =
              equal && std::memcmp(first[i].data(), now[i].data(), now[i].size() * sizeof(T)) == 0;
        same[at] = equal;
      }
    }
    sync.arrive_and_wait();
    if (r == 0) {
      allocations = detail::device_allocations.load() - allocations;
      attributes = detail::attribute_sets.load() - attributes;
      launches = detail::kernel_launches.load() - launches;
    }
    RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  });
  for (int r = 0; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(test::message(errors[static_cast<std::size_t>(r)]) == "");
    CHECK(heap[static_cast<std::size_t>(r)] == 0);
    CHECK(same[static_cast<std::size_t>(r)] == 1);
  }
  CHECK(allocations == 0);
  CHECK(attributes == 0);
  CHECK(launches > 0); // the counted calls did run kernels
}
} // namespace

TEST_CASE_TEMPLATE("a warmed-up device ring allocates nothing and sets no kernel attribute", P,
                   contiguous, round_robin, zigzag) {
  for (int ranks : {1, 3}) {
    check_warm_calls_allocate_nothing<P, causal>(ranks);
    check_warm_calls_allocate_nothing<P, full>(ranks);
  }
}

TEST_CASE("the allocation counters see plan-time work") {
  in_process_group group(1);
  auto comm = group.communicator(0);
  const std::uint64_t before = detail::device_allocations.load();
  ring_attention<zigzag, in_process_communicator, causal> attn(comm, {8, 2, 128, 0.0f},
                                                               std::vector<std::int32_t>{0, 256});
  attn.prepare_device(); // the forward's schedule: one device allocation
  CHECK(detail::device_allocations.load() > before);
}
