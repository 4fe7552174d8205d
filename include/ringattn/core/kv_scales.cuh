#pragma once
//! \file
//! The dequantisation scales of an FP8 (`fp8_e4m3`) KV cache shard: which scale an element reads
//! with is the scale layout's type, a model of `kv_scales`, so that a kernel receives it as a
//! template argument. Scales are fp32, in the memory of the path they are given to (host memory
//! for `forward_host`, device memory for the device `forward`).
//!
//! `scales_for<T>` is the scale layout a block of elements T carries, in the block arguments and
//! in a ring's K/V slot: none for fp16, bf16 and fp32, one k and one v scale per kv head for
//! e4m3. `element_format` is what a K/V block of T takes on the wire.

#include <ringattn/config.cuh>
#include <ringattn/core/element.cuh>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace ringattn {

//! One scale per kv head: key element x of kv head h reads as `float(x) * k[h]`, a value element
//! as `float(x) * v[h]` (`[kv_heads]` each). A per-tensor scale is this with equal entries.
struct head_scales {
  static constexpr const char* name = "head_scales";
  const float* k = nullptr;
  const float* v = nullptr;
  //! The scale index of pool row `row` (its page: `row >> page_shift`) of kv head `kvh`.
  RINGATTN_HOST_DEVICE static constexpr std::int64_t index(std::int64_t, int, int kvh, int) {
    return kvh;
  }
  //! Entries of each of `k` and `v` for a cache of `pages` pages and `kv_heads` heads.
  static constexpr std::int64_t entries(std::int64_t, int kv_heads) { return kv_heads; }
};

//! One scale per (pool page, kv head) of a paged cache, `[pages, kv_heads]` row-major each: every
//! page quantised on its own, so a page written once keeps its scale as the sequence grows.
struct page_scales {
  static constexpr const char* name = "page_scales";
  const float* k = nullptr;
  const float* v = nullptr;
  RINGATTN_HOST_DEVICE static constexpr std::int64_t index(std::int64_t row, int page_shift,
                                                           int kvh, int kv_heads) {
    return (row >> page_shift) * kv_heads + kvh;
  }
  static constexpr std::int64_t entries(std::int64_t pages, int kv_heads) {
    return pages * kv_heads;
  }
};

//! A cache in the step's own element type: nothing to dequantise.
struct no_scales {};

//! A scale layout of an FP8 cache: `head_scales` or `page_scales`.
template <class S>
concept kv_scales = std::same_as<S, head_scales> || std::same_as<S, page_scales>;

//! The scale layout a K/V block of elements T carries (`scales_for<T>`): `no_scales` unless
//! specialised; e4m3 blocks carry `head_scales`.
template <class T>
struct block_scales {
  using type = no_scales;
};
template <>
struct block_scales<fp8_e4m3> {
  using type = head_scales;
};
template <class T>
using scales_for = typename block_scales<std::remove_const_t<T>>::type;

//! Bytes a K/V block of `kv_heads` heads carries for its scales: none, or a k and a v scale
//! (fp32) per kv head.
template <class S>
constexpr std::size_t block_scale_bytes(int kv_heads) {
  if constexpr (std::is_same_v<S, no_scales>)
    return 0;
  else
    return 2 * static_cast<std::size_t>(kv_heads) * sizeof(float);
}
//! The scales stored at `at`, k's then v's (`kv_heads` each); nothing without scales.
template <class S>
RINGATTN_HOST_DEVICE constexpr S block_scales_at(float* at, int kv_heads) {
  if constexpr (std::is_same_v<S, no_scales>)
    return {};
  else
    return {at, at + kv_heads};
}

//! What a K/V block of one element type takes on the wire: bytes per element, and bytes of
//! scales per kv head (a block of no tokens carries none). A byte count alone is an element type
//! without scales.
struct element_format {
  std::size_t bytes;
  std::size_t scale_bytes_per_kv_head = 0;
  constexpr element_format(std::size_t element_bytes, std::size_t scale_bytes = 0) noexcept
      : bytes(element_bytes), scale_bytes_per_kv_head(scale_bytes) {}
  template <class T>
  static constexpr element_format of() noexcept {
    return {sizeof(T), block_scale_bytes<scales_for<T>>(1)};
  }
};

} // namespace ringattn
