// A peer missing mid-ring over NCCL (docs/reliability.md): two GPUs, one communicator each (2 s
// timeout). Both ranks plan the ring (the plan-time all-gather succeeds); rank 1 then stops taking
// part. Rank 0 fails within the timeout naming itself and the step, aborts its communicator
// (which ends the pending NCCL kernels), and its device stays usable; rank 1's communicator is
// then released without hanging. Two ways to be missing:
// - before the pair ever exchanged: NCCL sets up the send/receive connection when the first
//   exchange is issued, which needs the peer; the forward's own bounded wait for NCCL to accept
//   step 0's exchange fails (the forward throws);
// - after a forward together: the forward enqueues its exchanges and returns, and the bounded
//   `wait(stream, step)` that joins the stream fails.
#include "../support/device_buffer.cuh"
#include "per_gpu.cuh"

#include <ringattn/block_kernel.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
using clock = std::chrono::steady_clock;

struct missing_peer {
  std::string what;       // what rank 0 threw
  clock::duration took{}; // from its last forward to the throw
  bool drained = false;   // its stream finished after the abort
  std::vector<std::exception_ptr> errors;
};

//! Both ranks run `together` forwards; then rank 0 runs one more, rank 1 none.
missing_peer run(int together) {
  constexpr auto timeout = std::chrono::milliseconds(2000);
  const std::vector<std::int32_t> cu{0, 3000, 5001};
  const attention_arguments a{8, 2, 128, 0.0f};
  missing_peer res;
  std::atomic<bool> done{false};
  test::nccl_per_gpu comms(2, timeout);
  res.errors = test::on_gpus(2, [&](int r) {
    ring_attention<zigzag, nccl_communicator, causal> attn(comms[r], a, cu);
    attn.prepare_device();
    const std::int64_t n = attn.local_tokens();
    test::device_buffer<T> q(static_cast<std::size_t>(n * 8 * 128)),
        k(static_cast<std::size_t>(n * 2 * 128)), v(static_cast<std::size_t>(n * 2 * 128)),
        out(static_cast<std::size_t>(n * 8 * 128));
    test::device_buffer<float> lse(static_cast<std::size_t>(n * 8));
    RINGATTN_CUDA_CHECK(cudaMemset(q.get(), 0, q.size() * sizeof(T)));
    RINGATTN_CUDA_CHECK(cudaMemset(k.get(), 0, k.size() * sizeof(T)));
    RINGATTN_CUDA_CHECK(cudaMemset(v.get(), 0, v.size() * sizeof(T)));
    const std::size_t bytes = attn.device_workspace_bytes<T>();
    test::device_buffer<std::byte> ws(bytes);
    cudaStream_t stream;
    RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto forward = [&] {
      attn.forward(thd_view<const T>(q.get(), n, 8, 128), thd_view<const T>(k.get(), n, 2, 128),
                   thd_view<const T>(v.get(), n, 2, 128), thd_view<T>(out.get(), n, 8, 128),
                   lse.get(), ws.get(), bytes, stream);
      comms[r].wait(stream, 0);
    };
    for (int i = 0; i < together; ++i)
      forward();
    if (r == 1) { // from here on never sends or receives
      while (!done.load())
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
      return;
    }
    const auto start = clock::now();
    try {
      forward();
    } catch (const communication_error& e) {
      res.what = e.what();
    }
    res.took = clock::now() - start;
    done = true;
    // The abort ended the NCCL kernels: the stream drains and the device still works.
    const auto drain_by = clock::now() + std::chrono::seconds(10);
    cudaError_t state = cudaErrorNotReady;
    while ((state = cudaStreamQuery(stream)) == cudaErrorNotReady && clock::now() < drain_by)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    res.drained = state == cudaSuccess;
    if (!res.drained) return; // reported by the caller; a stuck stream would hang what follows
    RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
    RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  });
  done = true;
  return res; // rank 1's communicator is released here, bounded by its timeout
}

void check(const missing_peer& m, const char* waited_for) {
  CAPTURE(m.what);
  for (const auto& e : m.errors)
    CHECK(test::message(e) == "");
  CHECK(m.what.find(std::string("ringattn: rank 0, step 0: waited 2000 ms for ") + waited_for) !=
        std::string::npos);
  CHECK(m.what.find("; the NCCL communicator was aborted") != std::string::npos);
  CHECK(m.took < std::chrono::seconds(10));
  CHECK(m.drained);
}
} // namespace

TEST_CASE("NCCL: a peer missing from the first exchange fails the forward within the timeout") {
  check(run(/*together=*/0), "NCCL to accept a send/receive");
}

TEST_CASE(
    "NCCL: a peer missing after a forward together fails the stream wait within the timeout") {
  check(run(/*together=*/1), "its stream to finish (a peer may be missing)");
}
