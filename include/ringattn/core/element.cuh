#pragma once
//! \file
//! Element types (fp16, bf16, fp32) and their conversions, for host and device code; the FP8
//! (e4m3) element a KV cache may be stored in, and its quantisation.

#include <ringattn/config.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <type_traits>

namespace ringattn {

//! Storage type of a tensor. Accumulation is always fp32 (fp64 in the reference).
enum class dtype { f16, bf16, f32 };

//! Human-readable name ("fp16", "bf16", "fp32").
constexpr const char* to_string(dtype t) noexcept {
  switch (t) {
  case dtype::f16: return "fp16";
  case dtype::bf16: return "bf16";
  case dtype::f32: return "fp32";
  }
  return "?";
}

//! Maps an element type to its `dtype`. Only `__half`, `__nv_bfloat16` and `float` are elements.
template <class T>
struct dtype_of {
  static_assert(sizeof(T) == 0, "ringattn: element types are __half, __nv_bfloat16 and float");
};
template <>
struct dtype_of<__half> {
  static constexpr dtype value = dtype::f16;
};
template <>
struct dtype_of<__nv_bfloat16> {
  static constexpr dtype value = dtype::bf16;
};
template <>
struct dtype_of<float> {
  static constexpr dtype value = dtype::f32;
};
template <class T>
inline constexpr dtype dtype_of_v = dtype_of<std::remove_const_t<T>>::value;

//! True for the element types a tensor view may hold.
template <class T>
concept element = (std::is_same_v<std::remove_const_t<T>, __half> ||
                   std::is_same_v<std::remove_const_t<T>, __nv_bfloat16> ||
                   std::is_same_v<std::remove_const_t<T>, float>);

//! True for the element types the device path computes in: the 16-bit ones (its products
//! accumulate in fp32). `float` runs on the host path only.
template <class T>
concept device_element = (std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>);

//! The FP8 element of a quantised KV cache: e4m3 (4 exponent bits, 3 mantissa bits, finite
//! values up to 448, NaN but no infinity), each read as its value times an fp32 scale.
using fp8_e4m3 = __nv_fp8_e4m3;

//! True for the element types a cache shard may be stored in: an `element`, or `fp8_e4m3`.
template <class T>
concept cache_element = element<T> || std::is_same_v<std::remove_const_t<T>, fp8_e4m3>;

//! Conversions usable on the host (plain C++) and the device; round to nearest even.
RINGATTN_HOST_DEVICE inline float to_float(float x) { return x; }
RINGATTN_HOST_DEVICE inline float to_float(__half x) { return __half2float(x); }
RINGATTN_HOST_DEVICE inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
//! An e4m3 element's value (exact in fp32, fp16 and bf16; NaN stays NaN).
RINGATTN_HOST_DEVICE inline float to_float(fp8_e4m3 x) { return static_cast<float>(x); }

//! `x / scale` as e4m3, rounded to nearest even: finite values beyond the format's 448 saturate
//! to +-448 (the usual FP8 cache quantisation), a NaN or infinite quotient becomes NaN (the
//! format has no infinity: what an inf input reaches stays poisoned).
RINGATTN_HOST_DEVICE inline fp8_e4m3 quantize_e4m3(float x, float scale) {
  const float y = x / scale;
  fp8_e4m3 r;
  r.__x = y - y != 0.0f ? static_cast<__nv_fp8_storage_t>(0x7f)
                        : __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3);
  return r;
}

//! `from_float<T>(x)`: x rounded to nearest even in T.
template <element T>
RINGATTN_HOST_DEVICE inline T from_float(float x) {
  if constexpr (std::is_same_v<T, __half>)
    return __float2half_rn(x);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(x);
  else
    return x;
}

} // namespace ringattn
