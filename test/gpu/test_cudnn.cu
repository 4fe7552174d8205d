// The cuDNN block kernel (ringattn::cudnn_kernel): the device ring's matrix with cuDNN computing
// every block — every partitioner x {full, causal} x P in {1, 2, 3, 4, 8} virtual ranks x GQA
// 1 and 4, packed batches of odd lengths, forward and backward against the float64 oracle;
// fp16 and head_dim 64; repeatability; bad views refused before anything runs.
// Tolerances (bf16): forward 8e-3 relative L2 on O and 2e-3 absolute on LSE, as the native
// kernels; backward 1e-2 relative L2 on each of dQ, dK, dV (each block's gradients pass through
// bf16 once before the fp32 sums: the errors against the native path are printed). Both
// directions repeat bit for bit.
#include "device_ring.cuh"

#include <ringattn/cudnn.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>

#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <type_traits>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;

template <class P, class Kernel>
void check_forward(attention_arguments a) {
  test::check_ring_matrix<P, Kernel>(a, /*repeat_every_p=*/true);
}

template <class P, class Kernel, class Native, class E = T>
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
    const auto err =
        test::check_device_backward(c, test::device_backward_in_process<Kernel>(c, 1, repeat));
    const auto native =
        test::check_device_backward(c, test::device_backward_in_process<Native>(c, 1, false));
    MESSAGE(std::string(P::name), ' ', std::string(Kernel::name),
            (std::is_same_v<E, __half> ? " fp16" : " bf16"), " heads ", a.q_heads, '/', a.kv_heads,
            " d", a.head_dim, ", ", ranks, " ranks: cuDNN dq ", err[0], " dk ", err[1], " dv ",
            err[2], "; native dq ", native[0], " dk ", native[1], " dv ", native[2]);
  }
}
} // namespace

TEST_CASE_TEMPLATE("cuDNN block kernel: device ring forward equals the oracle", P, contiguous,
                   round_robin, zigzag) {
  for (attention_arguments a : {attention_arguments{8, 2, 128, 0.0f}, {8, 8, 128, 0.0f}}) {
    CAPTURE(a.kv_heads);
    check_forward<P, cudnn_full>(a);
    check_forward<P, cudnn_causal>(a);
  }
}

TEST_CASE_TEMPLATE("cuDNN block kernel: device ring backward equals the oracle", P, contiguous,
                   round_robin, zigzag) {
  for (attention_arguments a : {attention_arguments{8, 2, 128, 0.0f}, {8, 8, 128, 0.0f}}) {
    CAPTURE(a.kv_heads);
    check_backward<P, cudnn_full, full>(a, true);
    check_backward<P, cudnn_causal, causal>(a, true);
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
