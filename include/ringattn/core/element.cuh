#pragma once
//! \file
//! Element types (fp16, bf16, fp32) and their conversions, for host and device code.

#include <ringattn/config.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

//! Conversions usable on the host (plain C++) and the device; round to nearest even.
RINGATTN_HOST_DEVICE inline float to_float(float x) { return x; }
RINGATTN_HOST_DEVICE inline float to_float(__half x) { return __half2float(x); }
RINGATTN_HOST_DEVICE inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

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
