#pragma once
// One rank's part of a device ring test: the rank's forward on its shards (on the current
// device, into poisoned outputs), optionally twice for bitwise repeatability; and the check of
// all ranks' outputs against the float64 oracle. Shared by the one-GPU suite (virtual ranks) and
// the multi-GPU suite (ranks on several GPUs, in-process or NCCL).
#include "all_to_all_bytes.hpp"
#include "device_buffer.cuh"
#include "ranks.hpp"
#include "ring_bytes.hpp"
#include "sharded_backward_case.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/ring_attention.cuh>

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace ringattn::test {

//! Bytes rank r sends under the all-to-all (all_to_all_bytes.hpp), from the plan's shard sizes.
template <class Ring>
all_to_all_bytes expected_all_to_all_bytes(const Ring& attn, int r) {
  std::vector<std::int64_t> tokens;
  for (int s = 0; s < attn.size(); ++s)
    tokens.push_back(attn.plan().local_tokens(s));
  return all_to_all_bytes_of(tokens, r, attn.arguments(), sizeof(__nv_bfloat16),
                             attn.schedule().group_size());
}

//! Bytes rank r sends in one forward: the ring forwards the blocks some later rank sees, the
//! all-gather sends its own block to each rank that sees some of it (ring_bytes.hpp); the
//! all-to-all its formula.
template <class Schedule, class Ring>
std::uint64_t expected_forward_bytes(const Ring& attn, int r, mask_kind mask) {
  std::uint64_t want = 0;
  if constexpr (std::is_same_v<typename Schedule::plan_type, all_to_all_plan>) {
    want = expected_all_to_all_bytes(attn, r).forward;
  } else if constexpr (std::is_same_v<Schedule, all_gather_kv>) {
    want = all_gather_bytes<__nv_bfloat16>(attn, r, mask);
  } else {
    want = ring_forward_bytes<__nv_bfloat16>(attn, r, mask);
  }
  return want;
}

//! Bytes rank r sends in one backward: the ring passes the blocks with their fp32 dK/dV and sends
//! the last block's dK/dV home; the all-gather gathers K/V again and returns the fp32 dK/dV share
//! of every block it sees to its owner; the all-to-all its formula.
template <class Schedule, class Ring, class Plan>
std::uint64_t expected_backward_bytes(const Ring& attn, const Plan& /*plan*/, int r, int ranks,
                                      const attention_arguments& a, mask_kind mask) {
  std::uint64_t want = 0;
  if constexpr (std::is_same_v<typename Schedule::plan_type, all_to_all_plan>) {
    want = expected_all_to_all_bytes(attn, r).backward;
  } else if constexpr (std::is_same_v<Schedule, all_gather_kv>) {
    want = all_gather_bytes<__nv_bfloat16>(attn, r, mask) + all_gather_share_bytes(attn, r, mask);
  } else {
    const int steps = attn.schedule().step_count();
    for (int t = 0; t + 1 < steps; ++t)
      want += attn.template backward_block_bytes<__nv_bfloat16>((r - t + ranks) % ranks);
    if (steps > 1) // the own block's fp32 dK/dV go home
      want += sizeof(float) *
              static_cast<std::uint64_t>(
                  attn.schedule().travel_tokens(attn.schedule().source_of(steps - 1))) *
              a.kv_heads * (a.qk_dim() + a.v_dim());
  }
  return want;
}

template <class P, class T>
struct device_rank_run {
  typename sharded_case<P, T>::rank_output output;
  std::vector<float> max_logit; // asked for in the first forward where the kernel computes it
  bool repeatable = true;       // two forwards gave the same bits (when asked for)
  std::uint64_t sent = 0;       // bytes this rank sent in the first forward
  std::uint64_t expected = 0;   // what the plan says it sends: the blocks it forwards (and the
                                // max logits, P - 1 times)
};

//! Whether a device BlockKernel computes the max logit (all but the cuDNN model).
template <class Kernel>
constexpr bool device_max_logit = [] {
  if constexpr (requires { Kernel::device_max_logit; })
    return Kernel::device_max_logit;
  else
    return true;
}();

//! Rank r's device forward through `comm` on the current device. The host joins the stream with
//! the communicator's bounded `wait` where it has one (NCCL), else synchronises.
template <class Mask, class Schedule = ring_pass, class P, class T, class Comm>
device_rank_run<P, T> device_ring_rank(const sharded_case<P, T>& c, int r, Comm& comm,
                                       bool repeat) {
  const attention_arguments a = c.args;
  const int ranks = c.plan.ranks();
  const auto at = static_cast<std::size_t>(r);
  ring_attention<P, Comm, Mask, Schedule> attn(comm, a, c.plan.cu_seqlens());
  attn.prepare_device();
  const std::int64_t n = attn.local_tokens();
  const int dv = a.v_dim();
  device_buffer<T> q(c.qs[at]), k(c.ks[at]), v(c.vs[at]);
  device_buffer<T> out(std::vector<T>(static_cast<std::size_t>(n * a.q_heads * dv), poison<T>()));
  device_buffer<float> lse(std::vector<float>(static_cast<std::size_t>(n * a.q_heads), -7.0f));
  device_buffer<float> max_logit(std::vector<float>(static_cast<std::size_t>(a.q_heads), 7.0f));
  const std::size_t bytes = attn.template device_workspace_bytes<T>();
  device_buffer<std::byte> ws(bytes);
  cudaStream_t stream;
  RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const std::uint64_t sent_before = comm.bytes_sent();
  // The first forward asks for the max logit (where the kernel has it), a repeat does not: the
  // two must still agree bit for bit.
  auto once = [&](bool with_max_logit) {
    attn.forward(thd_view<const T>(q.get(), n, a.q_heads, a.head_dim),
                 thd_view<const T>(k.get(), n, a.kv_heads, a.head_dim),
                 thd_view<const T>(v.get(), n, a.kv_heads, dv),
                 thd_view<T>(out.get(), n, a.q_heads, dv), lse.get(),
                 with_max_logit ? max_logit.get() : nullptr, ws.get(), bytes, stream);
    if constexpr (requires { comm.wait(stream); })
      comm.wait(stream);
    else
      RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
    return std::pair{out.download(), lse.download()};
  };
  constexpr bool asks = device_max_logit<Mask>;
  device_rank_run<P, T> res;
  auto [o1, l1] = once(asks);
  res.sent = comm.bytes_sent() - sent_before;
  if (asks) res.max_logit = max_logit.download();
  if (repeat) {
    auto [o2, l2] = once(false);
    res.repeatable = std::memcmp(o1.data(), o2.data(), o1.size() * sizeof(T)) == 0 &&
                     std::memcmp(l1.data(), l2.data(), l1.size() * sizeof(float)) == 0;
  }
  RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  res.output = {std::move(o1), std::move(l1)};
  res.expected = expected_forward_bytes<Schedule>(attn, r, Mask::mask) +
                 (asks ? static_cast<std::uint64_t>(ranks - 1) * a.q_heads * sizeof(float) : 0);
  return res;
}

//! Runs `rank_run(r, comm)` for every rank of an in-process group of `ranks` ranks, each on its
//! own thread with device r % `devices` current (1: virtual ranks sharing one GPU); returns what
//! each returned (a rank that throws fails the test).
template <class Run, class RankRun>
std::vector<Run> on_device_ranks(int ranks, int devices, RankRun rank_run) {
  std::vector<Run> runs(static_cast<std::size_t>(ranks));
  in_process_group group(ranks, std::chrono::seconds(60));
  const auto errors = on_ranks(group, [&](int r, in_process_communicator& comm) {
    RINGATTN_CUDA_CHECK(cudaSetDevice(r % devices));
    runs[static_cast<std::size_t>(r)] = rank_run(r, comm);
  });
  for (const auto& e : errors)
    REQUIRE(message(e) == "");
  return runs;
}

//! Every rank's device forward (in-process group, rank r on device r % `devices`).
template <class Mask, class Schedule = ring_pass, class P, class T>
std::vector<device_rank_run<P, T>> device_ring_in_process(const sharded_case<P, T>& c, int devices,
                                                          bool repeat) {
  return on_device_ranks<device_rank_run<P, T>>(
      c.plan.ranks(), devices, [&](int r, in_process_communicator& comm) {
        return device_ring_rank<Mask, Schedule>(c, r, comm, repeat);
      });
}

//! All ranks' outputs against the oracle (the block kernel's bf16 tolerances, see
//! test_block_forward.cu: 8e-3 relative L2 on O, 2e-3 absolute on LSE), bytes sent against the
//! plan, and repeatability.
template <class P, class T>
void check_device_ring(const sharded_case<P, T>& c,
                       const std::vector<device_rank_run<P, T>>& runs) {
  static_assert(std::is_same_v<T, __nv_bfloat16>, "tolerances stated for bf16");
  const auto ref = c.oracle();
  double num = 0.0, den = 0.0, lse = 0.0;
  for (int r = 0; r < c.plan.ranks(); ++r) {
    CAPTURE(r);
    const auto& run = runs[static_cast<std::size_t>(r)];
    const auto e = c.rank_error(r, run.output, ref);
    num += e.num, den += e.den, lse = std::max(lse, e.lse);
    CHECK(run.repeatable);
    CHECK(run.sent == run.expected);
    if (!run.max_logit.empty()) {
      // fp32 logits of bf16 inputs: the lse's tolerance; every rank the same bits.
      CHECK(c.max_logit_error(run.max_logit, ref.max_logit) < 2e-3);
      CHECK(std::memcmp(run.max_logit.data(), runs[0].max_logit.data(),
                        run.max_logit.size() * sizeof(float)) == 0);
    }
  }
  CHECK(std::sqrt(num / den) < 8e-3);
  CHECK(lse < 2e-3);
}

//! Every P in {1, 2, 3, 4, 8}: a packed batch of three sequences of odd lengths (up to 700
//! tokens, 150 with RINGATTN_TEST_SMALL) through the device ring of `Kernel` on virtual ranks,
//! against the oracle; two forwards compared bit for bit at P = 3, or at every P.
template <class P, class Kernel, class Schedule = ring_pass>
void check_ring_matrix(attention_arguments a, bool repeat_every_p) {
  using T = __nv_bfloat16;
  const auto seed = fresh_seed();
  CAPTURE(seed);
  const bool small = std::getenv("RINGATTN_TEST_SMALL") != nullptr;
  for (int ranks : {1, 2, 3, 4, 8}) {
    CAPTURE(ranks);
    std::mt19937_64 rng(seed + static_cast<std::uint64_t>(ranks));
    sharded_case<P, T> c(random_cu_seqlens(3, 1, small ? 150 : 700, rng), ranks, a, Kernel::mask,
                         rng);
    check_device_ring(c,
                      device_ring_in_process<Kernel, Schedule>(c, 1, repeat_every_p || ranks == 3));
  }
}

template <class P, class T>
struct device_backward_run {
  typename sharded_backward_case<P, T>::rank_grads grads;
  bool repeatable = true;     // two backwards gave the same bits (when asked for)
  std::uint64_t sent = 0;     // bytes this rank sent in one backward
  std::uint64_t expected = 0; // the blocks with their dK/dV, then one block's dK/dV home
};

//! Rank r's device forward, then its device backward from that forward's out and lse (twice
//! when `repeat`), on the current device, into poisoned gradients.
template <class Mask, class Schedule = ring_pass, class P, class T, class Comm>
device_backward_run<P, T> device_backward_rank(const sharded_backward_case<P, T>& c, int r,
                                               Comm& comm, bool repeat) {
  const attention_arguments a = c.args;
  const int ranks = c.plan.ranks();
  const auto at = static_cast<std::size_t>(r);
  ring_attention<P, Comm, Mask, Schedule> attn(comm, a, c.plan.cu_seqlens());
  attn.prepare_device();
  const std::int64_t n = attn.local_tokens();
  const int qh = a.q_heads, kvh = a.kv_heads, d = a.qk_dim(), dvw = a.v_dim();
  device_buffer<T> q(c.qs[at]), k(c.ks[at]), v(c.vs[at]), dout(c.douts[at]);
  device_buffer<T> out(std::vector<T>(c.douts[at].size(), poison<T>()));
  device_buffer<float> lse(std::vector<float>(static_cast<std::size_t>(n * qh), -7.0f));
  device_buffer<T> dq(c.qs[at].size()), dk(c.ks[at].size()), dv(c.vs[at].size());
  const std::size_t bytes = std::max(attn.template device_workspace_bytes<T>(),
                                     attn.template device_backward_workspace_bytes<T>());
  device_buffer<std::byte> ws(bytes);
  cudaStream_t stream;
  RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto join = [&] {
    if constexpr (requires { comm.wait(stream); })
      comm.wait(stream);
    else
      RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  };
  attn.forward(thd_view<const T>(q.get(), n, qh, d), thd_view<const T>(k.get(), n, kvh, d),
               thd_view<const T>(v.get(), n, kvh, dvw), thd_view<T>(out.get(), n, qh, dvw),
               lse.get(), ws.get(), bytes, stream);
  join();
  const std::uint64_t before = comm.bytes_sent();
  auto once = [&] {
    dq.upload(std::vector<T>(dq.size(), poison<T>()));
    dk.upload(std::vector<T>(dk.size(), poison<T>()));
    dv.upload(std::vector<T>(dv.size(), poison<T>()));
    attn.backward(thd_view<const T>(q.get(), n, qh, d), thd_view<const T>(k.get(), n, kvh, d),
                  thd_view<const T>(v.get(), n, kvh, dvw), thd_view<const T>(out.get(), n, qh, dvw),
                  lse.get(), thd_view<const T>(dout.get(), n, qh, dvw),
                  thd_view<T>(dq.get(), n, qh, d), thd_view<T>(dk.get(), n, kvh, d),
                  thd_view<T>(dv.get(), n, kvh, dvw), ws.get(), bytes, stream);
    join();
    return typename sharded_backward_case<P, T>::rank_grads{dq.download(), dk.download(),
                                                            dv.download()};
  };
  device_backward_run<P, T> res;
  res.grads = once();
  if (repeat) {
    const auto again = once();
    for (int i = 0; i < 3; ++i) {
      const auto& x = i == 0 ? res.grads.dq : i == 1 ? res.grads.dk : res.grads.dv;
      const auto& y = i == 0 ? again.dq : i == 1 ? again.dk : again.dv;
      res.repeatable = res.repeatable && std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0;
    }
  }
  RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  res.sent = (comm.bytes_sent() - before) / (repeat ? 2 : 1);
  res.expected = expected_backward_bytes<Schedule>(attn, c.plan, r, ranks, a, Mask::mask);
  return res;
}

//! Every rank's device backward (in-process group, rank r on device r % `devices`).
template <class Mask, class Schedule = ring_pass, class P, class T>
std::vector<device_backward_run<P, T>>
device_backward_in_process(const sharded_backward_case<P, T>& c, int devices, bool repeat) {
  return on_device_ranks<device_backward_run<P, T>>(
      c.plan.ranks(), devices, [&](int r, in_process_communicator& comm) {
        return device_backward_rank<Mask, Schedule>(c, r, comm, repeat);
      });
}

//! All ranks' gradients against the oracle's backward: bf16 1e-2 relative L2 for each of dq, dk,
//! dv (the forward's bf16 output, from the CUDA kernel, enters through D; the gradients are
//! rounded to bf16); bytes against the plan; repeatability.
template <class P, class T>
std::array<double, 3> check_device_backward(const sharded_backward_case<P, T>& c,
                                            const std::vector<device_backward_run<P, T>>& runs) {
  const auto ref = c.oracle_backward();
  std::array<double, 3> num{}, den{}, err{};
  for (int r = 0; r < c.plan.ranks(); ++r) {
    CAPTURE(r);
    const auto& run = runs[static_cast<std::size_t>(r)];
    const auto e = c.rank_grad_error(r, run.grads, ref);
    for (std::size_t i = 0; i < 3; ++i)
      num[i] += e.num[i], den[i] += e.den[i];
    CHECK(run.repeatable);
    CHECK(run.sent == run.expected);
  }
  for (std::size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    err[i] = std::sqrt(num[i] / den[i]);
    CHECK(err[i] < 1e-2);
  }
  return err;
}

} // namespace ringattn::test
