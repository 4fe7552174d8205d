#pragma once
//! \file
//! Scatter (full packed tensor -> one rank's shard) and gather (all shards -> full tensor in
//! logical order), on the host and on the device.
//!
//! Gather reads the *rank-major concatenation* of the shards: rank r's shard starts at token
//! `plan.rank_offset(r)` (shards back to back), or at `r * rank_stride` when `rank_stride > 0`
//! (the padded layout of an all-gather of equal-sized buffers; rank_stride >= max_local_tokens()).
//! Device versions are asynchronous on `stream`, allocate nothing, and need 2-byte aligned views
//! (they use the widest vector access, up to 16 bytes, that every address and stride allows).
//!
//! \code
//! ringattn::scatter(plan, rank, full_q, my_q);                  // host
//! ringattn::scatter(device_plan, rank, full_q, my_q, stream);   // device, async
//! ringattn::gather(device_plan, all_shards, full_out, stream);  // device, async
//! \endcode

#include <ringattn/block/kernel/copy_rows.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/partition/device_plan.cuh>
#include <ringattn/partition/plan.cuh>
#include <ringattn/tensor.cuh>

#include <cstdint>
#include <cstring>
#include <span>
#include <type_traits>

#if defined(__CUDACC__)
RINGATTN_ABI_BEGIN
namespace kernels {
//! Largest vector width in bytes (16, 8, 4 or 2) dividing every address and stride of the copy.
template <class T>
int vector_width(const T* src, const T* dst, const thd_view<const T>& s, const thd_view<T>& d,
                 bool whole_rows) {
  const std::uint64_t e = sizeof(T);
  std::uint64_t bits = reinterpret_cast<std::uintptr_t>(src) |
                       reinterpret_cast<std::uintptr_t>(dst) |
                       static_cast<std::uint64_t>(s.token_stride) * e |
                       static_cast<std::uint64_t>(d.token_stride) * e;
  if (whole_rows)
    bits |= static_cast<std::uint64_t>(s.heads) * s.head_dim * e;
  else
    bits |= static_cast<std::uint64_t>(s.head_stride) * e |
            static_cast<std::uint64_t>(d.head_stride) * e |
            static_cast<std::uint64_t>(s.head_dim) * e;
  for (int w : {16, 8, 4})
    if ((bits & static_cast<std::uint64_t>(w - 1)) == 0) return w;
  return 2;
}

//! Copies `dst.tokens` rows: dst token t <- src token map(t).
template <class T, class Map>
void copy_rows(thd_view<const T> src, thd_view<T> dst, Map map, int multiprocessors,
               cudaStream_t stream) {
  if (dst.tokens == 0) return;
  // Dense on both sides: one run of heads * head_dim per token; otherwise one run per head.
  const bool whole = src.dense() && dst.dense();
  const int width = vector_width(src.data, dst.data, src, dst, whole);
  auto launch = [&]<class Vec>(Vec*) {
    // Widths below sizeof(T) are never chosen (vector_width starts at the element size).
    if constexpr (sizeof(Vec) >= sizeof(T)) {
      const std::int64_t per = static_cast<std::int64_t>(sizeof(Vec) / sizeof(T));
      row_geometry g{
          dst.tokens,
          whole ? 1 : dst.heads,
          static_cast<int>(
              (whole ? static_cast<std::int64_t>(dst.heads) * dst.head_dim : dst.head_dim) / per),
          src.token_stride / per,
          src.head_stride / per,
          dst.token_stride / per,
          dst.head_stride / per};
      constexpr int threads = 256, warps_per_block = threads / 32;
      const std::int64_t needed = (dst.tokens + warps_per_block - 1) / warps_per_block;
      // Enough resident warps to saturate memory (8 blocks of 8 warps per SM), no more.
      const std::int64_t cap = static_cast<std::int64_t>(multiprocessors) * 8;
      const unsigned blocks = static_cast<unsigned>(needed < cap ? needed : cap);
      copy_rows_kernel<Vec><<<blocks, threads, 0, stream>>>(
          reinterpret_cast<const Vec*>(src.data), reinterpret_cast<Vec*>(dst.data), g, map);
      RINGATTN_CUDA_CHECK_LAUNCH();
    }
  };
  switch (width) {
  case 16: launch(static_cast<uint4*>(nullptr)); break;
  case 8: launch(static_cast<uint2*>(nullptr)); break;
  case 4: launch(static_cast<unsigned*>(nullptr)); break;
  default: launch(static_cast<unsigned short*>(nullptr)); break;
  }
}

} // namespace kernels
RINGATTN_ABI_END
#endif

namespace ringattn {

namespace detail {
template <class T, class U>
validation same_row_shape(const thd_view<T>& a, const char* an, const thd_view<U>& b,
                          const char* bn) {
  validation r = validation::ok();
  r.require(a.heads == b.heads && a.head_dim == b.head_dim, an, " is [", a.tokens, ", ", a.heads,
            ", ", a.head_dim, "] but ", bn, " is [", b.tokens, ", ", b.heads, ", ", b.head_dim,
            "]: heads and head_dim must agree");
  return r;
}
} // namespace detail

//! Why `scatter(plan, rank, full, shard)` cannot run, or ok.
template <partitioner P, element T>
validation validate_scatter(const partition_plan<P>& plan, int rank, thd_view<const T> full,
                            thd_view<const T> shard) {
  validation r = validation::ok();
  r.require(rank >= 0 && rank < plan.ranks(), "rank ", rank, " is out of range [0, ", plan.ranks(),
            ")");
  r.require(validate_view(full, "full")).require(validate_view(shard, "shard"));
  r.require(detail::same_row_shape(full, "full", shard, "shard"));
  r.require(full.tokens == plan.tokens(), "full has ", full.tokens,
            " tokens but cu_seqlens describes ", plan.tokens());
  if (r)
    r.require(shard.tokens == plan.local_tokens(rank), "shard has ", shard.tokens,
              " tokens but rank ", rank, " holds ", plan.local_tokens(rank));
  return r;
}

//! Why `gather(plan, gathered, full, rank_stride)` cannot run, or ok.
template <partitioner P, element T>
validation validate_gather(const partition_plan<P>& plan, thd_view<const T> gathered,
                           thd_view<const T> full, std::int64_t rank_stride) {
  validation r = validation::ok();
  r.require(validate_view(full, "full")).require(validate_view(gathered, "gathered"));
  r.require(detail::same_row_shape(gathered, "gathered", full, "full"));
  r.require(full.tokens == plan.tokens(), "full has ", full.tokens,
            " tokens but cu_seqlens describes ", plan.tokens());
  r.require(rank_stride == 0 || rank_stride >= plan.max_local_tokens(), "rank_stride ", rank_stride,
            " is smaller than the largest shard (", plan.max_local_tokens(), ")");
  const std::int64_t need =
      rank_stride > 0 ? rank_stride * (plan.ranks() - 1) + plan.local_tokens(plan.ranks() - 1)
                      : plan.rank_offset(plan.ranks());
  r.require(rank_stride >= 0, "rank_stride must be >= 0 (got ", rank_stride, ")");
  r.require(gathered.tokens >= need, "gathered has ", gathered.tokens,
            " tokens but the shards need ", need);
  return r;
}

//! Host scatter: rank `rank`'s tokens of `full` into `shard` (both host memory).
template <partitioner P, element T>
void scatter(const partition_plan<P>& plan, int rank, std::type_identity_t<thd_view<const T>> full,
             thd_view<T> shard) {
  validate_scatter<P, T>(plan, rank, full, shard).throw_if_invalid();
  for (std::int64_t l = 0; l < shard.tokens; ++l) {
    const std::int64_t g = plan.global_token(rank, l);
    for (std::int32_t h = 0; h < full.heads; ++h)
      std::memcpy(shard.row(l, h), full.row(g, h), sizeof(T) * full.head_dim);
  }
}

//! Host gather from the rank-major concatenation of all shards into `full` (logical order).
template <partitioner P, element T>
void gather(const partition_plan<P>& plan, std::type_identity_t<thd_view<const T>> gathered,
            thd_view<T> full, std::int64_t rank_stride = 0) {
  validate_gather<P, T>(plan, gathered, full, rank_stride).throw_if_invalid();
  for (std::int64_t g = 0; g < full.tokens; ++g) {
    const owner o = plan.locate(g);
    const std::int64_t src =
        (rank_stride > 0 ? o.rank * rank_stride : plan.rank_offset(o.rank)) + o.local;
    for (std::int32_t h = 0; h < full.heads; ++h)
      std::memcpy(full.row(g, h), gathered.row(src, h), sizeof(T) * full.head_dim);
  }
}

//! Puts rank `rank`'s lse (`[q_heads, local tokens]`, as the ring returns it) into its places
//! of the global lse (`[q_heads, tokens]` in the packed batch's order). Every rank's call fills
//! its own tokens; after all of them (or over the gathered shards) the global lse is complete.
template <partitioner P>
void place_lse(const partition_plan<P>& plan, int rank, std::span<const float> local, int q_heads,
               std::span<float> global) {
  const std::int64_t n = plan.local_tokens(rank), tokens = plan.tokens();
  validation r = validation::ok();
  r.require(q_heads > 0, "q_heads must be positive (got ", q_heads, ")");
  r.require(static_cast<std::int64_t>(local.size()) == n * q_heads, "the local lse has ",
            local.size(), " entries; rank ", rank, "'s [q_heads, tokens] is ", n * q_heads);
  r.require(static_cast<std::int64_t>(global.size()) == tokens * q_heads, "the global lse has ",
            global.size(), " entries; [q_heads, tokens] is ", tokens * q_heads);
  r.throw_if_invalid();
  for (std::int64_t l = 0; l < n; ++l) {
    const std::int64_t g = plan.global_token(rank, l);
    for (int h = 0; h < q_heads; ++h)
      global[static_cast<std::size_t>(h * tokens + g)] = local[static_cast<std::size_t>(h * n + l)];
  }
}

#if defined(__CUDACC__)
//! Device scatter, asynchronous on `stream`; `full` and `shard` are device memory on the plan's
//! device. Validation happens on the host before anything is launched.
template <partitioner P, element T>
void scatter(const device_partition_plan<P>& plan, int rank,
             std::type_identity_t<thd_view<const T>> full, thd_view<T> shard, cudaStream_t stream) {
  validate_scatter<P, T>(plan.host(), rank, full, shard).throw_if_invalid();
  kernels::copy_rows(full, shard, kernels::scatter_map<P>{plan.ref(), rank}, plan.multiprocessors(),
                     stream);
}

//! Device gather, asynchronous on `stream`, from the rank-major concatenation of all shards.
template <partitioner P, element T>
void gather(const device_partition_plan<P>& plan, std::type_identity_t<thd_view<const T>> gathered,
            thd_view<T> full, cudaStream_t stream, std::int64_t rank_stride = 0) {
  validate_gather<P, T>(plan.host(), gathered, full, rank_stride).throw_if_invalid();
  kernels::copy_rows(gathered, full, kernels::gather_map<P>{plan.ref(), rank_stride},
                     plan.multiprocessors(), stream);
}
#endif

} // namespace ringattn
