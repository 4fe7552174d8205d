#pragma once
//! \file
//! The layout of a ring's workspace, one formula for every path and every `*_bytes()` query.
//!
//! Forward (host and device):   [ K/V slot 0 | ... | K/V slot S-1 | state o | state sum ]
//! Backward, its base:          [ grad slot 0 | ... | grad slot S-1 | dQ (fp32) | own dK/dV | D ]
//!   (`host_backward_bytes`), then `shares` fp32 dK/dV of the largest block
//!   (`device_backward_bytes`: what the ring and the all-gather take on both paths)
//!
//! A K/V slot holds a block's k (`[tokens, kv_heads, head_dim]` in T, dense: what travels) then
//! its v (`head_dim_v` wide) and the scales its element type carries (`scales_for<T>`, none for
//! fp16 and bf16; they travel in the same message); a grad slot the same followed by the block's
//! fp32 dk, dv (their widths). The state's o and dQ take the widths of the output and of q. The
//! schedule decides the counts: the ring keeps two slots (the block in use and the one arriving)
//! and one share, the all-gather a slot for every rank's block and a share for every block it
//! receives dK/dV of. Slots are sized for the largest block that travels; every region starts
//! 256-byte aligned. The state's lse is the caller's lse. Where not all of a rank's shard travels
//! (ring/schedule.cuh, `kv_travel`), the backward keeps the fp32 dK/dV of the whole shard apart
//! ("own dK/dV"): the own slot then holds the travelling rows and the sums the other ranks add to
//! them.

#include <ringattn/arguments.cuh>
#include <ringattn/block/device/backward_args.cuh>
#include <ringattn/core/kv_scales.cuh>
#include <ringattn/core/state.cuh>
#include <ringattn/tensor.cuh>

#include <cstddef>
#include <cstdint>

namespace ringattn {

//! A K/V block in a ring buffer: k of `tokens` rows, then v, both dense, then its scales.
template <class T>
struct kv_block_views {
  thd_view<T> k, v;
  [[no_unique_address]] scales_for<T> scales{};
};
//! A backward block in a ring buffer: k, v (T, dense) and their scales, then its fp32 dk, dv
//! accumulators.
template <class T>
struct grad_block_views {
  thd_view<T> k, v;
  float *dk, *dv;
  [[no_unique_address]] scales_for<T> scales{};
};

//! A block-backward call over a grad slot: `call` (this rank's q, dout, lse, delta, arguments and
//! dq sums) with the slot's k, v and scales, the block's dK/dV share into `dk` and `dv`.
template <class T>
block_backward_args<T> over_slot(block_backward_args<T> call, const grad_block_views<T>& b,
                                 float* dk, float* dv) {
  call.k = thd_view<const T>(b.k);
  call.v = thd_view<const T>(b.v);
  call.grad.dk = dk;
  call.grad.dv = dv;
  call.kv_scales = b.scales;
  return call;
}

class ring_workspace {
public:
  ring_workspace(std::int64_t q_tokens, std::int64_t max_kv_tokens, const attention_arguments& args,
                 element_format format, int slots = 2, int shares = 1, bool own_sums = false)
      : n_(q_tokens), max_kv_(max_kv_tokens), qh_(args.q_heads), kvh_(args.kv_heads),
        dk_(args.qk_dim()), dv_(args.v_dim()), slots_(slots), shares_(shares), elem_(format.bytes),
        scale_(format.scale_bytes_per_kv_head), own_sums_(own_sums) {}

  static constexpr std::size_t align(std::size_t n) { return (n + 255) / 256 * 256; }

  //! Elements of k (dk) of a block of `tokens` rows.
  std::size_t k_elements(std::int64_t tokens) const {
    return static_cast<std::size_t>(tokens) * kvh_ * dk_;
  }
  //! Elements of v (dv) of a block of `tokens` rows.
  std::size_t v_elements(std::int64_t tokens) const {
    return static_cast<std::size_t>(tokens) * kvh_ * dv_;
  }
  //! Elements of k and v together (of dk and dv together) of a block of `tokens` rows.
  std::size_t kv_elements(std::int64_t tokens) const {
    return k_elements(tokens) + v_elements(tokens);
  }
  //! Bytes a K/V block of `tokens` rows occupies on the wire: k and v in T, then their scales.
  std::size_t block_bytes(std::int64_t tokens) const {
    return kv_elements(tokens) * elem_ + scale_bytes(tokens);
  }
  //! Bytes of a block's scales (after its k and v).
  std::size_t scale_bytes(std::int64_t tokens) const {
    return tokens > 0 ? static_cast<std::size_t>(kvh_) * scale_ : 0;
  }
  //! Bytes of a block's fp32 dK and dV.
  std::size_t grad_bytes(std::int64_t tokens) const { return kv_elements(tokens) * sizeof(float); }
  //! The largest message a forward (or a backward: a block with its dK/dV) sends.
  std::size_t largest_message(bool backward) const {
    return block_bytes(max_kv_) + (backward ? grad_bytes(max_kv_) : 0);
  }

  // ---- forward
  std::size_t kv_slot() const { return align(block_bytes(max_kv_)); }
  std::size_t state_o_bytes() const {
    return align(static_cast<std::size_t>(n_) * qh_ * dv_ * sizeof(float));
  }
  std::size_t forward_bytes() const {
    return slots() * kv_slot() + state_o_bytes() +
           static_cast<std::size_t>(n_) * qh_ * sizeof(float);
  }
  template <class T>
  kv_block_views<T> kv_slot_views(std::byte* base, int slot, std::int64_t tokens) const {
    std::byte* b = base + static_cast<std::size_t>(slot) * kv_slot();
    T* k = reinterpret_cast<T*>(b);
    const auto e = static_cast<std::int64_t>(k_elements(tokens));
    return {thd_view<T>(k, tokens, kvh_, dk_), thd_view<T>(k + e, tokens, kvh_, dv_),
            scales_in<T>(b, tokens)};
  }
  //! The fp32 state in the workspace (o, then the weight sums) with the caller's lse and max
  //! logits (null where not asked for).
  attention_state state(std::byte* base, float* lse, float* max_logit = nullptr) const {
    std::byte* o = base + slots() * kv_slot();
    return {reinterpret_cast<float*>(o),
            lse,
            reinterpret_cast<float*>(o + state_o_bytes()),
            n_,
            qh_,
            dv_,
            max_logit};
  }

  // ---- backward
  std::size_t grad_slot() const { return align(block_bytes(max_kv_) + grad_bytes(max_kv_)); }
  std::size_t dq_bytes() const {
    return align(static_cast<std::size_t>(n_) * qh_ * dk_ * sizeof(float));
  }
  //! The shard's own fp32 dK/dV apart from the slots (none where the shard travels whole).
  std::size_t own_sums_bytes() const { return own_sums_ ? align(grad_bytes(n_)) : 0; }
  std::size_t host_backward_bytes() const {
    return slots() * grad_slot() + dq_bytes() + own_sums_bytes() +
           static_cast<std::size_t>(n_) * qh_ * sizeof(float);
  }
  std::size_t device_backward_bytes() const {
    return align(host_backward_bytes()) + shares() * align(grad_bytes(max_kv_));
  }
  template <class T>
  grad_block_views<T> grad_slot_views(std::byte* base, int slot, std::int64_t tokens) const {
    std::byte* b = base + static_cast<std::size_t>(slot) * grad_slot();
    T* kv = reinterpret_cast<T*>(b);
    float* g = reinterpret_cast<float*>(b + block_bytes(tokens));
    const auto e = static_cast<std::int64_t>(k_elements(tokens));
    return {thd_view<T>(kv, tokens, kvh_, dk_), thd_view<T>(kv + e, tokens, kvh_, dv_), g, g + e,
            scales_in<T>(b, tokens)};
  }
  float* dq(std::byte* base) const {
    return reinterpret_cast<float*>(base + slots() * grad_slot());
  }
  //! The whole shard's fp32 dK (then dV), `[q_tokens, kv_heads, width]` each, where kept apart.
  float* own_sums(std::byte* base) const {
    return reinterpret_cast<float*>(base + slots() * grad_slot() + dq_bytes());
  }
  float* delta(std::byte* base) const {
    return reinterpret_cast<float*>(base + slots() * grad_slot() + dq_bytes() + own_sums_bytes());
  }
  //! Share i of `shares` fp32 dK/dV regions after the host layout (the device ring: a step's
  //! share before it joins the arriving accumulators; the all-gather: a block's dK/dV received).
  float* share(std::byte* base, int i = 0) const {
    return reinterpret_cast<float*>(base + align(host_backward_bytes()) +
                                    static_cast<std::size_t>(i) * align(grad_bytes(max_kv_)));
  }

private:
  //! The scales of a block of `tokens` rows that starts at `block`.
  template <class T>
  scales_for<T> scales_in(std::byte* block, std::int64_t tokens) const {
    return block_scales_at<scales_for<T>>(
        reinterpret_cast<float*>(block + kv_elements(tokens) * elem_), kvh_);
  }
  std::size_t slots() const { return static_cast<std::size_t>(slots_); }
  std::size_t shares() const { return static_cast<std::size_t>(shares_); }
  std::int64_t n_, max_kv_;
  int qh_, kvh_, dk_, dv_, slots_, shares_;
  std::size_t elem_, scale_;
  bool own_sums_;
};

} // namespace ringattn
