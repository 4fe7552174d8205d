#pragma once
//! \file
//! Arguments of one block-backward call, shared by the host and CUDA implementations, and their
//! validation (run before anything is launched or written).
//!
//! One call takes a rank's queries against one K/V block (the same block groups as the forward)
//! and accumulates, in fp32, the gradient of the loss with respect to the queries (`dq`, over the
//! rank's Q shard) and to the block's keys and values (`dk`, `dv`, over the block). It recomputes
//! the probabilities from the forward's *final* log-sum-exp, `P_ij = exp(scale q_i.k_j - lse_i)`,
//! so every block's share is exact on its own, and needs `D_i = sum_e dO_ie O_ie` (`delta`, from
//! `compute_delta`): with `dP_ij = dO_i.v_j` and `dS_ij = P_ij (dP_ij - D_i)`,
//!
//!     dv_j += sum_i P_ij dO_i      dq_i += scale sum_j dS_ij k_j      dk_j += scale sum_i dS_ij
//!     q_i
//!
//! where, under GQA, dk and dv of a kv head sum over the query heads of its group.

#include <ringattn/arguments.cuh>
#include <ringattn/block/device/block.cuh>
#include <ringattn/core/kv_scales.cuh>
#include <ringattn/tensor.cuh>

#include <cstddef>
#include <cstdint>
#include <span>

namespace ringattn {

//! fp32 gradient accumulators of one call. Non-owning; host or device memory, dense.
struct gradient_state {
  float* dq = nullptr; //!< [q_tokens, q_heads, head_dim]
  float* dk = nullptr; //!< [kv_tokens, kv_heads, head_dim]
  float* dv = nullptr; //!< [kv_tokens, kv_heads, head_dim_v]
};

//! One block-backward call: `q` (`[q_tokens, q_heads, head_dim]`), `dout` (`[q_tokens, q_heads,
//! head_dim_v]`), the forward's `lse` and `delta` (`[q_heads, q_tokens]`, fp32, natural log for
//! lse) against the K/V block `k` (`[kv_tokens, kv_heads, head_dim]`), `v` (`[kv_tokens, kv_heads,
//! head_dim_v]`), accumulated into `grad`.
template <element T>
struct block_backward_args {
  thd_view<const T> q;
  thd_view<const T> k;
  thd_view<const T> v;
  thd_view<const T> dout;
  const float* lse = nullptr;
  const float* delta = nullptr;
  attention_arguments args;
  gradient_state grad;
  //! The forward's output (a model that recomputes D itself reads it; the ring's device path
  //! sets it, the native kernels take `delta` instead).
  thd_view<const T> out{};
  //! Device scratch of the BlockKernel's own, as in the forward.
  std::byte* scratch = nullptr;
  //! The dequantisation scales of k and v, as in the forward.
  [[no_unique_address]] scales_for<T> kv_scales{};
};

//! Shapes agree with the arguments, views are valid, pointers are there (the groups aside).
template <element T>
validation validate_block_backward_tensors(const block_backward_args<T>& a) {
  validation r = a.args.validate();
  r.require(validate_view(a.q, "q"))
      .require(validate_view(a.k, "k"))
      .require(validate_view(a.v, "v"))
      .require(validate_view(a.dout, "dout"));
  if (!r) return r;
  r.require(a.q.heads == a.args.q_heads && a.dout.heads == a.args.q_heads, "q/dout have ",
            a.q.heads, "/", a.dout.heads, " heads but q_heads is ", a.args.q_heads);
  r.require(a.k.heads == a.args.kv_heads && a.v.heads == a.args.kv_heads, "k/v have ", a.k.heads,
            "/", a.v.heads, " heads but kv_heads is ", a.args.kv_heads);
  r.require(a.q.head_dim == a.args.qk_dim() && a.k.head_dim == a.args.qk_dim(), "q/k head_dim ",
            a.q.head_dim, "/", a.k.head_dim, " differ from head_dim ", a.args.qk_dim());
  r.require(a.v.head_dim == a.args.v_dim() && a.dout.head_dim == a.args.v_dim(), "v/dout are ",
            a.v.head_dim, "/", a.dout.head_dim, " wide but head_dim_v is ", a.args.v_dim());
  r.require(a.k.tokens == a.v.tokens, "k has ", a.k.tokens, " tokens but v has ", a.v.tokens);
  r.require(a.dout.tokens == a.q.tokens, "dout has ", a.dout.tokens, " tokens but q has ",
            a.q.tokens);
  r.require(a.q.tokens == 0 || (a.lse != nullptr && a.delta != nullptr && a.grad.dq != nullptr),
            "lse, delta or dq is a null pointer");
  r.require(a.k.tokens == 0 || (a.grad.dk != nullptr && a.grad.dv != nullptr),
            "dk or dv is a null pointer");
  return r;
}

//! The tensors as above, and the groups fit them.
template <element T>
validation validate_block_backward(const block_backward_args<T>& a,
                                   std::span<const block_group> groups) {
  validation r = validate_block_backward_tensors(a);
  if (r) r.require(validate_groups(groups, a.q.tokens, a.k.tokens));
  return r;
}

} // namespace ringattn
