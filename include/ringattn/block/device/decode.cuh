#pragma once
//! \file
//! The split-K/V block forward for blocks with few query rows per group (block/kernel/decode.cuh):
//! its plan-time schedule and its launches.
//!
//! A block qualifies when every group has one key segment that every one of its query rows sees
//! whole (a full block per sequence, as new tokens against a KV cache) and at most
//! `decode_max_rows` query rows per kv head (new tokens x query heads per kv head). Each group's
//! segment is cut into equal splits of whole stages, as many as keep the launch's waves full (one
//! sequence of 128K keys fills the machine as well as a batch of 32); the
//! splits' partials (device scratch, `scratch_bytes()`) are combined per row and merged into the
//! state as a `fresh` or a `merge` epilogue. Key rows are read in place or through a page table
//! (`key_pages`), decided at plan time and given to the kernel as a template argument.

#include <ringattn/arguments.cuh>
#include <ringattn/block/device/block.cuh>
#include <ringattn/block/device/forward_args.cuh>
#include <ringattn/block/device/launch.cuh>
#include <ringattn/block/kernel/decode.cuh>
#include <ringattn/core/block.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/detail/device_tables.cuh>
#include <ringattn/error.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace ringattn {

class device_decode_schedule {
public:
  //! Whether the split kernel takes `groups` (see the file notes) at `args`' shapes.
  static bool takes(std::span<const block_group> groups, const attention_arguments& args) {
    if ((args.head_dim != 64 && args.head_dim != 128) || args.separate_widths()) return false;
    const int group_size = args.q_heads / args.kv_heads;
    for (const block_group& g : groups) {
      if (g.count != 1 || g.q_count * group_size > decode_max_rows) return false;
      const kv_block& b = g.kv[0];
      if (b.mask.lo > -(g.q_count - 1) || b.mask.hi < b.kv_count - 1) return false;
    }
    return true;
  }

  //! Plans the splits on the current device (its SM count) and copies the tables there. Throws
  //! `invalid_argument` when the split kernel does not take the block.
  //! With `pages` (a table and a power-of-two page size) the groups' key rows count through
  //! the page table (`key_pages`): `kv_tokens` is then the table's size times the page size.
  device_decode_schedule(std::span<const block_group> groups, std::int64_t q_tokens,
                         std::int64_t kv_tokens, const attention_arguments& args,
                         const key_pages& pages = {}, split_launch launch = split_launch::fitted)
      : q_tokens_(q_tokens), head_dim_(args.head_dim), group_size_(args.q_heads / args.kv_heads),
        kv_heads_(args.kv_heads) {
    validation v = validate_groups(groups, q_tokens, kv_tokens);
    v.require(takes(groups, args), "the split-K/V block forward takes full blocks of at most ",
              decode_max_rows, " query rows per kv head and head_dim 64 or 128 with v as wide");
    if (pages.page_size != 0) {
      v.require(std::has_single_bit(static_cast<std::uint32_t>(pages.page_size)),
                "a page size is a power of two (got ", pages.page_size, ")");
      v.require(static_cast<std::int64_t>(pages.table.size()) * pages.page_size == kv_tokens,
                "a paged block's key rows are its page table's entries times the page size (",
                pages.table.size(), " x ", pages.page_size, "), not ", kv_tokens);
      page_shift_ = std::countr_zero(static_cast<std::uint32_t>(pages.page_size));
    }
    v.throw_if_invalid();
    int device = 0, sms = 1, smem_per_sm = 0;
    RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
    RINGATTN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    RINGATTN_CUDA_CHECK(
        cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
    for (const block_group& g : groups)
      most_rows_ = std::max<std::int64_t>(most_rows_, g.q_count * group_size_);
    row_tiles_ = most_rows_ <= 16 ? 1 : most_rows_ <= 32 ? 2 : 4;
    // Thread blocks that fit on an SM at once (shared memory bounds them; 1 KiB each is the
    // system's), at most the two the kernel's registers allow.
    const int block_smem = decode_smem_bytes<std::uint16_t>(head_dim_) + 1024;
    const std::int64_t slots =
        static_cast<std::int64_t>(sms) * std::clamp(smem_per_sm / block_smem, 1, 2);
    const bool fixed = launch == split_launch::fixed;
    // A fixed launch: one wave of thread blocks, or a unit per group where the groups are more.
    const std::int64_t most_items =
        fixed ? std::max<std::int64_t>(static_cast<std::int64_t>(groups.size()),
                                       (slots + kv_heads_ - 1) / kv_heads_)
              : std::numeric_limits<std::int64_t>::max();
    const std::int64_t stage = decode_stage_keys,
                       per_split = split_stages(groups, slots, most_items);
    std::vector<block_group> kept;
    std::vector<decode_item> items;
    std::vector<std::int32_t> first{0};
    for (const block_group& g : groups) {
      const std::int64_t keys = g.kv[0].kv_count;
      // rows that see no key: the state is unchanged (a fixed launch keeps the group: its
      // combine finds no unit)
      if (g.q_count == 0 || (keys == 0 && !fixed)) continue;
      const std::int64_t own = (keys + stage - 1) / stage;
      const std::int64_t splits = (own + per_split - 1) / per_split;
      const std::int64_t step = splits == 0 ? 0 : (own + splits - 1) / splits * stage;
      for (std::int64_t lo = 0; lo < keys; lo += step)
        items.push_back({static_cast<std::int32_t>(kept.size()),
                         static_cast<std::int32_t>(items.size()), lo, std::min(keys, lo + step)});
      kept.push_back(g);
      first.push_back(static_cast<std::int32_t>(items.size()));
      rows_ += g.q_count;
    }
    if (fixed && !kept.empty()) // empty units (no keys) up to the launch's size
      items.resize(static_cast<std::size_t>(most_items), decode_item{0, 0, 0, 0});
    groups_ = static_cast<std::int64_t>(kept.size());
    items_ = static_cast<std::int64_t>(items.size());
    tables_ = detail::device_tables(std::span<const block_group>(kept),
                                    std::span<const decode_item>(items),
                                    std::span<const std::int32_t>(first), pages.table);
  }
  device_decode_schedule(device_decode_schedule&&) noexcept = default;
  device_decode_schedule(const device_decode_schedule&) = delete;
  device_decode_schedule& operator=(const device_decode_schedule&) = delete;
  device_decode_schedule& operator=(device_decode_schedule&&) = delete;

  //! Device scratch the splits' partials take.
  std::size_t scratch_bytes() const {
    return static_cast<std::size_t>(items_) * kv_heads_ * sizeof(float) *
           static_cast<std::size_t>(decode_partial_floats(head_dim_, 16 * row_tiles_));
  }
  //! Query rows the groups cover (a `fresh` launch must cover every row of the state).
  std::int64_t rows() const noexcept { return rows_; }
  std::int64_t q_tokens() const noexcept { return q_tokens_; }

#if defined(__CUDACC__)
  //! The block of `a` merged into `a.state` (`fresh`: written, covering every row), on `stream`,
  //! with `a.scratch` holding `scratch_bytes()`.
  template <class T>
  void forward(const block_forward_args<T>& a, bool fresh, cudaStream_t stream) const {
    run<T>(a, a.k, a.v, no_scales{}, fresh, stream);
  }
  //! The same with an FP8 cache: `k` and `v` in place of `a.k` and `a.v` (which are not read),
  //! dequantised by `scales` (`page_scales` only where the schedule reads through a page table).
  template <class T, kv_scales Scales>
  void forward(const block_forward_args<T>& a, thd_view<const fp8_e4m3> k,
               thd_view<const fp8_e4m3> v, Scales scales, bool fresh, cudaStream_t stream) const {
    run<T>(a, k, v, scales, fresh, stream);
  }
  //! Whether the key rows are read through a page table.
  bool paged() const noexcept { return page_shift_ >= 0; }
#endif

private:
#if defined(__CUDACC__)
  template <class T, class Cache, class Scales>
  void run(const block_forward_args<T>& a, thd_view<const Cache> k, thd_view<const Cache> v,
           Scales scales, bool fresh, cudaStream_t stream) const {
    if (items_ == 0) return;
    const float scale_log2 = static_cast<float>(a.args.scale() * 1.4426950408889634);
    auto* scratch = reinterpret_cast<float*>(a.scratch);
    const dim3 grid(static_cast<unsigned>(items_), static_cast<unsigned>(kv_heads_));
    const dim3 combine(static_cast<unsigned>(groups_), static_cast<unsigned>(kv_heads_));
    const block_group* groups = tables_.at<block_group>(0);
    const decode_item* items = tables_.at<decode_item>(1);
    const std::int32_t* first = tables_.at<std::int32_t>(2);
    const int smem = decode_smem_bytes<T, Cache>(head_dim_);
    auto launch = [&](auto split, auto key_rows, auto merge) {
      detail::allow_dynamic_smem(reinterpret_cast<const void*>(split), smem);
      split<<<grid, 128, smem, stream>>>(a.q.data, a.q.token_stride, a.q.head_stride, k.data,
                                         k.token_stride, k.head_stride, v.data, v.token_stride,
                                         v.head_stride, key_rows, scales, groups, items,
                                         group_size_, scale_log2, scratch);
      RINGATTN_CUDA_CHECK_LAUNCH();
      merge<<<combine, 256, 0, stream>>>(groups, first, group_size_, 16 * row_tiles_, scratch,
                                         a.state.o, a.state.lse, a.state.sum, a.state.tokens,
                                         fresh);
      RINGATTN_CUDA_CHECK_LAUNCH();
    };
    // The kernel's row tiles are the plan's (the group with the most rows).
    auto with_rows = [&]<int D, class R>(std::integral_constant<int, D>, R key_rows) {
      using kernels::decode_split_kernel, kernels::decode_combine_kernel;
      switch (row_tiles_) {
      case 1:
        return launch(decode_split_kernel<T, Cache, D, 1, R, Scales>, key_rows,
                      decode_combine_kernel<D>);
      case 2:
        return launch(decode_split_kernel<T, Cache, D, 2, R, Scales>, key_rows,
                      decode_combine_kernel<D>);
      default:
        return launch(decode_split_kernel<T, Cache, D, 4, R, Scales>, key_rows,
                      decode_combine_kernel<D>);
      }
    };
    auto with_dim = [&](auto key_rows) {
      head_dim_ == 64 ? with_rows(std::integral_constant<int, 64>{}, key_rows)
                      : with_rows(std::integral_constant<int, 128>{}, key_rows);
    };
    if constexpr (std::is_same_v<Scales, page_scales>) {
      if (page_shift_ < 0)
        throw invalid_argument("ringattn: page_scales need a paged cache (a slab or packed "
                               "cache's scales are head_scales)");
      with_dim(paged_key_rows{tables_.at<std::int32_t>(3), page_shift_});
    } else if (page_shift_ < 0) {
      with_dim(packed_key_rows{});
    } else {
      with_dim(paged_key_rows{tables_.at<std::int32_t>(3), page_shift_});
    }
  }
#endif

  // Stages per split. A launch takes about its waves (thread blocks over `slots`, those that run
  // at once) times its longest block (its stages plus about two for filling the pipeline and
  // writing the partial): the split length that minimises that, among those that cut the
  // longest group into 1..64 equal splits of at least eight stages (fewer splits on a tie), of at
  // most `most_items` units in all (one unit per group always counts as fitting). In
  // 32-bit arithmetic (a group's stages fit: its keys are int32), each length tried once.
  std::int64_t split_stages(std::span<const block_group> groups, std::int64_t slots,
                            std::int64_t most_items) const {
    constexpr std::uint32_t stage = decode_stage_keys, least = 8, overhead = 2, most_splits = 64;
    std::vector<std::uint32_t> own;
    own.reserve(groups.size());
    std::uint32_t longest = 0;
    for (const block_group& g : groups)
      if (g.q_count > 0 && g.kv[0].kv_count > 0) {
        own.push_back(static_cast<std::uint32_t>((g.kv[0].kv_count + stage - 1) / stage));
        longest = std::max(longest, own.back());
      }
    std::uint32_t best = std::max<std::uint32_t>(longest, 1), last = 0;
    std::uint64_t best_cost = ~std::uint64_t{0};
    const std::uint32_t tries = std::clamp<std::uint32_t>(longest / least, 1, most_splits);
    for (std::uint32_t splits = 1; splits <= tries; ++splits) {
      const std::uint32_t per = (longest + splits - 1) / splits;
      if (per == last) continue;
      last = per;
      std::uint64_t blocks = 0;
      std::uint32_t widest = 0;
      for (const std::uint32_t o : own) {
        const std::uint32_t n = (o + per - 1) / per;
        blocks += n;
        widest = std::max(widest, (o + n - 1) / n);
      }
      if (splits > 1 && blocks > static_cast<std::uint64_t>(most_items)) break;
      blocks *= static_cast<std::uint64_t>(kv_heads_);
      const std::uint64_t waves =
          (blocks + static_cast<std::uint64_t>(slots) - 1) / static_cast<std::uint64_t>(slots);
      const std::uint64_t cost = waves * (widest + overhead);
      if (cost < best_cost) best = per, best_cost = cost;
    }
    return best;
  }

  std::int64_t q_tokens_ = 0, rows_ = 0, groups_ = 0, items_ = 0, most_rows_ = 0;
  int head_dim_ = 0, group_size_ = 1, kv_heads_ = 1, row_tiles_ = 1;
  int page_shift_ = -1; // log2 of the page size; -1: key rows in place
  detail::device_tables tables_;
};

} // namespace ringattn
