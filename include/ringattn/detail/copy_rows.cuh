#pragma once
//! \file
//! Mechanics of device scatter/gather: a kernel that copies token rows of a THD tensor through an
//! index map (destination token -> source token). CUDA only.

#include <ringattn/config.cuh>
#include <ringattn/partition/device_plan.cuh>
#include <ringattn/tensor.cuh>

#include <cstdint>

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
// Kernels and their launchers; a name distinct from ringattn::detail, which stays unversioned.
namespace kernels {

//! Index of the last entry of sorted `a[0, n)` that is <= x (a[0] <= x assumed).
__device__ __forceinline__ int last_not_greater(const std::int32_t* a, int n, std::int64_t x) {
  int lo = 0, hi = n; // answer in [lo, hi)
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (a[mid] <= x)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

//! Shard token of `rank` -> token of the full batch.
template <class Partitioner>
struct scatter_map {
  device_plan_ref plan;
  int rank;
  __device__ std::int64_t operator()(std::int64_t local) const {
    const std::int32_t* lc =
        plan.local_cu_seqlens + static_cast<std::int64_t>(rank) * (plan.batch + 1);
    const int s = last_not_greater(lc, plan.batch + 1, local);
    const std::int64_t len = plan.cu_seqlens[s + 1] - plan.cu_seqlens[s];
    return plan.cu_seqlens[s] + Partitioner::position(len, plan.ranks, rank, local - lc[s]);
  }
};

//! Token of the full batch -> token of the rank-major concatenation of all shards.
template <class Partitioner>
struct gather_map {
  device_plan_ref plan;
  std::int64_t rank_stride; // 0: shards packed back to back (plan.rank_offsets)
  __device__ std::int64_t operator()(std::int64_t global) const {
    const int s = last_not_greater(plan.cu_seqlens, plan.batch + 1, global);
    const std::int64_t len = plan.cu_seqlens[s + 1] - plan.cu_seqlens[s];
    const owner o = Partitioner::locate(len, plan.ranks, global - plan.cu_seqlens[s]);
    const std::int64_t base = rank_stride > 0 ? o.rank * rank_stride : plan.rank_offsets[o.rank];
    return base + plan.local_cu_seqlens[static_cast<std::int64_t>(o.rank) * (plan.batch + 1) + s] +
           o.local;
  }
};

//! Copy geometry in units of `Vec`: each token has `runs` runs of `run_vecs` vectors.
struct row_geometry {
  std::int64_t tokens;
  int runs;
  int run_vecs;
  std::int64_t src_token_stride, src_run_stride; // in vectors
  std::int64_t dst_token_stride, dst_run_stride;
};

//! One warp per destination token; lanes stride over the token's vectors, several loads in
//! flight before the stores. Warps stride over tokens so any grid size is correct.
template <class Vec, class Map>
__global__ void __launch_bounds__(256)
    copy_rows_kernel(const Vec* __restrict__ src, Vec* __restrict__ dst, row_geometry g, Map map) {
  constexpr int unroll = 4;
  const int lane = threadIdx.x & 31;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int per_token = g.runs * g.run_vecs;
  for (std::int64_t t = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
       t < g.tokens; t += warps) {
    const std::int64_t s = map(t);
    const Vec* sp = src + s * g.src_token_stride;
    Vec* dp = dst + t * g.dst_token_stride;
    for (int v0 = lane; v0 < per_token; v0 += 32 * unroll) {
      Vec buf[unroll];
#pragma unroll
      for (int u = 0; u < unroll; ++u) {
        const int v = v0 + 32 * u;
        if (v < per_token) {
          const int run = v / g.run_vecs, off = v - run * g.run_vecs;
          buf[u] = sp[run * g.src_run_stride + off];
        }
      }
#pragma unroll
      for (int u = 0; u < unroll; ++u) {
        const int v = v0 + 32 * u;
        if (v < per_token) {
          const int run = v / g.run_vecs, off = v - run * g.run_vecs;
          dp[run * g.dst_run_stride + off] = buf[u];
        }
      }
    }
  }
}

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

#endif // __CUDACC__
