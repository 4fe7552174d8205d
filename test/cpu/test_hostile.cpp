// Hostile use of the host path: concurrent calls on one object, a rank that throws something
// not derived from std::exception, a rank taken twice, absurd group sizes, head counts and
// strides, and outputs that overlap each other, the inputs or the workspace. Each is refused with
// a sentence (or aborts the peers at once) instead of a crash, a hang or a wrong answer.
#include "../support/ranks.hpp"
#include "../support/sharded_backward_case.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>

#include <chrono>
#include <climits>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

using namespace ringattn;

namespace {
using T = __nv_bfloat16;
using clock_type = std::chrono::steady_clock;

std::vector<std::byte> workspace_of(std::size_t bytes) { return std::vector<std::byte>(bytes); }

// A BlockKernel whose host forward, on the rank that sets `fault_here`, throws an int, or
// stalls past a group's timeout (its first block only).
enum class fault { none, throws, stalls };
thread_local fault fault_here = fault::none;
struct faulty_kernel {
  static constexpr mask_kind mask = mask_kind::causal;
  static constexpr const char* name = "faulty";
  template <element E>
  static void host_forward(const block_forward_args<E>& a, std::span<const block_group> g) {
    if (fault_here == fault::throws) throw 42;
    if (fault_here == fault::stalls) {
      fault_here = fault::none;
      std::this_thread::sleep_for(std::chrono::milliseconds(700));
    }
    detail::host_block_forward_rows(a, g);
  }
  template <element E>
  static void host_backward(const block_backward_args<E>& a, std::span<const block_group> g) {
    detail::host_block_backward_rows(a, g);
  }
};
static_assert(block_kernel<faulty_kernel>);
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
  CHECK(second == "ringattn: another call on this object is running (one call at a time per "
                  "object; one object per rank's thread)");
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
    ring_attention<zigzag, in_process_communicator, faulty_kernel> attn(comm, c.args,
                                                                        c.plan.cu_seqlens());
    fault_here = r == 1 ? fault::throws : fault::none;
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

namespace {
// Relative L2 error of every rank's output against the oracle, from per-rank parts.
template <class Case, class Parts>
double relative_error(const Case&, const std::vector<Parts>& parts) {
  double num = 0.0, den = 0.0;
  for (const auto& p : parts) {
    num += p.num;
    den += p.den;
  }
  return std::sqrt(num / den);
}
} // namespace

// Every call is agreed by all ranks before its first block (ring/call.cuh): a dtype, an entry
// point or a call count that differ fail on every rank naming both sides, before anything is sent
// or written, and leave the group usable.
TEST_CASE("ranks that disagree at call time fail on every rank, naming both; the next call runs") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const std::vector<std::int32_t> cu{0, 150, 301};
  const attention_arguments args{4, 2, 64, 0.0f};
  test::sharded_backward_case<zigzag, T> c(cu, 3, args, mask_kind::causal, rng);
  test::sharded_case<zigzag, __half> h(cu, 3, args, mask_kind::causal, rng);
  const auto ref = c.oracle();
  in_process_group group(3, std::chrono::seconds(30));
  std::vector<std::string> by_dtype(3), by_direction(3);
  std::vector<test::sharded_case<zigzag, T>::error_parts> parts(3);
  std::vector<char> nothing_sent(3, 0); // not vector<bool>: ranks write their own elements
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    const auto at = static_cast<std::size_t>(r);
    ring_attention<zigzag, in_process_communicator, causal> attn(comm, args, cu);
    try { // rank 2 calls with fp16, the others with bf16
      if (r == 2)
        (void)h.forward_rank(attn, r);
      else
        (void)c.forward_rank(attn, r);
    } catch (const invalid_argument& e) {
      by_dtype[at] = e.what();
    }
    const std::int64_t n = attn.local_tokens();
    test::sharded_case<zigzag, T>::rank_output fwd{
        std::vector<T>(static_cast<std::size_t>(n * 4 * 64), test::poison<T>()),
        std::vector<float>(static_cast<std::size_t>(n * 4), -7.0f)};
    try { // rank 1 calls the backward, the others the forward
      if (r == 1)
        (void)c.backward_rank(attn, r, fwd);
      else
        fwd = c.forward_rank(attn, r);
    } catch (const invalid_argument& e) {
      by_direction[at] = e.what();
    }
    nothing_sent[at] = comm.bytes_sent() == 0;                 // refused before the first exchange
    parts[at] = c.rank_error(r, c.forward_rank(attn, r), ref); // agreed: runs
  });
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    const auto at = static_cast<std::size_t>(r);
    CHECK(test::message(errors[at]) == "");
    CHECK(by_dtype[at] == "ringattn: rank 2 calls forward_host with fp16 but rank 0 with bf16");
    CHECK(by_direction[at] == "ringattn: rank 1 calls backward_host but rank 0 calls forward_host");
    CHECK(nothing_sent[at]);
  }
  CHECK(relative_error(c, parts) < 4e-3); // bf16 output (the ring tests' tolerance)
}

TEST_CASE("two rings called in different orders on one group are told apart, not mixed") {
  const std::vector<std::int32_t> cu{0, 64};
  const attention_arguments args{4, 2, 64, 0.0f};
  std::mt19937_64 rng(test::fresh_seed());
  test::sharded_case<zigzag, T> c(cu, 2, args, mask_kind::causal, rng);
  in_process_group group(2, std::chrono::seconds(30));
  std::vector<std::string> seen(2);
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<zigzag, in_process_communicator, causal> a(comm, args, cu);
    ring_attention<zigzag, in_process_communicator, full> b(comm, args, cu);
    try {
      if (r == 0)
        (void)c.forward_rank(a, r);
      else
        (void)c.forward_rank(b, r);
    } catch (const invalid_argument& e) {
      seen[static_cast<std::size_t>(r)] = e.what();
    }
  });
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(test::message(errors[r]) == "");
    CHECK(seen[r] == "ringattn: rank 1 calls another ring than rank 0 (the plans differ: every "
                     "rank calls the same ring_attention objects in the same order)");
  }
}

// A call one rank rejects fails on every rank with that rank's reason before anything is sent,
// and the group stays usable: the next call, valid everywhere, gives the oracle's answer.
TEST_CASE("after a call one rank rejected, a valid retry runs on every rank") {
  std::mt19937_64 rng(test::fresh_seed());
  const std::vector<std::int32_t> cu{0, 100, 230};
  const attention_arguments args{4, 2, 64, 0.0f};
  test::sharded_case<zigzag, T> c(cu, 3, args, mask_kind::causal, rng);
  const auto ref = c.oracle();
  in_process_group group(3, std::chrono::seconds(30));
  std::vector<std::string> first(3);
  std::vector<test::sharded_case<zigzag, T>::error_parts> parts(3);
  const auto start = clock_type::now();
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<zigzag, in_process_communicator, causal> attn(comm, args, cu);
    try {
      (void)c.forward_rank(attn, r, /*null_lse=*/r == 2);
    } catch (const invalid_argument& e) {
      first[static_cast<std::size_t>(r)] = e.what();
    }
    parts[static_cast<std::size_t>(r)] = c.rank_error(r, c.forward_rank(attn, r), ref);
  });
  CHECK(clock_type::now() - start < std::chrono::seconds(10)); // no timeout was waited out
  CHECK(first[2] == "ringattn: lse is a null pointer");
  for (std::size_t r : {0u, 1u})
    CHECK(first[r] == "ringattn: rank 2 rejected call 1 (forward_host): lse is a null pointer");
  for (const auto& e : errors)
    CHECK(test::message(e) == "");
  CHECK(relative_error(c, parts) < 4e-3);
}

TEST_CASE("a call its caller refused fails on every rank naming the reason; the next call runs") {
  std::mt19937_64 rng(test::fresh_seed());
  const std::vector<std::int32_t> cu{0, 77, 200};
  const attention_arguments args{4, 2, 64, 0.0f};
  test::sharded_case<zigzag, T> c(cu, 3, args, mask_kind::causal, rng);
  const auto ref = c.oracle();
  in_process_group group(3, std::chrono::seconds(30));
  std::vector<std::string> first(3);
  std::vector<test::sharded_case<zigzag, T>::error_parts> parts(3);
  const auto start = clock_type::now();
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<zigzag, in_process_communicator, causal> attn(comm, args, cu);
    try {
      if (r == 1)
        attn.refuse<T>(/*backward=*/false, /*device=*/false, "k is on another device");
      else
        (void)c.forward_rank(attn, r);
    } catch (const invalid_argument& e) {
      first[static_cast<std::size_t>(r)] = e.what();
    }
    parts[static_cast<std::size_t>(r)] = c.rank_error(r, c.forward_rank(attn, r), ref);
  });
  CHECK(clock_type::now() - start < std::chrono::seconds(10)); // nobody waited for rank 1
  CHECK(first[1] == "ringattn: k is on another device");
  for (std::size_t r : {0u, 2u})
    CHECK(first[r] == "ringattn: rank 1 rejected call 1 (forward_host): k is on another device");
  for (const auto& e : errors)
    CHECK(test::message(e) == "");
  CHECK(relative_error(c, parts) < 4e-3);
}

// The recovery contract (docs/reliability.md): a timeout breaks the group for good. A late rank's
// data is never taken by a later call, and every later call, exchange or all-gather of any rank
// fails at once asking for a new group, instead of reading a stale offer or a dead frame.
TEST_CASE("after a timeout the group is broken: later calls fail at once, never with stale data") {
  std::mt19937_64 rng(test::fresh_seed());
  const std::vector<std::int32_t> cu{0, 90, 200};
  const attention_arguments args{4, 2, 64, 0.0f};
  test::sharded_case<zigzag, T> c(cu, 3, args, mask_kind::causal, rng);
  in_process_group group(3, std::chrono::milliseconds(200));
  std::vector<std::string> first(3), second(3), gather(3);
  std::vector<double> second_took(3);
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    const auto at = static_cast<std::size_t>(r);
    ring_attention<zigzag, in_process_communicator, faulty_kernel> attn(comm, args, cu);
    fault_here = r == 1 ? fault::stalls : fault::none;
    try {
      (void)c.forward_rank(attn, r);
    } catch (const communication_error& e) {
      first[at] = e.what();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(800)); // the late rank catches up
    const auto start = clock_type::now();
    test::sharded_case<zigzag, T>::rank_output o;
    try {
      o = c.forward_rank(attn, r);
    } catch (const communication_error& e) {
      second[at] = e.what();
    }
    second_took[at] = std::chrono::duration<double>(clock_type::now() - start).count();
    char mine = 'x', all[3] = {};
    try {
      comm.all_gather(&mine, 1, all);
    } catch (const communication_error& e) {
      gather[at] = e.what();
    }
  });
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    const auto at = static_cast<std::size_t>(r);
    CHECK(test::message(errors[at]) == "");
    CHECK(first[at].find("timed out after 200 ms") != std::string::npos);
    CHECK(second[at].find("this in-process group is broken (") != std::string::npos);
    CHECK(second[at].find("create a new in_process_group") != std::string::npos);
    CHECK(second_took[at] < 0.1); // at once, not after a timeout
    CHECK(gather[at].find("this in-process group is broken") != std::string::npos);
  }
}

// Extreme finite values on the host path (fp64 scores): q = k = 1e20 gives logits near 1e40,
// beyond fp32, so a block's lse is +inf. Two keys share the top logit; at P = 1 the output is
// their mean. At P >= 2 they may sit in different ranks' blocks, both saturated: the merge gives
// them equal weights (never inf - inf), so every P gives the P = 1 answer, finite, lse +inf.
TEST_CASE("huge finite logits: finite outputs at every P, the P = 1 answer") {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int32_t n = 96;
  const attention_arguments args{2, 1, 64, 0.0f};
  const std::vector<std::int32_t> cu{0, n};
  auto inputs = [&](auto& c) {
    for (auto& x : c.q)
      x = T(1e20f);
    for (std::int64_t t : {std::int64_t{0}, std::int64_t{n - 1}})
      for (int e = 0; e < 64; ++e)
        c.k[static_cast<std::size_t>(t * 64 + e)] = T(1e20f);
  };
  for (int ranks : {1, 2, 3, 4}) {
    CAPTURE(ranks);
    test::sharded_case<contiguous, T> c(cu, ranks, args, mask_kind::full, rng);
    inputs(c);
    for (int r = 0; r < ranks; ++r) { // shards of the edited tensors
      c.qs[static_cast<std::size_t>(r)] = c.shard(c.q, r, 2);
      c.ks[static_cast<std::size_t>(r)] = c.shard(c.k, r, 1);
    }
    in_process_group group(ranks);
    std::vector<test::sharded_case<contiguous, T>::rank_output> outs(
        static_cast<std::size_t>(ranks));
    const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
      ring_attention<contiguous, in_process_communicator, full> attn(comm, args, cu);
      outs[static_cast<std::size_t>(r)] = c.forward_rank(attn, r);
    });
    for (const auto& e : errors)
      REQUIRE(test::message(e) == "");
    bool finite = true, saturated = true;
    double worst = 0.0;
    for (int r = 0; r < ranks; ++r) {
      const auto& o = outs[static_cast<std::size_t>(r)];
      for (float l : o.lse)
        saturated = saturated && std::isinf(l) && l > 0;
      for (std::int64_t l = 0; l < c.plan.local_tokens(r); ++l)
        for (int h = 0; h < 2; ++h)
          for (int e = 0; e < 64; ++e) {
            const float got = to_float(o.out[static_cast<std::size_t>((l * 2 + h) * 64 + e)]);
            const double want = 0.5 * (double(to_float(c.v[static_cast<std::size_t>(e)])) +
                                       to_float(c.v[static_cast<std::size_t>((n - 1) * 64 + e)]));
            finite = finite && std::isfinite(got);
            worst = std::max(worst, std::abs(got - want));
          }
    }
    CHECK(finite);
    CHECK(saturated);
    CHECK(worst < 1e-2); // bf16 rounding of a mean of two values below 1 in magnitude
  }
}

// Two ring objects called at once on one rank's communicator (forbidden: their messages would
// mix): the second call is refused naming it, the group breaks, and every rank's call fails with
// an error instead of a wrong answer, a crash or a hang.
TEST_CASE("two objects called at once on one rank's communicator are refused, on every rank") {
  const attention_arguments args{4, 2, 64, 0.0f};
  const std::vector<std::int32_t> cu{0, 40, 64};
  std::mt19937_64 rng(test::fresh_seed());
  test::sharded_case<zigzag, T> c(cu, 2, args, mask_kind::causal, rng);
  in_process_group group(2, std::chrono::milliseconds(2000));
  std::string a0, b0, a1;
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<zigzag, in_process_communicator, causal> a(comm, args, cu);
    ring_attention<zigzag, in_process_communicator, causal> b(comm, args, cu);
    if (r == 0) {
      // A's call waits in its agreement for rank 1 (late by 300 ms) while B's call starts.
      std::thread second([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        try {
          (void)c.forward_rank(b, 0);
        } catch (const std::exception& e) {
          b0 = e.what();
        }
      });
      try {
        (void)c.forward_rank(a, 0);
      } catch (const std::exception& e) {
        a0 = e.what();
      }
      second.join();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      try {
        (void)c.forward_rank(a, 1);
      } catch (const std::exception& e) {
        a1 = e.what();
      }
    }
  });
  for (const auto& e : errors)
    CHECK(test::message(e) == "");
  const std::string why = "two threads use rank 0's communicator at once";
  CAPTURE(a0);
  CAPTURE(b0);
  CAPTURE(a1);
  CHECK(b0.find(why) != std::string::npos);
  CHECK(a0.find(why) != std::string::npos);
  CHECK(a1.find(why) != std::string::npos);
}

// The wording after a call-time timeout: the failed call names itself and its all-gather, the
// next call names the broken group and its cause; no "at plan time", one "ringattn:" prefix.
TEST_CASE("after a call's agreement times out, the errors name the call, not the plan") {
  const attention_arguments args{4, 2, 64, 0.0f};
  const std::vector<std::int32_t> cu{0, 64};
  std::mt19937_64 rng(test::fresh_seed());
  test::sharded_case<zigzag, T> c(cu, 3, args, mask_kind::causal, rng);
  in_process_group group(3, std::chrono::milliseconds(200));
  std::vector<std::string> first(3), second(3);
  const auto errors = test::on_ranks(group, [&](int r, in_process_communicator& comm) {
    ring_attention<zigzag, in_process_communicator, causal> attn(comm, args, cu);
    if (r == 2) std::this_thread::sleep_for(std::chrono::milliseconds(700));
    for (std::string* out : {&first[r], &second[r]}) {
      try {
        (void)c.forward_rank(attn, r);
      } catch (const communication_error& e) {
        *out = e.what();
      }
    }
  });
  for (const auto& e : errors)
    CHECK(test::message(e) == "");
  auto prefixes = [](const std::string& m) {
    std::size_t n = 0;
    for (std::size_t at = m.find("ringattn:"); at != std::string::npos;
         at = m.find("ringattn:", at + 1))
      ++n;
    return n;
  };
  // Ranks 0 and 1 wait for rank 2 with the same deadline. The first whose wait ends names its
  // own timeout; the other may be woken by the group that timeout broke, and then names it.
  const std::string timeout = "timed out after 200 ms waiting for rank 2 to join an all-gather";
  int own_timeouts = 0;
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CAPTURE(first[r]);
    CAPTURE(second[r]);
    const std::string rank = "ringattn: rank " + std::to_string(r);
    const std::string call = rank + ", call 1 (forward_host): ";
    const std::string passed_on = "rank " + std::to_string(1 - r) + ", all-gather: " + timeout;
    own_timeouts += first[r] == call + timeout;
    CHECK((first[r] == call + timeout || first[r] == call + passed_on));
    CHECK(
        second[r].starts_with(rank + ", call 2 (forward_host): this in-process group is broken ("));
    CHECK(second[r].find("all-gather: timed out after 200 ms") != std::string::npos);
    CHECK(second[r].find("at plan time") == std::string::npos);
    CHECK(prefixes(first[r]) == 1);
    CHECK(prefixes(second[r]) == 1);
  }
  CHECK(own_timeouts >= 1);
  CHECK(second[2].find("this in-process group is broken (") != std::string::npos);
}
