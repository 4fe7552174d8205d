#pragma once
//! \file
//! The kernel of device scatter/gather: copies token rows of a THD tensor through an index map
//! (destination token -> source token). CUDA only; the launcher is partition/scatter.cuh's.

#include <ringattn/config.cuh>
#include <ringattn/core/plan_ref.cuh>
#include <ringattn/core/segment.cuh>

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
    const placement pl = plan.placements ? plan.placements[s] : placement{0, plan.ranks};
    const int i = (rank - pl.first + plan.ranks) % plan.ranks; // a rank holding a token of s
    return plan.cu_seqlens[s] + Partitioner::position(len, pl.ranks, i, local - lc[s]);
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
    const placement pl = plan.placements ? plan.placements[s] : placement{0, plan.ranks};
    owner o = Partitioner::locate(len, pl.ranks, global - plan.cu_seqlens[s]);
    o.rank = (pl.first + o.rank) % plan.ranks;
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

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
