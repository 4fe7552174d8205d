// The NCCL communicator on what one GPU allows: a communicator of one rank (NCCL refuses two ranks
// on one device). Device exchange with itself, host exchange and all-gather through staging,
// barrier, bad peers, and the whole device ring (P = 1) through it against the float64 oracle.
// A peer that never joins times creation out. Several ranks, missing peers mid-ring and abort
// propagation need several GPUs (the multi-GPU issue).
#include "../support/device_buffer.cuh"
#include "../support/sharded_case.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/nccl.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <numeric>

using namespace ringattn;

static_assert(device_communicator_for<nccl_communicator, cudaStream_t>);

namespace {
nccl_communicator single_rank() {
  ncclUniqueId id;
  RINGATTN_NCCL_CHECK(ncclGetUniqueId(&id));
  return nccl_communicator(id, 1, 0, std::chrono::seconds(30));
}
} // namespace

TEST_CASE("NCCL communicator, one rank: exchanges, all-gather, barrier, bad peers") {
  nccl_communicator comm = single_rank();
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  comm.prepare_device();

  // Device exchange with itself: a copy, ordered on the stream.
  std::vector<int> src(1000);
  std::iota(src.begin(), src.end(), 17);
  test::device_buffer<int> a(src), b(std::vector<int>(src.size(), -1));
  cudaStream_t stream;
  RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  comm.exchange_async(a.get(), src.size() * sizeof(int), 0, b.get(), src.size() * sizeof(int), 0, 0,
                      stream);
  comm.wait(stream, 0);
  CHECK(b.download() == src);
  CHECK(comm.bytes_sent() == src.size() * sizeof(int));

  // Host exchange and all-gather go through device staging.
  std::vector<int> back(src.size(), -1);
  comm.exchange(src.data(), src.size() * sizeof(int), 0, back.data(), back.size() * sizeof(int), 0,
                1);
  CHECK(back == src);
  double mine = 2.5, all = 0.0;
  comm.all_gather(&mine, sizeof(mine), &all);
  CHECK(all == 2.5);
  comm.barrier();

  CHECK_THROWS_WITH_AS(comm.exchange_async(a.get(), 4, 1, b.get(), 4, 0, 3, stream),
                       "ringattn: rank 0, step 3: peer 1 is out of range [0, 1)", invalid_argument);
  CHECK_THROWS_WITH_AS(comm.exchange_async(a.get(), 8, 0, b.get(), 4, 0, 4, stream),
                       "ringattn: rank 0, step 4: sends 8 bytes to itself but expects 4",
                       invalid_argument);
  RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));

  // After abort every call fails at once instead of waiting.
  comm.abort("test");
  CHECK_THROWS_WITH_AS(comm.barrier(), "ringattn: rank 0: the NCCL communicator was aborted",
                       communication_error);
}

TEST_CASE("NCCL communicator wrapping the caller's (blocking) communicator") {
  ncclUniqueId id;
  RINGATTN_NCCL_CHECK(ncclGetUniqueId(&id));
  ncclComm_t raw = nullptr;
  RINGATTN_NCCL_CHECK(ncclCommInitRank(&raw, 1, id, 0));
  {
    nccl_communicator comm = nccl_communicator::wrap(raw, std::chrono::seconds(30));
    CHECK(comm.rank() == 0);
    CHECK(comm.size() == 1);
    CHECK(comm.native() == raw);
    std::vector<int> src(257, 5);
    test::device_buffer<int> a(src), b(std::vector<int>(src.size(), 0));
    cudaStream_t stream;
    RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    comm.exchange_async(a.get(), src.size() * sizeof(int), 0, b.get(), src.size() * sizeof(int), 0,
                        0, stream);
    comm.wait(stream, 0);
    CHECK(b.download() == src);
    RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  } // the wrapper leaves the communicator to its owner
  CHECK(ncclCommDestroy(raw) == ncclSuccess);
  CHECK_THROWS_AS(nccl_communicator::wrap(nullptr), invalid_argument);
}

// Fault injection on one GPU: a communicator of two ranks whose second rank never joins. The
// creation is bounded: after the timeout the communicator aborts and throws, naming the wait.
TEST_CASE("NCCL communicator: a rank that never joins makes creation fail within the timeout") {
  ncclUniqueId id;
  RINGATTN_NCCL_CHECK(ncclGetUniqueId(&id));
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(
      nccl_communicator(id, 2, 0, std::chrono::milliseconds(1500)),
      doctest::Contains(
          "ms for every rank to join the communicator; the NCCL communicator was aborted"),
      communication_error);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20));
}

TEST_CASE("NCCL communicator: bad construction is rejected before NCCL runs") {
  ncclUniqueId id{};
  CHECK_THROWS_WITH_AS(nccl_communicator(id, 2, 2),
                       "ringattn: an NCCL communicator of 2 ranks has no rank 2", invalid_argument);
  CHECK_THROWS_AS(nccl_communicator(id, 0, 0), invalid_argument);
}

TEST_CASE("device ring through NCCL (P = 1): zigzag causal and full equal the oracle") {
  using T = __nv_bfloat16;
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  nccl_communicator comm = single_rank();
  for (mask_kind m : {mask_kind::causal, mask_kind::full}) {
    CAPTURE(std::string(to_string(m)));
    const attention_arguments a{8, 2, 128, 0.0f};
    test::sharded_case<zigzag, T> c(test::random_cu_seqlens(3, 1, 500, rng), 1, a, m, rng);
    const auto ref = c.oracle();
    auto run = [&](auto mask) {
      ring_attention<zigzag, nccl_communicator, decltype(mask)> attn(comm, a, c.plan.cu_seqlens());
      attn.prepare_device();
      const std::int64_t n = attn.local_tokens();
      test::device_buffer<T> q(c.qs[0]), k(c.ks[0]), v(c.vs[0]);
      test::device_buffer<T> out(std::vector<T>(c.qs[0].size(), test::poison<T>()));
      test::device_buffer<float> lse(
          std::vector<float>(static_cast<std::size_t>(n * a.q_heads), -7.0f));
      const std::size_t bytes = attn.template device_workspace_bytes<T>();
      test::device_buffer<std::byte> ws(bytes);
      cudaStream_t stream;
      RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      attn.forward(thd_view<const T>(q.get(), n, a.q_heads, a.head_dim),
                   thd_view<const T>(k.get(), n, a.kv_heads, a.head_dim),
                   thd_view<const T>(v.get(), n, a.kv_heads, a.head_dim),
                   thd_view<T>(out.get(), n, a.q_heads, a.head_dim), lse.get(), ws.get(), bytes,
                   stream);
      comm.wait(stream);
      RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
      return typename test::sharded_case<zigzag, T>::rank_output{out.download(), lse.download()};
    };
    const auto got = m == mask_kind::causal ? run(causal{}) : run(full{});
    const auto e = c.rank_error(0, got, ref);
    // The block kernel's tolerances (test_block_forward.cu): bf16 8e-3 relative, LSE 2e-3.
    CHECK(std::sqrt(e.num / e.den) < 8e-3);
    CHECK(e.lse < 2e-3);
  }
}
