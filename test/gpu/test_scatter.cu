// Device scatter/gather equal the host ones, for every partitioner, dtype and alignment.
#include "../support/common.hpp"
#include "../support/device_buffer.cuh"

#include <ringattn/partition/balanced.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/scatter.cuh>
#include <ringattn/partition/zigzag.cuh>

#include <doctest/doctest.h>

#include <cstring>

using namespace ringattn;

namespace {
template <class P, class T>
void check_against_host(int trial, std::mt19937_64& rng) {
  const int ranks = 1 + static_cast<int>(rng() % 16);
  const auto cu = test::random_cu_seqlens(1 + static_cast<int>(rng() % 6), 0, 700, rng);
  const std::int64_t tokens = cu.back();
  const int heads = 1 + static_cast<int>(rng() % 4);
  const int dim = trial % 3 == 0 ? 64 : 128;
  // Layouts: dense; strided heads; a 1-element offset that forbids 16-byte vectors.
  const int layout = trial % 3;
  const std::int64_t hs = layout == 1 ? dim + 8 : dim;
  const std::int64_t ts = layout == 1 ? heads * hs + 24 : heads * dim;
  const std::int64_t shift = layout == 2 ? 1 : 0;
  CAPTURE(ranks);
  CAPTURE(layout);
  CAPTURE(tokens);
  partition_plan<P> plan(cu, ranks);
  device_partition_plan<P> dplan(plan);

  auto host_full = test::random_buffer<T>(static_cast<std::size_t>(tokens * ts + shift), rng);
  test::device_buffer<T> dfull(host_full);
  thd_view<const T> hv(host_full.data() + shift, tokens, heads, dim, ts, hs);
  thd_view<const T> dv(dfull.get() + shift, tokens, heads, dim, ts, hs);

  const std::int64_t row = static_cast<std::int64_t>(heads) * dim;
  const std::size_t all = static_cast<std::size_t>(plan.tokens() * row + shift);
  std::vector<T> host_shards(all, test::poison<T>());
  test::device_buffer<T> dshards(std::vector<T>(all, test::poison<T>()));
  cudaStream_t stream;
  RINGATTN_CUDA_CHECK(cudaStreamCreate(&stream));
  for (int r = 0; r < ranks; ++r) {
    const std::int64_t off = plan.rank_offset(r) * row + shift;
    scatter(plan, r, hv, thd_view<T>(host_shards.data() + off, plan.local_tokens(r), heads, dim));
    scatter(dplan, r, dv, thd_view<T>(dshards.get() + off, plan.local_tokens(r), heads, dim),
            stream);
  }
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto got_shards = dshards.download();
  REQUIRE(std::memcmp(got_shards.data(), host_shards.data(), all * sizeof(T)) == 0);

  test::device_buffer<T> dback(std::vector<T>(host_full.size(), test::poison<T>()));
  gather(dplan, thd_view<const T>(dshards.get() + shift, plan.tokens(), heads, dim),
         thd_view<T>(dback.get() + shift, tokens, heads, dim, ts, hs), stream);
  RINGATTN_CUDA_CHECK(cudaStreamSynchronize(stream));
  RINGATTN_CUDA_CHECK(cudaStreamDestroy(stream));
  const auto back = dback.download();
  thd_view<const T> bv(back.data() + shift, tokens, heads, dim, ts, hs);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h)
      REQUIRE(std::memcmp(bv.row(t, h), hv.row(t, h), sizeof(T) * dim) == 0);
}
} // namespace

TEST_CASE_TEMPLATE("device scatter and gather equal the host ones", P, contiguous, round_robin,
                   zigzag, balanced) {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 9; ++trial) {
    CAPTURE(trial);
    check_against_host<P, __nv_bfloat16>(trial, rng);
    check_against_host<P, __half>(trial, rng);
    check_against_host<P, float>(trial, rng);
  }
}

TEST_CASE("device gather reads the padded layout of an equal-size all-gather") {
  std::mt19937_64 rng(test::fresh_seed());
  const std::vector<std::int32_t> cu = {0, 2999, 3000, 4097};
  const int ranks = 4, heads = 2, dim = 128;
  partition_plan<zigzag> plan(cu, ranks);
  device_partition_plan<zigzag> dplan(plan);
  auto full = test::random_buffer<__nv_bfloat16>(
      static_cast<std::size_t>(plan.tokens() * heads * dim), rng);
  test::device_buffer<__nv_bfloat16> dfull(full), dback(full.size());
  const std::int64_t stride = plan.max_local_tokens();
  test::device_buffer<__nv_bfloat16> padded(static_cast<std::size_t>(stride * ranks * heads * dim));
  for (int r = 0; r < ranks; ++r)
    scatter(dplan, r, thd_view<const __nv_bfloat16>(dfull.get(), plan.tokens(), heads, dim),
            thd_view<__nv_bfloat16>(padded.get() + r * stride * heads * dim, plan.local_tokens(r),
                                    heads, dim),
            nullptr);
  dback.upload(std::vector<__nv_bfloat16>(full.size(), test::poison<__nv_bfloat16>()));
  gather(dplan, thd_view<const __nv_bfloat16>(padded.get(), stride * ranks, heads, dim),
         thd_view<__nv_bfloat16>(dback.get(), plan.tokens(), heads, dim), nullptr, stride);
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  const auto back = dback.download();
  CHECK(std::memcmp(back.data(), full.data(), full.size() * sizeof(__nv_bfloat16)) == 0);
}

TEST_CASE("device scatter validates before launching: nothing is written on bad input") {
  const std::vector<std::int32_t> cu = {0, 100};
  partition_plan<round_robin> plan(cu, 4);
  device_partition_plan<round_robin> dplan(plan);
  test::device_buffer<float> full(100 * 64), shard(std::vector<float>(25 * 64, 7.0f));
  CHECK_THROWS_WITH(scatter(dplan, 0, thd_view<const float>(full.get(), 100, 1, 64),
                            thd_view<float>(shard.get(), 24, 1, 64), nullptr),
                    "ringattn: shard has 24 tokens but rank 0 holds 25");
  CHECK_THROWS_AS(scatter(dplan, 0, thd_view<const float>(nullptr, 100, 1, 64),
                          thd_view<float>(shard.get(), 25, 1, 64), nullptr),
                  invalid_argument);
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  const auto s = shard.download();
  CHECK(std::all_of(s.begin(), s.end(), [](float x) { return x == 7.0f; }));
}
