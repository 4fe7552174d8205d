#pragma once
//! \file
//! What a block-forward kernel receives, and what its epilogue does with each row (`epilogue`).

#include <ringattn/config.cuh>
#include <ringattn/core/block.cuh>
#include <ringattn/core/state.cuh>

#include <cstdint>

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

//! What a block-forward epilogue writes: the block's result plainly (`out`, `lse_out`), merged
//! into the state, written into a state that holds nothing yet (never read), or merged with the
//! state into `out` in T (the state's lse gets the merged lse; a ring's last step).
enum class epilogue { plain, fresh, merge, merge_out };

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
  attention_state state; // what fresh, merge and merge_out read or write
  // Dense [tokens, q_heads, head_dim] output in T: plain and merge_out.
  T* out;
  float* lse_out; // plain: [q_heads, tokens]
  std::int32_t q_heads;
  std::int32_t group_size;
  std::int64_t q_tokens;
  float scale_log2; // softmax scale * log2(e)
};

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
