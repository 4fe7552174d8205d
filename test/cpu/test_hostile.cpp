// Hostile use of the host path: concurrent calls on one object, a rank that throws something
// not derived from std::exception, a rank taken twice, absurd group sizes, head counts and
// strides, and outputs that overlap each other, the inputs or the workspace. Each is refused with
// a sentence (or aborts the peers at once) instead of a crash, a hang or a wrong answer.
#include "../ranks.hpp"
#include "../sharded_backward_case.hpp"

#include <ringattn/comm/in_process.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>

#include <chrono>
#include <climits>
#include <string>
#include <thread>
#include <vector>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
using clock_type = std::chrono::steady_clock;

std::vector<std::byte> workspace_of(std::size_t bytes) { return std::vector<std::byte>(bytes); }

// A BlockKernel whose host forward throws an int on the rank that sets `throw_here`.
thread_local bool throw_here = false;
struct throwing_kernel {
  static constexpr mask_kind mask = mask_kind::causal;
  static constexpr const char* name = "throwing";
  template <element E>
  static void host_forward(const block_forward_args<E>& a, std::span<const block_group> g) {
    if (throw_here) throw 42;
    detail::host_block_forward_rows(a, g);
  }
  template <element E>
  static void host_backward(const block_backward_args<E>& a, std::span<const block_group> g) {
    detail::host_block_backward_rows(a, g);
  }
};
static_assert(block_kernel<throwing_kernel>);
} // namespace

TEST_CASE("a second call on one object while the first runs is refused; the first is unharmed") {
  const attention_arguments args{4, 2, 64, 0.0f};
  const std::vector<std::int32_t> cu{0, 64};
  in_process_group group(2, std::chrono::milliseconds(600));
  std::string first, second, peer;
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<zigzag, in_process_communicator, causal> attn(comm, args, cu);
    if (r == 1) return; // never calls: rank 0's call waits for it
    const std::int64_t n = attn.local_tokens();
    std::vector<T> q(n * 4 * 64), k(n * 2 * 64), v(k.size()), out(q.size()), out2(q.size());
    std::vector<float> lse(n * 4), lse2(n * 4);
    auto ws = workspace_of(attn.host_workspace_bytes<T>());
    auto ws2 = workspace_of(attn.host_workspace_bytes<T>());
    std::thread other([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(150));
      try {
        attn.forward_host(thd_view<const T>(q.data(), n, 4, 64),
                          thd_view<const T>(k.data(), n, 2, 64),
                          thd_view<const T>(v.data(), n, 2, 64), thd_view<T>(out2.data(), n, 4, 64),
                          lse2.data(), ws2);
      } catch (const std::exception& e) {
        second = e.what();
      }
    });
    try {
      attn.forward_host(
          thd_view<const T>(q.data(), n, 4, 64), thd_view<const T>(k.data(), n, 2, 64),
          thd_view<const T>(v.data(), n, 2, 64), thd_view<T>(out.data(), n, 4, 64), lse.data(), ws);
    } catch (const std::exception& e) {
      first = e.what();
    }
    other.join();
  });
  CHECK(second == "ringattn: another call on this ring_attention object is running (one call "
                  "at a time per object; one object per rank's thread)");
  // The first call ran on until its own timeout: the refused one did not abort the group.
  CHECK(first.find("timed out after 600 ms waiting for rank 1") != std::string::npos);
  for (const auto& e : errors)
    CHECK(test::message(e) == "");
}

TEST_CASE("a rank that throws something not derived from std::exception aborts its peers at once") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  test::sharded_case<zigzag, T> c({0, 200}, 2, {4, 2, 64, 0.0f}, mask_kind::causal, rng);
  in_process_group group(2, std::chrono::seconds(30));
  std::vector<std::string> caught(2);
  const auto start = clock_type::now();
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<zigzag, in_process_communicator, throwing_kernel> attn(comm, c.args,
                                                                          c.plan.cu_seqlens());
    throw_here = r == 1;
    try {
      c.forward_rank(attn, r);
    } catch (int) {
      caught[static_cast<std::size_t>(r)] = "int";
    } catch (const std::exception& e) {
      caught[static_cast<std::size_t>(r)] = e.what();
    }
  });
  const double seconds = std::chrono::duration<double>(clock_type::now() - start).count();
  CHECK(caught[1] == "int"); // rethrown as it was
  CHECK(caught[0].find("rank 1 aborted the ring: an exception not derived from std::exception") !=
        std::string::npos);
  CHECK(seconds < 10.0); // not the 30 s timeout
  for (const auto& e : errors)
    CHECK(test::message(e) == "");
}

TEST_CASE("a rank of an in-process group is taken once; absurd group sizes are refused") {
  in_process_group group(2);
  auto first = group.communicator(0);
  CHECK_THROWS_WITH_AS(group.communicator(0),
                       "ringattn: rank 0 of this in-process group is taken already (one "
                       "communicator per rank; copy it within the rank's thread)",
                       invalid_argument);
  CHECK_NOTHROW(group.communicator(1));
  CHECK(first.rank() == 0);
  CHECK_THROWS_WITH_AS(in_process_group(INT_MAX),
                       "ringattn: an in-process group has at most 65536 ranks (got 2147483647)",
                       invalid_argument);
}

TEST_CASE("absurd head counts and strides are refused, never wrapped") {
  CHECK(attention_arguments{1 << 20, 1, 64, 0.0f}.validate().reason() ==
        "q_heads (1048576) exceeds 65536");
  std::vector<T> x(64);
  thd_view<const T> v(x.data(), 1, 1, 64);
  v.heads = 4;
  v.head_stride = INT64_MAX / 2;
  v.token_stride = INT64_MAX;
  CHECK(validate_view(v, "q").reason() ==
        "q.head_stride (4611686018427387903) times heads (4) overflows a 64-bit element count");
  v.heads = 1;
  v.head_stride = 64;
  v.tokens = 3;
  CHECK(validate_view(v, "q").reason() ==
        "q spans more bytes than a 64-bit count holds (3 tokens, token_stride "
        "9223372036854775807)");
}

namespace {
// One rank's forward with `out`, `lse` and the workspace placed by the caller; returns the error.
std::string forward_into(thd_view<T> out, float* lse, std::span<std::byte> ws, thd_view<const T> q,
                         thd_view<const T> k, thd_view<const T> v) {
  in_process_group group(1);
  auto comm = group.communicator(0);
  ring_attention<zigzag, in_process_communicator, causal> attn(comm, {4, 2, 64, 0.0f},
                                                               std::vector<std::int32_t>{0, 32});
  try {
    attn.forward_host(q, k, v, out, lse, ws);
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return "";
}
} // namespace

TEST_CASE("outputs that overlap each other, an input or the workspace are refused") {
  const std::int64_t n = 32;
  // One buffer for everything: q, k, v, out, lse and the workspace laid out as each case says.
  std::vector<T> qkv(n * 8 * 64, from_float<T>(0.5f)); // packed [tokens, 4 + 2 + 2, 64]
  const thd_view<T> packed(qkv.data(), n, 8, 64);
  thd_view<const T> q(qkv.data(), n, 4, 64), k(qkv.data() + 4 * 64, n, 2, 64),
      v(qkv.data() + 6 * 64, n, 2, 64);
  q.token_stride = k.token_stride = v.token_stride = packed.token_stride;
  std::vector<T> out(n * 4 * 64);
  std::vector<float> lse(n * 4);
  std::vector<std::byte> ws(1 << 20);
  const thd_view<T> outv(out.data(), n, 4, 64);
  // The packed qkv layout is fine: its parts share rows but no element.
  CHECK(forward_into(outv, lse.data(), ws, q, k, v) == "");
  // out written over k.
  thd_view<T> over_k(qkv.data() + 4 * 64, n, 4, 64);
  over_k.token_stride = packed.token_stride;
  CHECK(forward_into(over_k, lse.data(), ws, q, k, v) == "ringattn: out overlaps the input k");
  // lse inside out.
  CHECK(forward_into(outv, reinterpret_cast<float*>(out.data()) + 8, ws, q, k, v) ==
        "ringattn: out and lse overlap (outputs must not share memory)");
  // The workspace over out.
  std::vector<std::byte> big((1 << 20) + out.size() * sizeof(T));
  const thd_view<T> out_in_ws(reinterpret_cast<T*>(big.data()), n, 4, 64);
  CHECK(forward_into(out_in_ws, lse.data(), std::span<std::byte>(big).subspan(256, 1 << 20), q, k,
                     v) == "ringattn: out and the workspace overlap (outputs must not share "
                           "memory)");
}
