// 03_packed_batch: a batch of packed sequences of mixed lengths, partitioned round-robin.
//
// Round-robin gives every rank the same number of tokens (to within one per sequence) for any mix
// of lengths, so short and long sequences in one batch keep the ranks balanced under a causal
// mask. The ring runs on P simulated ranks (threads, the host path); every output row is checked
// against the float64 oracle. The policies are fixed at compile time; `--ranks` picks P.
#include "../common/example.hpp"

#include <ringattn/comm/in_process.cuh>
#include <ringattn/ring_attention.cuh>
#include <ringattn/ringattn.cuh>

#include <cstdio>
#include <exception>
#include <random>
#include <thread>
#include <vector>

namespace {
constexpr std::int32_t lengths[] = {1, 7, 300, 31, 1024, 5, 611, 2, 129};
constexpr ringattn::attention_arguments args{8, 2, 64, 0.0f};
using partitioner = ringattn::round_robin;
using mask = ringattn::causal;
using T = __nv_bfloat16;
using ring = ringattn::ring_attention<partitioner, ringattn::in_process_communicator, mask>;
} // namespace

int main(int argc, char** argv) try {
  int ranks = 4;
  example::flags("packed_batch",
                 "Nine packed sequences of 1 to 1024 tokens, round-robin over the ranks, causal, "
                 "on the host; every output row against the float64 oracle.")
      .add("ranks", ranks, "ranks (threads of this process)", 1, 64)
      .parse(argc, argv);
  std::vector<std::int32_t> cu{0};
  for (std::int32_t l : lengths)
    cu.push_back(cu.back() + l);
  const std::int64_t tokens = cu.back();
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto random = [&](std::int64_t n) {
    std::vector<T> x(static_cast<std::size_t>(n));
    for (auto& e : x)
      e = ringattn::from_float<T>(u(rng));
    return x;
  };
  const int d = args.head_dim;
  const auto q = random(tokens * args.q_heads * d), k = random(tokens * args.kv_heads * d),
             v = random(tokens * args.kv_heads * d);
  const ringattn::partition_plan<partitioner> plan(cu, ranks);
  std::vector<T> out(q.size(), ringattn::from_float<T>(-12345.0f)); // poisoned
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  ringattn::in_process_group group(ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        auto comm = group.communicator(r);
        ring attn(comm, args, cu);
        const std::int64_t n = attn.local_tokens();
        auto shard = [&](const std::vector<T>& full, int heads) {
          std::vector<T> s(static_cast<std::size_t>(n * heads * d));
          ringattn::scatter(plan, r, ringattn::thd_view<const T>(full.data(), tokens, heads, d),
                            ringattn::thd_view<T>(s.data(), n, heads, d));
          return s;
        };
        const auto qs = shard(q, args.q_heads), ks = shard(k, args.kv_heads),
                   vs = shard(v, args.kv_heads);
        std::vector<T> os(qs.size());
        std::vector<float> lse(static_cast<std::size_t>(n * args.q_heads));
        std::vector<std::byte> ws(attn.host_workspace_bytes<T>() + 16);
        const std::size_t pad = (16 - reinterpret_cast<std::uintptr_t>(ws.data()) % 16) % 16;
        attn.forward_host(ringattn::thd_view<const T>(qs.data(), n, args.q_heads, d),
                          ringattn::thd_view<const T>(ks.data(), n, args.kv_heads, d),
                          ringattn::thd_view<const T>(vs.data(), n, args.kv_heads, d),
                          ringattn::thd_view<T>(os.data(), n, args.q_heads, d), lse.data(),
                          std::span<std::byte>(ws).subspan(pad, attn.host_workspace_bytes<T>()));
        // Gather: each rank writes its rows back to their places in the batch.
        for (std::int64_t l = 0; l < n; ++l) {
          const std::int64_t g = plan.global_token(r, l);
          std::copy_n(os.begin() + l * args.q_heads * d, args.q_heads * d,
                      out.begin() + g * args.q_heads * d);
        }
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (auto& t : threads)
    t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);

  const auto ref = ringattn::reference::attention_forward(
      ringattn::thd_view<const T>(q.data(), tokens, args.q_heads, d),
      ringattn::thd_view<const T>(k.data(), tokens, args.kv_heads, d),
      ringattn::thd_view<const T>(v.data(), tokens, args.kv_heads, d), cu, args, mask::mask);
  std::vector<double> got(out.size());
  for (std::size_t i = 0; i < out.size(); ++i)
    got[i] = ringattn::to_float(out[i]);
  const double err = ringattn::reference::relative_error(got, ref.out.data);

  std::printf("packed batch of %zu sequences (%lld tokens), %s, %s mask, %d ranks\n",
              std::size(lengths), static_cast<long long>(tokens), partitioner::name, mask::name,
              ranks);
  const auto w = ringattn::position_window::of(mask::mask);
  for (int r = 0; r < ranks; ++r)
    std::printf("  rank %d: %4lld tokens, %8lld visible scores per head\n", r,
                static_cast<long long>(plan.local_tokens(r)),
                static_cast<long long>(plan.work(r, w)));
  const bool ok = err < 4e-3; // bf16 output rounding
  std::printf("relative error of every output row against the float64 oracle: %.2e -> %s\n", err,
              ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
} catch (const example::help_requested& h) {
  std::printf("%s", h.text.c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
