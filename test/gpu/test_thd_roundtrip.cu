// A kernel round-trips THD views: strided -> dense -> strided through thd_view indexing, and the
// device conversions agree bit for bit with the host ones.
#include "../support/common.hpp"
#include "../support/device_buffer.cuh"

#include <ringattn/tensor.cuh>

#include <doctest/doctest.h>

#include <cstring>

using namespace ringattn;

namespace {
template <class T>
__global__ void copy_view(thd_view<const T> src, thd_view<T> dst) {
  const std::int64_t n = src.tokens * src.heads * src.head_dim;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t t = i / (src.heads * src.head_dim);
    const int h = static_cast<int>(i / src.head_dim % src.heads),
              d = static_cast<int>(i % src.head_dim);
    dst(t, h, d) = src(t, h, d);
  }
}
template <class T>
__global__ void round_trip_convert(const float* x, T* y, float* z, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    y[i] = from_float<T>(x[i]);
    z[i] = to_float(y[i]);
  }
}

template <class T>
void check_round_trip() {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const std::int64_t tokens = 1000;
  const int heads = 3, dim = 64, hs = 72, ts = heads * hs + 16;
  auto host = test::random_buffer<T>(static_cast<std::size_t>(tokens * ts), rng);
  test::device_buffer<T> src(host), dense(static_cast<std::size_t>(tokens * heads * dim)),
      back(host.size());
  std::vector<T> poisoned(host.size(), test::poison<T>());
  back.upload(poisoned);
  dense.upload(std::vector<T>(dense.size(), test::poison<T>()));
  thd_view<const T> sv(src.get(), tokens, heads, dim, ts, hs);
  thd_view<T> dv(dense.get(), tokens, heads, dim);
  thd_view<T> bv(back.get(), tokens, heads, dim, ts, hs);
  copy_view<T><<<64, 256>>>(sv, dv);
  RINGATTN_CUDA_CHECK_LAUNCH();
  copy_view<T><<<64, 256>>>(thd_view<const T>(dv), bv);
  RINGATTN_CUDA_CHECK_LAUNCH();
  RINGATTN_CUDA_CHECK(cudaDeviceSynchronize());
  const auto out = back.download();
  thd_view<const T> hin(host.data(), tokens, heads, dim, ts, hs),
      hout(out.data(), tokens, heads, dim, ts, hs);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h)
      REQUIRE(std::memcmp(hin.row(t, h), hout.row(t, h), sizeof(T) * dim) == 0);
  // Gaps between heads and tokens are untouched: still poison.
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t e = heads * hs; e < ts; ++e)
      REQUIRE(to_float(out[static_cast<std::size_t>(t * ts + e)]) == to_float(test::poison<T>()));
}
} // namespace

TEST_CASE_TEMPLATE("a kernel round-trips a strided THD view through a dense one", T, __half,
                   __nv_bfloat16, float) {
  check_round_trip<T>();
}

TEST_CASE_TEMPLATE("device and host conversions agree bit for bit", T, __half, __nv_bfloat16) {
  std::mt19937_64 rng(test::fresh_seed());
  std::uniform_real_distribution<float> u(-70000.0f, 70000.0f);
  const int n = 1 << 16;
  std::vector<float> x(n);
  for (auto& e : x)
    e = u(rng) * (rng() % 2 ? 1.0f : 1e-6f);
  test::device_buffer<float> dx(x), dz(static_cast<std::size_t>(n));
  test::device_buffer<T> dy(static_cast<std::size_t>(n));
  round_trip_convert<T><<<(n + 255) / 256, 256>>>(dx.get(), dy.get(), dz.get(), n);
  RINGATTN_CUDA_CHECK_LAUNCH();
  const auto y = dy.download();
  const auto z = dz.download();
  for (int i = 0; i < n; ++i) {
    const T h = from_float<T>(x[i]);
    REQUIRE(std::memcmp(&h, &y[i], sizeof(T)) == 0);
    const float hz = to_float(h);
    REQUIRE(std::memcmp(&hz, &z[i], sizeof(float)) == 0);
  }
}
