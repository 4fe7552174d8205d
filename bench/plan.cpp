// Plans on the host (no GPU), one core:
// - `plan/<partitioner>`: a rank's ring schedule (the partition plan, every step's blocks and
//   groups) for P = 8 and 1K to 64K packed sequences of uneven lengths. It should grow as n log n.
// - `documents/<mix>/<partitioner>`: 64K tokens of a document mix
//   (test/support/document_mixes.hpp) over P = 8 ranks, causal; the time to plan, and as
//   counters the layout's causal work max/mean (`imbalance`), the steps of the ring (`steps`), and
//   over the batch's tokens: the tokens the ring's forward sends (`sent`: a block's rows that
//   another rank sees, on while a later rank sees some of them), those its backward carries
//   (`carried`: those rows of every block the whole ring, their dK/dV going home) and the least
//   any schedule must move (`needed`: to every rank the key segments of the others that its
//   queries see, once).
//
//   bench_plan [--benchmark_out=plan.json --benchmark_out_format=json]
#include "../test/support/document_mixes.hpp"

#include <ringattn/partition/balanced.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring/schedule.cuh>

#include <benchmark/benchmark.h>

#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace {
namespace ra = ringattn;
constexpr int ranks = 8;
const ra::position_window causal = ra::position_window::of(ra::mask_kind::causal);

template <class P>
void plan(benchmark::State& state) {
  const auto sequences = static_cast<int>(state.range(0));
  std::vector<std::int32_t> cu{0};
  for (int i = 0; i < sequences; ++i)
    cu.push_back(cu.back() + 17 + (i * 7919) % 200);
  for (auto _ : state) {
    const ra::partition_plan<P> p(cu, ranks);
    const ra::ring_schedule s(p, 3, causal);
    benchmark::DoNotOptimize(s.steps().data());
  }
  state.SetComplexityN(sequences);
}
BENCHMARK(plan<ra::zigzag>)
    ->Name("plan/zigzag")
    ->ArgName("sequences")
    ->RangeMultiplier(4)
    ->Range(1024, 65536)
    ->Unit(benchmark::kMillisecond)
    ->Complexity(benchmark::oNLogN);
BENCHMARK(plan<ra::balanced>)
    ->Name("plan/balanced")
    ->ArgName("sequences")
    ->RangeMultiplier(4)
    ->Range(1024, 65536)
    ->Unit(benchmark::kMillisecond)
    ->Complexity(benchmark::oNLogN);

template <class P>
void documents(benchmark::State& state, const ra::test::document_mix& mix) {
  for (auto _ : state) {
    const ra::partition_plan<P> p(mix.cu_seqlens, ranks);
    const ra::ring_schedule s(p, 0, causal);
    benchmark::DoNotOptimize(s.steps().data());
  }
  const ra::partition_plan<P> p(mix.cu_seqlens, ranks);
  const int steps = ra::ring_schedule::steps_needed(p, causal);
  double sent = 0.0, carried = 0.0, needed = 0.0;
  for (int r = 0; r < ranks; ++r) {
    const ra::ring_schedule s(p, r, causal);
    for (const ra::ring_step& step : s.steps()) {
      const auto tokens = static_cast<double>(s.travel_tokens(step.source));
      sent += step.forwarded ? tokens : 0.0;
      carried += step.index + 1 < steps ? tokens : 0.0;
    }
  }
  for (int q = 0; q < ranks; ++q)
    for (int src = 0; src < ranks; ++src) {
      if (src == q) continue;
      std::set<std::int64_t> segments; // by first row: a key segment seen by several query ones
      for (const ra::block& b : p.blocks(q, src, causal))
        if (segments.insert(b.kv.local_begin).second) needed += static_cast<double>(b.kv.count);
    }
  const auto tokens = static_cast<double>(p.tokens());
  state.counters["documents"] = p.batch();
  state.counters["imbalance"] = p.work_imbalance(causal);
  state.counters["steps"] = steps;
  state.counters["sent"] = sent / tokens;
  state.counters["carried"] = carried / tokens;
  state.counters["needed"] = needed / tokens;
}

template <class P>
void register_mixes(const char* partitioner) {
  for (const ra::test::document_mix& mix : ra::test::document_mixes(65536, ranks))
    benchmark::RegisterBenchmark(("documents/" + mix.name + "/" + partitioner).c_str(),
                                 [mix](benchmark::State& s) { documents<P>(s, mix); })
        ->Unit(benchmark::kMillisecond);
}
} // namespace

int main(int argc, char** argv) {
  register_mixes<ra::contiguous>("contiguous");
  register_mixes<ra::round_robin>("round_robin");
  register_mixes<ra::zigzag>("zigzag");
  register_mixes<ra::balanced>("balanced");
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
