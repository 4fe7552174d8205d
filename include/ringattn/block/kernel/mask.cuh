#pragma once
//! \file
//! The band mask on the device: which K/V tiles a row tile of a block group visits and which of
//! them need the band predicate (`kv_walk`), shared by the forward kernels and the dQ walks.

#include <ringattn/config.cuh>
#include <ringattn/core/block.cuh>

#include <cstdint>

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

//! The K/V tiles (of `BN` keys) one row tile of a group visits: those of key segment 0, then
//! those of segment 1. Both segments are held in named members and picked with selects: an array
//! indexed with a run-time segment number would live in local memory.
template <int BN>
struct kv_walk {
  static_assert(max_blocks_per_group == 2, "the kernels walk at most two key segments per group");
  kv_block kv0, kv1;
  tile_trips t0, t1;
  int first, total; // tiles of segment 0, of both

  __device__ __forceinline__ kv_walk(const block_group& g, std::int64_t row0, int rows)
      : kv0(g.kv[0]), kv1(g.kv[1]) {
    const tile_trips none{0, 0, 0, 0};
    t0 = g.count > 0 ? kv0.mask.kv_tiles(row0, row0 + rows, kv0.kv_count, BN) : none;
    t1 = g.count > 1 ? kv1.mask.kv_tiles(row0, row0 + rows, kv1.kv_count, BN) : none;
    first = static_cast<int>(t0.end - t0.begin);
    total = first + static_cast<int>(t1.end - t1.begin);
  }
  //! Iteration `it` visits tile `j` of segment `second ? 1 : 0`.
  __device__ __forceinline__ void tile(int it, bool& second, std::int64_t& j) const {
    second = it >= first;
    j = second ? t1.begin + (it - first) : t0.begin + it;
  }
  //! Keys of a segment, its first row in the K/V block, its band.
  __device__ __forceinline__ std::int64_t count(bool second) const {
    return second ? kv1.kv_count : kv0.kv_count;
  }
  __device__ __forceinline__ std::int64_t begin(bool second) const {
    return second ? kv1.kv_begin : kv0.kv_begin;
  }
  __device__ __forceinline__ band mask(bool second) const { return second ? kv1.mask : kv0.mask; }
  //! Keys in tile j (BN but for a segment's last tile).
  __device__ __forceinline__ int valid(bool second, std::int64_t j) const {
    const std::int64_t left = count(second) - j * BN;
    return static_cast<int>(left < BN ? left : BN);
  }
  //! Whether tile j needs the band and bounds predicate (it is on a band edge or ragged).
  __device__ __forceinline__ bool needs_mask(bool second, std::int64_t j) const {
    const std::int64_t lo = second ? t1.unmasked_begin : t0.unmasked_begin;
    const std::int64_t hi = second ? t1.unmasked_end : t0.unmasked_end;
    return j < lo || j >= hi || (j + 1) * BN > count(second);
  }
};

//! Where element `e` of 8-column tile `t` of a 16-row accumulator fragment sits for `lane`: its
//! row (0..15) and column within the fragment. The scores of every tensor-core kernel use this
//! layout (mma.sync m16n8k16, and each warp's 16 rows of a wgmma m64nN).
__device__ __forceinline__ int fragment_row(int lane, int e) {
  return (lane >> 2) + (e >= 2 ? 8 : 0);
}
__device__ __forceinline__ int fragment_col(int lane, int t, int e) {
  return t * 8 + (lane & 3) * 2 + (e & 1);
}

//! Whether score (i, c) of a key segment of `count` keys is visible: inside the band and a key
//! that exists.
__device__ __forceinline__ bool visible(const band& bd, std::int64_t i, std::int64_t c,
                                        std::int64_t count) {
  return c < count && bd.sees(i, c);
}

//! A band and a column bound relative to one tile, in 32 bits: for tile-local offsets (key - row,
//! at most a few hundred apart) `d` and column `c`, whether lo <= base + d <= hi and c < count,
//! with base and count the tile's 64-bit origin and column count. Bounds far outside the tile are
//! clamped to +-2^20, which keeps every comparison the same; the predicates then compile to a few
//! integer compares and a select a score, with no branches.
struct band_window {
  int lo, hi, count;
  __device__ __forceinline__ band_window(const band& bd, std::int64_t base, std::int64_t cols)
      : lo(clamp(bd.lo - base)), hi(clamp(bd.hi - base)), count(clamp(cols)) {}
  __device__ __forceinline__ bool sees(int c, int d) const {
    return (c < count) & (d >= lo) & (d <= hi);
  }

private:
  __device__ __forceinline__ static int clamp(std::int64_t x) {
    constexpr std::int64_t far = std::int64_t{1} << 20;
    return static_cast<int>(x < -far ? -far : x > far ? far : x);
  }
};
//! The forward's band and bounds mask on one 16-row fragment of scores whose first element is
//! (row0, col0): every score `visible` rejects becomes -inf. `at(t, e)` is the fragment's element
//! e of tile t, by reference.
template <int NTiles, class At>
__device__ __forceinline__ void mask_fragment(At at, const band& bd, std::int64_t row0,
                                              std::int64_t col0, std::int64_t count, int lane) {
#pragma unroll
  for (int t = 0; t < NTiles; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (!visible(bd, row0 + fragment_row(lane, e), col0 + fragment_col(lane, t, e), count))
        at(t, e) = -__builtin_huge_valf();
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
