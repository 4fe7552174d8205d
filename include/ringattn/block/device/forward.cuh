#pragma once
//! \file
//! The CUDA block kernel, forward: attention of a rank's Q shard against one K/V block on tensor
//! cores, merged in fp32 into an `attention_state` (see state.cuh for the numerics).
//!
//! Plan, then run: a `device_block_schedule` is built once per (Q shard, K/V block) layout — it
//! validates the groups, orders the work tiles (heaviest first) and copies both to the device. The
//! run path (`block_forward`) validates the tensors on the host, allocates nothing and never waits
//! on the host; everything is asynchronous on `stream`.
//!
//! Two kernels implement it (docs/kernels.md): the Hopper one (wgmma, sm_90a builds on compute
//! capability 9.0, head_dim 64 and 128) and the FlashAttention-2 style one (mma.sync, sm_80 and
//! newer); the schedule picks one per device (`forward_path`).
//!
//! Supported: fp16 and bf16 storage, head_dim 64, 128 and 256, GQA/MQA (q_heads a multiple of
//! kv_heads; K/V never repeated), any strides that keep 16-byte alignment (pointers and strides
//! multiples of 8 elements), sm_80 and newer.
//!
//! \code
//! ringattn::device_block_schedule sched(groups, q_tokens, kv_tokens, head_dim); // plan time
//! ringattn::reset(state, stream);                          // o = 0, lse = -inf, sum = 0
//! for (each K/V block)
//!   ringattn::block_forward({q, k, v, args, state}, sched, stream);
//! ringattn::finalize(state, out, stream);                  // o / sum -> out, the lse
//! \endcode

#include <ringattn/block/device/forward_args.cuh>
#include <ringattn/block/device/launch.cuh>
#include <ringattn/block/device/state_ops.cuh>
#include <ringattn/block/kernel/elementwise.cuh>
#include <ringattn/block/kernel/forward_sm80.cuh>
#include <ringattn/block/kernel/forward_sm90.cuh>
#include <ringattn/core/tuning.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/detail/device_tables.cuh>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace ringattn {

//! Whether the Hopper block kernels (forward and backward) are built for q/k width `qk` with v
//! width `v`: equal widths of 64 or 128, and 192 with 128.
constexpr bool widths_on_wgmma(int qk, int v) {
  return (qk == v && (qk == 64 || qk == 128)) || (qk == 192 && v == 128);
}

//! Options of a `device_block_schedule`.
struct schedule_options {
  forward_path path = forward_path::automatic;
  //! How the wgmma kernel's merging calls add to the state (ignored by the mma_sync kernel).
  merge_path merge = merge_path::automatic;
#if defined(RINGATTN_EXPERIMENTS)
  //! Tile-shape experiments of the mma_sync kernel only (bench/forward_tuning.cu): rows per work
  //! tile and keys per K/V tile used for the work estimate; 0 = the tuned shape. A schedule made
  //! with another row count is rejected by `block_forward`.
  int block_m = 0;
  int block_n = 0;
#endif
};

} // namespace ringattn

RINGATTN_ABI_BEGIN

#if defined(__CUDACC__)
namespace kernels {
//! Whether the wgmma kernels of this build can run on the current device: an sm_90a image was
//! compiled and the device picks it. Asked once per device (a probe launch and a synchronous copy,
//! at plan time), then cached.
inline bool wgmma_available() {
  int device = 0;
  RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
  constexpr int max_devices = 64;
  static std::mutex mutex;
  static int known[max_devices] = {}; // 0 unknown, 1 no, 2 yes
  std::lock_guard lock(mutex);
  if (device < 0 || device >= max_devices) return false;
  if (known[device] == 0) {
    int major = 0;
    RINGATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    int yes = 0;
    if (major == 9) {
      int* flag = nullptr;
      RINGATTN_CUDA_CHECK(detail::device_malloc(&flag, sizeof(int)));
      kernels::sm90_probe_kernel<<<1, 1>>>(flag);
      cudaError_t e = cudaGetLastError();
      if (e == cudaSuccess) e = cudaMemcpy(&yes, flag, sizeof(int), cudaMemcpyDeviceToHost);
      cudaFree(flag);
      // No sm_90a image and no PTX to JIT from: the probe cannot launch, so no wgmma either.
      if (e == cudaErrorNoKernelImageForDevice || e == cudaErrorInvalidDeviceFunction) {
        yes = 0;
      } else {
        RINGATTN_CUDA_CHECK(e);
      }
    }
    known[device] = yes ? 2 : 1;
  }
  return known[device] == 2;
}
} // namespace kernels
#endif

//! Work tiles of one (Q shard, K/V block) layout for the CUDA kernel, on the device.
class device_block_schedule {
public:
  //! Validates `groups` against the shard sizes and lays out tiles of the kernel's row count for
  //! `head_dim` (q and k; v as wide), heaviest first (so the longest tiles of a causal block start
  //! first). Also resolves which kernel runs (`options.path`; the current device is asked once).
  //! Throws `invalid_argument` for a path that cannot run here.
  device_block_schedule(std::span<const block_group> groups, std::int64_t q_tokens,
                        std::int64_t kv_tokens, int head_dim, schedule_options options = {})
      : device_block_schedule(groups, q_tokens, kv_tokens, head_dim, head_dim, options) {}
  //! As above for the widths of `args` (q and k `head_dim`, v and the output `head_dim_v`).
  device_block_schedule(std::span<const block_group> groups, std::int64_t q_tokens,
                        std::int64_t kv_tokens, const attention_arguments& args,
                        schedule_options options = {})
      : device_block_schedule(groups, q_tokens, kv_tokens, args.qk_dim(), args.v_dim(), options) {}
  device_block_schedule(std::span<const block_group> groups, std::int64_t q_tokens,
                        std::int64_t kv_tokens, int head_dim, int head_dim_v,
                        schedule_options options)
      : groups_(groups.begin(), groups.end()), q_tokens_(q_tokens), kv_tokens_(kv_tokens),
        head_dim_(head_dim), head_dim_v_(head_dim_v) {
    validate_groups(groups, q_tokens, kv_tokens).throw_if_invalid();
    path_ = resolve(options.path, head_dim, head_dim_v);
    merge_ = options.merge;
    if (merge_ == merge_path::automatic) {
      bool banded = false;
      for (const block_group& g : groups_)
        for (int b = 0; b < g.count; ++b)
          banded = banded || g.kv[b].mask.lo > -(g.q_count - 1) ||
                   g.kv[b].mask.hi < g.kv[b].kv_count - 1;
      merge_ = head_dim == 128 && banded ? merge_path::reduce : merge_path::rewrite;
    }
    if (path_ != forward_path::wgmma) merge_ = merge_path::rewrite;
#if defined(RINGATTN_EXPERIMENTS)
    const int want_m = options.block_m, want_n = options.block_n;
#else
    const int want_m = 0, want_n = 0;
#endif
    block_m_ = want_m > 0 ? want_m : tuned_block_m(head_dim, path_);
    const int bm = block_m_, bn = want_n > 0 ? want_n : tuned_block_n(head_dim, path_);
    struct weighted {
      std::int64_t work;
      std::int32_t group, row;
    };
    std::vector<weighted> w;
    for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
      const block_group& g = groups_[gi];
      for (std::int64_t r = 0; r < g.q_count; r += bm) {
        const std::int64_t r1 = std::min(g.q_count, r + bm);
        std::int64_t tiles = 0;
        for (int b = 0; b < g.count; ++b) {
          const tile_trips t = g.kv[b].mask.kv_tiles(r, r1, g.kv[b].kv_count, bn);
          tiles += t.end - t.begin;
        }
        w.push_back({tiles, static_cast<std::int32_t>(gi), static_cast<std::int32_t>(r)});
        work_tiles_ += tiles;
      }
    }
    std::stable_sort(w.begin(), w.end(),
                     [](const weighted& a, const weighted& b) { return a.work > b.work; });
    std::vector<work_tile> tiles;
    for (const weighted& x : w)
      tiles.push_back({x.group, x.row});
    tile_count_ = static_cast<std::int64_t>(tiles.size());
    tables_ = detail::device_tables(std::span<const block_group>(groups_),
                                    std::span<const work_tile>(tiles));
    groups_device_ = tables_.at<block_group>(0);
    tiles_device_ = tables_.at<work_tile>(1);
  }
  device_block_schedule(device_block_schedule&&) noexcept = default;
  device_block_schedule(const device_block_schedule&) = delete;
  device_block_schedule& operator=(const device_block_schedule&) = delete;
  device_block_schedule& operator=(device_block_schedule&&) = delete;

  //! Query rows per thread block and keys per K/V tile of a kernel for a head_dim.
  static int tuned_block_m(int head_dim, forward_path path) {
    if (path == forward_path::wgmma) return 128;
    return head_dim == 64    ? forward_tuning_for<64>.block_m()
           : head_dim == 128 ? forward_tuning_for<128>.block_m()
                             : forward_tuning_for<256>.block_m();
  }
  static int tuned_block_n(int head_dim, forward_path path) {
    if (path == forward_path::wgmma) return 128;
    return head_dim == 64    ? forward_tuning_for<64>.block_n
           : head_dim == 128 ? forward_tuning_for<128>.block_n
                             : forward_tuning_for<256>.block_n;
  }
  //! The kernel this schedule's launches run (never `automatic`).
  forward_path path() const noexcept { return path_; }
  //! How its merging calls add to the state (never `automatic`; `rewrite` on mma_sync). A ring's
  //! first and last steps always rewrite.
  merge_path merge() const noexcept { return merge_; }
  //! Query rows per work tile of this schedule.
  int block_m() const noexcept { return block_m_; }
  std::span<const block_group> groups() const noexcept { return groups_; }
  std::int64_t q_tokens() const noexcept { return q_tokens_; }
  std::int64_t kv_tokens() const noexcept { return kv_tokens_; }
  int head_dim() const noexcept { return head_dim_; }
  int head_dim_v() const noexcept { return head_dim_v_; }
  //! Thread blocks per head of one launch.
  std::int64_t tiles() const noexcept { return tile_count_; }
  //! (row tile, KV tile) pairs visited per head: the work of one launch.
  std::int64_t work_tiles() const noexcept { return work_tiles_; }
  const block_group* device_groups() const noexcept { return groups_device_; }
  const work_tile* device_tiles() const noexcept { return tiles_device_; }

private:
  std::vector<block_group> groups_;
  std::int64_t q_tokens_, kv_tokens_;
  int head_dim_, head_dim_v_;
  forward_path path_ = forward_path::mma_sync;
  merge_path merge_ = merge_path::rewrite;
  int block_m_ = 0;
  std::int64_t tile_count_ = 0, work_tiles_ = 0;
  detail::device_tables tables_; // groups, then tiles
  block_group* groups_device_ = nullptr;
  work_tile* tiles_device_ = nullptr;

  static forward_path resolve(forward_path want, int qk, int v) {
    const bool mma_dims = qk == v && (qk == 64 || qk == 128 || qk == 256);
    const bool wgmma_dims = widths_on_wgmma(qk, v);
    const std::string widths =
        qk == v ? "head_dim " + std::to_string(qk)
                : "head_dim " + std::to_string(qk) + " with head_dim_v " + std::to_string(v);
    if (want == forward_path::mma_sync) {
      if (!mma_dims)
        throw invalid_argument("ringattn: the mma_sync block kernel takes head_dim 64, 128 or 256 "
                               "with v as wide (got " +
                               widths + ")");
      return want;
    }
#if defined(__CUDACC__)
    const bool here = wgmma_dims && kernels::wgmma_available();
#else
    const bool here = false; // the wgmma kernels exist only in CUDA translation units
#endif
    if (want == forward_path::wgmma && !here)
      throw invalid_argument(
          wgmma_dims ? "ringattn: the wgmma block kernel needs code built for sm_90a (CMake CUDA "
                       "architecture 90a) running on a compute capability 9.0 device"
                     : "ringattn: the wgmma block kernel takes head_dim 64 or 128, or 192 with "
                       "head_dim_v 128 (got " +
                           widths + ")");
    if (!here && !mma_dims)
      throw invalid_argument(
          "ringattn: " + widths +
          (wgmma_dims ? " runs only on the wgmma block kernel, which needs code built for sm_90a "
                        "(CMake CUDA architecture 90a) running on a compute capability 9.0 device"
                      : " has no native CUDA block kernel") +
          "; the host kernels take any widths and the cuDNN model those cuDNN supports");
    return here ? forward_path::wgmma : forward_path::mma_sync;
  }
};

#if defined(__CUDACC__)
//! Whether `path` can run on the current device for `head_dim` (`automatic` and `mma_sync`:
//! always; `wgmma`: an sm_90a image on a compute capability 9.0 device, head_dim 64 or 128).
inline bool forward_path_available(forward_path path, int head_dim) {
  if (path != forward_path::wgmma) return true;
  return (head_dim == 64 || head_dim == 128) && kernels::wgmma_available();
}
//! The same for q/k `head_dim` and v `head_dim_v` (192 with 128: the wgmma kernel only).
inline bool forward_path_available(forward_path path, int head_dim, int head_dim_v) {
  if (head_dim == head_dim_v) return forward_path_available(path, head_dim);
  return path != forward_path::mma_sync && widths_on_wgmma(head_dim, head_dim_v) &&
         kernels::wgmma_available();
}
#endif

RINGATTN_ABI_END

namespace ringattn {

//! The device-specific checks on top of `validate_block_forward`: dtype, head_dim, 16-byte
//! alignment, and a schedule made for these shapes.
template <element T>
validation validate_device_forward(const block_forward_args<T>& a, const device_block_schedule& s) {
  validation r = validate_block_forward_tensors(a);
  if (!r) return r;
  r.require(!std::is_same_v<std::remove_const_t<T>, float>,
            "the CUDA block kernel takes fp16 or bf16 inputs (got fp32)");
  r.require(rows_aligned_to(a.q, 16) && rows_aligned_to(a.k, 16) && rows_aligned_to(a.v, 16),
            "q, k and v must be 16-byte aligned with token and head strides that are multiples of "
            "8 elements");
  r.require(aligned_to(a.state.o, 16), "the state's o must be 16-byte aligned");
  r.require(s.block_m() == device_block_schedule::tuned_block_m(a.args.head_dim, s.path()),
            "the schedule's tiles have ", s.block_m(), " rows; the ", to_string(s.path()),
            " kernel for head_dim ", a.args.head_dim, " takes ",
            device_block_schedule::tuned_block_m(a.args.head_dim, s.path()));
  r.require(s.q_tokens() == a.q.tokens && s.kv_tokens() == a.k.tokens &&
                s.head_dim() == a.args.qk_dim() && s.head_dim_v() == a.args.v_dim(),
            "the schedule was made for ", s.q_tokens(), " query and ", s.kv_tokens(),
            " key tokens, head_dim ", s.head_dim(), ", head_dim_v ", s.head_dim_v(),
            "; the call has ", a.q.tokens, ", ", a.k.tokens, ", ", a.args.qk_dim(), ", ",
            a.args.v_dim());
  return r;
}

#if defined(__CUDACC__)
namespace detail {
//! The Hopper kernel's registers a thread, checked once per instantiation: the warpgroups trade
//! registers (setmaxnreg: 24 producer, 240 consumers), which balances only if the kernel starts
//! with 65536 / 384 = 168 a thread; fewer (-maxrregcount) would leave the consumers waiting for
//! registers forever.
template <class Kernel>
void require_sm90_registers(Kernel* kernel, const char* fallback) {
  cudaFuncAttributes attr{};
  RINGATTN_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  if (attr.numRegs != kernels::sm90_registers)
    throw error("ringattn: the wgmma kernel was compiled with " + std::to_string(attr.numRegs) +
                " registers a thread instead of " + std::to_string(kernels::sm90_registers) +
                " (is -maxrregcount set?); use " + fallback);
}

template <class T, int D, int DV, forward_tuning Tune, kernels::epilogue E>
void launch_block_forward(const kernels::forward_params<T>& p, const device_block_schedule& s,
                          cudaStream_t stream) {
  if (s.tiles() == 0 || p.q_heads == 0) return;
  const dim3 grid(static_cast<unsigned>(s.tiles()), static_cast<unsigned>(p.q_heads));
  if constexpr (D == 64 || D == 128 || D == 192) {
    if (s.path() == forward_path::wgmma) {
      constexpr int bytes = kernels::sm90_smem_bytes<T, D, DV>();
      constexpr int BN = kernels::sm90_block_n<D>;
      auto launch = [&](auto* kernel) {
        static const bool checked =
            (require_sm90_registers(kernel, "forward_path::mma_sync"), true);
        (void)checked;
        allow_dynamic_smem(reinterpret_cast<const void*>(kernel), bytes);
        kernel<<<grid, kernels::sm90_threads, bytes, stream>>>(p);
        RINGATTN_CUDA_CHECK_LAUNCH();
      };
      // Only a plain merge may add through the L2 (merge_path::reduce).
      if constexpr (E == kernels::epilogue::merge)
        if (s.merge() == merge_path::reduce)
          return launch(&kernels::block_forward_sm90_kernel<T, D, DV, BN, E, true>);
      return launch(&kernels::block_forward_sm90_kernel<T, D, DV, BN, E, false>);
    }
  }
  if constexpr (D != DV || D == 192) {
    throw error("ringattn: widths " + std::to_string(D) + "/" + std::to_string(DV) +
                " run only on the wgmma block kernel");
  } else {
    constexpr int smem = kernels::forward_smem_bytes<T, D>(Tune);
    auto* kernel = &kernels::block_forward_kernel<T, D, Tune.warps, Tune.m_tiles, Tune.block_n,
                                                  Tune.q_in_registers, E>;
    allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
    kernel<<<grid, Tune.threads(), smem, stream>>>(p);
    RINGATTN_CUDA_CHECK_LAUNCH();
  }
}

template <class T>
kernels::forward_params<T> forward_params_of(const block_forward_args<T>& a,
                                             const device_block_schedule& s, T* out,
                                             float* lse_out) {
  return {a.q.data,
          a.k.data,
          a.v.data,
          a.q.token_stride,
          a.q.head_stride,
          a.k.token_stride,
          a.k.head_stride,
          a.v.token_stride,
          a.v.head_stride,
          s.device_groups(),
          s.device_tiles(),
          a.state,
          out,
          lse_out,
          a.args.q_heads,
          a.args.group_size(),
          a.q.tokens,
          static_cast<float>(a.args.scale() * 1.4426950408889634)};
}

//! One launch with epilogue E; the schedule's groups were validated when it was made, so the call
//! checks only tensors, alignment and that the schedule fits them.
template <class T, kernels::epilogue E>
void block_forward(const block_forward_args<T>& a, const device_block_schedule& s, T* out,
                   float* lse_out, cudaStream_t stream) {
  validate_device_forward(a, s).throw_if_invalid();
  const auto p = forward_params_of(a, s, out, lse_out);
  if (a.args.separate_widths()) // 192/128: the schedule accepted no other pair
    return launch_block_forward<T, 192, 128, forward_tuning_for<128>, E>(p, s, stream);
  switch (a.args.head_dim) {
  case 64: launch_block_forward<T, 64, 64, forward_tuning_for<64>, E>(p, s, stream); break;
  case 128: launch_block_forward<T, 128, 128, forward_tuning_for<128>, E>(p, s, stream); break;
  default: launch_block_forward<T, 256, 256, forward_tuning_for<256>, E>(p, s, stream); break;
  }
}
} // namespace detail

//! Merges attention of `a.q` against the K/V block `a.k`, `a.v` into `a.state`, asynchronously on
//! `stream`. Validation (on the host, before anything is launched) throws `invalid_argument`.
template <device_element T>
void block_forward(const block_forward_args<T>& a, const device_block_schedule& s,
                   cudaStream_t stream) {
  detail::block_forward<T, kernels::epilogue::merge>(a, s, nullptr, nullptr, stream);
}

namespace detail {
//! The output of `block_forward_last` / `block_forward_plain`: a dense
//! `[q_tokens, q_heads, head_dim]` tensor in T, 4-byte aligned (the kernels store pairs).
template <class T>
validation validate_dense_out(const thd_view<T>& out, const block_forward_args<T>& a) {
  validation r = validate_view(out, "out");
  r.require(out.dense() && out.tokens == a.q.tokens && out.heads == a.args.q_heads &&
                out.head_dim == a.args.v_dim(),
            "out must be a dense [q_tokens, q_heads, head_dim_v] tensor");
  r.require(aligned_to(out.data, 4),
            "out must be 4-byte aligned (the kernels store pairs of elements)");
  return r;
}
} // namespace detail

//! The steps of a caller that knows which merge comes first and which last, to save the state's
//! traffic (the ring does): `block_forward_first` writes the block's result into the state
//! without reading it (no `reset` before it), `block_forward_last` merges and writes the merged
//! output to `out` (dense `[q_tokens, q_heads, head_dim]`, T, 4-byte aligned) instead of the
//! state's o (no `finalize` after it; the state's lse gets the merged lse). Each writes every
//! row of every group and leaves rows outside the groups untouched, so they replace `reset` or
//! `finalize` only for a call whose groups cover every query row (`rows_of(groups) ==
//! q_tokens`).
template <device_element T>
void block_forward_first(const block_forward_args<T>& a, const device_block_schedule& s,
                         cudaStream_t stream) {
  detail::block_forward<T, kernels::epilogue::fresh>(a, s, nullptr, nullptr, stream);
}
template <device_element T>
void block_forward_last(const block_forward_args<T>& a, const device_block_schedule& s,
                        thd_view<T> out, cudaStream_t stream) {
  validation r = detail::validate_dense_out(out, a);
  r.throw_if_invalid();
  detail::block_forward<T, kernels::epilogue::merge_out>(a, s, out.data, nullptr, stream);
}

//! The same kernel writing its block result directly (no state): `out` dense
//! `[q_tokens, q_heads, head_dim]` in T (4-byte aligned), `lse` `[q_heads, q_tokens]`. Every row of
//! `out` and `lse` that no group covers is left untouched. For a single-block attention and for
//! measuring what the merge costs.
template <device_element T>
void block_forward_plain(const block_forward_args<T>& a, const device_block_schedule& s,
                         thd_view<T> out, float* lse, cudaStream_t stream) {
  validation r = detail::validate_dense_out(out, a);
  r.require(lse != nullptr || a.q.tokens == 0, "lse is a null pointer");
  r.require(aligned_to(lse, 4), "lse must be 4-byte aligned");
  r.throw_if_invalid();
  detail::block_forward<T, kernels::epilogue::plain>(a, s, out.data, lse, stream);
}

#endif // __CUDACC__

} // namespace ringattn
