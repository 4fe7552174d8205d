#include <ringattn/arguments.cuh>
#include <ringattn/tensor.cuh>

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <vector>

using namespace ringattn;

TEST_CASE("half and bfloat16 conversions round to nearest even on the host") {
  // 1 + 2^-8 lies halfway between two bf16 values (1 and 1 + 2^-7): ties go to the even one, 1.
  CHECK(to_float(from_float<__nv_bfloat16>(1.0f + 1.0f / 256)) == 1.0f);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: the even one is 1 + 2^-6.
  CHECK(to_float(from_float<__nv_bfloat16>(1.0f + 3.0f / 256)) == 1.0f + 1.0f / 64);
  CHECK(to_float(from_float<__half>(1.0f + 1.0f / 2048)) == 1.0f); // half: 10 mantissa bits
  CHECK(to_float(from_float<__half>(65504.0f)) == 65504.0f);
  CHECK(std::isinf(to_float(from_float<__half>(70000.0f))));
  CHECK(to_float(from_float<float>(0.1f)) == 0.1f);
  CHECK(dtype_of_v<const __nv_bfloat16> == dtype::bf16);
  CHECK(std::string(to_string(dtype::f16)) == "fp16");
}

TEST_CASE("thd_view addresses [tokens, heads, head_dim] with token and head strides") {
  std::vector<float> buf(3 * 40, 0.0f);
  // 3 tokens, 2 heads of 8, heads 16 apart, tokens 40 apart (e.g. slices of a fused qkv tensor)
  thd_view<float> v(buf.data(), 3, 2, 8, 40, 16);
  CHECK(validate_view(v, "q").is_ok());
  CHECK_FALSE(v.dense());
  v(2, 1, 7) = 5.0f;
  CHECK(buf[2 * 40 + 16 + 7] == 5.0f);
  CHECK(v.row(1, 1) == buf.data() + 56);
  thd_view<const float> c = v;
  CHECK(c(2, 1, 7) == 5.0f);
  thd_view<float> dense(buf.data(), 3, 2, 8);
  CHECK(dense.dense());
  CHECK(dense.extent() == 48);
}

TEST_CASE("validate_view rejects bad shapes, overlapping strides and null data") {
  float x = 0;
  CHECK(validate_view(thd_view<float>(nullptr, 4, 2, 8), "k").reason() ==
        "k is a null pointer with 4 tokens");
  CHECK(validate_view(thd_view<float>(nullptr, 0, 2, 8), "k").is_ok());
  CHECK(validate_view(thd_view<float>(&x, 1, 0, 8), "q").reason().find("heads must be positive") !=
        std::string::npos);
  CHECK(validate_view(thd_view<float>(&x, 1, 2, 8, 12, 8), "v").reason().find("overlap") !=
        std::string::npos);
  CHECK(validate_view(thd_view<float>(&x, 1, 2, 8, 16, 4), "v").reason().find("head_stride") !=
        std::string::npos);
}

TEST_CASE("validate_cu_seqlens: starts at 0, monotone, ends at the token count") {
  std::vector<std::int32_t> good = {0, 5, 5, 9};
  CHECK(validate_cu_seqlens(good, 9).is_ok());
  CHECK(validate_cu_seqlens(good, 10).reason() ==
        "cu_seqlens ends at 9 but the tensor has 10 tokens");
  std::vector<std::int32_t> bad = {0, 5, 4, 9};
  CHECK(validate_cu_seqlens(bad, 9).reason().find("not monotone") != std::string::npos);
  std::vector<std::int32_t> off = {1, 5};
  CHECK(validate_cu_seqlens(off, 5).reason().find("[0] must be 0") != std::string::npos);
  std::vector<std::int32_t> one = {0};
  CHECK_FALSE(validate_cu_seqlens(one, 0).is_ok());
}

TEST_CASE("attention_arguments: heads divisible, supported head_dim, default scale") {
  attention_arguments a{.q_heads = 32, .kv_heads = 8, .head_dim = 128};
  CHECK(a.validate().is_ok());
  CHECK(a.group_size() == 4);
  CHECK(a.scale() == doctest::Approx(1.0 / std::sqrt(128.0)));
  a.softmax_scale = 0.5f;
  CHECK(a.scale() == 0.5);
  CHECK(attention_arguments{32, 6, 128}.validate().reason() ==
        "q_heads (32) is not a multiple of kv_heads (6)");
  CHECK(attention_arguments{8, 8, 96}.validate().reason().find("head_dim 96 is not supported") !=
        std::string::npos);
  CHECK_FALSE(attention_arguments{0, 1, 64}.validate().is_ok());
  CHECK_FALSE(attention_arguments{8, 8, 64, -1.0f}.validate().is_ok());
  CHECK_FALSE(attention_arguments{8, 8, 64, NAN}.validate().is_ok());
}
