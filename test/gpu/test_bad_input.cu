// The bad-input matrix, device side (docs/reliability.md): each bad input to the device forward
// or the CUDA block kernel is refused with an `invalid_argument` naming the problem before any
// kernel is launched (the library's launches are counted: RINGATTN_COUNT_LAUNCHES), nothing is
// sent, and the poisoned output and lse are untouched.
// (Other-device cases need two GPUs: test/multi_gpu/test_other_device.cu.)
#include "../support/bad_device_call.cuh"

#include <ringattn/block/device/backward.cuh>
#include <ringattn/block/device/forward.cuh>

#include <doctest/doctest.h>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
using test::device_call;
using test::forward_with;

struct device_case {
  const char* input;
  const char* error;
  std::function<void(device_call&)> breaks;
};

const std::vector<device_case>& device_cases() {
  static const std::vector<device_case> cases = {
      {"forward before prepare_device()", "prepare_device() must run before the device forward",
       [](device_call& c) { c.prepare = false; }},
      {"q in host memory", "q is host memory; the device forward takes device memory",
       [](device_call& c) { c.qv.data = c.host_q.data(); }},
      {"the workspace in host memory", "the workspace is host memory",
       [](device_call& c) { c.ws_ptr = c.host_ws.data(); }},
      {"q not 16-byte aligned", "q must be 16-byte aligned",
       [](device_call& c) {
         // 8 bytes in: element-aligned (the host check passes), not vector-aligned.
         c.qv = thd_view<const T>(c.q.get() + 4, device_call::n - 1, 8, 64);
         c.qv.tokens = device_call::n;
       }},
      {"q with a token stride that is not a multiple of 8", "q must be 16-byte aligned",
       [](device_call& c) {
         c.qv = thd_view<const T>(c.q.get(), 150, 8, 64, 8 * 64 * 2 - 4, 64);
         c.qv.tokens = device_call::n;
       }},
      {"a device workspace that is too small", "the workspace has",
       [](device_call& c) { c.ws_bytes -= 256; }},
      {"a device workspace that is misaligned", "the workspace must be 16-byte aligned",
       [](device_call& c) { c.ws_ptr = c.ws.get() + 8; }},
      {"lse is a null pointer", "lse is a null pointer",
       [](device_call& c) { c.lse_ptr = nullptr; }},
  };
  return cases;
}
} // namespace

TEST_CASE("bad device inputs: a clear error, no kernel launched, nothing sent or written") {
  test::check_bad_cases(device_cases(), forward_with);
  // The unbroken call runs: it launches kernels and writes (so the checks above can fail).
  bool clean = true;
  CHECK(forward_with([](device_call&) {}, clean) == "");
  CHECK_FALSE(clean);
}

namespace {
// A BlockKernel model whose device forward computes no max logit (a third party's, say): the
// native causal kernel declaring so.
struct causal_without_max_logit : causal {
  static constexpr bool device_max_logit = false;
  static constexpr const char* name = "causal_without_max_logit";
};
} // namespace

TEST_CASE("a BlockKernel that computes no max logit on the device: a call asking for it is refused "
          "before anything runs, one without it runs") {
  const std::vector<std::int32_t> cu{0, 100, 300};
  in_process_group group(1);
  auto comm = group.communicator(0);
  ring_attention<zigzag, in_process_communicator, causal_without_max_logit> attn(
      comm, {8, 2, 64, 0.0f}, cu);
  attn.prepare_device();
  device_call c(attn.device_workspace_bytes<T>());
  test::device_buffer<float> max_logit(std::vector<float>(8, 7.0f));
  const std::uint64_t launches = detail::kernel_launches.load();
  CHECK_THROWS_WITH_AS(attn.forward<T>(c.qv, c.kv, c.vv, c.ov, c.lse_ptr, max_logit.get(), c.ws_ptr,
                                       c.ws_bytes, nullptr),
                       doctest::Contains("the BlockKernel causal_without_max_logit computes no max "
                                         "logit on the device"),
                       invalid_argument);
  CHECK(detail::kernel_launches.load() == launches);
  CHECK(c.untouched());
  CHECK(max_logit.download() == std::vector<float>(8, 7.0f));
  // The same ring without it runs (so the checks above can fail).
  attn.forward<T>(c.qv, c.kv, c.vv, c.ov, c.lse_ptr, nullptr, c.ws_ptr, c.ws_bytes, nullptr);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(detail::kernel_launches.load() > launches);
  CHECK_FALSE(c.untouched());
}

TEST_CASE("the CUDA block kernel refuses fp32 inputs and a schedule made for other shapes") {
  const attention_arguments a{4, 2, 64, 0.0f};
  test::device_buffer<float> qf(64 * 4 * 64), kf(64 * 2 * 64), o(64 * 4 * 64), lse(64 * 4),
      sum(64 * 4);
  block_group g{0, 64, 1, {}};
  g.kv[0] = {0, 64, band{}};
  const std::vector<block_group> groups{g};
  const device_block_schedule sched(groups, 64, 64, 64);
  const attention_state st{o.get(), lse.get(), sum.get(), 64, 4, 64};
  const std::uint64_t launches = detail::kernel_launches.load();
  const block_forward_args<float> fa{
      {qf.get(), 64, 4, 64}, {kf.get(), 64, 2, 64}, {kf.get(), 64, 2, 64}, a, st};
  CHECK(validate_device_forward(fa, sched).reason().find(
            "the CUDA block kernel takes fp16 or bf16 inputs (got fp32)") != std::string::npos);
  test::device_buffer<T> q(128 * 4 * 64), k(128 * 2 * 64);
  const attention_state st2{o.get(), lse.get(), sum.get(), 64, 4, 64};
  const block_forward_args<T> other{
      {q.get(), 64, 4, 64}, {k.get(), 128, 2, 64}, {k.get(), 128, 2, 64}, a, st2};
  CHECK_THROWS_WITH_AS(block_forward(other, sched, nullptr),
                       doctest::Contains("the schedule was made for 64 query and 64 key tokens"),
                       invalid_argument);
  CHECK(detail::kernel_launches.load() == launches);
}

TEST_CASE("block_forward_plain and block_forward_last refuse an out (and plain an lse) that is not "
          "4-byte aligned") {
  // The kernels store pairs of elements: an out 2 bytes off is element-aligned (the view check
  // passes) and must still be refused before anything is launched or written.
  const attention_arguments a{4, 2, 64, 0.0f};
  constexpr std::int64_t n = 64;
  test::device_buffer<T> q(n * 4 * 64), k(n * 2 * 64), out(n * 4 * 64 + 8);
  test::device_buffer<float> o(n * 4 * 64), lse(n * 4), sum(n * 4);
  block_group g{0, n, 1, {}};
  g.kv[0] = {0, n, band{}};
  const std::vector<block_group> groups{g};
  const device_block_schedule sched(groups, n, n, 64);
  const attention_state st{o.get(), lse.get(), sum.get(), n, 4, 64};
  const block_forward_args<T> args{
      {q.get(), n, 4, 64}, {k.get(), n, 2, 64}, {k.get(), n, 2, 64}, a, st};
  const std::uint64_t launches = detail::kernel_launches.load();
  const thd_view<T> odd(out.get() + 1, n, 4, 64);
  CHECK_THROWS_WITH_AS(block_forward_plain(args, sched, odd, lse.get(), nullptr),
                       doctest::Contains("out must be 4-byte aligned"), invalid_argument);
  CHECK_THROWS_WITH_AS(block_forward_last(args, sched, odd, nullptr),
                       doctest::Contains("out must be 4-byte aligned"), invalid_argument);
  // block_forward_plain's lse: a float pointer 2 bytes off (a byte-offset cast) and a null one.
  const thd_view<T> even(out.get() + 2, n, 4, 64);
  float* odd_lse = reinterpret_cast<float*>(reinterpret_cast<std::byte*>(lse.get()) + 2);
  CHECK_THROWS_WITH_AS(block_forward_plain(args, sched, even, odd_lse, nullptr),
                       doctest::Contains("lse must be 4-byte aligned"), invalid_argument);
  CHECK_THROWS_WITH_AS(block_forward_plain(args, sched, even, nullptr, nullptr),
                       doctest::Contains("lse is a null pointer"), invalid_argument);
  CHECK(detail::kernel_launches.load() == launches);
  // The same call with an aligned out and lse is accepted (so the checks above can fail).
  CHECK_NOTHROW(block_forward_plain(args, sched, even, lse.get(), nullptr));
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(detail::kernel_launches.load() > launches);
}

TEST_CASE("bad device backward inputs: a clear error, no kernel launched, nothing sent") {
  const std::vector<std::int32_t> cu{0, 100, 300};
  const attention_arguments a{8, 2, 64, 0.0f};
  const std::int64_t n = 300;
  in_process_group group(1);
  auto comm = group.communicator(0);
  ring_attention<zigzag, in_process_communicator, causal> attn(comm, a, cu);
  test::device_buffer<T> q(n * 8 * 64), k(n * 2 * 64), v(n * 2 * 64), out(n * 8 * 64),
      dout(n * 8 * 64), dq(n * 8 * 64), dk(n * 2 * 64), dv(n * 2 * 64);
  test::device_buffer<float> lse(n * 8);
  const std::size_t bytes = attn.device_backward_workspace_bytes<T>();
  test::device_buffer<std::byte> ws(bytes);
  std::vector<T> host_dq(static_cast<std::size_t>(n * 8 * 64));
  const thd_view<const T> qv(q.get(), n, 8, 64), doutv(dout.get(), n, 8, 64);
  auto backward = [&](T* dq_ptr, std::size_t ws_bytes, thd_view<const T> qx = {},
                      thd_view<const T> doutx = {}) -> std::string {
    const std::uint64_t launches = detail::kernel_launches.load();
    std::string what;
    try {
      attn.backward<T>(qx.data ? qx : qv, {k.get(), n, 2, 64}, {v.get(), n, 2, 64},
                       {out.get(), n, 8, 64}, lse.get(), doutx.data ? doutx : doutv,
                       {dq_ptr, n, 8, 64}, {dk.get(), n, 2, 64}, {dv.get(), n, 2, 64}, ws.get(),
                       ws_bytes, nullptr);
    } catch (const invalid_argument& e) {
      what = e.what();
    }
    CHECK(detail::kernel_launches.load() == launches);
    CHECK(comm.bytes_sent() == 0);
    return what;
  };
  CHECK(backward(dq.get(), bytes).find("prepare_device() must run before the device backward") !=
        std::string::npos);
  attn.prepare_device();
  CHECK(backward(host_dq.data(), bytes)
            .find("dq is host memory; the device backward takes device memory") !=
        std::string::npos);
  CHECK(backward(dq.get(), bytes - 4).find("the workspace has") != std::string::npos);
  // The block backward reads q and dout in place with 16-byte loads: q 8 bytes in (element-
  // aligned, so the view check passes) and dout with a token stride of 2 x 8 x 64 - 4 elements.
  test::device_buffer<T> spare(n * 8 * 64 * 2 + 8);
  const thd_view<const T> q_off(spare.get() + 4, n, 8, 64);
  thd_view<const T> dout_odd(spare.get(), 150, 8, 64, 8 * 64 * 2 - 4, 64);
  dout_odd.tokens = n;
  CHECK(backward(dq.get(), bytes, q_off).find("q and dout must be 16-byte aligned") !=
        std::string::npos);
  CHECK(backward(dq.get(), bytes, {}, dout_odd).find("q and dout must be 16-byte aligned") !=
        std::string::npos);
}

TEST_CASE("the CUDA block backward refuses misaligned inputs, gradients, lse and delta") {
  const attention_arguments a{4, 2, 64, 0.0f};
  constexpr std::int64_t n = 64;
  test::device_buffer<T> q(n * 4 * 64 + 8), k(n * 2 * 64 + 8), dout(n * 4 * 64);
  test::device_buffer<float> lse(n * 4 + 4), delta(n * 4), dq(n * 4 * 64 + 4), dk(n * 2 * 64),
      dv(n * 2 * 64);
  block_group g{0, n, 1, {}};
  g.kv[0] = {0, n, band{}};
  const std::vector<block_group> groups{g};
  const device_backward_schedule sched(groups, n, n);
  REQUIRE(sched.tensor_cores(64)); // every GPU these tests run on (sm_80 and later)
  const block_backward_args<T> good{{q.get(), n, 4, 64},
                                    {k.get(), n, 2, 64},
                                    {k.get(), n, 2, 64},
                                    {dout.get(), n, 4, 64},
                                    lse.get(),
                                    delta.get(),
                                    a,
                                    {dq.get(), dk.get(), dv.get()}};
  const std::uint64_t launches = detail::kernel_launches.load();
  auto with = [&](auto change) {
    block_backward_args<T> x = good;
    change(x);
    return x;
  };
  // k 8 bytes in: element-aligned (the view check passes), not vector-aligned.
  CHECK_THROWS_WITH_AS(block_backward(with([&](auto& x) {
                                        x.k = {k.get() + 4, n, 2, 64};
                                      }),
                                      sched, nullptr),
                       doctest::Contains("q, k, v and dout must be 16-byte aligned"),
                       invalid_argument);
  // dq 4 bytes in: float-aligned, not pair-aligned.
  CHECK_THROWS_WITH_AS(
      block_backward(with([&](auto& x) { x.grad.dq = dq.get() + 1; }), sched, nullptr),
      doctest::Contains("dq, dk and dv must be 8-byte aligned"), invalid_argument);
  // lse 2 bytes off (a byte-offset cast).
  const float* odd_lse =
      reinterpret_cast<const float*>(reinterpret_cast<const std::byte*>(lse.get()) + 2);
  CHECK_THROWS_WITH_AS(block_backward(with([&](auto& x) { x.lse = odd_lse; }), sched, nullptr),
                       doctest::Contains("lse and delta must be 4-byte aligned"), invalid_argument);
  CHECK(detail::kernel_launches.load() == launches);
  // The unbroken call is accepted and runs (so the checks above can fail).
  CHECK_NOTHROW(block_backward(good, sched, nullptr));
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(detail::kernel_launches.load() > launches);
}
