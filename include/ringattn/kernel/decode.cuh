#pragma once
//! \file
//! The split-K/V block forward for blocks with few query rows per group (device/decode.cuh): its
//! plan-time schedule and its launches.
//!
//! A block qualifies when every group has one key segment that every one of its query rows sees
//! whole (a full block per sequence, as new tokens against a KV cache) and at most
//! `decode_max_rows` query rows per kv head (new tokens x query heads per kv head). Each group's
//! segment is cut into splits so that a launch has a few thread blocks per SM; the splits'
//! partials (device scratch, `scratch_bytes()`) are combined per row and merged into the state
//! as a `fresh` or a `merge` epilogue.

#include <ringattn/arguments.cuh>
#include <ringattn/core/block.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/detail/device_tables.cuh>
#include <ringattn/device/decode.cuh>
#include <ringattn/error.cuh>
#include <ringattn/kernel/block.cuh>
#include <ringattn/kernel/forward_args.cuh>
#include <ringattn/kernel/launch.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
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
  device_decode_schedule(std::span<const block_group> groups, std::int64_t q_tokens,
                         std::int64_t kv_tokens, const attention_arguments& args)
      : q_tokens_(q_tokens), head_dim_(args.head_dim), group_size_(args.q_heads / args.kv_heads),
        kv_heads_(args.kv_heads) {
    validation v = validate_groups(groups, q_tokens, kv_tokens);
    v.require(takes(groups, args), "the split-K/V block forward takes full blocks of at most ",
              decode_max_rows, " query rows per kv head and head_dim 64 or 128 with v as wide");
    v.throw_if_invalid();
    int device = 0, sms = 1;
    RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
    RINGATTN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    // About sixteen thread blocks per SM over the launch (three waves of the five that fit), no
    // split under 512 keys.
    constexpr std::int64_t least_keys = 512;
    const std::int64_t units =
        std::max<std::int64_t>(1, static_cast<std::int64_t>(groups.size()) * kv_heads_);
    const std::int64_t want = std::max<std::int64_t>(1, (16 * sms + units - 1) / units);
    std::vector<block_group> kept;
    std::vector<decode_item> items;
    std::vector<std::int32_t> first{0};
    for (const block_group& g : groups) {
      const std::int64_t keys = g.kv[0].kv_count;
      if (g.q_count == 0 || keys == 0) continue; // rows that see no key: the state is unchanged
      const std::int64_t splits =
          std::max<std::int64_t>(1, std::min(want, (keys + least_keys - 1) / least_keys));
      const std::int64_t step = (keys + splits - 1) / splits;
      for (std::int64_t lo = 0; lo < keys; lo += step)
        items.push_back({static_cast<std::int32_t>(kept.size()),
                         static_cast<std::int32_t>(items.size()), lo, std::min(keys, lo + step)});
      kept.push_back(g);
      first.push_back(static_cast<std::int32_t>(items.size()));
      rows_ += g.q_count;
      most_rows_ = std::max<std::int64_t>(most_rows_, g.q_count * group_size_);
    }
    groups_ = static_cast<std::int64_t>(kept.size());
    items_ = static_cast<std::int64_t>(items.size());
    tables_ = detail::device_tables(std::span<const block_group>(kept),
                                    std::span<const decode_item>(items),
                                    std::span<const std::int32_t>(first));
  }
  device_decode_schedule(device_decode_schedule&&) noexcept = default;
  device_decode_schedule(const device_decode_schedule&) = delete;
  device_decode_schedule& operator=(const device_decode_schedule&) = delete;
  device_decode_schedule& operator=(device_decode_schedule&&) = delete;

  //! Device scratch the splits' partials take.
  std::size_t scratch_bytes() const {
    return static_cast<std::size_t>(items_) * kv_heads_ * sizeof(float) *
           static_cast<std::size_t>(decode_max_rows) * (head_dim_ + 2);
  }
  //! Query rows the groups cover (a `fresh` launch must cover every row of the state).
  std::int64_t rows() const noexcept { return rows_; }
  std::int64_t q_tokens() const noexcept { return q_tokens_; }

#if defined(__CUDACC__)
  //! The block of `a` merged into `a.state` (`fresh`: written, covering every row), on `stream`,
  //! with `a.scratch` holding `scratch_bytes()`.
  template <class T>
  void forward(const block_forward_args<T>& a, bool fresh, cudaStream_t stream) const {
    if (items_ == 0) return;
    const float scale_log2 = static_cast<float>(a.args.scale() * 1.4426950408889634);
    auto* scratch = reinterpret_cast<float*>(a.scratch);
    const dim3 grid(static_cast<unsigned>(items_), static_cast<unsigned>(kv_heads_));
    const dim3 combine(static_cast<unsigned>(groups_), static_cast<unsigned>(kv_heads_));
    const block_group* groups = tables_.at<block_group>(0);
    const decode_item* items = tables_.at<decode_item>(1);
    const std::int32_t* first = tables_.at<std::int32_t>(2);
    auto launch = [&](auto split, auto merge) {
      split<<<grid, 128, 0, stream>>>(a.q.data, a.q.token_stride, a.q.head_stride, a.k.data,
                                      a.k.token_stride, a.k.head_stride, a.v.data, a.v.token_stride,
                                      a.v.head_stride, groups, items, group_size_, scale_log2,
                                      scratch);
      RINGATTN_CUDA_CHECK_LAUNCH();
      merge<<<combine, 256, 0, stream>>>(groups, first, group_size_, scratch, a.state.o,
                                         a.state.lse, a.state.sum, a.state.tokens, fresh);
      RINGATTN_CUDA_CHECK_LAUNCH();
    };
    // The kernel's row count is the plan's: 4 (one new token per sequence and up to four query
    // heads per kv head) keeps its registers to a third of the 16-row kernel's.
    const bool few = most_rows_ <= 4;
    if (head_dim_ == 64)
      few ? launch(kernels::decode_split_kernel<T, 64, 4>, kernels::decode_combine_kernel<64>)
          : launch(kernels::decode_split_kernel<T, 64, 16>, kernels::decode_combine_kernel<64>);
    else
      few ? launch(kernels::decode_split_kernel<T, 128, 4>, kernels::decode_combine_kernel<128>)
          : launch(kernels::decode_split_kernel<T, 128, 16>, kernels::decode_combine_kernel<128>);
  }
#endif

private:
  std::int64_t q_tokens_ = 0, rows_ = 0, groups_ = 0, items_ = 0, most_rows_ = 0;
  int head_dim_ = 0, group_size_ = 1, kv_heads_ = 1;
  detail::device_tables tables_;
};

} // namespace ringattn
