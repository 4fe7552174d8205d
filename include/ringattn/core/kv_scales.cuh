#pragma once
//! \file
//! The dequantisation scales of an FP8 (`fp8_e4m3`) KV cache shard: which scale an element reads
//! with is the scale layout's type, a model of `kv_scales`, so that a kernel receives it as a
//! template argument. Scales are fp32, in the memory of the path they are given to (host memory
//! for `forward_host`, device memory for the device `forward`).

#include <ringattn/config.cuh>

#include <concepts>
#include <cstdint>

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

} // namespace ringattn
