// The float64 oracle against hand-computed cases, against itself under rearrangement (packed vs
// separate, GQA vs repeated K/V), and its backward against finite differences.
#include "../support/common.hpp"

#include <ringattn/reference/attention.cuh>

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>

using namespace ringattn;
using reference::tensor;

namespace {
tensor random_tensor(std::int64_t t, int h, int d, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  tensor x(t, h, d);
  for (double& e : x.data)
    e = u(rng);
  return x;
}
tensor slice(const tensor& x, std::int64_t begin, std::int64_t end) {
  tensor r(end - begin, x.heads, x.dim);
  std::copy(x.row(begin, 0), x.row(end, 0), r.data.begin());
  return r;
}
} // namespace

TEST_CASE("oracle: a 2-token case computed by hand, full and causal") {
  // q = k = identity rows, v = [[1,2],[3,4]], scale 1.
  tensor q(2, 1, 2), k(2, 1, 2), v(2, 1, 2);
  q(0, 0, 0) = k(0, 0, 0) = 1.0;
  q(1, 0, 1) = k(1, 0, 1) = 1.0;
  v(0, 0, 0) = 1;
  v(0, 0, 1) = 2;
  v(1, 0, 0) = 3;
  v(1, 0, 1) = 4;
  const std::vector<std::int32_t> cu = {0, 2};
  const attention_arguments args{1, 1, 2, 1.0f};
  const double e = std::exp(1.0);

  auto full = reference::attention_forward(q, k, v, cu, args, mask_kind::full);
  // row 0: scores (1, 0) -> p = (e, 1) / (e + 1)
  CHECK(full.out(0, 0, 0) == doctest::Approx((e * 1 + 1 * 3) / (e + 1)).epsilon(1e-15));
  CHECK(full.out(0, 0, 1) == doctest::Approx((e * 2 + 1 * 4) / (e + 1)).epsilon(1e-15));
  CHECK(full.lse_at(0, 0) == doctest::Approx(std::log(e + 1)).epsilon(1e-15));
  // row 1: scores (0, 1)
  CHECK(full.out(1, 0, 0) == doctest::Approx((1 * 1 + e * 3) / (e + 1)).epsilon(1e-15));

  auto causal = reference::attention_forward(q, k, v, cu, args, mask_kind::causal);
  CHECK(causal.out(0, 0, 0) == 1.0); // row 0 sees key 0 alone
  CHECK(causal.out(0, 0, 1) == 2.0);
  CHECK(causal.lse_at(0, 0) == doctest::Approx(1.0).epsilon(1e-15));
  CHECK(causal.out(1, 0, 1) == doctest::Approx(full.out(1, 0, 1)).epsilon(1e-15));
}

TEST_CASE("oracle: empty sequences in a batch are skipped") {
  std::mt19937_64 rng(test::fresh_seed());
  const std::vector<std::int32_t> cu = {0, 0, 3, 3};
  auto q = random_tensor(3, 2, 4, rng), k = random_tensor(3, 2, 4, rng),
       v = random_tensor(3, 2, 4, rng);
  auto r = reference::attention_forward(q, k, v, cu, {2, 2, 4, 0.5f}, mask_kind::causal);
  for (double x : r.lse)
    CHECK(std::isfinite(x));
}

TEST_CASE("oracle: a packed batch equals each sequence run alone; GQA equals repeated K/V") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const std::vector<std::int32_t> cu = test::random_cu_seqlens(3, 1, 9, rng);
  const std::int64_t tokens = cu.back();
  const attention_arguments args{4, 2, 8, 0.0f};
  auto q = random_tensor(tokens, 4, 8, rng), k = random_tensor(tokens, 2, 8, rng),
       v = random_tensor(tokens, 2, 8, rng);
  for (mask_kind mask : {mask_kind::full, mask_kind::causal}) {
    CAPTURE(std::string(to_string(mask)));
    auto packed = reference::attention_forward(q, k, v, cu, args, mask);
    for (std::size_t b = 0; b + 1 < cu.size(); ++b) {
      const std::vector<std::int32_t> one = {0, cu[b + 1] - cu[b]};
      auto alone =
          reference::attention_forward(slice(q, cu[b], cu[b + 1]), slice(k, cu[b], cu[b + 1]),
                                       slice(v, cu[b], cu[b + 1]), one, args, mask);
      for (std::int64_t t = 0; t < one[1]; ++t)
        for (int h = 0; h < 4; ++h) {
          CHECK(alone.lse_at(h, t) == packed.lse_at(h, cu[b] + t));
          for (int d = 0; d < 8; ++d)
            CHECK(alone.out(t, h, d) == packed.out(cu[b] + t, h, d));
        }
    }
    // GQA: q head h reads kv head h / 2; repeating K/V per q head gives plain MHA.
    tensor k4(tokens, 4, 8), v4(tokens, 4, 8);
    for (std::int64_t t = 0; t < tokens; ++t)
      for (int h = 0; h < 4; ++h)
        for (int d = 0; d < 8; ++d) {
          k4(t, h, d) = k(t, h / 2, d);
          v4(t, h, d) = v(t, h / 2, d);
        }
    auto mha = reference::attention_forward(q, k4, v4, cu, {4, 4, 8, 0.0f}, mask);
    CHECK(reference::relative_error(mha.out.data, packed.out.data) == 0.0);
  }
}

TEST_CASE("oracle backward: gradients match central finite differences of <dO, O>") {
  const auto seed = test::fresh_seed();
  CAPTURE(seed);
  std::mt19937_64 rng(seed);
  const std::vector<std::int32_t> cu = {0, 5, 8};
  const attention_arguments args{4, 2, 4, 0.0f};
  auto q = random_tensor(8, 4, 4, rng), k = random_tensor(8, 2, 4, rng),
       v = random_tensor(8, 2, 4, rng), dout = random_tensor(8, 4, 4, rng);
  for (mask_kind mask : {mask_kind::full, mask_kind::causal}) {
    CAPTURE(std::string(to_string(mask)));
    auto grads = reference::attention_backward(q, k, v, dout, cu, args, mask);
    auto loss = [&](const tensor& qq, const tensor& kk, const tensor& vv) {
      auto f = reference::attention_forward(qq, kk, vv, cu, args, mask);
      double l = 0.0;
      for (std::size_t i = 0; i < f.out.data.size(); ++i)
        l += f.out.data[i] * dout.data[i];
      return l;
    };
    const double eps = 1e-6;
    // Every element of every input: the problem is small enough.
    auto check_input = [&](tensor& x, const tensor& g, int which) {
      double worst = 0.0;
      for (std::size_t i = 0; i < x.data.size(); ++i) {
        const double keep = x.data[i];
        x.data[i] = keep + eps;
        const double up = which == 0 ? loss(x, k, v) : which == 1 ? loss(q, x, v) : loss(q, k, x);
        x.data[i] = keep - eps;
        const double dn = which == 0 ? loss(x, k, v) : which == 1 ? loss(q, x, v) : loss(q, k, x);
        x.data[i] = keep;
        worst = std::max(worst, std::abs((up - dn) / (2 * eps) - g.data[i]));
      }
      return worst;
    };
    // Central differences in double: truncation ~eps^2, cancellation ~1e-16/eps = 1e-10.
    CHECK(check_input(q, grads.dq, 0) < 1e-8);
    CHECK(check_input(k, grads.dk, 1) < 1e-8);
    CHECK(check_input(v, grads.dv, 2) < 1e-8);
  }
}

TEST_CASE("oracle: views of bf16 storage give the same result as the float64 tensors they hold") {
  std::mt19937_64 rng(test::fresh_seed());
  const std::vector<std::int32_t> cu = {0, 7};
  auto qb = test::random_buffer<__nv_bfloat16>(7 * 2 * 64, rng);
  auto kb = test::random_buffer<__nv_bfloat16>(7 * 1 * 64, rng);
  auto vb = test::random_buffer<__nv_bfloat16>(7 * 1 * 64, rng);
  thd_view<const __nv_bfloat16> qv(qb.data(), 7, 2, 64), kv(kb.data(), 7, 1, 64),
      vv(vb.data(), 7, 1, 64);
  const attention_arguments args{2, 1, 64, 0.0f};
  auto a = reference::attention_forward(qv, kv, vv, cu, args, mask_kind::causal);
  auto b = reference::attention_forward(reference::to_tensor(qv), reference::to_tensor(kv),
                                        reference::to_tensor(vv), cu, args, mask_kind::causal);
  CHECK(a.out.data == b.out.data);
  CHECK(a.lse == b.lse);
}

TEST_CASE("oracle rejects inconsistent shapes") {
  tensor q(4, 2, 8), k(4, 1, 8), v(4, 1, 8), k3(3, 1, 8);
  const std::vector<std::int32_t> cu = {0, 4};
  CHECK_THROWS_AS(reference::attention_forward(q, k3, v, cu, {2, 1, 8, 0.f}, mask_kind::full),
                  invalid_argument);
  CHECK_THROWS_AS(reference::attention_forward(q, k, v, cu, {2, 2, 8, 0.f}, mask_kind::full),
                  invalid_argument);
  const std::vector<std::int32_t> short_cu = {0, 3};
  CHECK_THROWS_WITH(
      reference::attention_forward(q, k, v, short_cu, {2, 1, 8, 0.f}, mask_kind::full),
      "ringattn: cu_seqlens ends at 3 but the tensor has 4 tokens");
}

TEST_CASE("relative_error: NaN never passes, sizes must agree") {
  std::vector<double> a = {1, 2}, b = {1, 2}, n = {1, std::nan("")};
  CHECK(reference::relative_error(a, b) == 0.0);
  CHECK_FALSE(reference::relative_error(n, b) < 1.0);
  CHECK(std::isinf(reference::relative_error(std::vector<double>{1}, b)));
}

TEST_CASE("oracle on sample rows equals the same rows of the whole oracle") {
  std::mt19937_64 rng(test::fresh_seed());
  const std::vector<std::int32_t> cu = {0, 7, 7, 20};
  auto q = random_tensor(20, 4, 8, rng), k = random_tensor(20, 2, 8, rng),
       v = random_tensor(20, 2, 8, rng);
  const attention_arguments args{4, 2, 8, 0.0f};
  const auto w = position_window::of(mask_kind::causal);
  const auto whole = reference::attention_forward(q, k, v, cu, args, w);
  const std::vector<std::int64_t> rows = {19, 0, 6, 7, 13};
  const auto some = reference::attention_forward_rows(q, k, v, cu, args, w, rows);
  for (std::size_t i = 0; i < rows.size(); ++i)
    for (int h = 0; h < 4; ++h) {
      CHECK(some.lse_at(h, static_cast<std::int64_t>(i)) == whole.lse_at(h, rows[i]));
      for (int d = 0; d < 8; ++d)
        CHECK(some.out(static_cast<std::int64_t>(i), h, d) == whole.out(rows[i], h, d));
    }
  const std::vector<std::int64_t> bad = {20};
  CHECK_THROWS_AS(reference::attention_forward_rows(q, k, v, cu, args, w, bad), invalid_argument);
}
