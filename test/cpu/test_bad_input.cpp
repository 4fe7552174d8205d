// The bad-input matrix, host side (docs/reliability.md has the table): each bad input is refused
// with an `invalid_argument` naming the problem, before anything is sent or written — the output
// and lse keep their poison, the communicator sent nothing. Device-only inputs (host pointers,
// streams, alignment for the kernels) are in test/gpu/test_bad_input.cu.
#include "../support/common.hpp"
#include "../support/ranks.hpp"

#include <ringattn/block/device/host_forward.cuh>
#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
using test::message;

//! One rank's valid call of the host ring (P = 1: 300 tokens in two sequences, 8 q heads, 2 kv
//! heads, head_dim 64); a case breaks one thing in it.
struct call {
  std::vector<std::int32_t> cu{0, 100, 300};
  attention_arguments args{8, 2, 64, 0.0f};
  std::int64_t n = 300;
  std::vector<T> q, k, v, out;
  std::vector<float> lse;
  std::vector<std::byte> storage;
  thd_view<const T> qv, kv, vv;
  thd_view<T> ov;
  float* lse_ptr = nullptr;
  std::span<std::byte> ws;

  explicit call(std::mt19937_64& rng)
      : q(random(n * 8 * 64, rng)), k(random(n * 2 * 64, rng)), v(random(n * 2 * 64, rng)),
        out(static_cast<std::size_t>(n * 8 * 64), test::poison<T>()),
        lse(static_cast<std::size_t>(n * 8), -7.0f), qv(q.data(), n, 8, 64), kv(k.data(), n, 2, 64),
        vv(v.data(), n, 2, 64), ov(out.data(), n, 8, 64), lse_ptr(lse.data()) {}
  static std::vector<T> random(std::int64_t count, std::mt19937_64& rng) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<T> x(static_cast<std::size_t>(count));
    for (auto& e : x)
      e = T(u(rng));
    return x;
  }
  //! A 16-byte aligned workspace of `bytes` (+ `offset`).
  std::span<std::byte> workspace(std::size_t bytes, std::size_t offset = 0) {
    storage.assign(bytes + offset + 16, std::byte{0});
    auto base = reinterpret_cast<std::uintptr_t>(storage.data());
    const std::size_t pad = (16 - base % 16) % 16;
    return {storage.data() + pad + offset, bytes};
  }
  bool untouched() const {
    for (const T& x : out)
      if (std::memcmp(&x, &out[0], sizeof(T)) != 0) return false;
    const T p = test::poison<T>();
    if (std::memcmp(&out[0], &p, sizeof(T)) != 0) return false;
    for (float x : lse)
      if (x != -7.0f) return false;
    return true;
  }
};

using test_ring = ring_attention<zigzag, in_process_communicator, causal>;

//! Makes a valid `Call` and its ring (P = 1) with a workspace of `bytes(ring)`, lets `breaks` spoil
//! one input, runs `invoke(ring, call)`; returns what it threw ("" if nothing) and whether nothing
//! was sent and the outputs kept their poison.
template <class Call, class Bytes, class Invoke>
std::string run_broken(const std::function<void(Call&)>& breaks, bool& clean, Bytes bytes,
                       Invoke invoke) {
  std::mt19937_64 rng(test::fresh_seed());
  Call c(rng);
  in_process_group group(1);
  auto comm = group.communicator(0);
  test_ring attn(comm, c.args, c.cu);
  c.ws = c.workspace(bytes(attn));
  breaks(c);
  std::string what;
  try {
    invoke(attn, c);
  } catch (const invalid_argument& e) {
    what = e.what();
  }
  clean = c.untouched() && comm.bytes_sent() == 0;
  return what;
}

//! `forward_host` after `breaks`.
std::string forward_with(const std::function<void(call&)>& breaks, bool& clean) {
  return run_broken<call>(
      breaks, clean, [](const test_ring& a) { return a.host_workspace_bytes<T>(); },
      [](test_ring& a, call& c) { a.forward_host<T>(c.qv, c.kv, c.vv, c.ov, c.lse_ptr, c.ws); });
}

//! Plans a ring (P = 1) on `cu` and `args`; returns what it threw.
std::string plan_with(std::vector<std::int32_t> cu, attention_arguments args) {
  in_process_group group(1);
  auto comm = group.communicator(0);
  try {
    ring_attention<contiguous, in_process_communicator, full> attn(comm, args, cu);
  } catch (const invalid_argument& e) {
    return e.what();
  }
  return "";
}

struct forward_case {
  const char* input;
  const char* error; // a substring of the message
  std::function<void(call&)> breaks;
};

const std::vector<forward_case>& forward_cases() {
  static const std::vector<forward_case> cases = {
      {"q is a null pointer", "q is a null pointer with 300 tokens",
       [](call& c) { c.qv.data = nullptr; }},
      {"k is misaligned", "k is not aligned to its element size (2 bytes)",
       [](call& c) {
         c.kv.data = reinterpret_cast<const T*>(reinterpret_cast<const char*>(c.kv.data) + 1);
       }},
      {"q has the wrong token count", "q is [299, 8, 64] but rank 0's shard is [300, 8, 64]",
       [](call& c) { c.qv.tokens = 299; }},
      {"k has the wrong head count", "k is [300, 1, 64] but rank 0's shard is [300, 2, 64]",
       [](call& c) { c.kv = thd_view<const T>(c.k.data(), 300, 1, 64); }},
      {"v has another head_dim", "v is [300, 1, 128] but rank 0's shard is [300, 2, 64]",
       [](call& c) { c.vv = thd_view<const T>(c.v.data(), 300, 1, 128); }},
      {"out has the wrong head count", "out is [300, 4, 64] but rank 0's shard is [300, 8, 64]",
       [](call& c) { c.ov = thd_view<T>(c.out.data(), 300, 4, 64); }},
      {"a negative token count", "q.tokens is negative (-1)", [](call& c) { c.qv.tokens = -1; }},
      {"zero heads", "q.heads must be positive (got 0)", [](call& c) { c.qv.heads = 0; }},
      {"a head stride below head_dim", "q.head_stride (32) is smaller than head_dim (64)",
       [](call& c) { c.qv.head_stride = 32; }},
      {"a token stride that overlaps tokens", "q.token_stride (64) makes tokens overlap",
       [](call& c) { c.qv.token_stride = 64; }},
      {"lse is a null pointer", "lse is a null pointer", [](call& c) { c.lse_ptr = nullptr; }},
      {"the workspace is too small", "the workspace has",
       [](call& c) { c.ws = c.ws.first(c.ws.size() - 1); }},
      {"the workspace is a null pointer", "the workspace is a null pointer",
       [](call& c) { c.ws = std::span<std::byte>(static_cast<std::byte*>(nullptr), c.ws.size()); }},
      {"the workspace is misaligned", "the workspace must be 16-byte aligned",
       [](call& c) { c.ws = c.workspace(c.ws.size(), 8); }},
  };
  return cases;
}

//! One rank's valid call of the host ring's backward (the forward call's inputs, plus the
//! forward's out and lse, dout and poisoned gradients); a case breaks one thing in it.
struct backward_call : call {
  std::vector<T> fwd_out, dout, dq, dk, dv;
  thd_view<const T> fov, dov;
  thd_view<T> dqv, dkv, dvv;

  explicit backward_call(std::mt19937_64& rng)
      : call(rng), fwd_out(random(n * 8 * 64, rng)), dout(random(n * 8 * 64, rng)),
        dq(static_cast<std::size_t>(n * 8 * 64), test::poison<T>()),
        dk(static_cast<std::size_t>(n * 2 * 64), test::poison<T>()), dv(dk),
        fov(fwd_out.data(), n, 8, 64), dov(dout.data(), n, 8, 64), dqv(dq.data(), n, 8, 64),
        dkv(dk.data(), n, 2, 64), dvv(dv.data(), n, 2, 64) {
    std::fill(lse.begin(), lse.end(), 1.0f); // a forward's lse (finite)
  }
  bool untouched() const {
    const T p = test::poison<T>();
    for (const auto* g : {&dq, &dk, &dv})
      for (const T& x : *g)
        if (std::memcmp(&x, &p, sizeof(T)) != 0) return false;
    return true;
  }
};

//! `backward_host` after `breaks`.
std::string backward_with(const std::function<void(backward_call&)>& breaks, bool& clean) {
  return run_broken<backward_call>(
      breaks, clean, [](const test_ring& a) { return a.host_backward_workspace_bytes<T>(); },
      [](test_ring& a, backward_call& c) {
        a.backward_host<T>(c.qv, c.kv, c.vv, c.fov, c.lse_ptr, c.dov, c.dqv, c.dkv, c.dvv, c.ws);
      });
}

struct backward_case {
  const char* input;
  const char* error; // a substring of the message
  std::function<void(backward_call&)> breaks;
};

const std::vector<backward_case>& backward_cases() {
  static const std::vector<backward_case> cases = {
      {"dout has the wrong token count", "dout is [299, 8, 64] but rank 0's shard is [300, 8, 64]",
       [](backward_call& c) { c.dov.tokens = 299; }},
      {"the forward's out has the wrong head count",
       "out is [300, 4, 64] but rank 0's shard is [300, 8, 64]",
       [](backward_call& c) { c.fov = thd_view<const T>(c.fwd_out.data(), 300, 4, 64); }},
      {"dq has the wrong head count", "dq is [300, 4, 64] but rank 0's shard is [300, 8, 64]",
       [](backward_call& c) { c.dqv = thd_view<T>(c.dq.data(), 300, 4, 64); }},
      {"dk is a null pointer", "dk is a null pointer with 300 tokens",
       [](backward_call& c) { c.dkv.data = nullptr; }},
      {"dv is misaligned", "dv is not aligned to its element size (2 bytes)",
       [](backward_call& c) {
         c.dvv.data = reinterpret_cast<T*>(reinterpret_cast<char*>(c.dvv.data) + 1);
       }},
      {"dout with a head stride below head_dim", "dout.head_stride (32) is smaller than head_dim",
       [](backward_call& c) { c.dov.head_stride = 32; }},
      {"the forward's lse is a null pointer", "lse is a null pointer",
       [](backward_call& c) { c.lse_ptr = nullptr; }},
      {"the backward workspace is too small", "the workspace has",
       [](backward_call& c) { c.ws = c.ws.first(c.ws.size() - 1); }},
      {"the backward workspace is misaligned", "the workspace must be 16-byte aligned",
       [](backward_call& c) { c.ws = c.workspace(c.ws.size(), 4); }},
  };
  return cases;
}

struct plan_case {
  const char* input;
  const char* error;
  std::vector<std::int32_t> cu;
  attention_arguments args;
};

constexpr std::int32_t int32_max = std::numeric_limits<std::int32_t>::max();

const std::vector<plan_case>& plan_cases() {
  static const std::vector<plan_case> cases = {
      {"an unsupported head_dim",
       "head_dim 96 is not supported (supported: 64, 128, 192, 256)",
       {0, 300},
       {8, 2, 96, 0.0f}},
      {"q_heads not a multiple of kv_heads",
       "q_heads (8) is not a multiple of kv_heads (3)",
       {0, 300},
       {8, 3, 64, 0.0f}},
      {"zero q_heads", "q_heads must be positive (got 0)", {0, 300}, {0, 2, 64, 0.0f}},
      {"negative kv_heads", "kv_heads must be positive (got -2)", {0, 300}, {8, -2, 64, 0.0f}},
      {"a NaN softmax scale",
       "softmax_scale nan must be finite and >= 0",
       {0, 300},
       {8, 2, 64, std::nanf("")}},
      {"a negative softmax scale",
       "softmax_scale -1 must be finite and >= 0",
       {0, 300},
       {8, 2, 64, -1.0f}},
      {"cu_seqlens with one entry",
       "cu_seqlens needs batch + 1 >= 2 entries (got 1)",
       {0},
       {8, 2, 64, 0.0f}},
      {"cu_seqlens not starting at 0",
       "cu_seqlens[0] must be 0 (got 5)",
       {5, 300},
       {8, 2, 64, 0.0f}},
      {"cu_seqlens not monotone",
       "cu_seqlens is not monotone: cu_seqlens[2] = 50 < cu_seqlens[1] = 100",
       {0, 100, 50},
       {8, 2, 64, 0.0f}},
      // Lengths summed in int32 past 2^31 - 1 wrap around: refused, never planned.
      {"lengths past the int32 limit (wrapped cu_seqlens)",
       "cu_seqlens is not monotone",
       {0, int32_max - 10, static_cast<std::int32_t>(static_cast<std::uint32_t>(int32_max) + 90u)},
       {8, 2, 64, 0.0f}},
  };
  return cases;
}
} // namespace

TEST_CASE("bad forward inputs: a clear error, nothing sent, outputs untouched") {
  test::check_bad_cases(forward_cases(), forward_with);
  bool clean = false; // the unbroken call is accepted and writes (the cases above can fail)
  CHECK(forward_with([](call&) {}, clean) == "");
  CHECK_FALSE(clean);
}

TEST_CASE("bad backward inputs: a clear error, nothing sent, gradients untouched") {
  test::check_bad_cases(backward_cases(), backward_with);
  bool clean = false; // the unbroken call is accepted and writes (the cases above can fail)
  CHECK(backward_with([](backward_call&) {}, clean) == "");
  CHECK_FALSE(clean);
}

TEST_CASE("bad arguments and cu_seqlens: refused at plan time with a clear error") {
  for (const auto& c : plan_cases()) {
    const std::string input = c.input;
    CAPTURE(input);
    const std::string what = plan_with(c.cu, c.args);
    CHECK_MESSAGE(what.find(c.error) != std::string::npos, "got: ", what);
  }
  CHECK(plan_with({0, 300}, {8, 2, 64, 0.0f}) == "");
}

TEST_CASE("a communicator that does not fit its group is refused") {
  CHECK_THROWS_WITH_AS(in_process_group(0),
                       "ringattn: an in-process group needs at least one rank (got 0)",
                       invalid_argument);
  in_process_group group(2);
  CHECK_THROWS_WITH_AS(group.communicator(2), "ringattn: rank 2 is out of range [0, 2)",
                       invalid_argument);
  CHECK_THROWS_AS(group.communicator(-1), invalid_argument);
}

namespace {
//! Two ranks plan with per-rank arguments; returns each rank's error.
template <class P0, class P1, class M0, class M1>
std::vector<std::string> plan_two(const std::vector<std::int32_t>& cu0,
                                  const std::vector<std::int32_t>& cu1, attention_arguments a0,
                                  attention_arguments a1) {
  in_process_group group(2);
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    if (r == 0)
      ring_attention<P0, in_process_communicator, M0> attn(comm, a0, cu0);
    else
      ring_attention<P1, in_process_communicator, M1> attn(comm, a1, cu1);
  });
  return {message(errors[0]), message(errors[1])};
}
} // namespace

TEST_CASE("ranks that disagree on shapes, mask, partitioner or lengths fail at plan time, all") {
  const std::vector<std::int32_t> cu{0, 100, 300};
  const attention_arguments a{8, 2, 64, 0.0f};
  auto check_both = [](const std::vector<std::string>& e, const char* what) {
    for (const auto& m : e) {
      CAPTURE(m);
      CHECK(m.find(what) != std::string::npos);
    }
  };
  check_both(plan_two<zigzag, zigzag, causal, causal>(cu, cu, a, {16, 2, 64, 0.0f}),
             "rank 1 disagrees with rank 0 on q_heads (16 vs 8)");
  check_both(plan_two<zigzag, zigzag, causal, causal>(cu, cu, a, {8, 2, 128, 0.0f}),
             "rank 1 disagrees with rank 0 on head_dim (128 vs 64)");
  check_both(plan_two<zigzag, zigzag, causal, full>(cu, cu, a, a),
             "rank 1 disagrees with rank 0 on the mask (full vs causal)");
  check_both(plan_two<zigzag, contiguous, causal, causal>(cu, cu, a, a),
             "rank 1 disagrees with rank 0 on the partitioner");
  check_both(plan_two<zigzag, zigzag, causal, causal>(cu, {0, 150, 300}, a, a),
             "rank 1 disagrees with rank 0 on cu_seqlens");
  check_both(plan_two<zigzag, zigzag, causal, causal>(cu, {0, 100, 301}, a, a),
             "rank 1 disagrees with rank 0 on the total token count (301 vs 300)");
}

TEST_CASE("block kernel: a state of the wrong shape and lengths past int32 are refused") {
  std::mt19937_64 rng(test::fresh_seed());
  const attention_arguments a{4, 2, 64, 0.0f};
  std::vector<T> q = call::random(10 * 4 * 64, rng), k = call::random(10 * 2 * 64, rng);
  std::vector<float> o(10 * 4 * 64, -7.0f), lse(10 * 4, -7.0f), sum(10 * 4, -7.0f);
  block_group g{0, 10, 1, {}};
  g.kv[0] = {0, 10, band{}};
  const std::vector<block_group> groups{g};
  const thd_view<const T> qv(q.data(), 10, 4, 64), kv(k.data(), 10, 2, 64);
  const attention_state wrong{o.data(), lse.data(), sum.data(), 9, 4, 64};
  CHECK_THROWS_WITH_AS(host_block_forward<T>({qv, kv, kv, a, wrong}, groups),
                       doctest::Contains("the state is [9, 4, 64] but the output is [10, 4, 64]"),
                       invalid_argument);
  const attention_state no_sum{o.data(), lse.data(), nullptr, 10, 4, 64};
  CHECK_THROWS_WITH_AS(host_block_forward<T>({qv, kv, kv, a, no_sum}, groups),
                       doctest::Contains("the state's o, lse or sum is a null pointer"),
                       invalid_argument);
  // A view claiming 3 billion tokens (never read: validation stops first).
  const std::int64_t huge = 3'000'000'000;
  const attention_state big{o.data(), lse.data(), sum.data(), huge, 4, 64};
  block_group h{0, huge, 1, {}};
  h.kv[0] = {0, 10, band{}};
  CHECK_THROWS_WITH_AS(
      host_block_forward<T>({thd_view<const T>(q.data(), huge, 4, 64), kv, kv, a, big},
                            std::vector<block_group>{h}),
      doctest::Contains("exceeds the int32 limit of 2147483647 tokens"), invalid_argument);
  for (float x : o)
    CHECK(x == -7.0f);
  for (float x : sum)
    CHECK(x == -7.0f);
}
