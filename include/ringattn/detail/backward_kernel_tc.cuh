#pragma once
//! \file
//! Tensor-core kernels of the block backward (mma.sync m16n8k16, sm_80 and later; head_dim 64 and
//! 128): the FlashAttention-2 products in the fragment layouts of the forward kernel
//! (forward_kernel.cuh), deterministic like the CUDA-core version (one writer per accumulator
//! element per call, no atomics).
//!
//! dK/dV: a thread block of 4 warps owns 64 key columns (16 a warp) of one kv head and keeps
//! their dK, dV in registers. It computes the *transposed* scores S^T = K Q^T and dP^T = V dO^T
//! (K, V as A operands), so P^T and dS^T come out in the accumulator layout that is the A operand
//! of dV += P^T dO and dK += dS^T Q: nothing goes through shared memory but the inputs. It walks,
//! for each (group, key segment) covering its columns, the 64-row query tiles that see them, and
//! every query head of the group.
//!
//! dQ: a thread block of 4 warps owns 64 query rows (16 a warp) of one query head, walks the K/V
//! tiles its rows see (the forward's walk), computes S = Q K^T and dP = dO V^T, and accumulates
//! dQ += dS K in registers.
//!
//! Single-buffered tiles (load, wait, compute): the first version; double buffering as in the
//! forward comes with measurements.

#include <ringattn/detail/backward_kernel.cuh>
#include <ringattn/detail/forward_kernel.cuh>

RINGATTN_ABI_BEGIN
namespace kernels {

inline constexpr int tc_backward_rows = 64; //!< query rows (dQ) or key columns (dK/dV) a block
inline constexpr int tc_backward_threads = 128;

template <class T>
struct tc_backward_params {
  backward_params<T> b;
  const key_tile* key_tiles;
  std::int64_t key_tile_count;
  const work_tile* row_tiles; // query tiles of 64 rows: (group, first row)
  std::int64_t row_tile_count;
};

} // namespace kernels
RINGATTN_ABI_END

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

//! Shared memory of either kernel: four [64, D] tiles and two 64-float vectors.
template <class T, int D>
constexpr int tc_backward_smem_bytes() {
  return 4 * tc_backward_rows * D * static_cast<int>(sizeof(T)) + 2 * tc_backward_rows * 4;
}

// A 16 x (8 * N) accumulator of this warp, zeroed.
template <int N>
__device__ __forceinline__ void zero(float (&c)[N][4]) {
#pragma unroll
  for (int t = 0; t < N; ++t)
    c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.0f;
}

// C (16 x 64) += A (this warp's 16 rows of sA, [64, D] swizzled) * B^T (sB, [64, D]).
template <class T, int D>
__device__ __forceinline__ void mma_abt(float (&c)[8][4], std::uint32_t aA, int arow0,
                                        std::uint32_t aB, int lane) {
  constexpr std::uint32_t elem = sizeof(T);
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    std::uint32_t a[4];
    ldmatrix_x4(a, aA + elem * swizzle<D>(arow0 + (lane & 15), kk * 2 + (lane >> 4)));
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      std::uint32_t b[4];
      const int brow = np * 16 + ((lane >> 4) << 3) + (lane & 7);
      ldmatrix_x4(b, aB + elem * swizzle<D>(brow, kk * 2 + ((lane >> 3) & 1)));
      mma_16816<T>(c[2 * np], a, b[0], b[1]);
      mma_16816<T>(c[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// C (16 x D) += A (16 x 64, packed from an accumulator) * B (sB, [64 rows = k, D]).
template <class T, int D>
__device__ __forceinline__ void mma_ab(float (&c)[D / 8][4], const std::uint32_t (&a)[4][4],
                                       std::uint32_t aB, int lane) {
  constexpr std::uint32_t elem = sizeof(T);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      std::uint32_t b[4];
      const int brow = kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7);
      ldmatrix_x4_trans(b, aB + elem * swizzle<D>(brow, dp * 2 + (lane >> 4)));
      mma_16816<T>(c[2 * dp], a[kk], b[0], b[1]);
      mma_16816<T>(c[2 * dp + 1], a[kk], b[2], b[3]);
    }
}

// An accumulator (16 x 64) as the A operand of the next product (16-bit pairs).
template <class T>
__device__ __forceinline__ void pack_a(const float (&c)[8][4], std::uint32_t (&a)[4][4]) {
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    a[t / 2][(t & 1) * 2] = pack2<T>(c[t][0], c[t][1]);
    a[t / 2][(t & 1) * 2 + 1] = pack2<T>(c[t][2], c[t][3]);
  }
}

// Adds this warp's 16 x D accumulator to rows [row0 + 16 warp, ...) of a dense fp32 [*, stride]
// matrix at column offset `col0` (rows >= valid are skipped).
template <int D>
__device__ __forceinline__ void add_rows(float* base, std::int64_t row_stride, int warp_row,
                                         int valid, const float (&c)[D / 8][4], int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp_row + (lane >> 2) + r * 8;
    if (row >= valid) continue;
    float* dst = base + row * row_stride + (lane & 3) * 2;
#pragma unroll
    for (int t = 0; t < D / 8; ++t) {
      float2 x = *reinterpret_cast<float2*>(dst + t * 8);
      x.x += c[t][2 * r];
      x.y += c[t][2 * r + 1];
      *reinterpret_cast<float2*>(dst + t * 8) = x;
    }
  }
}

//! dK, dV of 64 key columns of one kv head (blockIdx.x: key tile, blockIdx.y: kv head).
template <class T, int D>
__global__ void __launch_bounds__(tc_backward_threads, 1) dkdv_tc_kernel(tc_backward_params<T> tp) {
  constexpr int R = tc_backward_rows;
  constexpr float log2e = 1.4426950408889634f;
  const backward_params<T>& p = tp.b;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + R * D;
  T* sQ = sV + R * D;
  T* sO = sQ + R * D;
  float* sL = reinterpret_cast<float*>(sO + R * D); // lse * log2(e) of the tile's rows
  float* sD = sL + R;                               // delta of the tile's rows
  const std::uint32_t aK = smem_address(sK), aV = smem_address(sV), aQ = smem_address(sQ),
                      aO = smem_address(sO);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, kvh = blockIdx.y;
  const key_tile kt = tp.key_tiles[blockIdx.x];
  const key_interval in = p.intervals[kt.interval];
  const int cols = static_cast<int>(in.end - kt.begin < R ? in.end - kt.begin : R);

  load_tile<R, D, tc_backward_threads>(
      sK, p.k + kt.begin * p.k_token_stride + kvh * p.k_head_stride, p.k_token_stride, cols);
  load_tile<R, D, tc_backward_threads>(
      sV, p.v + kt.begin * p.v_token_stride + kvh * p.v_head_stride, p.v_token_stride, cols);
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];
  zero(dk);
  zero(dv);
  const float scale_log2 = p.scale * log2e;

  for (int c = 0; c < in.cover_count; ++c) {
    const key_cover cv = p.covers[in.cover_begin + c];
    const block_group g = p.groups[cv.group];
    const kv_block kb = g.kv[cv.segment];
    const std::int64_t jl0 = kt.begin - kb.kv_begin; // first column, local to the segment
    // Query rows that see some column of [jl0, jl0 + cols): lo <= jl - i <= hi.
    std::int64_t i_begin = jl0 - kb.mask.hi, i_end = jl0 + cols - 1 - kb.mask.lo + 1;
    i_begin = i_begin > 0 ? i_begin : 0;
    i_end = i_end < g.q_count ? i_end : g.q_count;
    for (std::int64_t i0 = i_begin; i0 < i_end; i0 += R) {
      const int rows = static_cast<int>(g.q_count - i0 < R ? g.q_count - i0 : R);
      for (int h = kvh * p.group_size; h < (kvh + 1) * p.group_size; ++h) {
        __syncthreads(); // every warp is done with the previous Q/dO tile
        const std::int64_t row0 = g.q_begin + i0;
        load_tile<R, D, tc_backward_threads>(
            sQ, p.q + row0 * p.q_token_stride + h * p.q_head_stride, p.q_token_stride, rows);
        load_tile<R, D, tc_backward_threads>(
            sO, p.dout + row0 * p.do_token_stride + h * p.do_head_stride, p.do_token_stride, rows);
        cp_async_commit();
        for (int x = threadIdx.x; x < R; x += tc_backward_threads) {
          sL[x] = x < rows ? p.lse[h * p.q_tokens + row0 + x] * log2e : 0.0f;
          sD[x] = x < rows ? p.delta[h * p.q_tokens + row0 + x] : 0.0f;
        }
        cp_async_wait_all();
        __syncthreads();

        float s[8][4], dp[8][4];
        zero(s);
        zero(dp);
        mma_abt<T, D>(s, aK, warp * 16, aQ, lane);  // S^T = K Q^T
        mma_abt<T, D>(dp, aV, warp * 16, aO, lane); // dP^T = V dO^T
        // P^T and dS^T; rows are keys (this warp's 16), columns queries.
#pragma unroll
        for (int t = 0; t < 8; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = warp * 16 + (lane >> 2) + (e >= 2 ? 8 : 0);
            const int q = t * 8 + (lane & 3) * 2 + (e & 1);
            const bool seen = key < cols && q < rows && kb.mask.sees(i0 + q, jl0 + key);
            const float pr = seen ? fast_exp2(fmaf(s[t][e], scale_log2, -sL[q])) : 0.0f;
            s[t][e] = pr;
            dp[t][e] = pr * (dp[t][e] - sD[q]) * p.scale;
          }
        std::uint32_t a[4][4];
        pack_a<T>(s, a);
        mma_ab<T, D>(dv, a, aO, lane); // dV += P^T dO
        pack_a<T>(dp, a);
        mma_ab<T, D>(dk, a, aQ, lane); // dK += dS^T Q
      }
    }
  }
  cp_async_wait_all(); // (a block with no cover still waits for its K/V copies)
  const std::int64_t stride = static_cast<std::int64_t>(p.kv_heads) * D;
  add_rows<D>(p.dk + kt.begin * stride + kvh * D, stride, warp * 16, cols, dk, lane);
  add_rows<D>(p.dv + kt.begin * stride + kvh * D, stride, warp * 16, cols, dv, lane);
}

//! dQ of 64 query rows of one query head (blockIdx.x: row tile, blockIdx.y: head).
template <class T, int D>
__global__ void __launch_bounds__(tc_backward_threads, 1) dq_tc_kernel(tc_backward_params<T> tp) {
  constexpr int R = tc_backward_rows;
  constexpr float log2e = 1.4426950408889634f, neg_inf = -__builtin_huge_valf();
  const backward_params<T>& p = tp.b;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sO = sQ + R * D;
  T* sK = sO + R * D;
  T* sV = sK + R * D;
  const std::uint32_t aQ = smem_address(sQ), aO = smem_address(sO), aK = smem_address(sK),
                      aV = smem_address(sV);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, h = blockIdx.y,
            kvh = h / p.group_size;
  const work_tile wt = tp.row_tiles[blockIdx.x];
  const block_group g = p.groups[wt.group];
  const std::int64_t i0 = wt.row_begin, row0 = g.q_begin + i0;
  const int rows = static_cast<int>(g.q_count - i0 < R ? g.q_count - i0 : R);

  load_tile<R, D, tc_backward_threads>(sQ, p.q + row0 * p.q_token_stride + h * p.q_head_stride,
                                       p.q_token_stride, rows);
  load_tile<R, D, tc_backward_threads>(sO, p.dout + row0 * p.do_token_stride + h * p.do_head_stride,
                                       p.do_token_stride, rows);
  cp_async_commit();
  // This lane's two rows: lse (log2 units) and delta; rows past the tile or with no key: none.
  float lrow[2], drow[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int x = warp * 16 + (lane >> 2) + r * 8;
    const bool ok = x < rows;
    const float l = ok ? p.lse[h * p.q_tokens + row0 + x] : neg_inf;
    lrow[r] = l == neg_inf ? __builtin_huge_valf() : l * log2e; // +inf: every p is 0
    drow[r] = ok ? p.delta[h * p.q_tokens + row0 + x] : 0.0f;
  }
  const float scale_log2 = p.scale * log2e;
  float dq[D / 8][4];
  zero(dq);
  const kv_walk<R> walk(g, i0, rows);
  for (int it = 0; it < walk.total; ++it) {
    bool b;
    std::int64_t j;
    walk.tile(it, b, j);
    __syncthreads(); // every warp is done with the previous K/V tile
    const std::int64_t key0 = walk.begin(b) + j * R;
    load_tile<R, D, tc_backward_threads>(sK, p.k + key0 * p.k_token_stride + kvh * p.k_head_stride,
                                         p.k_token_stride, walk.valid(b, j));
    load_tile<R, D, tc_backward_threads>(sV, p.v + key0 * p.v_token_stride + kvh * p.v_head_stride,
                                         p.v_token_stride, walk.valid(b, j));
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    float s[8][4], dp[8][4];
    zero(s);
    zero(dp);
    mma_abt<T, D>(s, aQ, warp * 16, aK, lane);  // S = Q K^T
    mma_abt<T, D>(dp, aO, warp * 16, aV, lane); // dP = dO V^T
    const band bd = walk.mask(b);
    const std::int64_t count = walk.count(b);
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >= 2 ? 1 : 0;
        const std::int64_t i = i0 + warp * 16 + (lane >> 2) + r * 8;
        const std::int64_t col = j * R + t * 8 + (lane & 3) * 2 + (e & 1);
        const bool seen = col < count && bd.sees(i, col);
        const float pr = seen ? fast_exp2(fmaf(s[t][e], scale_log2, -lrow[r])) : 0.0f;
        dp[t][e] = pr * (dp[t][e] - drow[r]) * p.scale;
      }
    std::uint32_t a[4][4];
    pack_a<T>(dp, a);
    mma_ab<T, D>(dq, a, aK, lane); // dQ += dS K
  }
  cp_async_wait_all();
  const std::int64_t stride = static_cast<std::int64_t>(p.q_heads) * D;
  add_rows<D>(p.dq + row0 * stride + h * D, stride, warp * 16, rows, dq, lane);
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
