#pragma once
//! \file
//! The Hopper (sm_90a) block-backward kernels: the work split, walks and predicate of the
//! mma.sync ones (backward_sm80.cuh), with every product on warpgroup MMA. A thread block is
//! `WG` warpgroups (128 threads each, 16 rows a warp), each owning 64 key columns (dK/dV) or 64
//! query rows (dQ): with one, two blocks share an SM, so one's elementwise work runs while the
//! other's products are on the tensor cores; with two, the warpgroups share the tiles they walk
//! (Q/dO for dK/dV, K/V for dQ), copied once for twice the work, and interleave the same way.
//! With three (the tuned count), a producer warpgroup feeds two consumers through mbarrier
//! stages in the dK/dV blocks (`dkdv_sm90_ws`: no block barrier in their walk). Both block kinds
//! run in one grid (`backward_sm90_kernel`): the dK/dV blocks, then the dQ blocks.
//!
//! Every backward product has one of the forward kernel's two wgmma forms:
//! - S^T = K Q^T and dP^T = V dO^T (dK/dV block), S = Q K^T and dP = dO V^T (dQ block): A and
//!   B from shared memory, both read K-major (the head dimension is the k dimension);
//! - dV += P^T dO, dK += dS^T Q, dQ += dS K: A from registers (P^T, dS^T, dS are accumulators,
//!   packed to 16 bits they are wgmma's A fragment), B read N-major from shared memory (its
//!   rows are the k dimension), as V in the forward's P V.
//! Tiles are 64-column panels in the 128-byte swizzled layout, copied with cp.async
//! (`produce_tile`: by the producer, or else by the whole warpgroup into double buffers);
//! deterministic like the other kernels (one writer per accumulator element, no atomics).

#include <ringattn/block/kernel/backward_sm80.cuh>
#include <ringattn/block/kernel/wgmma.cuh>

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

//! Stages of Q/dO tiles of the warp-specialised (three-warpgroup) dK/dV blocks.
inline constexpr int sm90_backward_stages = 3;
//! Dynamic shared memory of the Hopper backward kernel with `WG` warpgroups (1, 2: two fixed
//! [64 WG, D] tiles, two double-buffered [64, D] ones, two double-buffered 64-float vectors; 3: the
//! larger of its two block kinds), plus 1 KB to align the swizzle atoms. Q and K are `D` wide,
//! V and dO `DV` (equal, except 192 and 128 with three warpgroups).
template <class T, int D, int DV, int WG>
constexpr int sm90_backward_smem_bytes() {
  constexpr int R = tc_backward_rows, E = static_cast<int>(sizeof(T));
  if constexpr (WG == 3) {
    // dK/dV: K, V of 128 keys and the stages' Q, dO, lse, delta; dQ: Q, dO of 128 rows and the
    // stages' K, V.
    constexpr int dkdv =
        2 * R * (D + DV) * E + sm90_backward_stages * (R * (D + DV) * E + 2 * R * 4);
    constexpr int dq = 2 * R * (D + DV) * E + sm90_backward_stages * R * (D + DV) * E;
    return (dkdv > dq ? dkdv : dq) + 1024;
  } else {
    static_assert(D == DV, "separate widths run with three warpgroups");
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
// c += A B over k = 64: A in registers, B's rows the k dimension; N = 2 * (registers of c). At
// N = 192 the first two panels of B go as one n128 product and the third as an n64 one: their
// accumulators are c's first 64 and last 32 registers (8 columns a 4-register group).
template <class T, int N>
__device__ __forceinline__ void product_rs(float (&c)[N], const std::uint32_t (&a)[4][4],
                                           std::uint32_t b) {
  if constexpr (N == 96) {
    auto& lo = reinterpret_cast<float(&)[64]>(c[0]);
    auto& hi = reinterpret_cast<float(&)[32]>(c[64]);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      wgmma_rs<T, 1>(lo, a[kk], n_major(b, kk), 1);
      wgmma_rs<T, 1>(hi, a[kk], n_major(b + 2 * R * 128, kk), 1);
    }
  } else {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_rs<T, 1>(c, a[kk], n_major(b, kk), 1);
  }
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
// The mbarriers of a warp-specialised block (producer warpgroup 0, consumers 1 and 2), for step
// n of a pipeline of `S` stages: `full` (the copies of each of the `Producers` copying threads
// for the step landed), `empty` (every consumer thread is done with the stage), and `kept` (the
// producer's copies of the tiles the block keeps throughout). One set a thread block (static
// shared memory).
template <int S, int Producers = 128>
struct ws_barriers {
  std::uint32_t full0, empty0, kept;
  // Every thread of the block calls it (thread 0 initialises, then a block barrier).
  __device__ __forceinline__ static ws_barriers make() {
    __shared__ alignas(8) std::uint64_t bars[2 * S + 1];
    const ws_barriers w{smem_address(&bars[0]), smem_address(&bars[S]), smem_address(&bars[2 * S])};
    if (threadIdx.x == 0) {
      for (int st = 0; st < S; ++st) {
        mbarrier_init(w.full0 + 8 * st, Producers);
        mbarrier_init(w.empty0 + 8 * st, 256);
      }
      mbarrier_init(w.kept, Producers);
    }
    __syncthreads();
    return w;
  }
  // Producer: before refilling step n's stage, wait until step n - S released it.
  __device__ __forceinline__ void wait_empty(int n) const {
    if (n >= S) mbarrier_wait(empty0 + 8 * (n % S), ((n / S) - 1) & 1);
  }
  // Producer: step n's copies (this thread's, once they land) fill its stage.
  __device__ __forceinline__ void filled(int n) const {
    cp_async_mbarrier_arrive(full0 + 8 * (n % S));
  }
  // Consumer: wait for step n's tiles (and make their cp.async writes visible to wgmma).
  __device__ __forceinline__ void wait_full(int n) const {
    mbarrier_wait(full0 + 8 * (n % S), (n / S) & 1);
    fence_proxy_async();
  }
  __device__ __forceinline__ void release(int n) const { mbarrier_arrive(empty0 + 8 * (n % S)); }
};
// What a dK/dV step computes besides dK and dV: nothing.
struct no_extra_products {
  __device__ __forceinline__ void before_dk(const std::uint32_t (&)[4][4], int, int) {}
  __device__ __forceinline__ void after_dk() {}
};
// One step of a dK/dV block's warpgroup: S^T and dP^T of its 64 key rows (`k`, `v`: those rows
// of the block's [BK, D] K and [BK, DV] V tiles; `key0` the first of them in the block) against
// the step's 64 query rows (`q`, `o`: their Q and dO tiles; `lse` in natural log and `delta` in
// shared memory), P^T and dS^T, then dV += P^T dO and dK += dS^T Q. Two product groups are in
// flight at a time: P^T is computed while dP^T is on the tensor cores, dS^T while dV's product
// is. Returns with every product done (the step's tiles may be refilled).
// With Q/K 192 and V 128 the accumulators alone take 160 registers a thread (of 240): P^T is
// then kept only as its 16-bit fragments (dS^T is computed from them), dP^T is computed after
// it, lse and delta are read from shared memory where they are used, and dV's and dK's products
// go out together.
// `extra` (the five-product kernel's dQ, `dq_five`; none by default) gets the packed dS^T before
// dK's product is issued (`before_dk`) and issues its own products after it (`after_dk`), which
// the step's last wait covers.
template <class T, int D, int DV, int BK, class Step, class Extra = no_extra_products>
__device__ __forceinline__ void
dkdv_step(float (&dk)[D / 2], float (&dv)[DV / 2], const Step& st, int cols, int key0,
          std::uint32_t k, std::uint32_t v, std::uint32_t q, std::uint32_t o, const float* lse,
          const float* delta, float scale, int warp, int lane, Extra&& extra = Extra{}) {
  constexpr float log2e = 1.4426950408889634f;
  constexpr bool lean = D + DV > 256;
  const float scale_log2 = scale * log2e;
  const auto [kb, i0, jl0, rows] = st;
  float s[32], dp[32];
  wgmma_fence();
  product_ss<T, D, BK>(s, k, q); // S^T = K Q^T
  wgmma_commit();
  if constexpr (lean) {
    wgmma_wait<0>(); // dP^T waits until P^T is packed
  } else {
    product_ss<T, DV, BK>(dp, v, o); // dP^T = V dO^T
    wgmma_commit();
    wgmma_wait<1>();
  }
  fence_operands(s);
  // lse (log2 units) and delta of this lane's 16 query columns, 8 t + 2 (lane % 4) + {0, 1}.
  float lcol[lean ? 1 : 16], dcol[lean ? 1 : 16];
  if constexpr (!lean) {
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const int c = t * 8 + (lane & 3) * 2;
      const float2 l = *reinterpret_cast<const float2*>(lse + c);
      const float2 d = *reinterpret_cast<const float2*>(delta + c);
      lcol[2 * t] = l.x * log2e, lcol[2 * t + 1] = l.y * log2e;
      dcol[2 * t] = d.x, dcol[2 * t + 1] = d.y;
    }
  }
  auto lse_at = [&](int t, int x) {
    if constexpr (lean) {
      const float2 l = *reinterpret_cast<const float2*>(lse + t * 8 + (lane & 3) * 2);
      return (x ? l.y : l.x) * log2e;
    } else {
      return lcol[2 * t + x];
    }
  };
  auto delta_at = [&](int t, int x) {
    if constexpr (lean) {
      const float2 d = *reinterpret_cast<const float2*>(delta + t * 8 + (lane & 3) * 2);
      return x ? d.y : d.x;
    } else {
      return dcol[2 * t + x];
    }
  };
  // P^T; rows are keys (this warp's 16), columns queries. A tile wholly in the band (its corners
  // are) with no ragged edge needs no predicate; else every score gets one, without branches
  // (`band_window`).
  if (st.whole(cols, BK)) {
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[4 * t + e] = fast_exp2(fmaf(s[4 * t + e], scale_log2, -lse_at(t, e & 1)));
  } else {
    // j - i = (jl0 - i0) + (key - c)
    const band_window bw(kb.mask, jl0 - i0, cols);
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + warp * 16 + fragment_row(lane, e);
        const int c = fragment_col(lane, t, e);
        const float x = fast_exp2(fmaf(s[4 * t + e], scale_log2, -lse_at(t, e & 1)));
        s[4 * t + e] = (bw.sees(key, key - c) & (c < rows)) ? x : 0.0f;
      }
  }
  std::uint32_t pa[4][4], da[4][4];
  pack<T>(s, pa);
  if constexpr (lean) {
    fence_operands(pa);
    wgmma_fence();
    product_ss<T, DV, BK>(dp, v, o); // dP^T = V dO^T
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(dp);
    // dS^T from P^T's fragments: element e of 8-column tile t is half e % 2 of register
    // (t % 2) * 2 + e / 2 of fragment t / 2 (pack's layout).
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = unpack1<T>(pa[t / 2][(t & 1) * 2 + (e >> 1)], e & 1);
        dp[4 * t + e] = p * (dp[4 * t + e] - delta_at(t, e & 1)) * scale;
      }
    pack<T>(dp, da);
    fence_operands(da);
    fence_operands(dv);
    fence_operands(dk);
    wgmma_fence();
    product_rs<T>(dv, pa, o); // dV += P^T dO, in one group with dK's product below
  } else {
    fence_operands(s);
    fence_operands(pa);
    wgmma_wait<0>();
    fence_operands(dp);
    fence_operands(dv);
    wgmma_fence();
    product_rs<T>(dv, pa, o); // dV += P^T dO
    wgmma_commit();
    // dS^T (P^T is 0 where the predicate said no).
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dp[4 * t + e] = s[4 * t + e] * (dp[4 * t + e] - delta_at(t, e & 1)) * scale;
    pack<T>(dp, da);
    extra.before_dk(da, warp, lane);
    fence_operands(da);
    fence_operands(dk);
    wgmma_fence();
  }
  product_rs<T>(dk, da, q); // dK += dS^T Q
  wgmma_commit();
  extra.after_dk();
  wgmma_wait<0>();
  fence_operands(pa);
  fence_operands(da);
  fence_operands(dv);
  fence_operands(dk);
}
} // namespace sm90_backward

//! dK, dV of 64 WG key columns of one kv head: thread block `b` of the dK/dV blocks takes key
//! tile b / kv_heads (the tiles are heaviest first) and kv head b % kv_heads.
template <class T, int D, int WG>
__device__ __forceinline__ void dkdv_sm90(const tc_backward_params<T>& tp, std::int64_t b) {
  using namespace sm90_backward;
  constexpr int BK = R * WG; // key columns of the block
  constexpr std::uint32_t tile = R * D * sizeof(T), kv_tile = BK * D * sizeof(T);
  static_assert(sizeof(T) == 2 && (D == 64 || D == 128) && (WG == 1 || WG == 2));
  const backward_params<T>& p = tp.b;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const std::uint32_t raw = smem_address(smem_raw);
  const std::uint32_t pad = (1024u - (raw & 1023u)) & 1023u; // swizzle atoms start 1 KB aligned
  const std::uint32_t aK = raw + pad, aV = aK + kv_tile, aQ = aV + kv_tile, aO = aQ + 2 * tile;
  // lse and delta of the step's rows, two buffers each.
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
      sL[buf * R + tid] = tid < rows ? p.lse[w.h * p.q_tokens + row0 + tid] : 0.0f;
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

  for (int step = 0; !w.done(); ++step) {
    cp_async_wait_all();
    fence_proxy_async(); // this thread's copies before the warpgroup's wgmma reads
    __syncthreads();     // every copy landed; every product on the buffer refilled below is done
    const int buf = step & 1;
    const auto st = w.current();
    w.advance(load_step, buf ^ 1);
    const std::uint32_t cQ = aQ + buf * tile, cO = aO + buf * tile;
    // This warpgroup's 64 key rows of K and V (rows 64 wg.. of the block's [BK, D] tiles).
    dkdv_step<T, D, D, BK>(dk, dv, st, cols, wg * R, aK + wg * (R * 128), aV + wg * (R * 128), cQ,
                           cO, sL + buf * R, sD + buf * R, p.scale, warp, lane);
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
//! Q and K are `D` wide, V and dO `DV`.
template <class T, int D, int DV>
__device__ __forceinline__ void dkdv_sm90_ws(const tc_backward_params<T>& tp, std::int64_t b) {
  using namespace sm90_backward;
  constexpr int BK = 2 * R, S = sm90_backward_stages;
  constexpr std::uint32_t q_tile = R * D * sizeof(T), o_tile = R * DV * sizeof(T),
                          k_tile = BK * D * sizeof(T), v_tile = BK * DV * sizeof(T),
                          stage_bytes = q_tile + o_tile;
  static_assert(sizeof(T) == 2 && (((D == 64 || D == 128) && DV == D) || (D == 192 && DV == 128)));
  const backward_params<T>& p = tp.b;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const std::uint32_t raw = smem_address(smem_raw);
  const std::uint32_t pad = (1024u - (raw & 1023u)) & 1023u; // swizzle atoms start 1 KB aligned
  // K, V, then stage s: Q at aS + s * stage_bytes, dO after it; then lse[S][64], delta[S][64].
  const std::uint32_t aK = raw + pad, aV = aK + k_tile, aS = aV + v_tile;
  float* sL = reinterpret_cast<float*>(smem_raw + pad + k_tile + v_tile + S * stage_bytes);
  float* sD = sL + S * R;
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
  const int kvh = static_cast<int>(b % p.kv_heads);
  const key_tile kt = tp.key_tiles[b / p.kv_heads];
  const key_interval in = p.intervals[kt.interval];
  const int cols = static_cast<int>(in.end - kt.begin < BK ? in.end - kt.begin : BK);
  const auto bars = ws_barriers<S>::make(); // kept: K and V

  if (wg == 0) {
    // ---- producer: K, V; then step n's tiles into stage n % S once step n - S released it.
    setmaxnreg_dec<24>();
    const int tid = static_cast<int>(threadIdx.x);
    produce_panels<BK, D>(aK, p.k + kt.begin * p.k_token_stride + kvh * p.k_head_stride,
                          p.k_token_stride, cols, tid);
    produce_panels<BK, DV>(aV, p.v + kt.begin * p.v_token_stride + kvh * p.v_head_stride,
                           p.v_token_stride, cols, tid);
    cp_async_mbarrier_arrive(bars.kept);
    cover_walk<T> w(p, in, kt.begin, cols, kvh);
    for (int n = 0; !w.done(); ++n, w.next()) {
      const int stage = n % S;
      bars.wait_empty(n);
      const block_group& g = p.groups[w.cover().group];
      const std::int64_t row0 = g.q_begin + w.i0;
      const int rows = static_cast<int>(g.q_count - w.i0 < R ? g.q_count - w.i0 : R);
      const std::uint32_t q = aS + stage * stage_bytes;
      produce_panels<R, D>(q, p.q + row0 * p.q_token_stride + w.h * p.q_head_stride,
                           p.q_token_stride, rows, tid);
      produce_panels<R, DV>(q + q_tile, p.dout + row0 * p.do_token_stride + w.h * p.do_head_stride,
                            p.do_token_stride, rows, tid);
      // lse (threads 0..63) and delta (64..127) of the rows; zero past the tile's last row.
      const int r = tid & (R - 1);
      const bool ok = r < rows;
      const float* src = (tid < R ? p.lse : p.delta) + w.h * p.q_tokens + row0 + (ok ? r : 0);
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                       smem_address((tid < R ? sL : sD) + stage * R + r)),
                   "l"(src), "r"(ok ? 4 : 0));
      bars.filled(n);
    }
    cp_async_wait_all();
    return;
  }

  // ---- consumers
  setmaxnreg_inc<240>();
  const int cw = wg - 1; // consumer warpgroup 0 or 1: key columns 64 cw..
  const int tid = static_cast<int>(threadIdx.x & 127), warp = tid >> 5, lane = tid & 31;
  cover_walk<T> w(p, in, kt.begin, cols, kvh);
  float dk[D / 2], dv[DV / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i)
    dk[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < DV / 2; ++i)
    dv[i] = 0.0f;
  const std::uint32_t myK = aK + cw * (R * 128), myV = aV + cw * (R * 128);
  if (!w.done()) mbarrier_wait(bars.kept, 0);
  // Each step's segment and rows come from global memory: read one step ahead, so the loads are
  // in flight while the step before computes.
  auto next = w.done() ? decltype(w.current()){} : w.current();
  for (int n = 0; !w.done(); ++n) {
    const auto st = next;
    w.next();
    if (!w.done()) next = w.current();
    const int stage = n % S;
    bars.wait_full(n);
    const std::uint32_t cQ = aS + stage * stage_bytes;
    dkdv_step<T, D, DV, BK>(dk, dv, st, cols, cw * R, myK, myV, cQ, cQ + q_tile, sL + stage * R,
                            sD + stage * R, p.scale, warp, lane);
    bars.release(n); // the step's tiles fully read
  }
  const std::int64_t k_stride = static_cast<std::int64_t>(p.kv_heads) * D,
                     v_stride = static_cast<std::int64_t>(p.kv_heads) * DV;
  add_rows<D>(p.dk + kt.begin * k_stride + kvh * D, k_stride, cw * R + warp * 16, cols, dk, lane);
  add_rows<DV>(p.dv + kt.begin * v_stride + kvh * DV, v_stride, cw * R + warp * 16, cols, dv, lane);
}

namespace sm90_backward {
// The lse (log2 units) and delta of this lane's two rows of a dQ warpgroup's 64 (`x`: the first
// of them in the block, `rows` valid); rows past the tile or with no key get lse = +inf (every p
// is 0) and delta 0.
template <class T>
__device__ __forceinline__ void dq_rows(const backward_params<T>& p, int h, std::int64_t row0,
                                        int x, int rows, float (&lrow)[2], float (&drow)[2]) {
  constexpr float log2e = 1.4426950408889634f, neg_inf = -__builtin_huge_valf();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool ok = x + r * 8 < rows;
    const float l = ok ? p.lse[h * p.q_tokens + row0 + x + r * 8] : neg_inf;
    lrow[r] = l == neg_inf ? __builtin_huge_valf() : l * log2e;
    drow[r] = ok ? p.delta[h * p.q_tokens + row0 + x + r * 8] : 0.0f;
  }
}
// One step of a dQ warpgroup: S and dP of its 64 query rows (`q`, `o`: those rows of the block's
// [BQ, D] Q and [BQ, DV] dO tiles; `i` the group-local index of this lane's first row) against
// K/V tile `it` of the walk (`k`, `v`), dS, then dQ += dS K. P is computed while dP is on the
// tensor cores. Returns with every product done (the tile may be refilled).
template <class T, int D, int DV, int BQ>
__device__ __forceinline__ void dq_step(float (&dq)[D / 2], const kv_walk<R>& walk, int it,
                                        std::int64_t i, std::uint32_t q, std::uint32_t o,
                                        std::uint32_t k, std::uint32_t v, const float (&lrow)[2],
                                        const float (&drow)[2], float scale, int lane) {
  constexpr float log2e = 1.4426950408889634f;
  const float scale_log2 = scale * log2e;
  bool second;
  std::int64_t j;
  walk.tile(it, second, j);
  float s[32], dp[32];
  wgmma_fence();
  product_ss<T, D, BQ>(s, q, k); // S = Q K^T (this warpgroup's rows)
  wgmma_commit();
  product_ss<T, DV, BQ>(dp, o, v); // dP = dO V^T
  wgmma_commit();
  wgmma_wait<1>();
  fence_operands(s);
  const band bd = walk.mask(second);
  const std::int64_t count = walk.count(second);
  // Rows past the tile have lrow = +inf (p = 0); only band edges and a ragged last tile need the
  // predicate (without branches, as in dkdv_step).
  if (!walk.needs_mask(second, j)) {
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[4 * t + e] = fast_exp2(fmaf(s[4 * t + e], scale_log2, -lrow[e >= 2 ? 1 : 0]));
  } else {
    // key - row = (j R - i) + (c - 8 r), c the column in the tile
    const band_window bw(bd, j * R - i, count - j * R);
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = fragment_col(lane, t, e);
        const float x = fast_exp2(fmaf(s[4 * t + e], scale_log2, -lrow[e >= 2 ? 1 : 0]));
        s[4 * t + e] = bw.sees(c, c - (e >= 2 ? 8 : 0)) ? x : 0.0f;
      }
  }
  fence_operands(s);
  wgmma_wait<0>();
  fence_operands(dp);
#pragma unroll
  for (int t = 0; t < 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      dp[4 * t + e] = s[4 * t + e] * (dp[4 * t + e] - drow[e >= 2 ? 1 : 0]) * scale;
  std::uint32_t da[4][4];
  pack<T>(dp, da);
  fence_operands(dq);
  fence_operands(da);
  wgmma_fence();
  product_rs<T>(dq, da, k); // dQ += dS K
  wgmma_commit();
  wgmma_wait<0>();
  fence_operands(dq);
}
} // namespace sm90_backward

//! dQ of 64 WG query rows of one query head: thread block `b` of the dQ blocks takes row tile
//! b / q_heads (heaviest first) and query head b % q_heads.
template <class T, int D, int WG>
__device__ __forceinline__ void dq_sm90(const tc_backward_params<T>& tp, std::int64_t b) {
  using namespace sm90_backward;
  constexpr int BQ = R * WG; // query rows of the block
  constexpr std::uint32_t tile = R * D * sizeof(T), q_tile = BQ * D * sizeof(T);
  static_assert(sizeof(T) == 2 && (D == 64 || D == 128) && (WG == 1 || WG == 2));
  const backward_params<T>& p = tp.b;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const std::uint32_t raw = smem_address(smem_raw);
  const std::uint32_t pad = (1024u - (raw & 1023u)) & 1023u;
  const std::uint32_t aQ = raw + pad, aO = aQ + q_tile, aK = aO + q_tile, aV = aK + 2 * tile;
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
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
    bool second;
    std::int64_t j;
    walk.tile(it, second, j);
    const std::int64_t key0 = walk.begin(second) + j * R;
    if (first)
      produce_tile<R, D>(aK + buf * tile, p.k + key0 * p.k_token_stride + kvh * p.k_head_stride,
                         p.k_token_stride, walk.valid(second, j), tid);
    if (last)
      produce_tile<R, D>(aV + buf * tile, p.v + key0 * p.v_token_stride + kvh * p.v_head_stride,
                         p.v_token_stride, walk.valid(second, j), tid);
  };
  if (first)
    produce_tile<BQ, D>(aQ, p.q + row0 * p.q_token_stride + h * p.q_head_stride, p.q_token_stride,
                        rows, tid);
  if (last)
    produce_tile<BQ, D>(aO, p.dout + row0 * p.do_token_stride + h * p.do_head_stride,
                        p.do_token_stride, rows, tid);
  if (walk.total > 0) load_kv(0, 0);
  cp_async_commit();
  const int x = wg * R + warp * 16 + (lane >> 2); // this lane's first row in the block
  float lrow[2], drow[2];
  dq_rows(p, h, row0, x, rows, lrow, drow);
  float dq[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i)
    dq[i] = 0.0f;
  for (int it = 0; it < walk.total; ++it) {
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads(); // tile `it` landed; every product on the buffer refilled below is done
    if (it + 1 < walk.total) load_kv(it + 1, (it + 1) & 1);
    cp_async_commit();
    dq_step<T, D, D, BQ>(dq, walk, it, i0 + x, aQ + wg * (R * 128), aO + wg * (R * 128),
                         aK + (it & 1) * tile, aV + (it & 1) * tile, lrow, drow, p.scale, lane);
  }
  cp_async_wait_all();
  const std::int64_t stride = static_cast<std::int64_t>(p.q_heads) * D;
  add_rows<D>(p.dq + row0 * stride + h * D, stride, wg * R + warp * 16, rows, dq, lane);
}

//! dQ of 128 query rows of one query head, warp-specialised as `dkdv_sm90_ws`: warpgroup 0
//! copies the rows' Q and dO once and then each K/V tile of the walk into one of
//! `sm90_backward_stages` stages (`full` / `empty` mbarriers); warpgroups 1 and 2 own 64 rows
//! each and wait only for their tile. Q and K are `D` wide, V and dO `DV`.
template <class T, int D, int DV>
__device__ __forceinline__ void dq_sm90_ws(const tc_backward_params<T>& tp, std::int64_t b) {
  using namespace sm90_backward;
  constexpr int BQ = 2 * R, S = sm90_backward_stages;
  constexpr std::uint32_t k_tile = R * D * sizeof(T), v_tile = R * DV * sizeof(T),
                          q_tile = BQ * D * sizeof(T), o_tile = BQ * DV * sizeof(T),
                          stage_bytes = k_tile + v_tile;
  static_assert(sizeof(T) == 2 && (((D == 64 || D == 128) && DV == D) || (D == 192 && DV == 128)));
  const backward_params<T>& p = tp.b;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const std::uint32_t raw = smem_address(smem_raw);
  const std::uint32_t pad = (1024u - (raw & 1023u)) & 1023u;
  // Q, dO, then stage s: K at aS + s * stage_bytes, V after it.
  const std::uint32_t aQ = raw + pad, aO = aQ + q_tile, aS = aO + o_tile;
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
  const int h = static_cast<int>(b % p.q_heads), kvh = h / p.group_size;
  const work_tile wt = tp.row_tiles[b / p.q_heads];
  const block_group g = p.groups[wt.group];
  const std::int64_t i0 = wt.row_begin, row0 = g.q_begin + i0;
  const int rows = static_cast<int>(g.q_count - i0 < BQ ? g.q_count - i0 : BQ);
  const kv_walk<R> walk(g, i0, rows);
  const auto bars = ws_barriers<S>::make(); // kept: Q and dO

  if (wg == 0) {
    // ---- producer: Q, dO; then K/V tile t into stage t % S once tile t - S released it.
    setmaxnreg_dec<24>();
    const int tid = static_cast<int>(threadIdx.x);
    produce_panels<BQ, D>(aQ, p.q + row0 * p.q_token_stride + h * p.q_head_stride, p.q_token_stride,
                          rows, tid);
    produce_panels<BQ, DV>(aO, p.dout + row0 * p.do_token_stride + h * p.do_head_stride,
                           p.do_token_stride, rows, tid);
    cp_async_mbarrier_arrive(bars.kept);
    for (int t = 0; t < walk.total; ++t) {
      const int stage = t % S;
      bars.wait_empty(t);
      bool second;
      std::int64_t j;
      walk.tile(t, second, j);
      const std::int64_t key0 = walk.begin(second) + j * R;
      const int valid = walk.valid(second, j);
      const std::uint32_t k = aS + stage * stage_bytes;
      produce_panels<R, D>(k, p.k + key0 * p.k_token_stride + kvh * p.k_head_stride,
                           p.k_token_stride, valid, tid);
      produce_panels<R, DV>(k + k_tile, p.v + key0 * p.v_token_stride + kvh * p.v_head_stride,
                            p.v_token_stride, valid, tid);
      bars.filled(t);
    }
    cp_async_wait_all();
    return;
  }

  // ---- consumers
  setmaxnreg_inc<240>();
  const int cw = wg - 1; // consumer warpgroup 0 or 1: rows 64 cw..
  const int tid = static_cast<int>(threadIdx.x & 127), warp = tid >> 5, lane = tid & 31;
  const int x = cw * R + warp * 16 + (lane >> 2); // this lane's first row in the block
  float lrow[2], drow[2];
  dq_rows(p, h, row0, x, rows, lrow, drow);
  float dq[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i)
    dq[i] = 0.0f;
  if (walk.total > 0) mbarrier_wait(bars.kept, 0);
  for (int it = 0; it < walk.total; ++it) {
    bars.wait_full(it);
    const std::uint32_t k = aS + (it % S) * stage_bytes;
    dq_step<T, D, DV, BQ>(dq, walk, it, i0 + x, aQ + cw * (R * 128), aO + cw * (R * 128), k,
                          k + k_tile, lrow, drow, p.scale, lane);
    bars.release(it); // the tile fully read
  }
  const std::int64_t stride = static_cast<std::int64_t>(p.q_heads) * D;
  add_rows<D>(p.dq + row0 * stride + h * D, stride, cw * R + warp * 16, rows, dq, lane);
}

namespace sm90_backward {
// Shared memory of the five-product kernel's parts (bytes; each swizzled tile 1 KB aligned).
struct five_layout {
  static constexpr int stages = 2;
  static constexpr int kv_tile = 2 * R * 128 * 2;   // K or V: 128 keys x 128 bf16/fp16
  static constexpr int q_tile = R * 128 * 2;        // Q or dO: 64 rows x 128
  static constexpr int stage_bytes = 2 * q_tile;    // Q then dO
  static constexpr int ds_tile = 2 * R * R * 2;     // dS^T: 128 keys x 64 rows
  static constexpr int dq_stride = 136;             // floats a row of a dQ tile (no bank conflict)
  static constexpr int dq_tile = R * dq_stride * 4; // 64 rows x 128 fp32 (both consumers' halves)
  static constexpr int k = 0, v = kv_tile, stage0 = 2 * kv_tile;
  static constexpr int ds = stage0 + stages * stage_bytes; // one dS^T tile
  static constexpr int dq = ds + ds_tile;                  // two dQ tiles (alternate steps)
  static constexpr int lse = dq + 2 * dq_tile;             // lse[stages][64], delta[stages][64]
  static constexpr int bytes = lse + 2 * stages * R * 4;
};
// Named barriers of the five-product kernel (0 is __syncthreads):
// - `ds_ready`: both consumers' dS^T halves of the step written (both consumers, 256 threads);
// - `ds_free` + c: the other consumer's dQ product of the last step, which read consumer c's
//   half, is done (it arrives, c waits before writing: 256);
// - `dq_full` + b: dQ tile b written (the consumers arrive, the writer warp waits: 288);
// - `dq_read` + b: the writer's bulk reductions have read dQ tile b (it arrives, the consumers
//   wait before writing it again: 288).
inline constexpr int five_ds_ready = 1, five_ds_free = 2, five_dq_full = 4, five_dq_read = 6;
// dQ of a consumer warpgroup's step in the five-product kernel: dQ[:, 64 cw..] = dS K over the
// block's 128 keys. `before_dk` writes this warpgroup's 64 keys of dS^T (packed, the 128-byte
// swizzle: key rows of 64 query rows) into the dS^T tile, once the other consumer's last product
// on it is done; `after_dk` waits until the other consumer's half is there and issues the 8
// k-steps, A read M-major from the dS^T tile, B = K read N-major (its rows are the keys).
template <class T>
struct dq_five {
  float acc[32];
  std::uint32_t ds, k; // the dS^T tile; K's 64 columns 64 cw..
  int cw;
  bool first; // the walk's first step (the tile is free)
  __device__ __forceinline__ void before_dk(const std::uint32_t (&da)[4][4], int warp, int lane) {
    if (!first) named_barrier_sync<256>(five_ds_free + cw);
    // Element (key, row) at key * 128 + ((row / 8) ^ (key % 8)) * 16 + (row % 8) * 2; this lane's
    // keys are 64 cw + 16 warp + lane / 4 (+ 8), so key % 8 = lane / 4.
    const std::uint32_t line = ds + (cw * R + warp * 16 + (lane >> 2)) * 128 + (lane & 3) * 4;
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi)
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(line + hi * 1024 + ((t ^ (lane >> 2)) << 4)),
                     "r"(da[t / 2][(t & 1) * 2 + hi])
                     : "memory");
    fence_proxy_async(); // before the other consumer's wgmma reads it
  }
  __device__ __forceinline__ void after_dk() {
    named_barrier_sync<256>(five_ds_ready);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 2 * R / 16; ++kk)
      wgmma_ss<T, 1, 1>(acc, n_major(ds, kk), n_major(k, kk), kk > 0);
    wgmma_commit();
  }
};
} // namespace sm90_backward

//! dK, dV of 128 key columns of one kv head and their share of dQ, in five products (head_dim
//! 128): the warp-specialised block of `dkdv_sm90_ws`, whose consumers also compute dQ = dS K
//! of each step (`dq_five`: dS^T through shared memory, both consumers' halves) and hand it, fp32,
//! through one of two shared-memory tiles to the producer warpgroup's third warp, which adds it
//! to `p.dq` with bulk reductions in the L2 (`cp.reduce.async.bulk .add.f32`, a 512-byte row
//! each, one bulk group a step) and waits for a tile's reads only a step later, so neither the
//! consumers nor the writer wait for the L2. The producer's first two warps copy (64 threads, two
//! stages); its fourth has nothing to do. dQ is added in no fixed order (not bitwise repeatable).
//! `Reduce` false leaves the reduction out (what it costs: bench/block_backward.cu).
template <class T, bool Reduce>
__device__ __forceinline__ void dkdv_dq_sm90(const tc_backward_params<T>& tp, std::int64_t b) {
  using namespace sm90_backward;
  using L = five_layout;
  constexpr int D = 128, BK = 2 * R, S = L::stages;
  static_assert(sizeof(T) == 2);
  const backward_params<T>& p = tp.b;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const std::uint32_t raw = smem_address(smem_raw);
  const std::uint32_t pad = (1024u - (raw & 1023u)) & 1023u; // swizzle atoms start 1 KB aligned
  const std::uint32_t base = raw + pad, aK = base + L::k, aV = base + L::v, aS = base + L::stage0,
                      aDQ = base + L::dq;
  float* sL = reinterpret_cast<float*>(smem_raw + pad + L::lse);
  float* sD = sL + S * R;
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
  const int kvh = static_cast<int>(b % p.kv_heads);
  const key_tile kt = tp.key_tiles[b / p.kv_heads];
  const key_interval in = p.intervals[kt.interval];
  const int cols = static_cast<int>(in.end - kt.begin < BK ? in.end - kt.begin : BK);
  const auto bars = ws_barriers<S, 64>::make(); // kept: K and V

  if (wg == 0) {
    setmaxnreg_dec<24>(); // with the consumers' 240: 24 x 128 + 240 x 256 = 168 x 384
    const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0);
    const int tid = static_cast<int>(threadIdx.x);
    if (warp < 2) {
      // ---- copies: K, V; then step n's tiles into stage n % S once step n - S released it.
      produce_tile<BK, D, 64>(aK, p.k + kt.begin * p.k_token_stride + kvh * p.k_head_stride,
                              p.k_token_stride, cols, tid);
      produce_tile<BK, D, 64>(aV, p.v + kt.begin * p.v_token_stride + kvh * p.v_head_stride,
                              p.v_token_stride, cols, tid);
      cp_async_mbarrier_arrive(bars.kept);
      cover_walk<T> w(p, in, kt.begin, cols, kvh);
      for (int n = 0; !w.done(); ++n, w.next()) {
        const int stage = n % S;
        bars.wait_empty(n);
        const block_group& g = p.groups[w.cover().group];
        const std::int64_t row0 = g.q_begin + w.i0;
        const int rows = static_cast<int>(g.q_count - w.i0 < R ? g.q_count - w.i0 : R);
        const std::uint32_t q = aS + stage * L::stage_bytes;
        produce_tile<R, D, 64>(q, p.q + row0 * p.q_token_stride + w.h * p.q_head_stride,
                               p.q_token_stride, rows, tid);
        produce_tile<R, D, 64>(q + L::q_tile,
                               p.dout + row0 * p.do_token_stride + w.h * p.do_head_stride,
                               p.do_token_stride, rows, tid);
        // lse and delta of the rows (thread r: row r); zero past the tile's last row.
        const bool ok = tid < rows;
        const std::int64_t at = w.h * p.q_tokens + row0 + (ok ? tid : 0);
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                         smem_address(sL + stage * R + tid)),
                     "l"(p.lse + at), "r"(ok ? 4 : 0));
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                         smem_address(sD + stage * R + tid)),
                     "l"(p.delta + at), "r"(ok ? 4 : 0));
        bars.filled(n);
      }
      cp_async_wait_all();
    } else if (warp == 2) {
      // ---- the dQ writer: step n's tile (its rows of 128 columns) added to dQ as one bulk
      // group; the tile of step n - 1 handed back once that group has read it.
      const int lane = tid & 31;
      const std::int64_t stride = static_cast<std::int64_t>(p.q_heads) * D;
      cover_walk<T> w(p, in, kt.begin, cols, kvh);
      for (int n = 0; !w.done(); ++n) {
        const block_group& g = p.groups[w.cover().group];
        const int rows = static_cast<int>(g.q_count - w.i0 < R ? g.q_count - w.i0 : R);
        float* const dst = p.dq + (g.q_begin + w.i0) * stride + w.h * D;
        w.next();
        const int buf = n & 1;
        named_barrier_sync<288>(five_dq_full + buf);
        if constexpr (Reduce)
          for (int r = lane; r < rows; r += 32)
            bulk_reduce_add_f32_uncommitted(dst + r * stride,
                                            aDQ + buf * L::dq_tile + r * (L::dq_stride * 4), D * 4);
        bulk_commit();
        if (n > 0) {
          bulk_wait_read<1>();
          if (!w.done()) named_barrier_arrive<288>(five_dq_read + (buf ^ 1));
        }
      }
      bulk_wait_all();
    }
    return;
  }

  // ---- consumers
  setmaxnreg_inc<240>();
  const int cw = wg - 1; // consumer warpgroup 0 or 1: key columns 64 cw.., dQ columns 64 cw..
  const int tid = static_cast<int>(threadIdx.x & 127), warp = tid >> 5, lane = tid & 31;
  cover_walk<T> w(p, in, kt.begin, cols, kvh);
  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i)
    dk[i] = dv[i] = 0.0f;
  const std::uint32_t myK = aK + cw * (R * 128), myV = aV + cw * (R * 128);
  dq_five<T> five{{}, base + L::ds, aK + cw * (BK * 128), cw, true};
  // This thread's place in dQ tile 0: rows 16 warp + lane / 4 (+ 8), columns 64 cw + 8 t +
  // 2 (lane % 4) (+ 1).
  float* const tile0 = reinterpret_cast<float*>(smem_raw + pad + L::dq) +
                       (warp * 16 + (lane >> 2)) * L::dq_stride + cw * R + (lane & 3) * 2;
  if (!w.done()) mbarrier_wait(bars.kept, 0);
  auto next = w.done() ? decltype(w.current()){} : w.current();
  for (int n = 0; !w.done(); ++n) {
    const auto st = next;
    w.next();
    const bool last = w.done();
    if (!last) next = w.current();
    const int stage = n % S;
    bars.wait_full(n);
    const std::uint32_t cQ = aS + stage * L::stage_bytes;
    five.first = n == 0;
    dkdv_step<T, D, D, BK>(dk, dv, st, cols, cw * R, myK, myV, cQ, cQ + L::q_tile, sL + stage * R,
                           sD + stage * R, p.scale, warp, lane, five);
    fence_operands(five.acc);
    bars.release(n);                                               // the step's tiles fully read
    if (!last) named_barrier_arrive<256>(five_ds_free + (cw ^ 1)); // dS^T read
    // dQ tile n % 2, once the writer has read step n - 2's from it.
    const int buf = n & 1;
    if (n > 1) named_barrier_sync<288>(five_dq_read + buf);
    float* const tile = tile0 + buf * (L::dq_tile / 4);
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi)
        *reinterpret_cast<float2*>(tile + hi * 8 * L::dq_stride + t * 8) =
            make_float2(five.acc[4 * t + 2 * hi], five.acc[4 * t + 2 * hi + 1]);
    fence_proxy_async(); // before the writer's bulk reductions read it
    named_barrier_arrive<288>(five_dq_full + buf);
  }
  const std::int64_t stride = static_cast<std::int64_t>(p.kv_heads) * D;
  add_rows<D>(p.dk + kt.begin * stride + kvh * D, stride, cw * R + warp * 16, cols, dk, lane);
  add_rows<D>(p.dv + kt.begin * stride + kvh * D, stride, cw * R + warp * 16, cols, dv, lane);
}

//! Dynamic shared memory of the five-product kernel (plus 1 KB to align the swizzle atoms).
inline constexpr int sm90_five_smem_bytes = sm90_backward::five_layout::bytes + 1024;

//! The five-product Hopper block backward (head_dim 128): one thread block of `dkdv_dq_sm90` a
//! (key tile, kv head), 384 threads; dQ is added to `p.dq` (fp32, 16-byte aligned) in the L2.
template <class T, bool Reduce = true>
__global__ void __launch_bounds__(384, 1) backward_sm90_five_kernel(tc_backward_params<T> tp) {
#if RINGATTN_WGMMA_ENABLED
  dkdv_dq_sm90<T, Reduce>(tp, blockIdx.x);
#else
  __trap(); // launched only where wgmma_available() said yes
#endif
}

//! The whole Hopper block backward in one launch: the first key_tile_count * kv_heads thread
//! blocks are dK/dV blocks, the next row_tile_count * q_heads dQ blocks. One grid, both lists
//! heaviest first, so the light dQ blocks fill the SMs the dK/dV blocks leave at their tail
//! instead of a second launch's waves starting behind the first's last block.
//! `Part` 1 or 2: only the dK/dV blocks or only the dQ blocks (the grid then holds those alone).
//! Separate widths launch the two kinds apart: in one function their register needs add up
//! (ptxas spills at 192/128), apart neither spills.
template <class T, int D, int DV, int WG, int Part = 0>
__global__ void __launch_bounds__(128 * WG, WG == 1 ? 2 : 1)
    backward_sm90_kernel(tc_backward_params<T> tp) {
#if RINGATTN_WGMMA_ENABLED
  static_assert(WG == 3 || (D == DV && Part == 0), "separate widths run with three warpgroups");
  const std::int64_t dkdv_blocks = tp.key_tile_count * tp.b.kv_heads;
  const std::int64_t b = blockIdx.x + (Part == 2 ? dkdv_blocks : 0);
  if constexpr (Part == 1) {
    dkdv_sm90_ws<T, D, DV>(tp, b);
  } else if constexpr (Part == 2) {
    dq_sm90_ws<T, D, DV>(tp, b - dkdv_blocks);
  } else if constexpr (WG == 3) {
    if (b < dkdv_blocks)
      dkdv_sm90_ws<T, D, DV>(tp, b);
    else
      dq_sm90_ws<T, D, DV>(tp, b - dkdv_blocks);
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
