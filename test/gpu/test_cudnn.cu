// The cuDNN block kernel (ringattn::cudnn_kernel): the device ring's matrix with cuDNN computing
// every block — every partitioner (balanced also over many random batches at 3 ranks) x {full,
// causal} x P in {1, 2, 3, 4, 8} virtual ranks x GQA 1 and 4, packed batches of odd lengths,
// forward (with the max logit, whose call returns the bits of one without it) and backward against
// the float64 oracle; one sequence over 2-8 ranks (dense calls); fp16 and head_dim 64; the
// all-gather schedule; repeatability; the backward with cuDNN's atomic dQ (the same matrix, no
// bitwise repeat); windows (cuDNN's diagonal band); q/k 192 with v 128; one rank
// over one sequence (cuDNN writes the outputs directly); a one-rank ring captured in a CUDA graph
// and replayed bit for bit; bad views refused before anything runs; packed batches with empty and
// one-token sequences, and planted NaN / inf, element by element (strict_ring.cuh). Tolerances
// (bf16): forward 8e-3 relative L2 on O and 2e-3 absolute on LSE, as the native kernels; backward
// 1e-2 relative L2 on each of dQ, dK, dV (each block's gradients pass through bf16 once before the
// fp32 sums: the errors against the native path are printed). Both directions repeat bit for bit.
#include "../support/device_ring.cuh"
#include "../support/strict_ring.cuh"

#include <ringattn/cudnn.cuh>
#include <ringattn/partition/balanced.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
using atomic_full = cudnn_kernel<full_mask, T, cudnn_atomic>;
using atomic_causal = cudnn_kernel<causal_mask, T, cudnn_atomic>;

template <class P, class Kernel>
void check_forward(attention_arguments a) {
  test::check_ring_matrix<P, Kernel>(a, /*repeat_every_p=*/true);
}

template <class P, class Kernel, class Native, class E = T, class Schedule = ring_pass>
void check_backward(attention_arguments a, bool repeat) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  std::mt19937_64 draw(seed);
  const auto cu = test::random_cu_seqlens(3, 1, small ? 120 : 400, draw);
  for (int ranks : {1, 2, 3, 4, 8}) {
    CAPTURE(ranks);
    std::mt19937_64 rng(seed + 1);
    test::sharded_backward_case<P, E> c(cu, ranks, a, Kernel::mask, rng);
    const auto err = test::check_device_backward(
        c, test::device_backward_in_process<Kernel, Schedule>(c, 1, repeat));
    const auto native =
        test::check_device_backward(c, test::device_backward_in_process<Native>(c, 1, false));
    MESSAGE(std::string(P::name), " ", std::string(Kernel::name),
            (std::is_same_v<E, __half> ? " fp16" : " bf16"), " heads ", a.q_heads, "/", a.kv_heads,
            " d", a.head_dim, ", ", ranks, " ranks: cuDNN dq ", err[0], " dk ", err[1], " dv ",
            err[2], "; native dq ", native[0], " dk ", native[1], " dv ", native[2]);
  }
}
} // namespace

TEST_CASE_TEMPLATE("cuDNN block kernel: device ring forward equals the oracle", P, contiguous,
                   round_robin, zigzag, balanced) {
  for (attention_arguments a : {attention_arguments{8, 2, 128, 0.0f}, {8, 8, 128, 0.0f}}) {
    CAPTURE(a.kv_heads);
    check_forward<P, cudnn_full>(a);
    check_forward<P, cudnn_causal>(a);
  }
}

TEST_CASE_TEMPLATE("cuDNN block kernel: device ring backward equals the oracle", P, contiguous,
                   round_robin, zigzag, balanced) {
  for (attention_arguments a : {attention_arguments{8, 2, 128, 0.0f}, {8, 8, 128, 0.0f}}) {
    CAPTURE(a.kv_heads);
    check_backward<P, cudnn_full, full>(a, true);
    check_backward<P, cudnn_causal, causal>(a, true);
  }
}

TEST_CASE_TEMPLATE("cuDNN block kernel, atomic dQ: device ring backward equals the oracle", P,
                   contiguous, round_robin, zigzag, balanced) {
  // cuDNN's atomic dQ accumulation: the same oracle and tolerances, no bitwise repeat.
  for (attention_arguments a : {attention_arguments{8, 2, 128, 0.0f}, {8, 8, 128, 0.0f}}) {
    CAPTURE(a.kv_heads);
    check_backward<P, atomic_full, full>(a, false);
    check_backward<P, atomic_causal, causal>(a, false);
  }
}

TEST_CASE_TEMPLATE("cuDNN block kernel: packed batches with empty and one-token sequences", P,
                   contiguous, round_robin, zigzag, balanced) {
  using full_k = cudnn_kernel<full_mask, T>;
  using causal_k = cudnn_kernel<causal_mask, T>;
  const attention_arguments a{4, 2, 64, 0.0f};
  test::check_sparse_batches<P, full_k>(a, {1, 2, 3, 4, 5, 6, 7, 8});
  test::check_sparse_batches<P, causal_k>(a, {1, 2, 3, 4, 5, 6, 7, 8});
  test::check_sparse_batches<P, causal_k, all_gather_kv>(a, {1, 2, 3, 4, 8});
  test::check_sparse_batches<P, causal_k, all_to_all_heads>({8, 2, 64, 0.0f}, {1, 2, 4, 8});
}

TEST_CASE("cuDNN block kernel, balanced partitioner: many packed batches over 3 ranks") {
  // Documents kept whole on one rank or split over some of the ranks, each batch of three
  // sequences of 1-300 tokens drawn anew: forward and backward of both masks against the oracle,
  // each rank's gradients through cuDNN's deterministic and atomic dQ.
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 draw(seed);
  const attention_arguments a{8, 2, 128, 0.0f};
  const int batches = std::getenv("RINGATTN_TEST_SMALL") != nullptr ? 3 : 12;
  for (int i = 0; i < batches; ++i) {
    const auto cu = test::random_cu_seqlens(3, 1, 300, draw);
    CAPTURE(i);
    CAPTURE(cu[1]);
    CAPTURE(cu[2] - cu[1]);
    CAPTURE(cu[3] - cu[2]);
    std::mt19937_64 rng(draw());
    test::sharded_backward_case<balanced, T> full_case(cu, 3, a, cudnn_full::mask, rng);
    test::check_device_backward(full_case,
                                test::device_backward_in_process<cudnn_full>(full_case, 1, true));
    test::check_device_backward(full_case,
                                test::device_backward_in_process<atomic_full>(full_case, 1, false));
    test::sharded_backward_case<balanced, T> causal_case(cu, 3, a, cudnn_causal::mask, rng);
    test::check_device_backward(
        causal_case, test::device_backward_in_process<cudnn_causal>(causal_case, 1, true));
    test::check_device_backward(
        causal_case, test::device_backward_in_process<atomic_causal>(causal_case, 1, false));
  }
}

TEST_CASE_TEMPLATE("cuDNN block kernel: NaN and inf in q, k, v or dout reach what the oracle's "
                   "reach",
                   P, contiguous, zigzag) {
  // Element by element, and the max logit NaN for exactly the heads the planted element reached:
  // a NaN or +inf logit makes the row's sum of exponentials NaN, whatever cuDNN's maximum keeps.
  test::check_planted<P, cudnn_causal>({4, 2, 64, 0.0f}, {1, 3});
  test::check_planted<P, cudnn_full>({4, 2, 128, 0.0f}, {1, 3});
}

TEST_CASE("cuDNN block kernel on the all-gather schedule equals the oracle") {
  for (attention_arguments a : {attention_arguments{8, 2, 128, 0.0f}, {8, 1, 128, 0.0f}}) {
    CAPTURE(a.kv_heads);
    test::check_ring_matrix<zigzag, cudnn_causal, all_gather_kv>(a, true);
    test::check_ring_matrix<contiguous, cudnn_full, all_gather_kv>(a, true);
    check_backward<zigzag, cudnn_causal, causal, T, all_gather_kv>(a, true);
    check_backward<round_robin, cudnn_full, full, T, all_gather_kv>(a, true);
  }
}

TEST_CASE_TEMPLATE("cuDNN block kernel with windows: device ring equals the oracle", P, contiguous,
                   round_robin, zigzag, balanced) {
  // A window's band pieces run as cuDNN's top-left diagonal band: a causal window shorter than a
  // shard, a two-sided one, one wider than every sequence; forward and backward.
  using causal_win = cudnn_kernel<causal_window_mask, T>;
  using sliding_win = cudnn_kernel<sliding_window_mask, T>;
  const attention_arguments short_causal{8, 2, 128, 0.0f, 24, 0};
  const attention_arguments two_sided{8, 2, 128, 0.0f, 40, 16};
  const attention_arguments wide{8, 8, 128, 0.0f, 5000, 3};
  check_forward<P, causal_win>(short_causal);
  check_forward<P, sliding_win>(two_sided);
  check_forward<P, sliding_win>(wide);
  check_backward<P, causal_win, causal_window>(short_causal, true);
  check_backward<P, sliding_win, sliding_window>(two_sided, true);
}

TEST_CASE_TEMPLATE("cuDNN block kernel with head_dim 192 and head_dim_v 128 equals the oracle", P,
                   contiguous, zigzag) {
  // q and k 192 wide, v and the output 128 (multi-head latent attention): cuDNN takes the widths
  // itself; V, O, dO and dV have ragged offsets of their own in the packed calls.
  for (const attention_arguments& a :
       {attention_arguments{.q_heads = 8, .kv_heads = 2, .head_dim = 192, .head_dim_v = 128},
        attention_arguments{.q_heads = 4, .kv_heads = 4, .head_dim = 192, .head_dim_v = 128}}) {
    CAPTURE(a.kv_heads);
    check_forward<P, cudnn_causal>(a);
    check_forward<P, cudnn_full>(a);
    if (forward_path_available(forward_path::wgmma, 192, 128)) { // the native path alongside
      check_backward<P, cudnn_causal, causal>(a, true);
      check_backward<P, cudnn_full, full>(a, true);
    }
  }
}

TEST_CASE("cuDNN block kernel: fp16 and head_dim 64") {
  using full16 = cudnn_kernel<full_mask, __half>;
  using causal16 = cudnn_kernel<causal_mask, __half>;
  check_backward<zigzag, causal16, causal, __half>({8, 2, 128, 0.0f}, true);
  check_backward<round_robin, full16, full, __half>({4, 4, 128, 0.0f}, true);
  check_forward<zigzag, cudnn_causal>({8, 2, 64, 0.0f});
  check_backward<contiguous, cudnn_causal, causal>({8, 2, 64, 0.0f}, true);
}

TEST_CASE(
    "cuDNN block kernel: one sequence over several ranks (dense calls of a shard's later rows)") {
  // One sequence per batch: a step's pieces are single, so the calls run dense, and under zigzag
  // and round-robin the later chunk of a rank's queries against a whole block is a dense call
  // whose rows start inside the shard. Backward (deterministic and atomic dQ) and forward against
  // the oracle at P = 2, 3, 4, 8 (1024 tokens: zigzag's chunks at P = 8 are one tile, 64 rows).
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  const attention_arguments a{8, 2, 128, 0.0f};
  const std::vector<std::int32_t> cu{0, small ? 512 : 1024};
  for (int ranks : {2, 3, 4, 8}) {
    if (small && ranks > 4) break; // 512 tokens: chunks below a tile at P = 8 (packed calls)
    CAPTURE(ranks);
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(ranks));
    test::sharded_case<zigzag, T> f(cu, ranks, a, cudnn_causal::mask, rng);
    test::check_device_ring(f, test::device_ring_in_process<cudnn_causal>(f, 1, false));
    test::sharded_backward_case<zigzag, T> zz(cu, ranks, a, cudnn_causal::mask, rng);
    test::check_device_backward(zz, test::device_backward_in_process<cudnn_causal>(zz, 1, true));
    test::check_device_backward(zz, test::device_backward_in_process<atomic_causal>(zz, 1, false));
    test::sharded_backward_case<round_robin, T> rr(cu, ranks, a, cudnn_causal::mask, rng);
    test::check_device_backward(rr, test::device_backward_in_process<cudnn_causal>(rr, 1, true));
    test::sharded_backward_case<contiguous, T> full(cu, ranks, a, cudnn_full::mask, rng);
    test::check_device_backward(full, test::device_backward_in_process<cudnn_full>(full, 1, true));
  }
}

TEST_CASE("cuDNN block kernel: one rank over one sequence writes out, lse, dq, dk, dv directly") {
  // One dense piece covering the rank's queries and keys: the forward's out and lse and the
  // backward's dq, dk, dv come straight from cuDNN (40 tokens: below a tile, the packed path).
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  for (std::int32_t len : {40, 333, 1024}) {
    for (attention_arguments a : {attention_arguments{8, 2, 128, 0.0f}, {4, 4, 64, 0.0f}}) {
      CAPTURE(len);
      CAPTURE(a.kv_heads);
      std::mt19937_64 rng(seed + static_cast<std::uint64_t>(len));
      const std::vector<std::int32_t> cu{0, len};
      test::sharded_case<zigzag, T> f(cu, 1, a, cudnn_causal::mask, rng);
      test::check_device_ring(f, test::device_ring_in_process<cudnn_causal>(f, 1, true));
      test::sharded_backward_case<contiguous, T> full(cu, 1, a, cudnn_full::mask, rng);
      test::check_device_backward(full,
                                  test::device_backward_in_process<cudnn_full>(full, 1, true));
      test::sharded_backward_case<zigzag, T> causal(cu, 1, a, cudnn_causal::mask, rng);
      test::check_device_backward(causal,
                                  test::device_backward_in_process<cudnn_causal>(causal, 1, true));
      test::check_device_backward(
          causal, test::device_backward_in_process<atomic_causal>(causal, 1, false));
    }
  }
}

namespace {
// A one-rank ring's forward and backward captured in a CUDA graph: the graph's launches give the
// eager call's bits (out, lse, dq, dk, dv), each into poisoned outputs.
template <class Kernel>
void check_captured(const std::vector<std::int32_t>& cu) {
  const attention_arguments a{8, 2, 128, 0.0f};
  const int qh = a.q_heads, kvh = a.kv_heads, d = a.head_dim;
  std::mt19937_64 rng(test::fresh_seed());
  in_process_group group(1);
  auto comm = group.communicator(0);
  ring_attention<zigzag, in_process_communicator, Kernel> attn(comm, a, cu);
  attn.prepare_device();
  const std::int64_t n = attn.local_tokens();
  const auto q_elems = static_cast<std::size_t>(n * qh * d);
  const auto kv_elems = static_cast<std::size_t>(n * kvh * d);
  test::device_buffer<T> q(test::random_buffer<T>(q_elems, rng)),
      k(test::random_buffer<T>(kv_elems, rng)), v(test::random_buffer<T>(kv_elems, rng)),
      dout(test::random_buffer<T>(q_elems, rng));
  test::device_buffer<T> out(q_elems), dq(q_elems), dk(kv_elems), dv(kv_elems);
  test::device_buffer<float> lse(static_cast<std::size_t>(n * qh));
  const std::size_t bytes = std::max(attn.template device_workspace_bytes<T>(),
                                     attn.template device_backward_workspace_bytes<T>());
  test::device_buffer<std::byte> ws(bytes);
  cudaStream_t stream;
  RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto enqueue = [&] {
    attn.forward(thd_view<const T>(q.get(), n, qh, d), thd_view<const T>(k.get(), n, kvh, d),
                 thd_view<const T>(v.get(), n, kvh, d), thd_view<T>(out.get(), n, qh, d), lse.get(),
                 ws.get(), bytes, stream);
    attn.backward(thd_view<const T>(q.get(), n, qh, d), thd_view<const T>(k.get(), n, kvh, d),
                  thd_view<const T>(v.get(), n, kvh, d), thd_view<const T>(out.get(), n, qh, d),
                  lse.get(), thd_view<const T>(dout.get(), n, qh, d),
                  thd_view<T>(dq.get(), n, qh, d), thd_view<T>(dk.get(), n, kvh, d),
                  thd_view<T>(dv.get(), n, kvh, d), ws.get(), bytes, stream);
  };
  auto poison_all = [&] {
    out.upload(std::vector<T>(q_elems, test::poison<T>()));
    dq.upload(std::vector<T>(q_elems, test::poison<T>()));
    dk.upload(std::vector<T>(kv_elems, test::poison<T>()));
    dv.upload(std::vector<T>(kv_elems, test::poison<T>()));
    lse.upload(std::vector<float>(lse.size(), -7.0f));
  };
  auto same = [](const auto& x, const auto& y) {
    return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])) == 0;
  };
  poison_all();
  enqueue();
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto want_out = out.download(), want_dq = dq.download(), want_dk = dk.download(),
             want_dv = dv.download();
  const auto want_lse = lse.download();
  cudaGraph_t graph = nullptr;
  RINGATTN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    enqueue();
  } catch (...) {
    // End the capture so that later work on this thread is not captured too.
    if (cudaStreamEndCapture(stream, &graph) == cudaSuccess && graph) cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    throw;
  }
  RINGATTN_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  RINGATTN_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int launch = 0; launch < 2; ++launch) {
    CAPTURE(launch);
    poison_all();
    RINGATTN_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
    CHECK(same(out.download(), want_out));
    CHECK(same(lse.download(), want_lse));
    CHECK(same(dq.download(), want_dq));
    CHECK(same(dk.download(), want_dk));
    CHECK(same(dv.download(), want_dv));
  }
  RINGATTN_CUDA_CHECK(cudaGraphExecDestroy(exec));
  RINGATTN_CUDA_CHECK(cudaGraphDestroy(graph));
  RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
}
} // namespace

TEST_CASE("cuDNN block kernel: a one-rank ring's forward and backward replay from a CUDA graph") {
  // One sequence (cuDNN writes the outputs directly) and a packed batch (the pieces, the merge
  // and add kernels, the fp32 sums), with the native kernels alongside.
  for (const std::vector<std::int32_t>& cu :
       {std::vector<std::int32_t>{0, 500}, std::vector<std::int32_t>{0, 100, 377, 380}}) {
    CAPTURE(cu.size());
    check_captured<cudnn_causal>(cu);
    check_captured<cudnn_full>(cu);
    check_captured<causal>(cu);
  }
}

TEST_CASE("cuDNN block kernel: a block whose backward workspace exceeds the device is refused at "
          "plan time") {
  // One rank over 64K tokens with 32 query heads: the deterministic backward's dP alone is
  // 65536^2 x 32 x 2 bytes = 256 GiB.
  const std::vector<std::int32_t> cu{0, 65536};
  in_process_group group(1);
  auto comm = group.communicator(0);
  ring_attention<contiguous, in_process_communicator, cudnn_full> attn(comm, {32, 8, 128, 0.0f},
                                                                       cu);
  CHECK_THROWS_WITH_AS(attn.prepare_device(), doctest::Contains("GiB of workspace"),
                       invalid_argument);
}

TEST_CASE("cuDNN block kernel: views it cannot take are refused before anything runs") {
  const std::vector<std::int32_t> cu{0, 100};
  in_process_group group(1);
  auto comm = group.communicator(0);
  ring_attention<zigzag, in_process_communicator, cudnn_causal> attn(comm, {4, 4, 64, 0.0f}, cu);
  CHECK_THROWS_WITH_AS((void)attn.device_workspace_bytes<T>(),
                       doctest::Contains("call prepare_device() before"), invalid_argument);
  attn.prepare_device();
  const std::int64_t n = attn.local_tokens();
  const std::size_t bytes = attn.device_workspace_bytes<T>();
  CHECK(bytes > attn.host_workspace_bytes<T>()); // cuDNN's workspace and the packed outputs
  test::device_buffer<T> q(n * 8 * 64), k(n * 4 * 64), v(n * 4 * 64), out(n * 4 * 64);
  test::device_buffer<float> lse(n * 4);
  test::device_buffer<std::byte> ws(bytes);
  // q with a token stride of 8 heads: valid for the native kernels, not for the planned graph.
  try {
    attn.forward(thd_view<const T>(q.get(), n, 4, 64, 8 * 64, 64),
                 thd_view<const T>(k.get(), n, 4, 64), thd_view<const T>(v.get(), n, 4, 64),
                 thd_view<T>(out.get(), n, 4, 64), lse.get(), ws.get(), bytes, nullptr);
    FAIL("a strided q was accepted");
  } catch (const invalid_argument& e) {
    CHECK(std::string(e.what()).find("needs dense q, k and v") != std::string::npos);
  }
}
