#pragma once
//! \file
//! Mechanics of the CUDA block-forward kernel (FlashAttention-2 style, mma.sync m16n8k16 with
//! ldmatrix and cp.async double buffering). CUDA only; see kernel/forward.cuh for the contract.

#include <ringattn/config.cuh>
#include <ringattn/kernel/block.cuh>
#include <ringattn/kernel/state.cuh>
#include <ringattn/kernel/tuning.cuh>
#include <ringattn/tensor.cuh>

#include <cstdint>

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

template <class T>
struct forward_params {
  const T* q;
  const T* k;
  const T* v;
  std::int64_t q_token_stride, q_head_stride;
  std::int64_t k_token_stride, k_head_stride;
  std::int64_t v_token_stride, v_head_stride;
  const block_group* groups;
  const work_tile* tiles;
  attention_state state; // merge target (Merge) or o unused
  // Dense [tokens, q_heads, head_dim] output: the plain output (!Merge), or with Merge, when not
  // null, where the merged o goes in T instead of the state's o (a ring's last step).
  T* out;
  float* lse_out; // plain output (!Merge): [q_heads, tokens]
  std::int32_t q_heads;
  std::int32_t group_size;
  std::int64_t q_tokens;
  float scale_log2;   // softmax scale * log2(e)
  std::int32_t fresh; // Merge: the state holds nothing yet; it is written, never read
};

__device__ __forceinline__ std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n"); }

// ldmatrix on a 32-bit shared-space address (computed once per thread block, then offset with
// 32-bit arithmetic: no generic-to-shared conversion per load).
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
//! 2^x with the hardware approximation (relative error ~2^-22; -inf gives 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

//! c += a * b for one m16n8k16 tile; fp32 accumulation.
template <class T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const std::uint32_t (&a)[4],
                                          std::uint32_t b0, std::uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

//! Two floats as one register of two 16-bit elements (low half = first).
template <class T>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&v);
  }
}

//! Element offset of 16-byte chunk `chunk` of row `row` in a [rows, D] shared tile. Chunks are
//! XOR-swizzled with row % 8 so that the 8 rows an ldmatrix reads hit 8 different bank groups.
template <int D>
__device__ __forceinline__ std::uint32_t swizzle(int row, int chunk) {
  return static_cast<std::uint32_t>(row * D + ((chunk ^ (row & 7)) << 3));
}

//! Copies rows [0, Rows) of a [tokens, D] global slice (row stride `stride` elements) into a
//! swizzled shared tile; rows >= valid are zero-filled (their scores are masked, and zeros keep
//! 0 * garbage from making NaN).
template <int Rows, int D, int Threads, class T>
__device__ __forceinline__ void load_tile(T* s, const T* g, std::int64_t stride, int valid) {
  constexpr int chunks = D / 8;
#pragma unroll
  for (int c = threadIdx.x; c < Rows * chunks; c += Threads) {
    const int r = c / chunks, ch = c % chunks;
    const bool ok = r < valid;
    cp_async_16(s + swizzle<D>(r, ch), ok ? g + r * stride + ch * 8 : g, ok);
  }
}

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

//! What a block-forward epilogue writes: the block's result plainly (`out`, `lse_out`), merged
//! into the state, written into a state that holds nothing yet (never read), or merged with the
//! state into `out` in T (the state's lse gets the merged lse; a ring's last step).
enum class epilogue { plain, merge, fresh, merge_out };

//! Finishes one query row of a block-forward thread block, in the m16n8 accumulator layout (a
//! quad of lanes holds a row; `acc(t, x)` is element x of this lane's pair in the row's 8-column
//! tile t of the unnormalised output): reduces the row sum across the quad, then writes as `E`
//! says. `m` is the row's running max in log2 units, `l` this lane's part of its sum. Every lane
//! of the quad must call it. `old(t, x)`, `ref` and `sum` are the state's o, reference and sum for
//! the same elements (merge and merge_out; read by the caller, possibly early, so that the loads
//! overlap other work; -inf and 0 for a row that is not live). The merge is state.cuh's, each
//! element `old * w.old + acc * (inv * w.block)` rounded step by step (no fused multiply-add), so
//! that a merge that only adds (`w.old` = 1) rounds as the L2's reduction does.
template <class T, int D, epilogue E, class Acc, class Old>
__device__ __forceinline__ void finish_row(const forward_params<T>& p, int h, std::int64_t row,
                                           bool live, float m, float l, int lane, Acc acc, Old old,
                                           float ref, float sum_old) {
  constexpr float ln2 = 0.6931471805599453f, neg_inf = -__builtin_huge_valf();
  float sum = l;
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  const float lse_b = sum > 0.0f ? (m + __log2f(sum)) * ln2 : neg_inf;
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  const std::int64_t at = h * p.state.tokens + row; // the row's lse and sum in the state
  auto write_out = [&](auto value, float lse, float* lse_dst) {
    if (!live) return;
    T* o = p.out + (row * p.q_heads + h) * D + (lane & 3) * 2;
#pragma unroll
    for (int t = 0; t < D / 8; ++t)
      *reinterpret_cast<std::uint32_t*>(o + t * 8) = pack2<T>(value(t, 0), value(t, 1));
    if ((lane & 3) == 0) *lse_dst = lse;
  };
  auto write_state = [&](auto value, float new_ref, float new_sum) {
    if (!live) return;
    float* o = p.state.o_row(row, h) + (lane & 3) * 2;
#pragma unroll
    for (int t = 0; t < D / 8; ++t)
      *reinterpret_cast<float2*>(o + t * 8) = make_float2(value(t, 0), value(t, 1));
    if ((lane & 3) == 0) {
      p.state.lse[at] = new_ref;
      p.state.sum[at] = new_sum;
    }
  };
  auto block = [&](int t, int x) { return acc(t, x) * inv; };
  if constexpr (E == epilogue::plain) {
    write_out(block, lse_b, p.lse_out + h * p.q_tokens + row);
  } else if constexpr (E == epilogue::fresh) {
    write_state(block, lse_b, sum > 0.0f ? 1.0f : 0.0f);
  } else {
    __syncwarp(); // every lane of the quad has read the row's lse and sum before one rewrites them
    const row_merge w = merge_into(ref, lse_b);
    const float k = inv * w.block;
    auto merged = [&](int t, int x) {
      return __fadd_rn(__fmul_rn(old(t, x), w.old), __fmul_rn(acc(t, x), k));
    };
    const float new_sum = __fadd_rn(__fmul_rn(sum_old, w.old), w.block);
    if constexpr (E == epilogue::merge) {
      write_state(merged, w.new_ref, new_sum);
    } else {
      const float inv_sum = new_sum > 0.0f ? 1.0f / new_sum : 0.0f;
      write_out([&](int t, int x) { return merged(t, x) * inv_sum; }, final_lse(w.new_ref, new_sum),
                p.state.lse + at);
    }
  }
}

//! `finish_row` reading the state's old values itself.
template <class T, int D, epilogue E, class Acc>
__device__ __forceinline__ void finish_row(const forward_params<T>& p, int h, std::int64_t row,
                                           bool live, float m, float l, int lane, Acc acc) {
  constexpr bool reads = E == epilogue::merge || E == epilogue::merge_out;
  float ref = -__builtin_huge_valf(), sum = 0.0f;
  if (reads && live) {
    ref = p.state.lse[h * p.state.tokens + row];
    sum = p.state.sum[h * p.state.tokens + row];
  }
  const float* o = reads ? p.state.o_row(row, h) + (lane & 3) * 2 : nullptr;
  finish_row<T, D, E>(
      p, h, row, live, m, l, lane, acc, [&](int t, int x) { return o[t * 8 + x]; }, ref, sum);
}

//! Runs `finish.template operator()<E>()` with the epilogue a launch asked for: plain output
//! (`!Merge`), or for a merge, fresh (`p.fresh`), into the output (`p.out`) or into the state.
template <bool Merge, class T, class Finish>
__device__ __forceinline__ void with_epilogue(const forward_params<T>& p, Finish finish) {
  if constexpr (!Merge)
    finish.template operator()<epilogue::plain>();
  else if (p.fresh)
    finish.template operator()<epilogue::fresh>();
  else if (p.out != nullptr)
    finish.template operator()<epilogue::merge_out>();
  else
    finish.template operator()<epilogue::merge>();
}

// The tuning arrives as plain integers: nvcc's host stubs cannot spell class-type template
// arguments. Each warp owns MT row tiles of 16 rows; the thread block owns BM = 16 * MT * Warps.
template <class T, int D, int Warps, int MT, int BN, bool QInRegisters, bool Merge>
__global__ void __launch_bounds__(Warps * 32, Warps == 4 && D <= 128 ? 2 : 1)
    block_forward_kernel(forward_params<T> p) {
  constexpr int BM = 16 * MT * Warps, Threads = 32 * Warps;
  constexpr int KSteps = D / 16; // k-steps of Q K^T
  constexpr int NTiles = BN / 8; // 8-column tiles of S
  constexpr int DTiles = D / 8;  // 8-column tiles of O
  constexpr float neg_inf = -__builtin_huge_valf();

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
  // Running max of scaled scores (log2 units) and this thread's part of the running sum, for
  // rows r and r + 8 of each row tile.
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    m[mt][0] = m[mt][1] = neg_inf, l[mt][0] = l[mt][1] = 0.0f;
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
      const std::int64_t count = walk.count(b);
      const band bd = walk.mask(b);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < NTiles; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const std::int64_t i = row0 + wrow + mt * 16 + (lane >> 2) + (e >= 2 ? 8 : 0);
            const std::int64_t c = j * BN + t * 8 + (lane & 3) * 2 + (e & 1);
            if (c >= count || !bd.sees(i, c)) s[mt][t][e] = neg_inf;
          }
    }

    // Online softmax in base 2: p = 2^(s * scale_log2 - m). P is packed to 16-bit pairs at once:
    // the fp32 scores die here (half the registers), and two 8-column tiles of S accumulators are
    // exactly the A fragment of one k-step of P V.
    std::uint32_t pa[MT][BN / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float mx[2] = {neg_inf, neg_inf};
#pragma unroll
      for (int t = 0; t < NTiles; ++t) {
        mx[0] = fmaxf(mx[0], fmaxf(s[mt][t][0], s[mt][t][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[mt][t][2], s[mt][t][3]));
      }
      float corr[2], base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float mnew = fmaxf(m[mt][r], mx[r] * p.scale_log2);
        corr[r] = m[mt][r] == neg_inf ? 0.0f : fast_exp2(m[mt][r] - mnew);
        base[r] = mnew == neg_inf ? 0.0f : mnew; // a row with nothing visible yet: p = 0
        m[mt][r] = mnew;
        l[mt][r] *= corr[r];
      }
#pragma unroll
      for (int t = 0; t < NTiles; ++t) {
        const float p0 = fast_exp2(fmaf(s[mt][t][0], p.scale_log2, -base[0]));
        const float p1 = fast_exp2(fmaf(s[mt][t][1], p.scale_log2, -base[0]));
        const float p2 = fast_exp2(fmaf(s[mt][t][2], p.scale_log2, -base[1]));
        const float p3 = fast_exp2(fmaf(s[mt][t][3], p.scale_log2, -base[1]));
        l[mt][0] += p0 + p1;
        l[mt][1] += p2 + p3;
        pa[mt][t / 2][(t & 1) * 2] = pack2<T>(p0, p1);
        pa[mt][t / 2][(t & 1) * 2 + 1] = pack2<T>(p2, p3);
      }
#pragma unroll
      for (int t = 0; t < DTiles; ++t) {
        acc[mt][t][0] *= corr[0];
        acc[mt][t][1] *= corr[0];
        acc[mt][t][2] *= corr[1];
        acc[mt][t][3] *= corr[1];
      }
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

  // The block's (o, lse) per row, then merge into the state (or write it plainly).
  with_epilogue<Merge>(p, [&]<epilogue E>() {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int local = wrow + mt * 16 + (lane >> 2) + r * 8;
        finish_row<T, D, E>(p, h, g.q_begin + row0 + local, local < rows_valid, m[mt][r], l[mt][r],
                            lane, [&](int t, int x) { return acc[mt][t][2 * r + x]; });
      }
  });
}

//! Shared memory of one thread block: the Q tile, two K and two V tiles.
template <class T, int D>
constexpr int forward_smem_bytes(forward_tuning t) {
  return (t.block_m() + 4 * t.block_n) * D * static_cast<int>(sizeof(T));
}

template <class V>
__global__ void fill_kernel(V* p, std::int64_t n, V value) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    p[i] = value;
}

//! o / sum of every row of a (head-major) state into `out`, and the row's lse over its reference
//! (the thread that handles a row's first pair).
template <class T>
__global__ void finalize_kernel(const float* o, float* lse, const float* sum, T* out,
                                std::int64_t rows, std::int64_t tokens, int head_dim,
                                std::int64_t token_stride, std::int64_t head_stride) {
  // Row r of the state is (head r / tokens, token r % tokens); two elements a thread at a time.
  const std::int64_t pairs = rows * (head_dim / 2);
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / (head_dim / 2);
    const int e = static_cast<int>(i % (head_dim / 2)) * 2;
    const float s = sum[row], inv = s > 0.0f ? 1.0f / s : 0.0f;
    const float2 x = *reinterpret_cast<const float2*>(o + row * head_dim + e);
    T* dst = out + (row % tokens) * token_stride + (row / tokens) * head_stride + e;
    *reinterpret_cast<std::uint32_t*>(dst) = pack2<T>(x.x * inv, x.y * inv);
    if (e == 0) lse[row] = final_lse(lse[row], s);
  }
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
