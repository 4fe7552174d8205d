// The bad-input matrix, device side (docs/reliability.md): each bad input to the device forward
// or the CUDA block kernel is refused with an `invalid_argument` naming the problem before any
// kernel is launched (the library's launches are counted: RINGATTN_COUNT_LAUNCHES), nothing is
// sent, and the poisoned output and lse are untouched.
#include "../common.hpp"
#include "device_buffer.cuh"

#include <ringattn/comm/in_process.cuh>
#include <ringattn/kernel/forward.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#if !defined(RINGATTN_COUNT_LAUNCHES)
#error "the gpu suite counts the library's kernel launches (RINGATTN_COUNT_LAUNCHES)"
#endif

using namespace ringattn;

namespace {
using T = __nv_bfloat16;

//! One rank's valid device call (P = 1, 300 tokens, 8 q heads, 2 kv heads, head_dim 64) whose
//! pieces a case may replace.
struct device_call {
  static constexpr std::int64_t n = 300;
  test::device_buffer<T> q{std::vector<T>(n * 8 * 64, T(0.5f))},
      k{std::vector<T>(n * 2 * 64, T(0.25f))}, v{std::vector<T>(n * 2 * 64, T(1.0f))},
      out{std::vector<T>(n * 8 * 64, test::poison<T>())};
  test::device_buffer<float> lse{std::vector<float>(n * 8, -7.0f)};
  std::vector<T> host_q = std::vector<T>(n * 8 * 64, T(0.5f));
  std::vector<std::byte> host_ws;
  test::device_buffer<std::byte> ws;
  thd_view<const T> qv{q.get(), n, 8, 64}, kv{k.get(), n, 2, 64}, vv{v.get(), n, 2, 64};
  thd_view<T> ov{out.get(), n, 8, 64};
  float* lse_ptr = lse.get();
  void* ws_ptr = nullptr;
  std::size_t ws_bytes = 0;
  cudaStream_t stream = nullptr;
  bool prepare = true;
  int device_at_call = -1; // >= 0: made current after prepare_device(), for the call only

  explicit device_call(std::size_t bytes) : host_ws(bytes), ws(bytes + 64) {
    ws_ptr = ws.get();
    ws_bytes = bytes;
  }
  bool untouched() const {
    const T p = test::poison<T>();
    for (const T& x : out.download())
      if (std::memcmp(&x, &p, sizeof(T)) != 0) return false;
    for (float x : lse.download())
      if (x != -7.0f) return false;
    return true;
  }
};

struct device_case {
  const char* input;
  const char* error;
  std::function<void(device_call&)> breaks;
};

//! Runs the device forward after `breaks`; returns what it threw, and whether nothing was
//! launched, sent or written.
std::string forward_with(const std::function<void(device_call&)>& breaks, bool& clean) {
  const std::vector<std::int32_t> cu{0, 100, 300};
  in_process_group group(1);
  auto comm = group.communicator(0);
  ring_attention<zigzag, in_process_communicator, causal> attn(comm, {8, 2, 64, 0.0f}, cu);
  device_call c(attn.device_workspace_bytes<T>());
  breaks(c);
  if (c.prepare) attn.prepare_device();
  cudaStream_t stream;
  RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  if (c.stream == nullptr) c.stream = stream;
  const std::uint64_t launches = detail::kernel_launches.load();
  int device = 0;
  RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
  if (c.device_at_call >= 0) RINGATTN_CUDA_CHECK(cudaSetDevice(c.device_at_call));
  std::string what;
  try {
    attn.forward<T>(c.qv, c.kv, c.vv, c.ov, c.lse_ptr, c.ws_ptr, c.ws_bytes, c.stream);
  } catch (const invalid_argument& e) {
    what = e.what();
  }
  RINGATTN_CUDA_CHECK(cudaSetDevice(device));
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  clean = detail::kernel_launches.load() == launches && comm.bytes_sent() == 0 && c.untouched();
  return what;
}

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

TEST_CASE("a stream or current device other than the prepared one is refused") {
  int devices = 0;
  RINGATTN_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices < 2) {
    MESSAGE("one GPU: the other-device cases need two (skipped)");
    return;
  }
  RINGATTN_CUDA_CHECK(cudaSetDevice(0));
  bool clean = false;
  cudaStream_t other = nullptr;
  std::string what = forward_with(
      [&](device_call& c) {
        RINGATTN_CUDA_CHECK(cudaSetDevice(1));
        RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
        RINGATTN_CUDA_CHECK(cudaSetDevice(0));
        c.stream = other;
      },
      clean);
  CHECK(what.find("the stream belongs to device 1; this rank runs on device 0") !=
        std::string::npos);
  CHECK(clean);
  RINGATTN_CUDA_CHECK(cudaStreamDestroy(other));

  what = forward_with([](device_call& c) { c.device_at_call = 1; }, clean);
  CHECK(what.find("the current device is 1 but prepare_device() ran on 0") != std::string::npos);
  CHECK(clean);

  void* far = nullptr; // q's bytes on device 1
  RINGATTN_CUDA_CHECK(cudaSetDevice(1));
  RINGATTN_CUDA_CHECK(cudaMalloc(&far, device_call::n * 8 * 64 * sizeof(T)));
  RINGATTN_CUDA_CHECK(cudaSetDevice(0));
  what = forward_with([&](device_call& c) { c.qv.data = static_cast<const T*>(far); }, clean);
  CHECK(what.find("q is device memory of another device (1; this rank runs on device 0)") !=
        std::string::npos);
  CHECK(clean);
  RINGATTN_CUDA_CHECK(cudaFree(far));
}

TEST_CASE("the CUDA block kernel refuses fp32 inputs and a schedule made for other shapes") {
  const attention_arguments a{4, 2, 64, 0.0f};
  test::device_buffer<float> qf(64 * 4 * 64), kf(64 * 2 * 64), o(64 * 4 * 64), lse(64 * 4);
  block_group g{0, 64, 1, {}};
  g.kv[0] = {0, 64, band{}};
  const std::vector<block_group> groups{g};
  const device_block_schedule sched(groups, 64, 64, 64);
  const attention_state st{o.get(), lse.get(), 64, 4, 64};
  const std::uint64_t launches = detail::kernel_launches.load();
  const block_forward_args<float> fa{
      {qf.get(), 64, 4, 64}, {kf.get(), 64, 2, 64}, {kf.get(), 64, 2, 64}, a, st};
  CHECK(validate_device_forward(fa, sched).reason().find(
            "the CUDA block kernel takes fp16 or bf16 inputs (got fp32)") != std::string::npos);
  test::device_buffer<T> q(128 * 4 * 64), k(128 * 2 * 64);
  const attention_state st2{o.get(), lse.get(), 64, 4, 64};
  const block_forward_args<T> other{
      {q.get(), 64, 4, 64}, {k.get(), 128, 2, 64}, {k.get(), 128, 2, 64}, a, st2};
  CHECK_THROWS_WITH_AS(block_forward(other, sched, nullptr),
                       doctest::Contains("the schedule was made for 64 query and 64 key tokens"),
                       invalid_argument);
  CHECK(detail::kernel_launches.load() == launches);
}
