// Plan time against the number of packed sequences (host only): a rank's ring schedule — the
// partition plan, every step's blocks and groups — for P = 8 and 1K to 64K sequences of uneven
// lengths. It should grow as n log n.
//
//   bench_plan [--benchmark_out=plan.json --benchmark_out_format=json]
#include <ringattn/partition/plan.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring/schedule.cuh>

#include <benchmark/benchmark.h>

#include <vector>

namespace {
void plan(benchmark::State& state) {
  const auto sequences = static_cast<int>(state.range(0));
  std::vector<std::int32_t> cu{0};
  for (int i = 0; i < sequences; ++i)
    cu.push_back(cu.back() + 17 + (i * 7919) % 200);
  for (auto _ : state) {
    const ringattn::partition_plan<ringattn::zigzag> p(cu, 8);
    const ringattn::ring_schedule s(p, 3,
                                    ringattn::position_window::of(ringattn::mask_kind::causal));
    benchmark::DoNotOptimize(s.steps().data());
  }
  state.SetComplexityN(sequences);
}
BENCHMARK(plan)
    ->ArgName("sequences")
    ->RangeMultiplier(4)
    ->Range(1024, 65536)
    ->Unit(benchmark::kMillisecond)
    ->Complexity(benchmark::oNLogN);
} // namespace

BENCHMARK_MAIN();
