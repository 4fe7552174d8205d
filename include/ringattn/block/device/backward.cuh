#pragma once
//! \file
//! The CUDA block backward: the contract of backward_args.cuh on the device, deterministic (no
//! atomics: every fp32 accumulator element has one writer per call, adding in a fixed order).
//!
//! \code
//! ringattn::device_backward_schedule sched(groups, q_tokens, kv_tokens);   // plan time
//! ringattn::compute_delta(out, dout, delta, stream);                        // once per rank
//! ringattn::block_backward<T>({q, k, v, dout, lse, delta, args, {dq, dk, dv}}, sched, stream);
//! ringattn::write_gradient(dq_fp32, dq_view, stream);                      // fp32 -> T
//! \endcode
//!
//! Two kernels per call, in one of three families (`backward_path`): a dK/dV kernel that owns
//! key columns of a kv head and walks the query rows that see them, and a dQ kernel that owns
//! query rows of a query head and walks the keys they see; both recompute P from the forward's
//! LSE. On tensor cores (64 columns or rows a thread block; mma.sync on sm_80 and later,
//! block/kernel/backward_sm80.cuh, or wgmma on sm_90a, block/kernel/backward_sm90.cuh) for head_dim
//! 64 and 128; on CUDA cores (a warp per column or row, block/kernel/backward_cuda_cores.cuh) for
//! any head_dim and as their reference. The Hopper family runs both in one grid (the dK/dV blocks
//! first). The schedule lists, for every run of key columns, the (group, key segment) pairs that
//! cover it, and every query row of every group, and orders the tensor-core kernels' tiles heaviest
//! first
//! (`plan_backward_tiles`). docs/kernels.md has the numbers.

#include <ringattn/block/device/backward_args.cuh>
#include <ringattn/block/device/forward.cuh>
#include <ringattn/block/device/launch.cuh>
#include <ringattn/block/device/state_ops.cuh>
#include <ringattn/block/kernel/backward_cuda_cores.cuh>
#include <ringattn/block/kernel/backward_sm80.cuh>
#include <ringattn/block/kernel/backward_sm90.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/detail/device_tables.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace ringattn {

//! What the backward kernels walk, planned on the host from a call's groups: the key columns
//! split at every key-segment boundary into runs covered by the same (group, segment) pairs
//! (`intervals`, each listing its `covers`; runs no group sees are left out), and every query row
//! of every group (`rows`). Each key column a group sees is in exactly one interval, and each
//! interval lists every (group, segment) whose segment holds it; `key_items` counts the columns.
struct backward_plan {
  std::vector<kernels::key_interval> intervals;
  std::vector<kernels::key_cover> covers;
  std::vector<kernels::query_row> rows;
  std::int64_t key_items = 0;
};

inline backward_plan plan_backward(std::span<const block_group> groups) {
  backward_plan plan;
  // A sweep over the key segments' boundaries: at each cut the segments that end there leave the
  // active set and those that begin there join it; the interval up to the next cut is covered by
  // exactly the active ones (in (group, segment) order). O(n log n + covers).
  struct edge {
    std::int64_t at;
    bool begins;
    kernels::key_cover segment;
  };
  std::vector<edge> edges;
  for (std::size_t gi = 0; gi < groups.size(); ++gi)
    for (int b = 0; b < groups[gi].count; ++b) {
      const kv_block& kb = groups[gi].kv[b];
      if (kb.kv_count <= 0 || groups[gi].q_count <= 0) continue;
      const kernels::key_cover c{static_cast<std::int32_t>(gi), b};
      edges.push_back({kb.kv_begin, true, c});
      edges.push_back({kb.kv_begin + kb.kv_count, false, c});
    }
  std::sort(edges.begin(), edges.end(), [](const edge& x, const edge& y) { return x.at < y.at; });
  auto order = [](const kernels::key_cover& x, const kernels::key_cover& y) {
    return x.group != y.group ? x.group < y.group : x.segment < y.segment;
  };
  std::set<kernels::key_cover, decltype(order)> active(order);
  for (std::size_t e = 0; e < edges.size();) {
    const std::int64_t cut = edges[e].at;
    for (; e < edges.size() && edges[e].at == cut; ++e)
      if (edges[e].begins)
        active.insert(edges[e].segment);
      else
        active.erase(edges[e].segment);
    if (e == edges.size() || active.empty()) continue;
    const std::int64_t next = edges[e].at;
    kernels::key_interval in{cut, next, plan.key_items,
                             static_cast<std::int32_t>(plan.covers.size()),
                             static_cast<std::int32_t>(active.size())};
    plan.covers.insert(plan.covers.end(), active.begin(), active.end());
    plan.key_items += next - cut;
    plan.intervals.push_back(in);
  }
  for (std::size_t gi = 0; gi < groups.size(); ++gi)
    for (std::int64_t i = 0; i < groups[gi].q_count; ++i)
      plan.rows.push_back({static_cast<std::int32_t>(gi), static_cast<std::int32_t>(i)});
  return plan;
}

//! The thread-block tiles of the tensor-core kernels, each list heaviest first: `key_tiles` of
//! `cols` key columns of an interval (dK/dV blocks), `row_tiles` of `rows` query rows of a group
//! (dQ blocks), and the steps each walks (`key_steps`: 64-row query tiles x covers;
//! `row_steps`: 64-key K/V tiles). A GPU runs thread blocks roughly in launch order, so the
//! heaviest going first leaves only light ones for the tail (longest processing time first);
//! a causal block's column tiles differ in work by up to the number of row tiles.
struct backward_tiles {
  std::vector<kernels::key_tile> key_tiles;
  std::vector<work_tile> row_tiles;
  std::vector<std::int64_t> key_steps, row_steps;
};

inline backward_tiles plan_backward_tiles(std::span<const block_group> groups,
                                          const backward_plan& plan, int cols, int rows) {
  constexpr std::int64_t step = 64; // rows (dK/dV) or keys (dQ) a step of either kernel family
  struct keyed {
    std::int64_t steps;
    std::size_t index;
  };
  // Stable order by steps, heaviest first; equal ones keep their plan order.
  auto order = [](std::vector<keyed>& v) {
    std::stable_sort(v.begin(), v.end(),
                     [](const keyed& a, const keyed& b) { return a.steps > b.steps; });
  };
  std::vector<kernels::key_tile> keys;
  std::vector<keyed> key_order;
  for (std::size_t i = 0; i < plan.intervals.size(); ++i) {
    const kernels::key_interval& in = plan.intervals[i];
    for (std::int64_t b = in.begin; b < in.end; b += cols) {
      const std::int64_t n = std::min<std::int64_t>(cols, in.end - b);
      std::int64_t steps = 0;
      // As the kernels' cover walk: the rows of each cover that see a column of the tile.
      for (std::int32_t c = 0; c < in.cover_count; ++c) {
        const kernels::key_cover cv = plan.covers[static_cast<std::size_t>(in.cover_begin + c)];
        const block_group& g = groups[static_cast<std::size_t>(cv.group)];
        const kv_block& kb = g.kv[cv.segment];
        const std::int64_t jl0 = b - kb.kv_begin;
        const std::int64_t r0 = std::max<std::int64_t>(0, jl0 - kb.mask.hi),
                           r1 = std::min<std::int64_t>(g.q_count, jl0 + n - kb.mask.lo);
        if (r0 < r1) steps += (r1 - r0 + step - 1) / step;
      }
      key_order.push_back({steps, keys.size()});
      keys.push_back({static_cast<std::int32_t>(i), b});
    }
  }
  std::vector<work_tile> tiles;
  std::vector<keyed> row_order;
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    const block_group& g = groups[gi];
    if (g.count == 0) continue;
    for (std::int64_t r = 0; r < g.q_count; r += rows) {
      const std::int64_t r1 = std::min<std::int64_t>(g.q_count, r + rows);
      std::int64_t steps = 0;
      for (int s = 0; s < g.count; ++s) { // as the kernels' kv_walk
        const tile_trips t = g.kv[s].mask.kv_tiles(r, r1, g.kv[s].kv_count, step);
        steps += t.end - t.begin;
      }
      row_order.push_back({steps, tiles.size()});
      tiles.push_back({static_cast<std::int32_t>(gi), static_cast<std::int32_t>(r)});
    }
  }
  order(key_order);
  order(row_order);
  backward_tiles out;
  for (const keyed& k : key_order) {
    out.key_tiles.push_back(keys[k.index]);
    out.key_steps.push_back(k.steps);
  }
  for (const keyed& k : row_order) {
    out.row_tiles.push_back(tiles[k.index]);
    out.row_steps.push_back(k.steps);
  }
  return out;
}

//! Which kernels a block backward runs: the tensor-core ones on mma.sync (sm_80 and later,
//! head_dim 64 and 128), the Hopper ones on wgmma (an sm_90a image on a compute capability 9.0
//! device, head_dim 64 and 128), the CUDA-core ones (any head_dim; the reference for the others),
//! or the best available (`automatic`: wgmma, else mma.sync, else CUDA cores). head_dim 256 runs
//! on the CUDA cores whatever the path.
enum class backward_path { automatic, cuda_cores, tensor_cores, wgmma };

inline const char* to_string(backward_path p) {
  return p == backward_path::automatic      ? "automatic"
         : p == backward_path::cuda_cores   ? "cuda_cores"
         : p == backward_path::tensor_cores ? "tensor_cores"
                                            : "wgmma";
}

//! Options of a `device_backward_schedule`.
struct backward_options {
  backward_path path = backward_path::automatic;
  //! Warpgroups a thread block of the wgmma kernels: 0 or 3 (the tuned count: a producer
  //! warpgroup and two consumers of 64 rows each). Builds with `RINGATTN_EXPERIMENTS` also take
  //! 1 (64 key columns or query rows a block, two blocks an SM) and 2 (128, one block), kept for
  //! comparison (bench/block_backward.cu).
  int wgmma_warpgroups = 0;
  //! Bitwise-repeatable gradients (the default). `false` lets head_dim 128 on the wgmma path run
  //! the five-product kernel, which adds each step's dQ share to the fp32 accumulator in the L2
  //! in no fixed order (dq must then be 16-byte aligned); other widths and paths are the same
  //! either way.
  bool deterministic = true;
};
//! The tuned warpgroup count of the wgmma backward kernels.
inline constexpr int tuned_wgmma_warpgroups = backward_tuning_tuned.sm90_warpgroups;

//! The device side of one call's groups for the backward kernels; made at plan time (it
//! allocates and copies), used by any number of calls with the same groups and sizes.
class device_backward_schedule {
public:
  device_backward_schedule(std::span<const block_group> groups, std::int64_t q_tokens,
                           std::int64_t kv_tokens, backward_path path = backward_path::automatic)
      : device_backward_schedule(groups, q_tokens, kv_tokens, backward_options{path, 0}) {}
  device_backward_schedule(std::span<const block_group> groups, std::int64_t q_tokens,
                           std::int64_t kv_tokens, backward_options options)
      : q_tokens_(q_tokens), kv_tokens_(kv_tokens), path_(options.path),
        deterministic_(options.deterministic),
        wgmma_warpgroups_(options.wgmma_warpgroups == 0 ? tuned_wgmma_warpgroups
                                                        : options.wgmma_warpgroups) {
    validate_groups(groups, q_tokens, kv_tokens).throw_if_invalid();
#if defined(RINGATTN_EXPERIMENTS)
    if (wgmma_warpgroups_ < 1 || wgmma_warpgroups_ > 3)
      throw invalid_argument("ringattn: the wgmma block backward takes 1, 2 or 3 warpgroups a "
                             "thread block (got " +
                             std::to_string(wgmma_warpgroups_) + ")");
#else
    if (wgmma_warpgroups_ != tuned_wgmma_warpgroups)
      throw invalid_argument(
          "ringattn: the wgmma block backward takes " + std::to_string(tuned_wgmma_warpgroups) +
          " warpgroups a thread block (got " + std::to_string(wgmma_warpgroups_) +
          "; 1 and 2 are tuning experiments, built with RINGATTN_EXPERIMENTS)");
#endif
    if (path_ != backward_path::cuda_cores) {
      int device = 0, major = 0;
      RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
      RINGATTN_CUDA_CHECK(
          cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
      if (major < 8 && path_ == backward_path::tensor_cores)
        throw invalid_argument("ringattn: the tensor-core block backward needs sm_80 or later");
      tensor_cores_ok_ = major >= 8;
      if (path_ == backward_path::automatic || path_ == backward_path::wgmma) {
#if defined(__CUDACC__)
        wgmma_ok_ = kernels::wgmma_available();
#endif
        if (path_ == backward_path::wgmma && !wgmma_ok_)
          throw invalid_argument("ringattn: the wgmma block backward needs code built for sm_90a "
                                 "(CMake CUDA architecture 90a) running on a compute capability "
                                 "9.0 device");
      }
    }
    backward_plan plan = plan_backward(groups);
    key_items_ = plan.key_items;
    const auto& intervals = plan.intervals;
    const auto& covers = plan.covers;
    const auto& rows = plan.rows;
    row_items_ = static_cast<std::int64_t>(rows.size());
    interval_count_ = static_cast<std::int32_t>(intervals.size());
    // Tiles of the tensor-core kernels, heaviest first: R key columns of an interval; R query
    // rows of a group (64, or 64 a warpgroup for the wgmma kernels).
    const int R = kernels::tc_backward_rows *
                  (wgmma_ok_ && path_ != backward_path::tensor_cores
                       ? std::min(wgmma_warpgroups_, 2) // three: a producer and two consumers
                       : 1);
    backward_tiles tiles = plan_backward_tiles(groups, plan, R, R);
    const auto& key_tiles = tiles.key_tiles;
    const auto& row_tiles = tiles.row_tiles;
    key_tile_count_ = static_cast<std::int64_t>(key_tiles.size());
    row_tile_count_ = static_cast<std::int64_t>(row_tiles.size());
    tables_ = detail::device_tables(
        groups, std::span<const kernels::key_interval>(intervals),
        std::span<const kernels::key_cover>(covers), std::span<const kernels::query_row>(rows),
        std::span<const kernels::key_tile>(key_tiles), std::span<const work_tile>(row_tiles));
    groups_ = tables_.at<block_group>(0);
    intervals_ = tables_.at<kernels::key_interval>(1);
    covers_ = tables_.at<kernels::key_cover>(2);
    rows_ = tables_.at<kernels::query_row>(3);
    key_tiles_ = tables_.at<kernels::key_tile>(4);
    row_tiles_ = tables_.at<work_tile>(5);
  }
  device_backward_schedule(device_backward_schedule&&) noexcept = default;
  device_backward_schedule(const device_backward_schedule&) = delete;
  device_backward_schedule& operator=(const device_backward_schedule&) = delete;
  device_backward_schedule& operator=(device_backward_schedule&&) = delete;

  std::int64_t q_tokens() const noexcept { return q_tokens_; }
  std::int64_t kv_tokens() const noexcept { return kv_tokens_; }
  bool empty() const noexcept { return key_items_ == 0; }
  //! Whether calls with this head_dim run tensor-core kernels (mma.sync or wgmma).
  bool tensor_cores(int head_dim) const noexcept {
    return path_ != backward_path::cuda_cores && tensor_cores_ok_ && head_dim <= 128;
  }
  //! The same for q/k `head_dim` and v `head_dim_v` (unequal widths: wgmma or nothing).
  bool tensor_cores(int head_dim, int head_dim_v) const noexcept {
    return head_dim == head_dim_v ? tensor_cores(head_dim) : wgmma(head_dim, head_dim_v);
  }
  //! Warpgroups a thread block of the wgmma kernels.
  int wgmma_warpgroups() const noexcept { return wgmma_warpgroups_; }
  //! Whether calls with this head_dim run the Hopper (wgmma) kernels.
  bool wgmma(int head_dim) const noexcept { return wgmma(head_dim, head_dim); }
  //! The same for q/k `head_dim` and v `head_dim_v` (64/64, 128/128 and 192/128; the last with
  //! the tuned three warpgroups only).
  bool wgmma(int head_dim, int head_dim_v) const noexcept {
    return (path_ == backward_path::automatic || path_ == backward_path::wgmma) && wgmma_ok_ &&
           widths_on_wgmma(head_dim, head_dim_v) &&
           (head_dim == head_dim_v || wgmma_warpgroups_ == tuned_wgmma_warpgroups);
  }
  //! Whether the gradients are bitwise repeatable (backward_options::deterministic).
  bool deterministic() const noexcept { return deterministic_; }
  //! Whether calls of these widths run the five-product kernel (dQ reduced in the L2): head_dim
  //! 128 on the wgmma path of a non-deterministic schedule.
  bool five_products(int head_dim, int head_dim_v) const noexcept {
    return !deterministic_ && head_dim == 128 && head_dim_v == 128 && wgmma(head_dim, head_dim_v) &&
           wgmma_warpgroups_ == tuned_wgmma_warpgroups;
  }
  //! Whether a call of these widths has a kernel under this schedule: unequal widths need the
  //! wgmma kernels, and equal ones of 192 have none.
  validation supports(int head_dim, int head_dim_v) const {
    validation r = validation::ok();
    if (head_dim != head_dim_v || head_dim == 192)
      r.require(wgmma(head_dim, head_dim_v), "head_dim ", head_dim, " with head_dim_v ", head_dim_v,
                widths_on_wgmma(head_dim, head_dim_v)
                    ? " runs only on the wgmma block backward, which needs code built for sm_90a "
                      "(CMake CUDA architecture 90a) running on a compute capability 9.0 device "
                      "and the automatic or wgmma path"
                    : " has no native CUDA block backward",
                "; the host kernels take any widths and the cuDNN model those cuDNN supports");
    return r;
  }

  template <class T>
  kernels::tc_backward_params<T> tc_params(const block_backward_args<T>& a) const {
    return {params(a), key_tiles_, key_tile_count_, row_tiles_, row_tile_count_};
  }

  template <class T>
  kernels::backward_params<T> params(const block_backward_args<T>& a) const {
    return {a.q.data,
            a.k.data,
            a.v.data,
            a.dout.data,
            a.q.token_stride,
            a.q.head_stride,
            a.k.token_stride,
            a.k.head_stride,
            a.v.token_stride,
            a.v.head_stride,
            a.dout.token_stride,
            a.dout.head_stride,
            a.lse,
            a.delta,
            a.grad.dq,
            a.grad.dk,
            a.grad.dv,
            groups_,
            intervals_,
            covers_,
            rows_,
            key_items_,
            interval_count_,
            row_items_,
            a.q.tokens,
            a.args.q_heads,
            a.args.kv_heads,
            a.args.group_size(),
            static_cast<float>(a.args.scale())};
  }

private:
  std::int64_t q_tokens_ = 0, kv_tokens_ = 0;
  backward_path path_ = backward_path::automatic;
  bool deterministic_ = true;
  int wgmma_warpgroups_ = tuned_wgmma_warpgroups;
  bool tensor_cores_ok_ = false, wgmma_ok_ = false;
  std::int64_t key_items_ = 0, row_items_ = 0;
  std::int32_t interval_count_ = 0;
  std::int64_t key_tile_count_ = 0, row_tile_count_ = 0;
  detail::device_tables tables_; // groups, intervals, covers, rows, key tiles, row tiles
  block_group* groups_ = nullptr;
  kernels::key_interval* intervals_ = nullptr;
  kernels::key_cover* covers_ = nullptr;
  kernels::query_row* rows_ = nullptr;
  kernels::key_tile* key_tiles_ = nullptr;
  work_tile* row_tiles_ = nullptr;
};

#if defined(__CUDACC__)
namespace detail {
template <class T, int D>
void launch_block_backward(const kernels::backward_params<T>& p, cudaStream_t stream) {
  if (p.key_items > 0) {
    kernels::dkdv_kernel<T, D><<<warp_blocks(p.key_items * p.kv_heads), 256, 0, stream>>>(p);
    RINGATTN_CUDA_CHECK_LAUNCH();
  }
  if (p.row_items > 0) {
    kernels::dq_kernel<T, D><<<warp_blocks(p.row_items * p.q_heads), 256, 0, stream>>>(p);
    RINGATTN_CUDA_CHECK_LAUNCH();
  }
}
// The Hopper kernel's one grid: its dK/dV blocks (key tile, kv head) then its dQ blocks (row
// tile, query head), heads fastest, so blocks go in the schedule's heaviest-first tile order.
template <class T>
unsigned sm90_backward_grid(const kernels::tc_backward_params<T>& p) {
  const std::int64_t n = p.key_tile_count * p.b.kv_heads + p.row_tile_count * p.b.q_heads;
  if (n > std::numeric_limits<std::int32_t>::max())
    throw invalid_argument("ringattn: block backward of " + std::to_string(n) +
                           " thread blocks (tiles x heads) exceeds one grid; split the call");
  return static_cast<unsigned>(n);
}
// The mma.sync kernels on grids (heads, tiles): at most 65535 tiles a launch, so a longer list
// goes in several launches, each on its part of the list.
template <class T>
void launch_tc_pair(void (*dkdv)(kernels::tc_backward_params<T>),
                    void (*dq)(kernels::tc_backward_params<T>), int threads, int smem,
                    const kernels::tc_backward_params<T>& p, cudaStream_t stream) {
  constexpr std::int64_t most = 65535;
  for (auto [kernel, dkdv_list] : {std::pair{dkdv, true}, std::pair{dq, false}}) {
    const std::int64_t count = dkdv_list ? p.key_tile_count : p.row_tile_count;
    if (count == 0) continue;
    allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    for (std::int64_t first = 0; first < count; first += most) {
      kernels::tc_backward_params<T> part = p;
      const unsigned n = static_cast<unsigned>(std::min(most, count - first));
      if (dkdv_list)
        part.key_tiles += first, part.key_tile_count = n;
      else
        part.row_tiles += first, part.row_tile_count = n;
      const unsigned heads = static_cast<unsigned>(dkdv_list ? p.b.kv_heads : p.b.q_heads);
      kernel<<<dim3(heads, n), threads, smem, stream>>>(part);
      RINGATTN_CUDA_CHECK_LAUNCH();
    }
  }
}
// `wgmma_warpgroups` 0: the mma.sync kernels (dK/dV, then dQ); 1, 2 or 3: the wgmma kernel with
// that many warpgroups (both block kinds in one grid).
// Q/K `D` wide, V `DV` (unequal: the three-warpgroup wgmma kernel only).
template <class T, int D, int DV = D>
void launch_block_backward_tc(const kernels::tc_backward_params<T>& p, int wgmma_warpgroups,
                              cudaStream_t stream) {
  if constexpr (D == DV) {
    if (wgmma_warpgroups == 0) {
      launch_tc_pair<T>(&kernels::dkdv_tc_kernel<T, D>, &kernels::dq_tc_kernel<T, D>,
                        kernels::tc_backward_threads, kernels::tc_backward_smem_bytes<T, D>(), p,
                        stream);
      return;
    }
  }
  const unsigned blocks = sm90_backward_grid(p);
  if (blocks == 0) return;
  constexpr int W = tuned_wgmma_warpgroups;
  if constexpr (D != DV) {
    // The dK/dV blocks, then the dQ blocks, in two launches (backward_sm90_kernel's `Part`).
    constexpr int smem = kernels::sm90_backward_smem_bytes<T, D, DV, W>();
    auto launch = [&](auto* kernel, std::int64_t count) {
      static const bool checked = (require_sm90_registers(kernel, "the host kernels"), true);
      (void)checked;
      if (count == 0) return;
      allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
      kernel<<<static_cast<unsigned>(count), 128 * W, smem, stream>>>(p);
      RINGATTN_CUDA_CHECK_LAUNCH();
    };
    launch(&kernels::backward_sm90_kernel<T, D, DV, W, 1>, p.key_tile_count * p.b.kv_heads);
    launch(&kernels::backward_sm90_kernel<T, D, DV, W, 2>, p.row_tile_count * p.b.q_heads);
    return;
  } else {
#if defined(RINGATTN_EXPERIMENTS)
    auto kernel = &kernels::backward_sm90_kernel<T, D, DV, W>;
    int smem = kernels::sm90_backward_smem_bytes<T, D, DV, W>();
    if constexpr (D == DV) {
      if (wgmma_warpgroups != W) {
        kernel = wgmma_warpgroups == 2 ? &kernels::backward_sm90_kernel<T, D, D, 2>
                                       : &kernels::backward_sm90_kernel<T, D, D, 1>;
        smem = wgmma_warpgroups == 2 ? kernels::sm90_backward_smem_bytes<T, D, D, 2>()
                                     : kernels::sm90_backward_smem_bytes<T, D, D, 1>();
      }
    }
#else
    auto kernel = &kernels::backward_sm90_kernel<T, D, DV, W>;
    const int smem = kernels::sm90_backward_smem_bytes<T, D, DV, W>();
#endif
    if (wgmma_warpgroups == 3) {
      // As the forward's Hopper kernel (require_sm90_registers), checked once.
      static const bool checked =
          (require_sm90_registers(kernel, "backward_path::tensor_cores"), true);
      (void)checked;
    }
    allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    kernel<<<blocks, 128 * wgmma_warpgroups, smem, stream>>>(p);
    RINGATTN_CUDA_CHECK_LAUNCH();
  }
}
// The five-product kernel (head_dim 128): one thread block a (key tile, kv head); `Reduce` false
// leaves dQ's reduction out (bench/block_backward.cu's measure of what it costs).
template <class T, bool Reduce = true>
void launch_block_backward_five(const kernels::tc_backward_params<T>& p, cudaStream_t stream) {
  const std::int64_t n = p.key_tile_count * p.b.kv_heads;
  if (n > std::numeric_limits<std::int32_t>::max())
    throw invalid_argument("ringattn: block backward of " + std::to_string(n) +
                           " thread blocks (tiles x heads) exceeds one grid; split the call");
  if (n == 0) return;
  auto kernel = &kernels::backward_sm90_five_kernel<T, Reduce>;
  static const bool checked =
      (require_sm90_registers(kernel, "backward_options{.deterministic = true}"), true);
  (void)checked;
  constexpr int smem = kernels::sm90_five_smem_bytes;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
  kernel<<<static_cast<unsigned>(n), 384, smem, stream>>>(p);
  RINGATTN_CUDA_CHECK_LAUNCH();
}
} // namespace detail

//! Whether `path` can run on the current device (`automatic` and `cuda_cores`: always;
//! `tensor_cores`: sm_80 and later; `wgmma`: an sm_90a image on a compute capability 9.0 device).
inline bool backward_path_available(backward_path path) {
  if (path == backward_path::automatic || path == backward_path::cuda_cores) return true;
  if (path == backward_path::wgmma) return kernels::wgmma_available();
  int device = 0, major = 0;
  RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
  RINGATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  return major >= 8;
}

//! Adds one K/V block's share of dQ, dK, dV to `a.grad` (fp32, device memory), asynchronously on
//! `stream`. Validation (host, before any launch) throws `invalid_argument`.
template <device_element T>
void block_backward(const block_backward_args<T>& a, const device_backward_schedule& s,
                    cudaStream_t stream) {
  validation r = validate_block_backward<T>(a, {});
  r.require(s.q_tokens() == a.q.tokens && s.kv_tokens() == a.k.tokens, "the schedule was made for ",
            s.q_tokens(), " query and ", s.kv_tokens(), " key tokens, the call has ", a.q.tokens,
            " and ", a.k.tokens);
  if (r) r.require(s.supports(a.args.qk_dim(), a.args.v_dim()));
  if (r && s.tensor_cores(a.args.qk_dim(), a.args.v_dim())) {
    r.require(rows_aligned_to(a.q, 16) && rows_aligned_to(a.k, 16) && rows_aligned_to(a.v, 16) &&
                  rows_aligned_to(a.dout, 16),
              "q, k, v and dout must be 16-byte aligned with token and head strides that are "
              "multiples of 8 elements (the tensor-core kernels load 16-byte vectors)");
    r.require(aligned_to(a.grad.dq, 8) && aligned_to(a.grad.dk, 8) && aligned_to(a.grad.dv, 8),
              "dq, dk and dv must be 8-byte aligned (the tensor-core kernels add pairs of floats)");
    if (s.five_products(a.args.qk_dim(), a.args.v_dim()))
      r.require(aligned_to(a.grad.dq, 16), "dq must be 16-byte aligned (the non-deterministic "
                                           "kernel adds it in 256-byte rows)");
  }
  r.require(aligned_to(a.lse, 4) && aligned_to(a.delta, 4), "lse and delta must be 4-byte aligned");
  r.throw_if_invalid();
  if (s.empty()) return;
  if (a.args.separate_widths()) { // 192/128 on wgmma: `supports` said so
    detail::launch_block_backward_tc<T, 192, 128>(s.tc_params(a), s.wgmma_warpgroups(), stream);
    return;
  }
  if (s.five_products(a.args.qk_dim(), a.args.v_dim())) {
    detail::launch_block_backward_five<T>(s.tc_params(a), stream);
    return;
  }
  if (s.tensor_cores(a.args.head_dim)) {
    const auto p = s.tc_params(a);
    const int wgmma = s.wgmma(a.args.head_dim) ? s.wgmma_warpgroups() : 0;
    if (a.args.head_dim == 64)
      detail::launch_block_backward_tc<T, 64>(p, wgmma, stream);
    else
      detail::launch_block_backward_tc<T, 128>(p, wgmma, stream);
    return;
  }
  const auto p = s.params(a);
  switch (a.args.head_dim) {
  case 64: detail::launch_block_backward<T, 64>(p, stream); break;
  case 128: detail::launch_block_backward<T, 128>(p, stream); break;
  default: detail::launch_block_backward<T, 256>(p, stream); break;
  }
}

#endif // __CUDACC__

} // namespace ringattn
