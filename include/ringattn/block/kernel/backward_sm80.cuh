#pragma once
//! \file
//! Tensor-core kernels of the block backward (mma.sync m16n8k16, sm_80 and later; head_dim 64 and
//! 128): the FlashAttention-2 products in the fragment layouts of the forward kernel
//! (forward_sm80.cuh), deterministic like the CUDA-core version (one writer per accumulator
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
//! Both double-buffer the tiles they walk (the next Q/dO or K/V tile is copied with cp.async
//! while the current one is computed, as in the forward), and skip the band and bounds predicate
//! on tiles that lie wholly inside the band.

#include <ringattn/block/kernel/backward_cuda_cores.cuh>
#include <ringattn/block/kernel/mask.cuh>
#include <ringattn/block/kernel/primitives.cuh>
#include <ringattn/core/tuning.cuh>

RINGATTN_ABI_BEGIN
namespace kernels {

//! Query rows (dQ) or key columns (dK/dV) a block, and its threads (core/tuning.cuh).
inline constexpr int tc_backward_rows = backward_tuning_tuned.rows;
inline constexpr int tc_backward_threads = backward_tuning_tuned.threads;

template <class T>
struct tc_backward_params {
  backward_params<T> b;
  const key_tile* key_tiles; // key tiles of the dK/dV blocks, heaviest first
  std::int64_t key_tile_count;
  const work_tile* row_tiles; // query tiles of the dQ blocks, (group, first row), heaviest first
  std::int64_t row_tile_count;
};

} // namespace kernels
RINGATTN_ABI_END

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

//! Shared memory of either kernel: six [64, D] tiles (two fixed, two double-buffered) and two
//! double-buffered 64-float vectors.
template <class T, int D>
constexpr int tc_backward_smem_bytes() {
  return 6 * tc_backward_rows * D * static_cast<int>(sizeof(T)) + 4 * tc_backward_rows * 4;
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

// The (cover, query tile, query head) steps of a dK/dV thread block, in order: for each cover of
// its interval, the 64-row query tiles that see some of its columns, and within each tile every
// query head of its kv head's group (innermost, so a tile's rows stay in L2 across heads).
template <class T>
struct cover_walk {
  const backward_params<T>* p;
  key_interval in;
  std::int64_t first_col; // the block's first column in the K/V block
  int cols, h_begin, h_end;
  // The step: cover c (== in.cover_count past the end), rows [i0, i0 + 64) of its group, head h.
  int c, h;
  std::int64_t i0, i_end;

  __device__ __forceinline__ cover_walk(const backward_params<T>& params, key_interval interval,
                                        std::int64_t col0, int ncols, int kvh)
      : p(&params), in(interval), first_col(col0), cols(ncols), h_begin(kvh * params.group_size),
        h_end((kvh + 1) * params.group_size), c(-1), h(0), i0(0), i_end(0) {
    next_cover();
  }
  __device__ __forceinline__ bool done() const { return c >= in.cover_count; }
  __device__ __forceinline__ key_cover cover() const { return p->covers[in.cover_begin + c]; }
  // The cover's key segment: read from global memory with the run-time index (a local copy of the
  // group indexed at run time would go to local memory).
  __device__ __forceinline__ kv_block segment() const {
    const key_cover cv = cover();
    return p->groups[cv.group].kv[cv.segment];
  }
  __device__ __forceinline__ void next() {
    if (++h < h_end) return;
    h = h_begin;
    i0 += tc_backward_rows;
    if (i0 >= i_end) next_cover();
  }
  //! The current step as the kernels compute it: the key segment, the first query row (local to
  //! the group), the block's first column local to the segment, and the rows in the tile.
  struct step {
    kv_block kb;
    std::int64_t i0, jl0;
    int rows;
    //! Whether the 64-row tile and `block_cols` columns lie wholly in the band (its corners do)
    //! with no ragged edge (`cols` of them valid): no predicate needed.
    __device__ __forceinline__ bool whole(int cols, int block_cols) const {
      return rows == tc_backward_rows && cols == block_cols &&
             kb.mask.sees(i0 + tc_backward_rows - 1, jl0) && kb.mask.sees(i0, jl0 + block_cols - 1);
    }
  };
  __device__ __forceinline__ step current() const {
    const kv_block kb = segment();
    const std::int64_t q_count = p->groups[cover().group].q_count;
    const int rows =
        static_cast<int>(q_count - i0 < tc_backward_rows ? q_count - i0 : tc_backward_rows);
    return {kb, i0, first_col - kb.kv_begin, rows};
  }
  //! Moves to the next step, first letting `load(next, buf)` copy its tiles (if there is one)
  //! and committing the copies as one cp.async group (empty at the end).
  template <class Load>
  __device__ __forceinline__ void advance(Load&& load, int buf) {
    cover_walk n = *this;
    n.next();
    if (!n.done()) load(n, buf);
    cp_async_commit();
    *this = n;
  }

private:
  // Moves to the next cover whose band reaches some query row of the block's columns.
  __device__ __forceinline__ void next_cover() {
    h = h_begin;
    for (++c; c < in.cover_count; ++c) {
      const kv_block kb = segment();
      const std::int64_t q_count = p->groups[cover().group].q_count;
      const std::int64_t jl0 = first_col - kb.kv_begin; // first column, local to the segment
      // Query rows that see some column of [jl0, jl0 + cols): lo <= jl - i <= hi.
      std::int64_t b = jl0 - kb.mask.hi, e = jl0 + cols - 1 - kb.mask.lo + 1;
      b = b > 0 ? b : 0;
      e = e < q_count ? e : q_count;
      if (b < e) {
        i0 = b, i_end = e;
        return;
      }
    }
  }
};

//! dK, dV of 64 key columns of one kv head (blockIdx.x: kv head, blockIdx.y: key tile; heads
//! fastest, so the blocks go in the schedule's heaviest-first tile order).
template <class T, int D>
__global__ void __launch_bounds__(tc_backward_threads, 1) dkdv_tc_kernel(tc_backward_params<T> tp) {
  constexpr int R = tc_backward_rows;
  constexpr std::uint32_t elem = sizeof(T), tile_bytes = R * D * elem;
  constexpr float log2e = 1.4426950408889634f;
  const backward_params<T>& p = tp.b;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + R * D;
  T* sQ = sV + R * D;                                   // two buffers
  T* sO = sQ + 2 * R * D;                               // two buffers
  float* sL = reinterpret_cast<float*>(sO + 2 * R * D); // lse * log2(e) of the rows, two buffers
  float* sD = sL + 2 * R;                               // delta of the rows, two buffers
  const std::uint32_t aK = smem_address(sK), aV = smem_address(sV), aQ = smem_address(sQ),
                      aO = smem_address(sO);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, kvh = blockIdx.x;
  const key_tile kt = tp.key_tiles[blockIdx.y];
  const key_interval in = p.intervals[kt.interval];
  const int cols = static_cast<int>(in.end - kt.begin < R ? in.end - kt.begin : R);

  load_tile<R, D, tc_backward_threads>(
      sK, p.k + kt.begin * p.k_token_stride + kvh * p.k_head_stride, p.k_token_stride, cols);
  load_tile<R, D, tc_backward_threads>(
      sV, p.v + kt.begin * p.v_token_stride + kvh * p.v_head_stride, p.v_token_stride, cols);

  // Copies step `w`'s Q/dO tile (cp.async) and lse/delta (plain stores) into buffer `buf`.
  auto load_step = [&](const cover_walk<T>& w, int buf) {
    const std::int64_t q_begin = p.groups[w.cover().group].q_begin,
                       q_count = p.groups[w.cover().group].q_count;
    const int rows = static_cast<int>(q_count - w.i0 < R ? q_count - w.i0 : R);
    const std::int64_t row0 = q_begin + w.i0;
    load_tile<R, D, tc_backward_threads>(sQ + buf * R * D,
                                         p.q + row0 * p.q_token_stride + w.h * p.q_head_stride,
                                         p.q_token_stride, rows);
    load_tile<R, D, tc_backward_threads>(sO + buf * R * D,
                                         p.dout + row0 * p.do_token_stride + w.h * p.do_head_stride,
                                         p.do_token_stride, rows);
    for (int x = threadIdx.x; x < R; x += tc_backward_threads) {
      sL[buf * R + x] = x < rows ? p.lse[w.h * p.q_tokens + row0 + x] * log2e : 0.0f;
      sD[buf * R + x] = x < rows ? p.delta[w.h * p.q_tokens + row0 + x] : 0.0f;
    }
  };

  cover_walk<T> w(p, in, kt.begin, cols, kvh);
  if (!w.done()) load_step(w, 0);
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];
  zero(dk);
  zero(dv);
  const float scale_log2 = p.scale * log2e;

  for (int step = 0; !w.done(); ++step) {
    cp_async_wait_all();
    __syncthreads(); // step's tiles landed; every warp is done with the buffer refilled below
    const int buf = step & 1;
    const auto st = w.current();
    const auto [kb, i0, jl0, rows] = st;
    w.advance(load_step, buf ^ 1);
    const std::uint32_t cQ = aQ + buf * tile_bytes, cO = aO + buf * tile_bytes;
    const float* cL = sL + buf * R;
    const float* cD = sD + buf * R;

    float s[8][4], dp[8][4];
    zero(s);
    zero(dp);
    mma_abt<T, D>(s, aK, warp * 16, cQ, lane);  // S^T = K Q^T
    mma_abt<T, D>(dp, aV, warp * 16, cO, lane); // dP^T = V dO^T
    // The tile lies wholly in the band (its corners do) and has no ragged edge: no predicate.
    const bool whole = st.whole(cols, R);
    // P^T and dS^T; rows are keys (this warp's 16), columns queries.
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = warp * 16 + fragment_row(lane, e);
        const int q = fragment_col(lane, t, e);
        const bool seen = whole || (key < cols && q < rows && kb.mask.sees(i0 + q, jl0 + key));
        const float pr = seen ? fast_exp2(fmaf(s[t][e], scale_log2, -cL[q])) : 0.0f;
        s[t][e] = pr;
        dp[t][e] = pr * (dp[t][e] - cD[q]) * p.scale;
      }
    std::uint32_t a[4][4];
    pack_a<T>(s, a);
    mma_ab<T, D>(dv, a, cO, lane); // dV += P^T dO
    pack_a<T>(dp, a);
    mma_ab<T, D>(dk, a, cQ, lane); // dK += dS^T Q
  }
  cp_async_wait_all(); // (a block with no cover still waits for its K/V copies)
  const std::int64_t stride = static_cast<std::int64_t>(p.kv_heads) * D;
  add_rows<D>(p.dk + kt.begin * stride + kvh * D, stride, warp * 16, cols, dk, lane);
  add_rows<D>(p.dv + kt.begin * stride + kvh * D, stride, warp * 16, cols, dv, lane);
}

//! dQ of 64 query rows of one query head (blockIdx.x: query head, blockIdx.y: row tile, heaviest
//! first).
template <class T, int D>
__global__ void __launch_bounds__(tc_backward_threads, 1) dq_tc_kernel(tc_backward_params<T> tp) {
  constexpr int R = tc_backward_rows;
  constexpr std::uint32_t elem = sizeof(T), tile_bytes = R * D * elem;
  constexpr float log2e = 1.4426950408889634f, neg_inf = -__builtin_huge_valf();
  const backward_params<T>& p = tp.b;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sO = sQ + R * D;
  T* sK = sO + R * D;     // two buffers
  T* sV = sK + 2 * R * D; // two buffers
  const std::uint32_t aQ = smem_address(sQ), aO = smem_address(sO), aK = smem_address(sK),
                      aV = smem_address(sV);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, h = blockIdx.x,
            kvh = h / p.group_size;
  const work_tile wt = tp.row_tiles[blockIdx.y];
  const block_group g = p.groups[wt.group];
  const std::int64_t i0 = wt.row_begin, row0 = g.q_begin + i0;
  const int rows = static_cast<int>(g.q_count - i0 < R ? g.q_count - i0 : R);
  const kv_walk<R> walk(g, i0, rows);
  // Copies K/V tile `it` of the walk into buffer `buf`.
  auto load_kv = [&](int it, int buf) {
    bool b;
    std::int64_t j;
    walk.tile(it, b, j);
    const std::int64_t key0 = walk.begin(b) + j * R;
    load_tile<R, D, tc_backward_threads>(sK + buf * R * D,
                                         p.k + key0 * p.k_token_stride + kvh * p.k_head_stride,
                                         p.k_token_stride, walk.valid(b, j));
    load_tile<R, D, tc_backward_threads>(sV + buf * R * D,
                                         p.v + key0 * p.v_token_stride + kvh * p.v_head_stride,
                                         p.v_token_stride, walk.valid(b, j));
  };

  load_tile<R, D, tc_backward_threads>(sQ, p.q + row0 * p.q_token_stride + h * p.q_head_stride,
                                       p.q_token_stride, rows);
  load_tile<R, D, tc_backward_threads>(sO, p.dout + row0 * p.do_token_stride + h * p.do_head_stride,
                                       p.do_token_stride, rows);
  if (walk.total > 0) load_kv(0, 0);
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
  for (int it = 0; it < walk.total; ++it) {
    cp_async_wait_all();
    __syncthreads(); // tile `it` landed; every warp is done with the buffer refilled below
    if (it + 1 < walk.total) load_kv(it + 1, (it + 1) & 1);
    cp_async_commit();
    bool b;
    std::int64_t j;
    walk.tile(it, b, j);
    const std::uint32_t cK = aK + (it & 1) * tile_bytes, cV = aV + (it & 1) * tile_bytes;
    float s[8][4], dp[8][4];
    zero(s);
    zero(dp);
    mma_abt<T, D>(s, aQ, warp * 16, cK, lane);  // S = Q K^T
    mma_abt<T, D>(dp, aO, warp * 16, cV, lane); // dP = dO V^T
    const band bd = walk.mask(b);
    const std::int64_t count = walk.count(b);
    // Rows past the tile have lrow = +inf (p = 0); only band edges and a ragged last tile need
    // the predicate (without branches: key - row = (j R - i0 - 16 warp) + (c - row in the warp)).
    const bool masked = walk.needs_mask(b, j);
    const band_window bw(bd, j * R - (i0 + warp * 16), count - j * R);
#pragma unroll
    for (int t = 0; t < 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >= 2 ? 1 : 0;
        const int c = fragment_col(lane, t, e);
        const bool seen = !masked | bw.sees(c, c - fragment_row(lane, e));
        const float x = fast_exp2(fmaf(s[t][e], scale_log2, -lrow[r]));
        const float pr = seen ? x : 0.0f;
        dp[t][e] = pr * (dp[t][e] - drow[r]) * p.scale;
      }
    std::uint32_t a[4][4];
    pack_a<T>(dp, a);
    mma_ab<T, D>(dq, a, cK, lane); // dQ += dS K
  }
  cp_async_wait_all();
  const std::int64_t stride = static_cast<std::int64_t>(p.q_heads) * D;
  add_rows<D>(p.dq + row0 * stride + h * D, stride, warp * 16, rows, dq, lane);
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
