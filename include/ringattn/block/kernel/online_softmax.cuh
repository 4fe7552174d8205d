#pragma once
//! \file
//! The online softmax of the forward kernels (mma.sync and wgmma) and the decode kernel, in base
//! 2: a thread's part of the running state of its two rows of an m16n8 accumulator fragment (rows
//! r and r + 8 of a 16-row tile; the quad of four threads holding a row holds its 8-column tiles'
//! columns 2 (lane % 4) and 2 (lane % 4) + 1), updated one tile of scores at a time.

#include <ringattn/block/kernel/primitives.cuh>

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

//! A row maximum that passes over a NaN score (fmaxf). The NaN still reaches the row's sum and
//! output through its weight, 2^NaN.
struct skipping_max {
  __device__ __forceinline__ static float of(float a, float b) { return fmaxf(a, b); }
};
//! A row maximum that is NaN once a NaN score is seen: the row's maximum, sum and output are then
//! all NaN (the decode's partials are merged by their maxima).
struct carrying_max {
  __device__ __forceinline__ static float of(float a, float b) { return nan_max(a, b); }
};

//! A thread's running softmax state of its two rows: `m`, the largest scaled score seen (log2
//! units; -inf while no key was visible), and `l`, this thread's part of the sum of the weights
//! 2^(s scale_log2 - m) (the quad's four parts make the row's sum).
template <class Max = skipping_max>
struct online_softmax {
  float m[2] = {-__builtin_huge_valf(), -__builtin_huge_valf()};
  float l[2] = {0.0f, 0.0f};

  //! Folds one tile of `NTiles` 8-column accumulator tiles of raw scores into the state.
  //! `score(t, e)` is element e of tile t (row e / 2), masked keys at -inf. Each row's maximum
  //! and its factor for what was accumulated before (`corr`: 0 while no key was visible, as the
  //! output then is 0) come first; then `weigh(t, p0, p1, p2, p3)` receives tile t's weights, in
  //! the order of `score`, and their sum is added to `l`. A row that has seen no key yet gets
  //! weights 0.
  template <int NTiles, class Score, class Weigh>
  __device__ __forceinline__ void update(Score&& score, float scale_log2, float (&corr)[2],
                                         Weigh&& weigh) {
    constexpr float neg_inf = -__builtin_huge_valf();
    float mx[2] = {neg_inf, neg_inf};
#pragma unroll
    for (int t = 0; t < NTiles; ++t) {
      mx[0] = Max::of(mx[0], Max::of(score(t, 0), score(t, 1)));
      mx[1] = Max::of(mx[1], Max::of(score(t, 2), score(t, 3)));
    }
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = Max::of(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = Max::of(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float now = Max::of(m[r], mx[r] * scale_log2);
      corr[r] = m[r] == neg_inf ? 0.0f : fast_exp2(m[r] - now);
      base[r] = now == neg_inf ? 0.0f : now; // nothing visible yet: every weight is 0
      m[r] = now;
      l[r] *= corr[r];
    }
#pragma unroll
    for (int t = 0; t < NTiles; ++t) {
      const float p0 = fast_exp2(fmaf(score(t, 0), scale_log2, -base[0]));
      const float p1 = fast_exp2(fmaf(score(t, 1), scale_log2, -base[0]));
      const float p2 = fast_exp2(fmaf(score(t, 2), scale_log2, -base[1]));
      const float p3 = fast_exp2(fmaf(score(t, 3), scale_log2, -base[1]));
      l[0] += p0 + p1;
      l[1] += p2 + p3;
      weigh(t, p0, p1, p2, p3);
    }
  }
};

//! Scales the two rows of `Tiles` 8-column accumulator tiles (`acc(t, e)`, element e of tile t,
//! row e / 2) by their factors.
template <int Tiles, class Acc>
__device__ __forceinline__ void scale_rows(Acc&& acc, const float (&corr)[2]) {
#pragma unroll
  for (int t = 0; t < Tiles; ++t) {
    acc(t, 0) *= corr[0];
    acc(t, 1) *= corr[0];
    acc(t, 2) *= corr[1];
    acc(t, 3) *= corr[1];
  }
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
