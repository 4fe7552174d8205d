#pragma once
//! \file
//! Arguments of one block-forward call, shared by the host and CUDA implementations, and their
//! validation (run before anything is launched or written).

#include <ringattn/arguments.cuh>
#include <ringattn/block/device/block.cuh>
#include <ringattn/core/kv_scales.cuh>
#include <ringattn/core/state.cuh>
#include <ringattn/tensor.cuh>

#include <cstddef>
#include <cstdint>
#include <span>

namespace ringattn {

//! One block-forward call: `q` (this rank's Q shard, `[q_tokens, q_heads, head_dim]`) against the
//! K/V block `k` (`[kv_tokens, kv_heads, head_dim]`), `v` (`[kv_tokens, kv_heads, head_dim_v]`),
//! merged into `state` (`head_dim_v` wide).
template <element T>
struct block_forward_args {
  thd_view<const T> q;
  thd_view<const T> k;
  thd_view<const T> v;
  attention_arguments args;
  attention_state state;
  //! Device scratch of the BlockKernel's own (`*_workspace_bytes()` count it; a model that asks
  //! for none gets a null pointer).
  std::byte* scratch = nullptr;
  //! The dequantisation scales of k and v, in the layout their element type carries
  //! (`scales_for<T>`, core/kv_scales.cuh: none for fp16 and bf16, taking no space). The ring
  //! fills it from the K/V slot the block travelled in.
  [[no_unique_address]] scales_for<T> kv_scales{};
};

//! Shapes agree with the arguments, views are valid, the state matches q (the groups aside: a
//! caller that validated them once, at plan time, checks only these).
template <element T>
validation validate_block_forward_tensors(const block_forward_args<T>& a) {
  validation r = a.args.validate();
  r.require(validate_view(a.q, "q"))
      .require(validate_view(a.k, "k"))
      .require(validate_view(a.v, "v"));
  if (!r) return r;
  r.require(a.q.heads == a.args.q_heads, "q has ", a.q.heads, " heads but q_heads is ",
            a.args.q_heads);
  r.require(a.k.heads == a.args.kv_heads && a.v.heads == a.args.kv_heads, "k/v have ", a.k.heads,
            "/", a.v.heads, " heads but kv_heads is ", a.args.kv_heads);
  r.require(a.q.head_dim == a.args.qk_dim() && a.k.head_dim == a.args.qk_dim(), "q/k head_dim ",
            a.q.head_dim, "/", a.k.head_dim, " differ from head_dim ", a.args.qk_dim());
  r.require(a.v.head_dim == a.args.v_dim(), "v is ", a.v.head_dim, " wide but head_dim_v is ",
            a.args.v_dim());
  r.require(a.k.tokens == a.v.tokens, "k has ", a.k.tokens, " tokens but v has ", a.v.tokens);
  r.require(a.state.tokens == a.q.tokens && a.state.q_heads == a.args.q_heads &&
                a.state.head_dim == a.args.v_dim(),
            "the state is [", a.state.tokens, ", ", a.state.q_heads, ", ", a.state.head_dim,
            "] but the output is [", a.q.tokens, ", ", a.args.q_heads, ", ", a.args.v_dim(), "]");
  r.require(a.q.tokens == 0 ||
                (a.state.o != nullptr && a.state.lse != nullptr && a.state.sum != nullptr),
            "the state's o, lse or sum is a null pointer");
  return r;
}

//! The tensors as above, and the groups fit them.
template <element T>
validation validate_block_forward(const block_forward_args<T>& a,
                                  std::span<const block_group> groups) {
  validation r = validate_block_forward_tensors(a);
  if (r) r.require(validate_groups(groups, a.q.tokens, a.k.tokens));
  return r;
}

} // namespace ringattn
