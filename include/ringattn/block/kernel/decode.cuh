#pragma once
//! \file
//! The split-K/V block forward for few query rows (decoding): a launch's unit is one key range
//! (a split) of one group's K/V segment for one kv head, and all query rows of the group that
//! share that kv head (new tokens x the GQA group, at most `decode_max_rows`), so each K/V byte
//! of the split is read once. The block is bound by reading K and V: everything serves keeping
//! the memory busy.
//!
//! `decode_split_kernel<T, Cache, HeadDim, RowTiles, KeyRows, Scales>`: 4 warps; the query rows
//! padded to `RowTiles` tiles of 16 (zero rows), and the warps laid out as RowTiles x (4 /
//! RowTiles): a warp takes one row tile and its share of each stage's keys. K and V stream through
//! `decode_stages` shared buffers of `decode_stage_keys` keys by cp.async (two stages in flight
//! while one is computed; keys past the split are zero-filled and masked; `KeyRows` says where a
//! key row lives: in place, or through a page table). Scores and P V on tensor cores (mma.sync
//! m16n8k16, fp32 accumulation), an online softmax in base 2 per warp; the warps' states meet in
//! shared memory, and the split's unnormalised output, maximum (log2 units) and weight sum go to
//! the scratch.
//!
//! An FP8 cache (`Cache` = `fp8_e4m3`) streams its stages as bytes, half the traffic; each stage
//! is converted, exactly and one instruction per element pair, into one shared fp16 tile per K
//! and V before its products, which run as above in fp16 (bf16 queries are scaled into fp16 row
//! by row by a power of two, exact at every magnitude that reaches a score). Its scales
//! (`Scales`) are applied in fp32: a key's to its scores before the softmax, a value's to the
//! output (`head_scales`: once, at the split's end) or, relative to the largest of the split's, to
//! the weights it is multiplied with (`page_scales`: per key, the stage's scales loaded with it).
//! `decode_combine_kernel`: per row, the splits in order, then the block merges into the fp32 state
//! (core/state.cuh) as a `fresh` or a `merge` epilogue.

#include <ringattn/block/kernel/online_softmax.cuh>
#include <ringattn/block/kernel/primitives.cuh>
#include <ringattn/config.cuh>
#include <ringattn/core/block.cuh>
#include <ringattn/core/element.cuh>
#include <ringattn/core/kv_scales.cuh>
#include <ringattn/core/state.cuh>

#include <cstdint>
#include <type_traits>

namespace ringattn {

//! Query rows (new tokens x query heads per kv head) one unit of the split kernel takes.
inline constexpr int decode_max_rows = 64;
//! Keys of one pipeline stage of the split kernel, and its stages (buffers) in shared memory.
inline constexpr int decode_stage_keys = 64, decode_stages = 3;

//! One unit of the split kernel: keys [kv_lo, kv_hi) of group `group`'s segment; its partial
//! goes to scratch slot `slot` (x kv heads).
struct decode_item {
  std::int32_t group = 0;
  std::int32_t slot = 0;
  std::int64_t kv_lo = 0, kv_hi = 0;
};

//! Where the split kernel finds key row `L` of a group's segment (its `kv_begin` plus an offset):
//! row `L` of K and V themselves, a packed or slab cache.
struct packed_key_rows {
  static constexpr bool paged = false;
  __host__ __device__ std::int64_t operator()(std::int64_t at) const { return at; }
};
//! A paged cache: `L` counts through the step's page table (a group's `kv_begin` is its first
//! table entry times the page size), so row `L` sits in pool page `table[L >> shift]`, row
//! `L & (2^shift - 1)` of that page.
struct paged_key_rows {
  static constexpr bool paged = true;
  const std::int32_t* table = nullptr;
  int shift = 0; //!< log2 of the page size
  __host__ __device__ std::int64_t operator()(std::int64_t at) const {
    return (static_cast<std::int64_t>(table[at >> shift]) << shift) |
           (at & ((std::int64_t{1} << shift) - 1));
  }
};

//! Floats of one unit's partial for one kv head: per row (`rows` padded rows) an output of
//! `head_dim`, a maximum and a weight sum.
__host__ __device__ constexpr std::int64_t decode_partial_floats(int head_dim, int rows) {
  return static_cast<std::int64_t>(rows) * (head_dim + 2);
}

//! Shared memory of the split kernel: the K and V stages (the query tile borrows the last
//! stage's K buffer until the queries are in registers); for an FP8 cache, byte stages, one
//! converted tile of T per K and V (the query tile borrows K's) and the stages' per-key scales.
//! 96 KiB at head_dim 128 (82 KiB with an FP8 cache): within the 99 KiB a thread block may take
//! on every sm_80+ device.
template <class T, class Cache = T>
constexpr int decode_smem_bytes(int head_dim) {
  constexpr int keys = decode_stage_keys, stages = decode_stages;
  const int stage_bytes = 2 * keys * stages * head_dim * static_cast<int>(sizeof(Cache));
  if constexpr (std::is_same_v<Cache, T>)
    return stage_bytes;
  else
    return stage_bytes + 2 * keys * head_dim * static_cast<int>(sizeof(T)) +
           (2 * stages * keys + decode_max_rows) * static_cast<int>(sizeof(float));
}

} // namespace ringattn

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

template <class T, class Cache, int HeadDim, int RowTiles, class KeyRows, class Scales>
__global__ void __launch_bounds__(128, 2)
    decode_split_kernel(const T* q, std::int64_t q_token_stride, std::int64_t q_head_stride,
                        const Cache* k, std::int64_t k_token_stride, std::int64_t k_head_stride,
                        const Cache* v, std::int64_t v_token_stride, std::int64_t v_head_stride,
                        KeyRows key_rows, Scales scales, const block_group* groups,
                        const decode_item* items, int group_size, float scale_log2,
                        float* scratch) {
  static_assert(RowTiles == 1 || RowTiles == 2 || RowTiles == 4);
  static_assert(16 * RowTiles <= decode_stage_keys, "the query tile fits a stage's K buffer");
  constexpr bool quantized = !std::is_same_v<Cache, T>;
  constexpr bool per_key = std::is_same_v<Scales, page_scales>; // a scale per key of a stage
  // The products' element type: an FP8 cache's tiles are fp16 (one conversion per element pair;
  // bf16 queries are scaled into fp16 row by row, a power of two each).
  using M = std::conditional_t<quantized, __half, T>;
  constexpr bool scaled_q = quantized && !std::is_same_v<T, __half>;
  static_assert(!quantized || std::is_same_v<Cache, fp8_e4m3>);
  static_assert(quantized == !std::is_same_v<Scales, no_scales>);
  static_assert(!per_key || KeyRows::paged, "page scales come with a paged cache");
  constexpr int D = HeadDim, Rows = 16 * RowTiles, KeyWarps = 4 / RowTiles;
  constexpr int BK = decode_stage_keys, S = decode_stages;
  static_assert(2 * BK == 128, "a thread loads one key's K or V scale of a stage");
  constexpr int KW = BK / KeyWarps; // keys of a stage one warp takes
  constexpr int NT = KW / 8;        // its score tiles of 8 keys
  constexpr int KSteps = D / 16, DTiles = D / 8, chunks = D / 8;
  constexpr int bytes_chunks = D * static_cast<int>(sizeof(Cache)) / 16; // 16-byte chunks a row
  constexpr std::uint32_t elem = sizeof(T);
  constexpr float neg_inf = -__builtin_huge_valf();
  extern __shared__ __align__(128) unsigned char decode_smem[];
  // The stages (of Cache), then for an FP8 cache the converted tiles (of T) and the scales.
  Cache* sK = reinterpret_cast<Cache*>(decode_smem);
  Cache* sV = sK + S * BK * D;
  M* tK = reinterpret_cast<M*>(sV + S * BK * D);
  M* tV = tK + BK * D;
  float* kscale_s = reinterpret_cast<float*>(tV + BK * D); // [S][BK], then V's
  float* qscale_s = kscale_s + 2 * S * BK;                 // [Rows]: 2^e of each query row
  // The query tile: the last stage's K buffer, first filled at t = 0; an FP8 cache's K tile,
  // first written at t = 0 once the queries are in registers.
  T* sQ = quantized ? reinterpret_cast<T*>(tK) : reinterpret_cast<T*>(sK + (S - 1) * BK * D);
  static_assert(!quantized || (KeyWarps * Rows * (D + 2)) * 4 <=
                                  2 * S * BK * D * static_cast<int>(sizeof(Cache)),
                "the warps' states meet in the FP8 stages");

  const decode_item item = items[blockIdx.x];
  if (item.kv_hi <= item.kv_lo) return; // an empty unit of a fixed launch
  const block_group g = groups[item.group];
  const int kvh = static_cast<int>(blockIdx.y), kv_heads = static_cast<int>(gridDim.y);
  const int rows = static_cast<int>(g.q_count) * group_size;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int wr = warp % RowTiles, wk = warp / RowTiles;
  const std::int64_t keys = item.kv_hi - item.kv_lo;
  const int tiles = static_cast<int>((keys + BK - 1) / BK);
  const std::int64_t first = g.kv[0].kv_begin + item.kv_lo;
  auto load_stage = [&](int t) {
    const int buf = t % S;
    const std::int64_t at = first + static_cast<std::int64_t>(t) * BK,
                       left = keys - static_cast<std::int64_t>(t) * BK;
    const int valid = left < BK ? static_cast<int>(left) : BK;
    if constexpr (quantized) {
      // Byte stages, row-major (each thread reads back the chunks it copied: no swizzle).
      const Cache* k_head = k + kvh * k_head_stride;
      const Cache* v_head = v + kvh * v_head_stride;
      const std::int64_t base = KeyRows::paged ? 0 : key_rows(at);
#pragma unroll
      for (int c = static_cast<int>(threadIdx.x); c < BK * bytes_chunks; c += 128) {
        const int r = c / bytes_chunks, ch = c % bytes_chunks;
        const bool ok = r < valid;
        std::int64_t row = 0;
        if (ok) row = KeyRows::paged ? key_rows(at + r) : base + r;
        cp_async_16(sK + buf * BK * D + r * D + ch * 16,
                    ok ? k_head + row * k_token_stride + ch * 16 : k, ok);
        cp_async_16(sV + buf * BK * D + r * D + ch * 16,
                    ok ? v_head + row * v_token_stride + ch * 16 : v, ok);
      }
      if constexpr (per_key) {
        // Thread i < BK: key i's K scale; thread BK + i: its V scale (0 past the split).
        const int r = static_cast<int>(threadIdx.x) % BK;
        const bool is_v = static_cast<int>(threadIdx.x) >= BK, ok = r < valid;
        const float* from = is_v ? scales.v : scales.k;
        const std::int64_t at_scale =
            ok ? Scales::index(key_rows(at + r), key_rows.shift, kvh, kv_heads) : 0;
        cp_async_4(kscale_s + (is_v ? S * BK : 0) + buf * BK + r, from + at_scale, ok);
      }
    } else if constexpr (KeyRows::paged) {
      // Each 16-byte chunk's row through the page table (a row's K and V share the lookup).
      const T* k_head = k + kvh * k_head_stride;
      const T* v_head = v + kvh * v_head_stride;
#pragma unroll
      for (int c = static_cast<int>(threadIdx.x); c < BK * chunks; c += 128) {
        const int r = c / chunks, ch = c % chunks;
        const bool ok = r < valid;
        const std::int64_t row = ok ? key_rows(at + r) : 0;
        cp_async_16(sK + buf * BK * D + swizzle<D>(r, ch),
                    ok ? k_head + row * k_token_stride + ch * 8 : k, ok);
        cp_async_16(sV + buf * BK * D + swizzle<D>(r, ch),
                    ok ? v_head + row * v_token_stride + ch * 8 : v, ok);
      }
    } else {
      const std::int64_t row = key_rows(at);
      load_tile<BK, D, 128>(sK + buf * BK * D, k + kvh * k_head_stride + row * k_token_stride,
                            k_token_stride, valid);
      load_tile<BK, D, 128>(sV + buf * BK * D, v + kvh * v_head_stride + row * v_token_stride,
                            v_token_stride, valid);
    }
  };

  // The group's queries for this kv head, row r = token r / G, query head kvh * G + r % G (rows
  // past the group's zero-filled), with the first stages.
  for (int c = static_cast<int>(threadIdx.x); c < Rows * chunks; c += 128) {
    const int r = c / chunks, ch = c % chunks;
    const bool ok = r < rows;
    const T* src =
        ok ? q + (g.q_begin + r / group_size) * q_token_stride +
                 static_cast<std::int64_t>(kvh * group_size + r % group_size) * q_head_stride +
                 ch * 8
           : q;
    cp_async_16(sQ + swizzle<D>(r, ch), src, ok);
  }
#pragma unroll
  for (int t = 0; t < S - 1; ++t) {
    if (t < tiles) load_stage(t);
    cp_async_commit();
  }

  const std::uint32_t aQ = smem_address(sQ);
  const std::uint32_t aK = smem_address(quantized ? static_cast<void*>(tK) : sK),
                      aV = smem_address(quantized ? static_cast<void*>(tV) : sV);
  // The head's scales (an FP8 cache with a scale per kv head). With a scale per page, the
  // weights meet each value's scale over the largest finite one of the split's pages (`v_scale`;
  // 1 where none is above 0), which the output then takes: the fp16 weights stay at most 1.
  float k_scale = 1.0f, v_scale = 1.0f, v_over = 1.0f;
  if constexpr (std::is_same_v<Scales, head_scales>)
    k_scale = scales.k[kvh], v_scale = scales.v[kvh];
  if constexpr (per_key) {
    float top = 0.0f;
    if (keys > 0)
      for (std::int64_t page = (first >> key_rows.shift) + threadIdx.x;
           page <= (first + keys - 1) >> key_rows.shift; page += 128) {
        const float x = scales.v[static_cast<std::int64_t>(key_rows.table[page]) * kv_heads + kvh];
        if (x < __builtin_huge_valf()) top = fmaxf(top, x); // NaN and inf left to the products
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    if (lane == 0) qscale_s[warp] = top; // free until the first stage is in
    __syncthreads();
    top = fmaxf(fmaxf(qscale_s[0], qscale_s[1]), fmaxf(qscale_s[2], qscale_s[3]));
    if (top > 0.0f) v_scale = top, v_over = 1.0f / top;
  }
  std::uint32_t qf[KSteps][4];
  float acc[DTiles][4];
#pragma unroll
  for (int t = 0; t < DTiles; ++t)
    acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
  online_softmax<carrying_max> sm; // this thread's two rows
  // Each score's factor for this thread's two rows: the key scale of a head, and for bf16
  // queries in fp16 their row's power of two.
  float row_scale[2] = {k_scale, k_scale};

  for (int t = 0; t < tiles; ++t) {
    cp_async_wait<S - 2>();
    __syncthreads(); // stage t landed; every warp is done with the buffer refilled below
    if (t == 0) {
      if constexpr (scaled_q) {
        // bf16 queries to fp16 in place, each row times 2^-e with its largest finite magnitude
        // in [2^14, 2^15): exact but for elements below 2^-28 of it (each then within 2^-39 of it).
        // Two threads a row, half the row each.
        const int r = static_cast<int>(threadIdx.x) >> 1, half = static_cast<int>(threadIdx.x) & 1;
        float top = 0.0f;
        if (r < Rows)
          for (int ch = half * chunks / 2; ch < (half + 1) * chunks / 2; ++ch) {
            const uint4 x = *reinterpret_cast<const uint4*>(sQ + swizzle<D>(r, ch));
            const std::uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
              top = fmaxf(top, fmaxf(fabsf(unpack1<T>(w[i], 0)), fabsf(unpack1<T>(w[i], 1))));
          }
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
        const int e = top > 0.0f && top < __builtin_huge_valf() ? max(ilogbf(top) - 14, -100) : 0;
        const float down = ldexpf(1.0f, -e);
        if (r < Rows) {
          for (int ch = half * chunks / 2; ch < (half + 1) * chunks / 2; ++ch) {
            uint4* at = reinterpret_cast<uint4*>(sQ + swizzle<D>(r, ch));
            const uint4 x = *at;
            auto half2 = [&](std::uint32_t w) {
              return pack2<M>(unpack1<T>(w, 0) * down, unpack1<T>(w, 1) * down);
            };
            *at = uint4{half2(x.x), half2(x.y), half2(x.z), half2(x.w)};
          }
          if (half == 0) qscale_s[r] = ldexpf(1.0f, e);
        }
        __syncthreads();
        row_scale[0] *= qscale_s[wr * 16 + (lane >> 2)];
        row_scale[1] *= qscale_s[wr * 16 + (lane >> 2) + 8];
      }
      // The queries to registers before stage S - 1 overwrites them.
#pragma unroll
      for (int kk = 0; kk < KSteps; ++kk)
        ldmatrix_x4(qf[kk], aQ + elem * swizzle<D>(wr * 16 + (lane & 15), kk * 2 + (lane >> 4)));
      __syncthreads();
    }
    if (t + S - 1 < tiles) load_stage(t + S - 1);
    cp_async_commit();
    if constexpr (quantized) {
      // Stage t's bytes to the fp16 tiles (the warps are done with them: the barrier above). A
      // thread converts 16 elements to two swizzled chunks, storing first the one that spreads
      // a quarter warp over distinct banks. With one row tile each warp converts the keys it
      // alone reads (a warp's barrier); else the block converts the stage.
      const Cache* fK = sK + (t % S) * BK * D;
      const Cache* fV = sV + (t % S) * BK * D;
      auto convert = [&](int c) {
        const int r = c / bytes_chunks, ch = c % bytes_chunks, a = (ch >> 2) & 1;
        auto one = [&](const Cache* from, M* to) {
          const uint4 x = *reinterpret_cast<const uint4*>(from + r * D + ch * 16);
          const uint4 lo{e4m3x2_to<M>(x.x), e4m3x2_to<M>(x.x >> 16), e4m3x2_to<M>(x.y),
                         e4m3x2_to<M>(x.y >> 16)};
          const uint4 hi{e4m3x2_to<M>(x.z), e4m3x2_to<M>(x.z >> 16), e4m3x2_to<M>(x.w),
                         e4m3x2_to<M>(x.w >> 16)};
          *reinterpret_cast<uint4*>(to + swizzle<D>(r, 2 * ch + a)) = a ? hi : lo;
          *reinterpret_cast<uint4*>(to + swizzle<D>(r, 2 * ch + 1 - a)) = a ? lo : hi;
        };
        one(fK, tK);
        one(fV, tV);
      };
      if constexpr (KeyWarps == 4) {
#pragma unroll
        for (int c = lane; c < KW * bytes_chunks; c += 32)
          convert(wk * KW * bytes_chunks + c);
        __syncwarp();
      } else {
#pragma unroll
        for (int c = static_cast<int>(threadIdx.x); c < BK * bytes_chunks; c += 128)
          convert(c);
        __syncthreads();
      }
    }
    const std::uint32_t cK = quantized ? aK : aK + (t % S) * (BK * D * elem);
    const std::uint32_t cV = quantized ? aV : aV + (t % S) * (BK * D * elem);

    // S = Q K^T for this warp's row tile and its KW keys of the stage.
    float s[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KSteps; ++kk)
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        std::uint32_t kb[4];
        const int krow = wk * KW + np * 16 + ((lane >> 4) << 3) + (lane & 7);
        ldmatrix_x4(kb, cK + elem * swizzle<D>(krow, kk * 2 + ((lane >> 3) & 1)));
        mma_16816<M>(s[2 * np], qf[kk], kb[0], kb[1]);
        mma_16816<M>(s[2 * np + 1], qf[kk], kb[2], kb[3]);
      }
    // An FP8 cache's key scales, each score by its key's (NaN and inf carried as they come).
    const float* kscale_t = kscale_s + (t % S) * BK;
    const float* vscale_t = kscale_t + S * BK;
    if constexpr (quantized) {
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[n][e] *= per_key
                         ? row_scale[e >> 1] * kscale_t[wk * KW + n * 8 + 2 * (lane & 3) + (e & 1)]
                         : row_scale[e >> 1];
    }
    // Keys past the split (the last stage only) see nothing.
    const std::int64_t left = keys - static_cast<std::int64_t>(t) * BK;
    if (left < BK) {
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (wk * KW + n * 8 + 2 * (lane & 3) + (e & 1) >= left) s[n][e] = neg_inf;
    }

    // Online softmax (NaN carried: a NaN score stays NaN in m, l and o); P is packed to 16-bit
    // pairs, two score tiles making one A fragment of P V.
    std::uint32_t pa[NT / 2][4];
    float corr[2];
    sm.template update<NT>([&](int n, int e) { return s[n][e]; }, scale_log2, corr,
                           [&](int n, float p0, float p1, float p2, float p3) {
                             if constexpr (per_key) {
                               // Each weight times its value's scale, the sum of weights unscaled.
                               const int col = wk * KW + n * 8 + 2 * (lane & 3);
                               const float s0 = vscale_t[col] * v_over,
                                           s1 = vscale_t[col + 1] * v_over;
                               pa[n / 2][(n & 1) * 2] = pack2<M>(p0 * s0, p1 * s1);
                               pa[n / 2][(n & 1) * 2 + 1] = pack2<M>(p2 * s0, p3 * s1);
                             } else {
                               pa[n / 2][(n & 1) * 2] = pack2<M>(p0, p1);
                               pa[n / 2][(n & 1) * 2 + 1] = pack2<M>(p2, p3);
                             }
                           });
    scale_rows<DTiles>([&](int d, int e) -> float& { return acc[d][e]; }, corr);

    // O += P V over the warp's keys.
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk)
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        std::uint32_t vb[4];
        const int vrow = wk * KW + kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7);
        ldmatrix_x4_trans(vb, cV + elem * swizzle<D>(vrow, dp * 2 + (lane >> 4)));
        mma_16816<M>(acc[2 * dp], pa[kk], vb[0], vb[1]);
        mma_16816<M>(acc[2 * dp + 1], pa[kk], vb[2], vb[3]);
      }
  }
  cp_async_wait_all();
  __syncthreads(); // the stage buffers are free: the warps' states meet there
  if constexpr (quantized) {
#pragma unroll
    for (int d = 0; d < DTiles; ++d)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        acc[d][e] *= v_scale;
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    sm.l[r] += __shfl_xor_sync(0xffffffffu, sm.l[r], 1);
    sm.l[r] += __shfl_xor_sync(0xffffffffu, sm.l[r], 2);
  }
  float* out = scratch + (static_cast<std::int64_t>(item.slot) * kv_heads + kvh) *
                             decode_partial_floats(D, Rows);
  if constexpr (KeyWarps == 1) {
    // One warp per row tile: its state is the split's.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wr * 16 + (lane >> 2) + r * 8;
      if (row >= rows) continue;
#pragma unroll
      for (int d = 0; d < DTiles; ++d)
        *reinterpret_cast<float2*>(out + row * D + d * 8 + 2 * (lane & 3)) =
            make_float2(acc[d][2 * r], acc[d][2 * r + 1]);
      if ((lane & 3) == 0) out[Rows * D + row] = sm.m[r], out[Rows * (D + 1) + row] = sm.l[r];
    }
  } else {
    float* o_s = reinterpret_cast<float*>(decode_smem); // [KeyWarps][Rows][D]
    float* m_s = o_s + KeyWarps * Rows * D;             // [KeyWarps][Rows]
    float* l_s = m_s + KeyWarps * Rows;                 // [KeyWarps][Rows]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wr * 16 + (lane >> 2) + r * 8;
#pragma unroll
      for (int d = 0; d < DTiles; ++d)
        *reinterpret_cast<float2*>(o_s + (wk * Rows + row) * D + d * 8 + 2 * (lane & 3)) =
            make_float2(acc[d][2 * r], acc[d][2 * r + 1]);
      if ((lane & 3) == 0) m_s[wk * Rows + row] = sm.m[r], l_s[wk * Rows + row] = sm.l[r];
    }
    __syncthreads();
    for (int i = static_cast<int>(threadIdx.x); i < rows * D; i += 128) {
      const int row = i / D, e = i % D;
      float top = neg_inf;
#pragma unroll
      for (int w = 0; w < KeyWarps; ++w)
        top = nan_max(top, m_s[w * Rows + row]);
      float o_sum = 0.0f, l_sum = 0.0f;
#pragma unroll
      for (int w = 0; w < KeyWarps; ++w) {
        const float mw = m_s[w * Rows + row];
        const float f = mw == neg_inf ? 0.0f : fast_exp2(mw - top);
        o_sum += o_s[(w * Rows + row) * D + e] * f;
        l_sum += l_s[w * Rows + row] * f;
      }
      out[row * D + e] = o_sum;
      if (e == 0) out[Rows * D + row] = top, out[Rows * (D + 1) + row] = l_sum;
    }
  }
}

//! One thread block per (group, kv head): the group's units in order (partials of `partial_rows`
//! rows), merged per (row, column), then into the state: `fresh` writes it, else the block merges
//! by `merge_into`. Each row's factors are decided once (phase 1) before any of its columns changes
//! (phase 2).
template <int HeadDim>
__global__ void __launch_bounds__(256)
    decode_combine_kernel(const block_group* groups, const std::int32_t* first_slot, int group_size,
                          int partial_rows, const float* scratch, float* o, float* lse, float* sum,
                          std::int64_t tokens, bool fresh) {
  constexpr float ln2 = 0.6931471805599453f, inf = __builtin_huge_valf();
  __shared__ float top_s[decode_max_rows], inv_s[decode_max_rows], old_s[decode_max_rows],
      block_s[decode_max_rows];
  const int gi = static_cast<int>(blockIdx.x), kvh = static_cast<int>(blockIdx.y);
  const int kv_heads = static_cast<int>(gridDim.y);
  const block_group g = groups[gi];
  const int rows = static_cast<int>(g.q_count) * group_size;
  const int s0 = first_slot[gi], s1 = first_slot[gi + 1];
  auto at = [&](int s) {
    return scratch + (static_cast<std::int64_t>(s) * kv_heads + kvh) *
                         decode_partial_floats(HeadDim, partial_rows);
  };
  auto state_row = [&](int r) {
    return static_cast<std::int64_t>(kvh * group_size + r % group_size) * tokens + g.q_begin +
           r / group_size;
  };
  if (static_cast<int>(threadIdx.x) < rows) {
    const int r = static_cast<int>(threadIdx.x);
    float top = -inf;
    for (int s = s0; s < s1; ++s)
      top = nan_max(top, at(s)[partial_rows * HeadDim + r]);
    float weight = 0.0f;
    if (top != -inf)
      for (int s = s0; s < s1; ++s) {
        const float mx = at(s)[partial_rows * HeadDim + r];
        weight += mx == -inf ? 0.0f : at(s)[partial_rows * (HeadDim + 1) + r] * fast_exp2(mx - top);
      }
    // The block's lse (natural log) for this row, and how it meets the state.
    const float block_lse = saw_key(weight) ? (top + log2f(weight)) * ln2 : -inf;
    const std::int64_t row = state_row(r);
    row_merge m{0.0f, saw_key(weight) ? 1.0f : 0.0f, block_lse, true};
    if (!fresh) m = merge_into(lse[row], block_lse);
    top_s[r] = top;
    inv_s[r] = inverse_sum(weight);
    old_s[r] = m.old;
    block_s[r] = m.block;
    lse[row] = m.new_ref;
    sum[row] = fresh ? m.block : sum[row] * m.old + m.block;
  }
  __syncthreads();
  for (int i = static_cast<int>(threadIdx.x); i < rows * HeadDim; i += 256) {
    const int r = i / HeadDim, e = i % HeadDim;
    float acc = 0.0f;
    if (top_s[r] != -inf)
      for (int s = s0; s < s1; ++s) {
        const float* part = at(s);
        const float mx = part[partial_rows * HeadDim + r];
        acc += mx == -inf ? 0.0f : part[r * HeadDim + e] * fast_exp2(mx - top_s[r]);
      }
    float* orow = o + state_row(r) * HeadDim;
    const float block_o = acc * inv_s[r];
    orow[e] = fresh ? block_o : orow[e] * old_s[r] + block_o * block_s[r];
  }
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
