#pragma once
//! \file
//! Mechanics of the CUDA block-forward kernel (FlashAttention-2 style, mma.sync m16n8k16 with
//! ldmatrix and cp.async double buffering). CUDA only; see block/device/forward.cuh for the
//! contract.

#include <ringattn/block/kernel/epilogue.cuh>
#include <ringattn/block/kernel/mask.cuh>
#include <ringattn/block/kernel/online_softmax.cuh>
#include <ringattn/block/kernel/primitives.cuh>
#include <ringattn/config.cuh>
#include <ringattn/core/tuning.cuh>

#include <cstdint>

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

// The tuning arrives as plain integers: nvcc's host stubs cannot spell class-type template
// arguments. Each warp owns MT row tiles of 16 rows; the thread block owns BM = 16 * MT * Warps.
template <class T, int D, int Warps, int MT, int BN, bool QInRegisters, epilogue E>
__global__ void __launch_bounds__(Warps * 32, Warps == 4 && D <= 128 ? 2 : 1)
    block_forward_kernel(forward_params<T> p) {
  constexpr int BM = 16 * MT * Warps, Threads = 32 * Warps;
  constexpr int KSteps = D / 16; // k-steps of Q K^T
  constexpr int NTiles = BN / 8; // 8-column tiles of S
  constexpr int DTiles = D / 8;  // 8-column tiles of O

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BM * D; // two buffers of BN x D
  T* sV = sK + 2 * BN * D;
  constexpr std::uint32_t elem = sizeof(T);
  const std::uint32_t aQ = smem_address(sQ), aK = smem_address(sK), aV = smem_address(sV);

  const work_tile tile = p.tiles[blockIdx.x];
  const block_group g = p.groups[tile.group];
  const int h = blockIdx.y, kvh = h / p.group_size;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t row0 = tile.row_begin; // first row of this tile within the group
  const int rows_valid = static_cast<int>(g.q_count - row0 < BM ? g.q_count - row0 : BM);

  const kv_walk<BN> walk(g, row0, rows_valid);
  const int total = walk.total;
  auto kv_base = [&](bool second, std::int64_t j, const T* base, std::int64_t ts, std::int64_t hs) {
    return base + (walk.begin(second) + j * BN) * ts + kvh * hs;
  };

  // Q tile and the first K/V tile.
  load_tile<BM, D, Threads>(sQ, p.q + (g.q_begin + row0) * p.q_token_stride + h * p.q_head_stride,
                            p.q_token_stride, rows_valid);
  if (total > 0) {
    bool b;
    std::int64_t j;
    walk.tile(0, b, j);
    load_tile<BN, D, Threads>(sK, kv_base(b, j, p.k, p.k_token_stride, p.k_head_stride),
                              p.k_token_stride, walk.valid(b, j));
    load_tile<BN, D, Threads>(sV, kv_base(b, j, p.v, p.v_token_stride, p.v_head_stride),
                              p.v_token_stride, walk.valid(b, j));
  }
  cp_async_commit();

  float acc[MT][DTiles][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < DTiles; ++t)
      acc[mt][t][0] = acc[mt][t][1] = acc[mt][t][2] = acc[mt][t][3] = 0.0f;
  online_softmax<> sm[MT]; // rows r and r + 8 of each row tile
  std::uint32_t qf[QInRegisters ? MT : 1][QInRegisters ? KSteps : 1][4];

  const int wrow = warp * 16 * MT; // first row of this warp in the tile
  for (int it = 0; it < total; ++it) {
    cp_async_wait_all();
    __syncthreads(); // tile `it` landed; every warp is done with the buffer refilled below
    bool b;
    std::int64_t j;
    walk.tile(it, b, j);
    const std::uint32_t cK = aK + (it & 1) * (BN * D * elem);
    const std::uint32_t cV = aV + (it & 1) * (BN * D * elem);
    if (it + 1 < total) {
      bool nb;
      std::int64_t nj;
      walk.tile(it + 1, nb, nj);
      T* dK = sK + ((it + 1) & 1) * BN * D;
      T* dV = sV + ((it + 1) & 1) * BN * D;
      load_tile<BN, D, Threads>(dK, kv_base(nb, nj, p.k, p.k_token_stride, p.k_head_stride),
                                p.k_token_stride, walk.valid(nb, nj));
      load_tile<BN, D, Threads>(dV, kv_base(nb, nj, p.v, p.v_token_stride, p.v_head_stride),
                                p.v_token_stride, walk.valid(nb, nj));
    }
    cp_async_commit();
    if constexpr (QInRegisters) {
      if (it == 0) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int kk = 0; kk < KSteps; ++kk)
            ldmatrix_x4(qf[mt][kk],
                        aQ + elem * swizzle<D>(wrow + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
      }
    }

    // S = Q K^T for this warp's rows and BN columns; each K fragment feeds MT instructions.
    float s[MT][NTiles][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int t = 0; t < NTiles; ++t)
        s[mt][t][0] = s[mt][t][1] = s[mt][t][2] = s[mt][t][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KSteps; ++kk) {
      std::uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (QInRegisters) {
#pragma unroll
          for (int x = 0; x < 4; ++x)
            a[mt][x] = qf[mt][kk][x];
        } else {
          ldmatrix_x4(a[mt],
                      aQ + elem * swizzle<D>(wrow + mt * 16 + (lane & 15), kk * 2 + (lane >> 4)));
        }
      }
#pragma unroll
      for (int np = 0; np < NTiles / 2; ++np) {
        std::uint32_t kb[4];
        const int krow = np * 16 + ((lane >> 4) << 3) + (lane & 7);
        ldmatrix_x4(kb, cK + elem * swizzle<D>(krow, kk * 2 + ((lane >> 3) & 1)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<T>(s[mt][2 * np], a[mt], kb[0], kb[1]);
          mma_16816<T>(s[mt][2 * np + 1], a[mt], kb[2], kb[3]);
        }
      }
    }

    // Band and bounds mask: only tiles outside the unmasked range or past the last key.
    if (walk.needs_mask(b, j)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        mask_fragment<NTiles>([&](int t, int e) -> float& { return s[mt][t][e]; }, walk.mask(b),
                              row0 + wrow + mt * 16, j * BN, walk.count(b), lane);
    }

    // Online softmax (online_softmax.cuh). P is packed to 16-bit pairs at once: the fp32 scores
    // die here (half the registers), and two 8-column tiles of S accumulators are exactly the A
    // fragment of one k-step of P V.
    std::uint32_t pa[MT][BN / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float corr[2];
      sm[mt].template update<NTiles>([&](int t, int e) { return s[mt][t][e]; }, p.scale_log2, corr,
                                     [&](int t, float p0, float p1, float p2, float p3) {
                                       pa[mt][t / 2][(t & 1) * 2] = pack2<T>(p0, p1);
                                       pa[mt][t / 2][(t & 1) * 2 + 1] = pack2<T>(p2, p3);
                                     });
      scale_rows<DTiles>([&](int t, int e) -> float& { return acc[mt][t][e]; }, corr);
    }

    // O += P V; each V fragment feeds MT instructions.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        std::uint32_t vb[4];
        const int vrow = kk * 16 + (((lane >> 3) & 1) << 3) + (lane & 7);
        ldmatrix_x4_trans(vb, cV + elem * swizzle<D>(vrow, dp * 2 + (lane >> 4)));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_16816<T>(acc[mt][2 * dp], pa[mt][kk], vb[0], vb[1]);
          mma_16816<T>(acc[mt][2 * dp + 1], pa[mt][kk], vb[2], vb[3]);
        }
      }
    }
  }
  cp_async_wait_all();

  if (p.state.max_logit != nullptr) { // asked for: the warp's rows' largest logit, one atomic
    float x = -__builtin_huge_valf();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        x = nan_max(x, row_max_logit(wrow + mt * 16 + (lane >> 2) + r * 8 < rows_valid, sm[mt].m[r],
                                     sm[mt].l[r]));
    add_max_logit(p, h, lane, x);
  }
  // The block's (o, lse) per row, then merge into the state (or write it plainly).
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int local = wrow + mt * 16 + (lane >> 2) + r * 8;
      finish_row<T, D, E>(p, h, g.q_begin + row0 + local, local < rows_valid, sm[mt].m[r],
                          sm[mt].l[r], lane, [&](int t, int x) { return acc[mt][t][2 * r + x]; });
    }
}

//! Shared memory of one thread block: the Q tile, two K and two V tiles.
template <class T, int D>
constexpr int forward_smem_bytes(forward_tuning t) {
  return (t.block_m() + 4 * t.block_n) * D * static_cast<int>(sizeof(T));
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
