#pragma once
//! \file
//! The Hopper (sm_90a) block-backward kernels: the work split, walks and predicate of the
//! mma.sync ones (backward_kernel_tc.cuh), with every product on warpgroup MMA. A thread block is
//! `WG` warpgroups (128 threads each, 16 rows a warp), each owning 64 key columns (dK/dV) or 64
//! query rows (dQ): with one, two blocks share an SM, so one's elementwise work runs while the
//! other's products are on the tensor cores; with two, the warpgroups share the tiles they walk
//! (Q/dO for dK/dV, K/V for dQ), copied once for twice the work, and interleave the same way.
//! Both run in one grid (`backward_sm90_kernel`): the dK/dV blocks, then the dQ blocks.
//!
//! Every backward product has one of the forward kernel's two wgmma forms:
//! - S^T = K Q^T and dP^T = V dO^T (dK/dV block), S = Q K^T and dP = dO V^T (dQ block): A and
//!   B from shared memory, both read K-major (the head dimension is the k dimension);
//! - dV += P^T dO, dK += dS^T Q, dQ += dS K: A from registers (P^T, dS^T, dS are accumulators,
//!   packed to 16 bits they are wgmma's A fragment), B read N-major from shared memory (its
//!   rows are the k dimension), as V in the forward's P V.
//! Tiles are 64-column panels in the 128-byte swizzled layout, copied with cp.async by the whole
//! warpgroup (`produce_tile`) and double-buffered; deterministic like the other kernels (one
//! writer per accumulator element, no atomics).

#include <ringattn/detail/backward_kernel_tc.cuh>
#include <ringattn/detail/forward_kernel_sm90.cuh>
#include <ringattn/detail/wgmma.cuh>

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

//! Dynamic shared memory of the Hopper backward kernel with `WG` warpgroups (1, 2: two fixed
//! [64 WG, D] tiles, two double-buffered [64, D] ones, two double-buffered 64-float vectors; 3: the
//! larger of its two block kinds), plus 1 KB to align the swizzle atoms.
//! Stages of Q/dO tiles of the warp-specialised (three-warpgroup) dK/dV blocks.
inline constexpr int sm90_backward_stages = 3;
template <class T, int D, int WG>
constexpr int sm90_backward_smem_bytes() {
  constexpr int R = tc_backward_rows, E = static_cast<int>(sizeof(T));
  if constexpr (WG == 3) {
    // dK/dV: K, V of 128 keys and the stages' Q, dO, lse, delta; dQ: as with two warpgroups.
    constexpr int dkdv = 4 * R * D * E + sm90_backward_stages * (2 * R * D * E + 2 * R * 4);
    constexpr int dq = 8 * R * D * E + 4 * R * 4;
    return (dkdv > dq ? dkdv : dq) + 1024;
  } else {
    return (2 * WG + 4) * R * D * E + 4 * R * 4 + 1024;
  }
}

namespace sm90_backward {
constexpr int R = tc_backward_rows;
// Descriptor of k-step `kk` of 64 rows (M or N) of a [Rows, D] panelled tile read K-major;
// `tile` is the address of the first of those rows in the first panel.
template <int Rows = R>
__device__ __forceinline__ std::uint64_t k_major(std::uint32_t tile, int kk) {
  return sw128_descriptor(tile + (kk >> 2) * (Rows * 128) + (kk & 3) * 32, 16);
}
// Descriptor of k-step `kk` (16 rows) of a [64, D] panelled tile read N-major (rows = K).
__device__ __forceinline__ std::uint64_t n_major(std::uint32_t tile, int kk) {
  return sw128_descriptor(tile + kk * (16 * 128), R * 128);
}
// Accumulator (m64n64, 32 registers) -> the four A fragments of a k = 64 product.
template <class T>
__device__ __forceinline__ void pack(const float (&c)[32], std::uint32_t (&a)[4][4]) {
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    a[t / 2][(t & 1) * 2] = pack2<T>(c[4 * t], c[4 * t + 1]);
    a[t / 2][(t & 1) * 2 + 1] = pack2<T>(c[4 * t + 2], c[4 * t + 3]);
  }
}
// c = A B^T over k = D: A's and B's k-steps from descriptors (A: 64 rows of a [ARows, D] tile).
template <class T, int D, int ARows = R>
__device__ __forceinline__ void product_ss(float (&c)[32], std::uint32_t a, std::uint32_t b) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<T, 0>(c, k_major<ARows>(a, kk), k_major(b, kk), kk > 0);
}
// c += A B over k = 64: A in registers, B's rows the k dimension.
template <class T, int N>
__device__ __forceinline__ void product_rs(float (&c)[N], const std::uint32_t (&a)[4][4],
                                           std::uint32_t b) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
    wgmma_rs<T, 1>(c, a[kk], n_major(b, kk), 1);
}
// Adds this warp's 16 rows of an m64nD accumulator to rows [warp_row, ...) of a dense fp32
// matrix (rows >= valid are skipped).
template <int D>
__device__ __forceinline__ void add_rows(float* base, std::int64_t row_stride, int warp_row,
                                         int valid, const float (&c)[D / 2], int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp_row + (lane >> 2) + r * 8;
    if (row >= valid) continue;
    float* dst = base + row * row_stride + (lane & 3) * 2;
#pragma unroll
    for (int t = 0; t < D / 8; ++t) {
      float2 x = *reinterpret_cast<float2*>(dst + t * 8);
      x.x += c[4 * t + 2 * r];
      x.y += c[4 * t + 2 * r + 1];
      *reinterpret_cast<float2*>(dst + t * 8) = x;
    }
  }
}
} // namespace sm90_backward

//! dK, dV of 64 WG key columns of one kv head: thread block `b` of the dK/dV blocks takes key
//! tile b / kv_heads (the tiles are heaviest first) and kv head b % kv_heads.
template <class T, int D, int WG>
__device__ __forceinline__ void dkdv_sm90(const tc_backward_params<T>& tp, std::int64_t b) {
  using namespace sm90_backward;
  constexpr int BK = R * WG; // key columns of the block
  constexpr std::uint32_t tile = R * D * sizeof(T), kv_tile = BK * D * sizeof(T);
  constexpr float log2e = 1.4426950408889634f;
  static_assert(sizeof(T) == 2 && (D == 64 || D == 128) && (WG == 1 || WG == 2));
  const backward_params<T>& p = tp.b;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const std::uint32_t raw = smem_address(smem_raw);
  const std::uint32_t pad = (1024u - (raw & 1023u)) & 1023u; // swizzle atoms start 1 KB aligned
  const std::uint32_t aK = raw + pad, aV = aK + kv_tile, aQ = aV + kv_tile, aO = aQ + 2 * tile;
  // lse * log2(e) and delta of the step's rows, two buffers each.
  float* sL = reinterpret_cast<float*>(smem_raw + pad + 2 * kv_tile + 4 * tile);
  float* sD = sL + 2 * R;
  // Warpgroup (broadcast from lane 0, so the compiler knows it is warp-uniform), its thread.
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
  const int tid = static_cast<int>(threadIdx.x & 127), warp = tid >> 5, lane = tid & 31,
            kvh = static_cast<int>(b % p.kv_heads);
  const key_tile kt = tp.key_tiles[b / p.kv_heads];
  const key_interval in = p.intervals[kt.interval];
  const int cols = static_cast<int>(in.end - kt.begin < BK ? in.end - kt.begin : BK);

  // Copies: K and Q by warpgroup 0, V and dO by the last one (both by one when WG = 1).
  const bool first = wg == 0, last = wg == WG - 1;
  if (first)
    produce_tile<BK, D>(aK, p.k + kt.begin * p.k_token_stride + kvh * p.k_head_stride,
                        p.k_token_stride, cols, tid);
  if (last)
    produce_tile<BK, D>(aV, p.v + kt.begin * p.v_token_stride + kvh * p.v_head_stride,
                        p.v_token_stride, cols, tid);
  // Copies step `w`'s Q/dO tiles (cp.async) and lse/delta (plain stores) into buffer `buf`.
  auto load_step = [&](const cover_walk<T>& w, int buf) {
    const block_group& g = p.groups[w.cover().group];
    const std::int64_t q_count = g.q_count, row0 = g.q_begin + w.i0;
    const int rows = static_cast<int>(q_count - w.i0 < R ? q_count - w.i0 : R);
    if (first)
      produce_tile<R, D>(aQ + buf * tile, p.q + row0 * p.q_token_stride + w.h * p.q_head_stride,
                         p.q_token_stride, rows, tid);
    if (last)
      produce_tile<R, D>(aO + buf * tile,
                         p.dout + row0 * p.do_token_stride + w.h * p.do_head_stride,
                         p.do_token_stride, rows, tid);
    if (first && tid < R) {
      sL[buf * R + tid] = tid < rows ? p.lse[w.h * p.q_tokens + row0 + tid] * log2e : 0.0f;
      sD[buf * R + tid] = tid < rows ? p.delta[w.h * p.q_tokens + row0 + tid] : 0.0f;
    }
  };
  cover_walk<T> w(p, in, kt.begin, cols, kvh);
  if (!w.done()) load_step(w, 0);
  cp_async_commit();

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i)
    dk[i] = dv[i] = 0.0f;
  const float scale_log2 = p.scale * log2e;

  for (int step = 0; !w.done(); ++step) {
    cp_async_wait_all();
    fence_proxy_async(); // this thread's copies before the warpgroup's wgmma reads
    __syncthreads();     // every copy landed; every product on the buffer refilled below is done
    const int buf = step & 1;
    const auto st = w.current();
    const auto [kb, i0, jl0, rows] = st;
    w.advance(load_step, buf ^ 1);
    const std::uint32_t cQ = aQ + buf * tile, cO = aO + buf * tile;
    const float* cL = sL + buf * R;
    const float* cD = sD + buf * R;

    // Two product groups in flight at a time: P^T is computed while dP^T is on the tensor cores,
    // dS^T while dV's product is.
    // This warpgroup's 64 key rows of K and V (rows 64 wg.. of the block's [BK, D] tiles).
    const std::uint32_t myK = aK + wg * (R * 128), myV = aV + wg * (R * 128);
    float s[32], dp[32];
    wgmma_fence();
    product_ss<T, D, BK>(s, myK, cQ); // S^T = K Q^T
    wgmma_commit();
    product_ss<T, D, BK>(dp, myV, cO); // dP^T = V dO^T
    wgmma_commit();
    wgmma_wait<1>();
    fence_operands(s);
    // The tile lies wholly in the band (its corners do) and has no ragged edge: no predicate.
    const bool whole = st.whole(cols, BK);
    // P^T; rows are keys (this warp's 16), columns queries.
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = wg * R + warp * 16 + (lane >> 2) + (e >= 2 ? 8 : 0);
        const int q = t * 8 + (lane & 3) * 2 + (e & 1);
        const bool seen = whole || (key < cols && q < rows && kb.mask.sees(i0 + q, jl0 + key));
        s[4 * t + e] = seen ? fast_exp2(fmaf(s[4 * t + e], scale_log2, -cL[q])) : 0.0f;
      }
    std::uint32_t pa[4][4], da[4][4];
    pack<T>(s, pa);
    fence_operands(s);
    fence_operands(pa);
    wgmma_wait<0>();
    fence_operands(dp);
    fence_operands(dv);
    wgmma_fence();
    product_rs<T>(dv, pa, cO); // dV += P^T dO
    wgmma_commit();
    // dS^T (P^T is 0 where the predicate said no).
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = t * 8 + (lane & 3) * 2 + (e & 1);
        dp[4 * t + e] = s[4 * t + e] * (dp[4 * t + e] - cD[q]) * p.scale;
      }
    pack<T>(dp, da);
    fence_operands(da);
    fence_operands(dk);
    wgmma_fence();
    product_rs<T>(dk, da, cQ); // dK += dS^T Q
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(pa);
    fence_operands(da);
    fence_operands(dv);
    fence_operands(dk);
  }
  cp_async_wait_all(); // (a block with no cover still waits for its K/V copies)
  const std::int64_t stride = static_cast<std::int64_t>(p.kv_heads) * D;
  add_rows<D>(p.dk + kt.begin * stride + kvh * D, stride, wg * R + warp * 16, cols, dk, lane);
  add_rows<D>(p.dv + kt.begin * stride + kvh * D, stride, wg * R + warp * 16, cols, dv, lane);
}

//! dK, dV of 128 key columns of one kv head, warp-specialised (three warpgroups): warpgroup 0
//! copies (24 registers a thread) K and V once, then each step's Q, dO, lse and delta into one of
//! `sm90_backward_stages` stages; `full[stage]` (an mbarrier its cp.async completions arrive on)
//! says a step's tiles landed, `empty[stage]` (both consumers arrive) that they may be
//! overwritten. Warpgroups 1 and 2 (240 registers) own 64 key columns each and compute as in
//! `dkdv_sm90`, but wait only for their step's tiles: no block barrier in the walk, so one
//! consumer's elementwise work can run while the other's products are on the tensor cores.
template <class T, int D>
__device__ __forceinline__ void dkdv_sm90_ws(const tc_backward_params<T>& tp, std::int64_t b) {
  using namespace sm90_backward;
  constexpr int BK = 2 * R, S = sm90_backward_stages;
  constexpr std::uint32_t tile = R * D * sizeof(T), kv_tile = BK * D * sizeof(T),
                          stage_bytes = 2 * tile;
  constexpr float log2e = 1.4426950408889634f;
  static_assert(sizeof(T) == 2 && (D == 64 || D == 128));
  const backward_params<T>& p = tp.b;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ alignas(8) std::uint64_t bars[2 * S + 1]; // full[S], empty[S], K/V landed
  const std::uint32_t raw = smem_address(smem_raw);
  const std::uint32_t pad = (1024u - (raw & 1023u)) & 1023u; // swizzle atoms start 1 KB aligned
  // K, V, then stage s: Q at aS + s * stage_bytes, dO after it; then lse[S][64], delta[S][64].
  const std::uint32_t aK = raw + pad, aV = aK + kv_tile, aS = aV + kv_tile;
  float* sL = reinterpret_cast<float*>(smem_raw + pad + 2 * kv_tile + S * stage_bytes);
  float* sD = sL + S * R;
  const std::uint32_t full0 = smem_address(&bars[0]), empty0 = smem_address(&bars[S]),
                      kv_full = smem_address(&bars[2 * S]);
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
  const int kvh = static_cast<int>(b % p.kv_heads);
  const key_tile kt = tp.key_tiles[b / p.kv_heads];
  const key_interval in = p.intervals[kt.interval];
  const int cols = static_cast<int>(in.end - kt.begin < BK ? in.end - kt.begin : BK);
  if (threadIdx.x == 0) {
    for (int st = 0; st < S; ++st) {
      mbarrier_init(full0 + 8 * st, 128);  // every producer thread's copies
      mbarrier_init(empty0 + 8 * st, 256); // every consumer thread
    }
    mbarrier_init(kv_full, 128);
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer: K, V; then step n's tiles into stage n % S once step n - S released it.
    setmaxnreg_dec<24>();
    const int tid = static_cast<int>(threadIdx.x);
    produce_tile<BK, D>(aK, p.k + kt.begin * p.k_token_stride + kvh * p.k_head_stride,
                        p.k_token_stride, cols, tid);
    produce_tile<BK, D>(aV, p.v + kt.begin * p.v_token_stride + kvh * p.v_head_stride,
                        p.v_token_stride, cols, tid);
    cp_async_mbarrier_arrive(kv_full);
    cover_walk<T> w(p, in, kt.begin, cols, kvh);
    for (int n = 0; !w.done(); ++n, w.next()) {
      const int stage = n % S;
      if (n >= S) mbarrier_wait(empty0 + 8 * stage, ((n / S) - 1) & 1);
      const block_group& g = p.groups[w.cover().group];
      const std::int64_t row0 = g.q_begin + w.i0;
      const int rows = static_cast<int>(g.q_count - w.i0 < R ? g.q_count - w.i0 : R);
      const std::uint32_t q = aS + stage * stage_bytes;
      produce_tile<R, D>(q, p.q + row0 * p.q_token_stride + w.h * p.q_head_stride,
                         p.q_token_stride, rows, tid);
      produce_tile<R, D>(q + tile, p.dout + row0 * p.do_token_stride + w.h * p.do_head_stride,
                         p.do_token_stride, rows, tid);
      // lse (threads 0..63) and delta (64..127) of the rows; zero past the tile's last row.
      const int r = tid & (R - 1);
      const bool ok = r < rows;
      const float* src = (tid < R ? p.lse : p.delta) + w.h * p.q_tokens + row0 + (ok ? r : 0);
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                       smem_address((tid < R ? sL : sD) + stage * R + r)),
                   "l"(src), "r"(ok ? 4 : 0));
      cp_async_mbarrier_arrive(full0 + 8 * stage);
    }
    cp_async_wait_all();
    return;
  }

  // ---- consumers
  setmaxnreg_inc<240>();
  const int cw = wg - 1; // consumer warpgroup 0 or 1: key columns 64 cw..
  const int tid = static_cast<int>(threadIdx.x & 127), warp = tid >> 5, lane = tid & 31;
  cover_walk<T> w(p, in, kt.begin, cols, kvh);
  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i)
    dk[i] = dv[i] = 0.0f;
  const float scale_log2 = p.scale * log2e;
  const std::uint32_t myK = aK + cw * (R * 128), myV = aV + cw * (R * 128);
  if (!w.done()) mbarrier_wait(kv_full, 0);
  for (int n = 0; !w.done(); ++n, w.next()) {
    const int stage = n % S;
    mbarrier_wait(full0 + 8 * stage, (n / S) & 1);
    fence_proxy_async(); // the step's cp.async writes before this thread's wgmma reads
    const auto st = w.current();
    const auto [kb, i0, jl0, rows] = st;
    const std::uint32_t cQ = aS + stage * stage_bytes, cO = cQ + tile;
    const float* cL = sL + stage * R;
    const float* cD = sD + stage * R;
    float s[32], dp[32];
    wgmma_fence();
    product_ss<T, D, BK>(s, myK, cQ); // S^T = K Q^T
    wgmma_commit();
    product_ss<T, D, BK>(dp, myV, cO); // dP^T = V dO^T
    wgmma_commit();
    wgmma_wait<1>();
    fence_operands(s);
    const bool whole = st.whole(cols, BK);
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = cw * R + warp * 16 + (lane >> 2) + (e >= 2 ? 8 : 0);
        const int q = t * 8 + (lane & 3) * 2 + (e & 1);
        const bool seen = whole || (key < cols && q < rows && kb.mask.sees(i0 + q, jl0 + key));
        s[4 * t + e] = seen ? fast_exp2(fmaf(s[4 * t + e], scale_log2, -cL[q] * log2e)) : 0.0f;
      }
    std::uint32_t pa[4][4], da[4][4];
    pack<T>(s, pa);
    fence_operands(s);
    fence_operands(pa);
    wgmma_wait<0>();
    fence_operands(dp);
    fence_operands(dv);
    wgmma_fence();
    product_rs<T>(dv, pa, cO); // dV += P^T dO
    wgmma_commit();
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = t * 8 + (lane & 3) * 2 + (e & 1);
        dp[4 * t + e] = s[4 * t + e] * (dp[4 * t + e] - cD[q]) * p.scale;
      }
    pack<T>(dp, da);
    fence_operands(da);
    fence_operands(dk);
    wgmma_fence();
    product_rs<T>(dk, da, cQ); // dK += dS^T Q
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(pa);
    fence_operands(da);
    fence_operands(dv);
    fence_operands(dk);
    mbarrier_arrive(empty0 + 8 * stage); // the step's tiles fully read
  }
  const std::int64_t stride = static_cast<std::int64_t>(p.kv_heads) * D;
  add_rows<D>(p.dk + kt.begin * stride + kvh * D, stride, cw * R + warp * 16, cols, dk, lane);
  add_rows<D>(p.dv + kt.begin * stride + kvh * D, stride, cw * R + warp * 16, cols, dv, lane);
}

//! dQ of 64 WG query rows of one query head: thread block `b` of the dQ blocks takes row tile
//! b / q_heads (heaviest first) and query head b % q_heads.
template <class T, int D, int WG, bool Producer = false>
__device__ __forceinline__ void dq_sm90(const tc_backward_params<T>& tp, std::int64_t b) {
  using namespace sm90_backward;
  constexpr int BQ = R * WG; // query rows of the block
  constexpr std::uint32_t tile = R * D * sizeof(T), q_tile = BQ * D * sizeof(T);
  constexpr float log2e = 1.4426950408889634f, neg_inf = -__builtin_huge_valf();
  static_assert(sizeof(T) == 2 && (D == 64 || D == 128) && (WG == 1 || WG == 2));
  const backward_params<T>& p = tp.b;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const std::uint32_t raw = smem_address(smem_raw);
  const std::uint32_t pad = (1024u - (raw & 1023u)) & 1023u;
  const std::uint32_t aQ = raw + pad, aO = aQ + q_tile, aK = aO + q_tile, aV = aK + 2 * tile;
  // Warpgroup among the block's (after a producer warpgroup's, which takes no part here).
  const int wg =
      __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7) - (Producer ? 1 : 0), 0);
  const int tid = static_cast<int>(threadIdx.x & 127), warp = tid >> 5, lane = tid & 31,
            h = static_cast<int>(b % p.q_heads), kvh = h / p.group_size;
  const work_tile wt = tp.row_tiles[b / p.q_heads];
  const block_group g = p.groups[wt.group];
  const std::int64_t i0 = wt.row_begin, row0 = g.q_begin + i0;
  const int rows = static_cast<int>(g.q_count - i0 < BQ ? g.q_count - i0 : BQ);
  const kv_walk<R> walk(g, i0, rows);
  // Copies: Q and K by warpgroup 0, dO and V by the last one (both by one when WG = 1).
  const bool first = wg == 0, last = wg == WG - 1;
  // Copies K/V tile `it` of the walk into buffer `buf`.
  auto load_kv = [&](int it, int buf) {
    bool b;
    std::int64_t j;
    walk.tile(it, b, j);
    const std::int64_t key0 = walk.begin(b) + j * R;
    if (first)
      produce_tile<R, D>(aK + buf * tile, p.k + key0 * p.k_token_stride + kvh * p.k_head_stride,
                         p.k_token_stride, walk.valid(b, j), tid);
    if (last)
      produce_tile<R, D>(aV + buf * tile, p.v + key0 * p.v_token_stride + kvh * p.v_head_stride,
                         p.v_token_stride, walk.valid(b, j), tid);
  };
  if (first)
    produce_tile<BQ, D>(aQ, p.q + row0 * p.q_token_stride + h * p.q_head_stride, p.q_token_stride,
                        rows, tid);
  if (last)
    produce_tile<BQ, D>(aO, p.dout + row0 * p.do_token_stride + h * p.do_head_stride,
                        p.do_token_stride, rows, tid);
  if (walk.total > 0) load_kv(0, 0);
  cp_async_commit();
  // This lane's two rows: lse (log2 units) and delta; rows past the tile or with no key: none.
  float lrow[2], drow[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int x = wg * R + warp * 16 + (lane >> 2) + r * 8;
    const bool ok = x < rows;
    const float l = ok ? p.lse[h * p.q_tokens + row0 + x] : neg_inf;
    lrow[r] = l == neg_inf ? __builtin_huge_valf() : l * log2e; // +inf: every p is 0
    drow[r] = ok ? p.delta[h * p.q_tokens + row0 + x] : 0.0f;
  }
  const float scale_log2 = p.scale * log2e;
  float dq[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i)
    dq[i] = 0.0f;
  for (int it = 0; it < walk.total; ++it) {
    cp_async_wait_all();
    fence_proxy_async();
    // Tile `it` landed; every product on the buffer refilled below is done.
    if constexpr (Producer)
      named_barrier_sync<128 * WG>(1);
    else
      __syncthreads();
    if (it + 1 < walk.total) load_kv(it + 1, (it + 1) & 1);
    cp_async_commit();
    bool b;
    std::int64_t j;
    walk.tile(it, b, j);
    const std::uint32_t cK = aK + (it & 1) * tile, cV = aV + (it & 1) * tile;
    // P is computed while dP is on the tensor cores.
    float s[32], dp[32];
    wgmma_fence();
    product_ss<T, D, BQ>(s, aQ + wg * (R * 128), cK); // S = Q K^T (this warpgroup's rows)
    wgmma_commit();
    product_ss<T, D, BQ>(dp, aO + wg * (R * 128), cV); // dP = dO V^T
    wgmma_commit();
    wgmma_wait<1>();
    fence_operands(s);
    const band bd = walk.mask(b);
    const std::int64_t count = walk.count(b);
    // Rows past the tile have lrow = +inf (p = 0); only band edges and a ragged last tile need
    // the predicate.
    const bool masked = walk.needs_mask(b, j);
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >= 2 ? 1 : 0;
        const std::int64_t i = i0 + wg * R + warp * 16 + (lane >> 2) + r * 8;
        const std::int64_t col = j * R + t * 8 + (lane & 3) * 2 + (e & 1);
        const bool seen = !masked || (col < count && bd.sees(i, col));
        s[4 * t + e] = seen ? fast_exp2(fmaf(s[4 * t + e], scale_log2, -lrow[r])) : 0.0f;
      }
    fence_operands(s);
    wgmma_wait<0>();
    fence_operands(dp);
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dp[4 * t + e] = s[4 * t + e] * (dp[4 * t + e] - drow[e >= 2 ? 1 : 0]) * p.scale;
    std::uint32_t da[4][4];
    pack<T>(dp, da);
    fence_operands(dq);
    fence_operands(da);
    wgmma_fence();
    product_rs<T>(dq, da, cK); // dQ += dS K
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(dq);
  }
  cp_async_wait_all();
  const std::int64_t stride = static_cast<std::int64_t>(p.q_heads) * D;
  add_rows<D>(p.dq + row0 * stride + h * D, stride, wg * R + warp * 16, rows, dq, lane);
}

//! The whole Hopper block backward in one launch: the first key_tile_count * kv_heads thread
//! blocks are dK/dV blocks, the next row_tile_count * q_heads dQ blocks. One grid, both lists
//! heaviest first, so the light dQ blocks fill the SMs the dK/dV blocks leave at their tail
//! instead of a second launch's waves starting behind the first's last block.
template <class T, int D, int WG>
__global__ void __launch_bounds__(128 * WG, WG == 1 ? 2 : 1)
    backward_sm90_kernel(tc_backward_params<T> tp) {
#if RINGATTN_WGMMA_ENABLED
  const std::int64_t b = blockIdx.x, dkdv_blocks = tp.key_tile_count * tp.b.kv_heads;
  if constexpr (WG == 3) {
    if (b < dkdv_blocks) {
      dkdv_sm90_ws<T, D>(tp, b);
    } else if (threadIdx.x < 128) {
      setmaxnreg_dec<24>(); // a dQ block's first warpgroup only hands its registers over
    } else {
      setmaxnreg_inc<240>();
      dq_sm90<T, D, 2, true>(tp, b - dkdv_blocks);
    }
  } else if (b < dkdv_blocks) {
    dkdv_sm90<T, D, WG>(tp, b);
  } else {
    dq_sm90<T, D, WG>(tp, b - dkdv_blocks);
  }
#else
  __trap(); // launched only where wgmma_available() said yes
#endif
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
