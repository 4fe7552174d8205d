// The CUDA block backward against the float64 oracle's backward (bands x GQA x head_dim x packed
// odd lengths, fp16 and bf16), K/V split into several calls, bitwise repeatability, validation.
#include "../support/block_case.hpp"
#include "../support/device_buffer.cuh"

#include <ringattn/block/device/backward.cuh>

#include <doctest/doctest.h>

#include <string>

#include <algorithm>
#include <cstdlib>
#include <cstring>

using namespace ringattn;

namespace {

template <class T>
test::block_grads run(const test::block_backward_case<T>& c,
                      const std::vector<std::vector<block_group>>& calls, backward_options path) {
  const auto n = static_cast<std::size_t>(c.tokens());
  const attention_arguments& a = c.args;
  test::device_buffer<T> q(c.q), k(c.k), v(c.v), dout(c.dout);
  test::device_buffer<float> lse(c.lse), delta(c.delta);
  const int dv_width = a.v_dim();
  test::device_buffer<float> dq(std::vector<float>(n * a.q_heads * a.head_dim, 0.0f)),
      dk(std::vector<float>(n * a.kv_heads * a.head_dim, 0.0f)),
      dv(std::vector<float>(n * a.kv_heads * dv_width, 0.0f));
  const auto t = c.tokens();
  for (const auto& groups : calls) {
    const device_backward_schedule s(groups, t, t, path);
    block_backward<T>({{q.get(), t, a.q_heads, a.head_dim},
                       {k.get(), t, a.kv_heads, a.head_dim},
                       {v.get(), t, a.kv_heads, dv_width},
                       {dout.get(), t, a.q_heads, dv_width},
                       lse.get(),
                       delta.get(),
                       a,
                       {dq.get(), dk.get(), dv.get()}},
                      s, nullptr);
  }
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  return {dq.download(), dk.download(), dv.download()};
}

} // namespace

// Tolerances. CUDA cores: fp32 dot products and accumulators, P from the fp32 lse with the fast
// exponential: within 1e-4 relative of the float64 oracle (the host twin, with fp64 terms, is at
// 1e-5). Tensor cores (mma.sync and wgmma): P and dS are rounded to the input type before their
// products (fp32 accumulation), as in FlashAttention: 4e-3 relative for bf16 (8 mantissa bits;
// seen on the H200: at most 1.9e-3), 1e-3 for fp16 (seen: at most 2.2e-4).
TEST_CASE_TEMPLATE("CUDA block backward equals the oracle: bands x GQA x head_dim x kernels", T,
                   __half, __nv_bfloat16) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const double tc_tolerance = std::is_same_v<T, __nv_bfloat16> ? 4e-3 : 1e-3;
  // CUDA cores, mma.sync, wgmma with three (a producer) warpgroups a thread block, in builds with
  // RINGATTN_EXPERIMENTS also with one and two, and the non-deterministic wgmma schedule (the
  // five-product kernel at head_dim 128, whose dQ is not bitwise repeatable).
  std::vector<backward_options> paths{{backward_path::cuda_cores, 0},
                                      {backward_path::tensor_cores, 0}};
  if (backward_path_available(backward_path::wgmma))
    paths.insert(paths.end(), {
#if defined(RINGATTN_EXPERIMENTS)
      {backward_path::wgmma, 1}, {backward_path::wgmma, 2},
#endif
          {backward_path::wgmma, 3}, {
        backward_path::wgmma, 3, false
      }
    });
  else
    MESSAGE("no wgmma kernels here (an sm_90a image on a compute capability 9.0 device)");
  // RINGATTN_TEST_SMALL=1 (compute-sanitizer runs): GQA 1 and 4, head_dim 64 and 128, shorter
  // sequences.
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  double worst[6] = {}; // the largest error seen per path (as in `paths`)
  for (int group : {1, 4, 8})
    for (int d : {64, 128, 256})
      for (const band& b : test::test_bands(rng)) {
        if (small && (group == 8 || d == 256)) continue;
        CAPTURE(group);
        CAPTURE(d);
        CAPTURE(b.lo);
        CAPTURE(b.hi);
        const attention_arguments a{8, 8 / group, d, 0.0f};
        test::block_backward_case<T> c(test::random_cu_seqlens(3, 1, small ? 100 : 150, rng), a, b,
                                       rng);
        for (std::size_t pi = 0; pi < paths.size(); ++pi) {
          const backward_options path = paths[pi];
          if (path.path != backward_path::cuda_cores && d > 128) continue;
          CAPTURE(pi);
          const double tol = path.path == backward_path::cuda_cores ? 1e-4 : tc_tolerance;
          const test::block_grads g = run(c, c.calls(1), path);
          const double e[3] = {test::grad_error(g.dq, c.ref.dq.data),
                               test::grad_error(g.dk, c.ref.dk.data),
                               test::grad_error(g.dv, c.ref.dv.data)};
          CHECK(e[0] < tol);
          CHECK(e[1] < tol);
          CHECK(e[2] < tol);
          worst[pi] = std::max({worst[pi], e[0], e[1], e[2]});
          // The same K/V in three calls (the first two pieces as two key segments of one group).
          const test::block_grads split = run(c, c.calls(3, true), path);
          CHECK(test::grad_error(split.dq, c.ref.dq.data) < tol);
          CHECK(test::grad_error(split.dk, c.ref.dk.data) < tol);
          CHECK(test::grad_error(split.dv, c.ref.dv.data) < tol);
          const test::block_grads again = run(c, c.calls(3, true), path);
          if (path.deterministic)
            CHECK(std::memcmp(again.dq.data(), split.dq.data(), split.dq.size() * 4) == 0);
          else
            CHECK(test::grad_error(again.dq, c.ref.dq.data) < tol);
          CHECK(std::memcmp(again.dk.data(), split.dk.data(), split.dk.size() * 4) == 0);
          CHECK(std::memcmp(again.dv.data(), split.dv.data(), split.dv.size() * 4) == 0);
        }
      }
  std::string seen;
  for (std::size_t i = 0; i < paths.size(); ++i)
    seen += std::string(i ? ", " : "") + to_string(paths[i].path) +
            (paths[i].path == backward_path::wgmma
                 ? " (" + std::to_string(paths[i].wgmma_warpgroups) + " warpgroups" +
                       (paths[i].deterministic ? ")" : ", non-deterministic)")
                 : std::string()) +
            " " + std::to_string(worst[i]);
  MESSAGE("largest relative error: ", seen);
}

// Q/K 192 wide with V 128 (multi-head latent attention): the wgmma kernels only (three
// warpgroups, P^T kept as 16-bit fragments: dS^T from the rounded P, so bf16 is checked at the
// tensor-core tolerance as above); every other path refuses the widths before launching.
TEST_CASE_TEMPLATE("CUDA block backward with head_dim 192 and head_dim_v 128 equals the oracle", T,
                   __half, __nv_bfloat16) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const double tol = std::is_same_v<T, __nv_bfloat16> ? 4e-3 : 1e-3;
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  for (int group : {1, 4})
    for (const band& b : test::test_bands(rng)) {
      CAPTURE(group);
      CAPTURE(b.lo);
      CAPTURE(b.hi);
      const attention_arguments a{
          .q_heads = 8, .kv_heads = 8 / group, .head_dim = 192, .head_dim_v = 128};
      test::block_backward_case<T> c(test::random_cu_seqlens(3, 1, small ? 100 : 300, rng), a, b,
                                     rng);
      const auto t = c.tokens();
      for (backward_path refused : {backward_path::cuda_cores, backward_path::tensor_cores}) {
        const device_backward_schedule s(c.calls(1)[0], t, t, refused);
        CHECK(s.supports(192, 128).reason().find("runs only on the wgmma block backward") !=
              std::string::npos);
      }
      if (!backward_path_available(backward_path::wgmma)) continue;
      const test::block_grads g = run(c, c.calls(1), {backward_path::wgmma, 3});
      const double e[3] = {test::grad_error(g.dq, c.ref.dq.data),
                           test::grad_error(g.dk, c.ref.dk.data),
                           test::grad_error(g.dv, c.ref.dv.data)};
      MESSAGE("192/128 group ", group, " band [", b.lo, ", ", b.hi, "]: dq ", e[0], ", dk ", e[1],
              ", dv ", e[2]);
      CHECK(e[0] < tol);
      CHECK(e[1] < tol);
      CHECK(e[2] < tol);
      const test::block_grads split = run(c, c.calls(3, true), {backward_path::wgmma, 3});
      CHECK(test::grad_error(split.dq, c.ref.dq.data) < tol);
      CHECK(test::grad_error(split.dk, c.ref.dk.data) < tol);
      CHECK(test::grad_error(split.dv, c.ref.dv.data) < tol);
      const test::block_grads again = run(c, c.calls(3, true), {backward_path::wgmma, 3});
      CHECK(std::memcmp(again.dk.data(), split.dk.data(), split.dk.size() * 4) == 0);
      CHECK(std::memcmp(again.dv.data(), split.dv.data(), split.dv.size() * 4) == 0);
      CHECK(std::memcmp(again.dq.data(), split.dq.data(), split.dq.size() * 4) == 0);
    }
}

TEST_CASE("CUDA block backward validates before launching") {
  std::mt19937_64 rng(test::fresh_seed());
  const attention_arguments a{4, 2, 64, 0.0f};
  test::block_backward_case<__nv_bfloat16> c({0, 20}, a, band{}, rng);
  const auto groups = c.calls(1)[0];
  const device_backward_schedule s(groups, 20, 20);
  const device_backward_schedule other(groups, 20, 30);
  test::device_buffer<__nv_bfloat16> q(c.q), k(c.k), dout(c.dout);
  test::device_buffer<float> f(20 * 4 * 64);
  const std::uint64_t launches = detail::kernel_launches.load();
  block_backward_args<__nv_bfloat16> x{{q.get(), 20, 4, 64},
                                       {k.get(), 20, 2, 64},
                                       {k.get(), 20, 2, 64},
                                       {dout.get(), 20, 4, 64},
                                       f.get(),
                                       f.get(),
                                       a,
                                       {f.get(), nullptr, f.get()}};
  CHECK_THROWS_WITH_AS(block_backward(x, s, nullptr), "ringattn: dk or dv is a null pointer",
                       invalid_argument);
  x.grad.dk = f.get();
  CHECK_THROWS_WITH_AS(block_backward(x, other, nullptr),
                       doctest::Contains("the schedule was made for 20 query and 30 key tokens"),
                       invalid_argument);
  CHECK(detail::kernel_launches.load() == launches);
}

// The five-product kernel (a non-deterministic schedule, head_dim 128, wgmma) adds dQ in 16-byte
// pieces: a dq that is 8-byte but not 16-byte aligned is refused before anything launches, and
// the same call with an aligned dq then runs and equals the oracle.
TEST_CASE("CUDA block backward: the non-deterministic kernel refuses a dq it cannot add to") {
  if (!backward_path_available(backward_path::wgmma)) {
    MESSAGE("no wgmma kernels here (an sm_90a image on a compute capability 9.0 device)");
    return;
  }
  std::mt19937_64 rng(test::fresh_seed());
  const attention_arguments a{4, 2, 128, 0.0f};
  test::block_backward_case<__nv_bfloat16> c({0, 70}, a, band{}, rng);
  const device_backward_schedule s(c.calls(1)[0], 70, 70, {backward_path::wgmma, 3, false});
  REQUIRE(s.five_products(128, 128));
  test::device_buffer<__nv_bfloat16> q(c.q), k(c.k), v(c.v), dout(c.dout);
  test::device_buffer<float> lse(c.lse), delta(c.delta);
  test::device_buffer<float> dq(std::vector<float>(70 * 4 * 128 + 2, 0.0f)),
      dk(std::vector<float>(70 * 2 * 128, 0.0f)), dv(std::vector<float>(70 * 2 * 128, 0.0f));
  block_backward_args<__nv_bfloat16> x{{q.get(), 70, 4, 128},
                                       {k.get(), 70, 2, 128},
                                       {v.get(), 70, 2, 128},
                                       {dout.get(), 70, 4, 128},
                                       lse.get(),
                                       delta.get(),
                                       a,
                                       {dq.get() + 2, dk.get(), dv.get()}};
  const std::uint64_t launches = detail::kernel_launches.load();
  CHECK_THROWS_WITH_AS(block_backward(x, s, nullptr),
                       doctest::Contains("dq must be 16-byte aligned"), invalid_argument);
  CHECK(detail::kernel_launches.load() == launches);
  x.grad.dq = dq.get();
  block_backward(x, s, nullptr);
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> got = dq.download();
  got.resize(70 * 4 * 128);
  CHECK(test::grad_error(got, c.ref.dq.data) < 4e-3);
  CHECK(test::grad_error(dk.download(), c.ref.dk.data) < 4e-3);
}
