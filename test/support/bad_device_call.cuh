#pragma once
// One rank's valid device forward (P = 1, in-process, zigzag causal) whose pieces a bad-input case
// may replace, and the runner that reports what the forward threw and whether it stayed clean
// (no kernel launched: RINGATTN_COUNT_LAUNCHES; nothing sent; poisoned outputs untouched).
// Shared by the one-GPU bad-input matrix and the multi-GPU suite's other-device cases.
#include "common.hpp"
#include "device_buffer.cuh"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#if !defined(RINGATTN_COUNT_LAUNCHES)
#error "bad-input tests count the library's kernel launches (RINGATTN_COUNT_LAUNCHES)"
#endif

namespace ringattn::test {
namespace {
using bad_call_t = __nv_bfloat16;

//! One rank's valid device call (P = 1, 300 tokens, 8 q heads, 2 kv heads, head_dim 64) whose
//! pieces a case may replace.
struct device_call {
  static constexpr std::int64_t n = 300;
  device_buffer<bad_call_t> q{std::vector<bad_call_t>(n * 8 * 64, bad_call_t(0.5f))},
      k{std::vector<bad_call_t>(n * 2 * 64, bad_call_t(0.25f))},
      v{std::vector<bad_call_t>(n * 2 * 64, bad_call_t(1.0f))},
      out{std::vector<bad_call_t>(n * 8 * 64, poison<bad_call_t>())};
  device_buffer<float> lse{std::vector<float>(n * 8, -7.0f)};
  std::vector<bad_call_t> host_q = std::vector<bad_call_t>(n * 8 * 64, bad_call_t(0.5f));
  std::vector<std::byte> host_ws;
  device_buffer<std::byte> ws;
  thd_view<const bad_call_t> qv{q.get(), n, 8, 64}, kv{k.get(), n, 2, 64}, vv{v.get(), n, 2, 64};
  thd_view<bad_call_t> ov{out.get(), n, 8, 64};
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
    const bad_call_t p = poison<bad_call_t>();
    for (const bad_call_t& x : out.download())
      if (std::memcmp(&x, &p, sizeof(bad_call_t)) != 0) return false;
    for (float x : lse.download())
      if (x != -7.0f) return false;
    return true;
  }
};

//! Runs the device forward after `breaks`; returns what it threw, and whether nothing was
//! launched, sent or written.
std::string forward_with(const std::function<void(device_call&)>& breaks, bool& clean) {
  const std::vector<std::int32_t> cu{0, 100, 300};
  in_process_group group(1);
  auto comm = group.communicator(0);
  ring_attention<zigzag, in_process_communicator, causal> attn(comm, {8, 2, 64, 0.0f}, cu);
  device_call c(attn.device_workspace_bytes<bad_call_t>());
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
    attn.forward<bad_call_t>(c.qv, c.kv, c.vv, c.ov, c.lse_ptr, c.ws_ptr, c.ws_bytes, c.stream);
  } catch (const invalid_argument& e) {
    what = e.what();
  }
  RINGATTN_CUDA_CHECK(cudaSetDevice(device));
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  clean = detail::kernel_launches.load() == launches && comm.bytes_sent() == 0 && c.untouched();
  return what;
}

} // namespace
} // namespace ringattn::test
