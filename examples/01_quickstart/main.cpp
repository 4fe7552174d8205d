// 01_quickstart: the README's main command.
//
// Until the ring driver lands this example shows the two pieces that exist: how each partitioner
// spreads a long causal sequence over P ranks (exact per-rank work), and the float64 oracle on a
// small packed batch whose shards are scattered and gathered back through the partition plan.
//
//   quickstart [--ranks P] [--tokens N] [--heads H] [--kv-heads K] [--mask causal|full]
#include <ringattn/ringattn.cuh>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {
struct options {
  int ranks = 8;
  std::int32_t tokens = 65536;
  int heads = 8, kv_heads = 2;
  ringattn::mask_kind mask = ringattn::mask_kind::causal;
};

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : "";
    if (a == "--ranks")
      o.ranks = std::atoi(v), ++i;
    else if (a == "--tokens")
      o.tokens = std::atoi(v), ++i;
    else if (a == "--heads")
      o.heads = std::atoi(v), ++i;
    else if (a == "--kv-heads")
      o.kv_heads = std::atoi(v), ++i;
    else if (a == "--mask")
      o.mask =
          std::strcmp(v, "full") == 0 ? ringattn::mask_kind::full : ringattn::mask_kind::causal,
      ++i;
    else {
      std::fprintf(stderr,
                   "usage: %s [--ranks P] [--tokens N] [--heads H] [--kv-heads K] "
                   "[--mask causal|full]\n",
                   argv[0]);
      std::exit(2);
    }
  }
  return o;
}

template <class P>
void balance_row(const options& o) {
  const std::vector<std::int32_t> cu = {0, o.tokens};
  ringattn::partition_plan<P> plan(cu, o.ranks);
  const auto w = ringattn::position_window::of(o.mask);
  std::int64_t lo = INT64_MAX, hi = 0, sum = 0;
  for (int r = 0; r < o.ranks; ++r) {
    const std::int64_t x = plan.work(r, w);
    lo = std::min(lo, x), hi = std::max(hi, x), sum += x;
  }
  const double mean = static_cast<double>(sum) / o.ranks;
  std::printf("  %-12s %6d %8s %10d %14.4g %14.4g %9.3f\n", P::name, o.ranks,
              ringattn::to_string(o.mask), o.tokens, static_cast<double>(lo),
              static_cast<double>(hi), hi / mean);
}
} // namespace

int main(int argc, char** argv) try {
  const options o = parse(argc, argv);
  std::printf("ringattn %d.%d.%d quickstart\n\n", ringattn::version.major, ringattn::version.minor,
              ringattn::version.patch);
  std::printf("Per-rank work (visible score elements per head) for one sequence:\n");
  std::printf("  %-12s %6s %8s %10s %14s %14s %9s\n", "partitioner", "ranks", "mask", "tokens",
              "min work", "max work", "max/mean");
  balance_row<ringattn::contiguous>(o);
  balance_row<ringattn::round_robin>(o);
  balance_row<ringattn::zigzag>(o);

  // A small packed batch: scatter to shards, gather back, and attend with the float64 oracle.
  const std::vector<std::int32_t> cu = {0, 301, 302, 777};
  const ringattn::attention_arguments args{o.heads, o.kv_heads, 64, 0.0f};
  args.validate().throw_if_invalid();
  ringattn::partition_plan<ringattn::zigzag> plan(cu, o.ranks);
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<__nv_bfloat16> q(static_cast<std::size_t>(cu.back()) * o.heads * 64);
  for (auto& x : q)
    x = ringattn::from_float<__nv_bfloat16>(u(rng));
  ringattn::thd_view<const __nv_bfloat16> qv(q.data(), cu.back(), o.heads, 64);
  std::vector<__nv_bfloat16> shards(q.size()), back(q.size());
  for (int r = 0; r < o.ranks; ++r)
    ringattn::scatter(
        plan, r, qv,
        ringattn::thd_view<__nv_bfloat16>(shards.data() + plan.rank_offset(r) * o.heads * 64,
                                          plan.local_tokens(r), o.heads, 64));
  ringattn::gather(plan,
                   ringattn::thd_view<const __nv_bfloat16>(shards.data(), cu.back(), o.heads, 64),
                   ringattn::thd_view<__nv_bfloat16>(back.data(), cu.back(), o.heads, 64));
  const bool same = std::memcmp(q.data(), back.data(), q.size() * sizeof(q[0])) == 0;

  std::vector<__nv_bfloat16> kv(static_cast<std::size_t>(cu.back()) * o.kv_heads * 64);
  for (auto& x : kv)
    x = ringattn::from_float<__nv_bfloat16>(u(rng));
  ringattn::thd_view<const __nv_bfloat16> kvv(kv.data(), cu.back(), o.kv_heads, 64);
  const auto t0 = std::chrono::steady_clock::now();
  auto ref = ringattn::reference::attention_forward(qv, kvv, kvv, cu, args, o.mask);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("\nPacked batch of %zu sequences (%d tokens), zigzag over %d ranks: scatter+gather "
              "%s; float64 oracle %.1f ms, lse[0,0] = %.6f\n",
              cu.size() - 1, cu.back(), o.ranks, same ? "is the identity" : "FAILED", ms,
              ref.lse_at(0, 0));
  std::printf(
      "(The ring driver, which runs this on P ranks, arrives with the ring-forward issue.)\n");
  return same ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
