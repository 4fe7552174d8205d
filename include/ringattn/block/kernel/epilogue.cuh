#pragma once
//! \file
//! The row finish of the block-forward kernels (the online softmax's last step): the block's lse,
//! then a plain write, a fresh state, a merge into the state or a merge into the output, as the
//! launch's `epilogue` template argument says. Shared by the sm80 and sm90 kernels.

#include <ringattn/block/kernel/forward_params.cuh>
#include <ringattn/block/kernel/primitives.cuh>
#include <ringattn/config.cuh>
#include <ringattn/core/state.cuh>

#include <cstdint>

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

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
  const float lse_b = saw_key(sum) ? (m + __log2f(sum)) * ln2 : neg_inf;
  const float inv = inverse_sum(sum);
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
    write_state(block, lse_b, saw_key(sum) ? 1.0f : 0.0f);
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
      const float inv_sum = inverse_sum(new_sum);
      write_out([&](int t, int x) { return merged(t, x) * inv_sum; }, final_lse(w.new_ref, new_sum),
                p.state.lse + at);
    }
  }
}

//! A block row's contribution to its head's max logit (state.cuh's `max_logit_of`): `m` is the
//! row's running max in log2 units, `l` this lane's part of its sum (summed over the quad here;
//! every lane of the quad must call it). -inf for a row that is not live.
__device__ __forceinline__ float row_max_logit(bool live, float m, float l) {
  constexpr float ln2 = 0.6931471805599453f;
  float sum = l;
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  return live ? max_logit_of(m * ln2, sum) : -__builtin_huge_valf();
}

//! Adds the rows a warp finished (every lane's `x`, from `row_max_logit`; all of head `h`) to the
//! state's max logit with one atomic. Every lane of the warp must call it.
template <class T>
__device__ __forceinline__ void add_max_logit(const forward_params<T>& p, int h, int lane,
                                              float x) {
#pragma unroll
  for (int lane_mask = 4; lane_mask < 32; lane_mask *= 2)
    x = nan_max(x, __shfl_xor_sync(0xffffffffu, x, lane_mask));
  if (lane == 0) atomic_max_logit(p.state.max_logit + h, x);
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

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
