#pragma once
//! \file
//! Element types and tensor views of the THD layout.
//!
//! THD: a tensor `[tokens, heads, head_dim]` with head_dim contiguous (stride 1), heads
//! `head_stride` elements apart and tokens `token_stride` elements apart. All packed sequences of a
//! batch share the token dimension; `cu_seqlens` (int32, batch + 1 entries, starting at 0) says
//! where each begins. Views never own memory. Whether `data` is host or device memory is the
//! caller's contract with the function the view is passed to.
//!
//! \code
//! __nv_bfloat16* q = ...;                                  // [tokens, 32, 128], packed
//! ringattn::thd_view<const __nv_bfloat16> qv(q, tokens, 32, 128);
//! float x = ringattn::to_float(qv(t, h, d));
//! \endcode

#include <ringattn/core/element.cuh>
#include <ringattn/error.cuh>

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

namespace ringattn {

//! A non-owning view of a `[tokens, heads, head_dim]` tensor, head_dim contiguous.
//! Strides count elements, not bytes. Trivially copyable: pass it to kernels by value.
//! Elements: fp16, bf16, fp32, and `fp8_e4m3` for a quantised KV cache.
template <cache_element T>
struct thd_view {
  T* data = nullptr;
  std::int64_t tokens = 0;
  std::int32_t heads = 0;
  std::int32_t head_dim = 0;
  std::int64_t token_stride = 0; //!< elements between token t and t + 1 (>= heads * head_stride)
  std::int64_t head_stride = 0;  //!< elements between head h and h + 1 (>= head_dim)

  constexpr thd_view() = default;
  //! A densely packed view: head_stride = head_dim, token_stride = heads * head_dim.
  RINGATTN_HOST_DEVICE constexpr thd_view(T* p, std::int64_t t, std::int32_t h, std::int32_t d)
      : data(p), tokens(t), heads(h), head_dim(d), token_stride(static_cast<std::int64_t>(h) * d),
        head_stride(d) {}
  //! A strided view (e.g. q, k, v slices of one fused qkv projection).
  RINGATTN_HOST_DEVICE constexpr thd_view(T* p, std::int64_t t, std::int32_t h, std::int32_t d,
                                          std::int64_t ts, std::int64_t hs)
      : data(p), tokens(t), heads(h), head_dim(d), token_stride(ts), head_stride(hs) {}

  //! A view of const elements from a view of mutable ones (thd_view<T> -> thd_view<const T>).
  template <class U>
  requires(std::is_const_v<T>&& std::is_same_v<const U, T> &&
           !std::is_const_v<U>) RINGATTN_HOST_DEVICE constexpr thd_view(const thd_view<U>& o)
      : data(o.data), tokens(o.tokens), heads(o.heads), head_dim(o.head_dim),
        token_stride(o.token_stride), head_stride(o.head_stride) {}

  RINGATTN_HOST_DEVICE constexpr std::int64_t offset(std::int64_t t, std::int32_t h,
                                                     std::int32_t d) const {
    return t * token_stride + h * head_stride + d;
  }
  RINGATTN_HOST_DEVICE constexpr T& operator()(std::int64_t t, std::int32_t h,
                                               std::int32_t d) const {
    return data[offset(t, h, d)];
  }
  //! Pointer to the head_dim vector of (token, head).
  RINGATTN_HOST_DEVICE constexpr T* row(std::int64_t t, std::int32_t h) const {
    return data + t * token_stride + h * head_stride;
  }
  //! Elements a dense buffer for this view must hold (tokens * token_stride).
  RINGATTN_HOST_DEVICE constexpr std::int64_t extent() const { return tokens * token_stride; }
  //! True when heads and tokens follow each other without gaps.
  RINGATTN_HOST_DEVICE constexpr bool dense() const {
    return head_stride == head_dim && token_stride == static_cast<std::int64_t>(heads) * head_dim;
  }
};

template <class T>
thd_view(T*, std::int64_t, std::int32_t, std::int32_t) -> thd_view<T>;

//! Whether the address `p` is a multiple of `bytes`.
inline bool aligned_to(const void* p, std::size_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

//! Whether every (token, head) row of `v` starts on a multiple of `bytes`: its data pointer and
//! both strides, in bytes, are multiples of `bytes` (what the kernels' vector loads and stores
//! need: 16 for the 16-byte loads of q, k and v, 4 for the stores of element pairs).
template <class T>
bool rows_aligned_to(const thd_view<T>& v, std::size_t bytes) {
  return aligned_to(v.data, bytes) &&
         static_cast<std::size_t>(v.token_stride) * sizeof(T) % bytes == 0 &&
         static_cast<std::size_t>(v.head_stride) * sizeof(T) % bytes == 0;
}

namespace detail {
//! Bytes from a view's first element to one past its last (0 for no tokens), or -1 where that
//! does not fit in a signed 64-bit count (absurd strides).
template <class T>
std::int64_t view_bytes(const thd_view<T>& v) {
  if (v.tokens <= 0) return 0;
  std::int64_t a = 0, b = 0, e = 0;
  if (__builtin_mul_overflow(v.tokens - 1, v.token_stride, &a) ||
      __builtin_mul_overflow(static_cast<std::int64_t>(v.heads) - 1, v.head_stride, &b) ||
      __builtin_add_overflow(a, b, &e) || __builtin_add_overflow(e, v.head_dim, &e) ||
      __builtin_mul_overflow(e, static_cast<std::int64_t>(sizeof(T)), &e))
    return -1;
  return e;
}
} // namespace detail

//! Checks a view's shape and strides; `name` is used in the reason ("q", "k", ...).
//! A view with tokens == 0 may have a null pointer. Size arithmetic is checked: strides whose
//! products overflow are refused, never wrapped.
template <cache_element T>
validation validate_view(const thd_view<T>& v, const char* name) {
  validation r = validation::ok();
  r.require(v.tokens >= 0, name, ".tokens is negative (", v.tokens, ")");
  r.require(v.heads > 0, name, ".heads must be positive (got ", v.heads, ")");
  r.require(v.head_dim > 0, name, ".head_dim must be positive (got ", v.head_dim, ")");
  r.require(v.head_stride >= v.head_dim, name, ".head_stride (", v.head_stride,
            ") is smaller than head_dim (", v.head_dim, ")");
  if (!r) return r;
  std::int64_t row = 0; // elements of one token's heads
  const bool row_fits =
      !__builtin_mul_overflow(static_cast<std::int64_t>(v.heads) - 1, v.head_stride, &row) &&
      !__builtin_add_overflow(row, v.head_dim, &row);
  r.require(row_fits, name, ".head_stride (", v.head_stride, ") times heads (", v.heads,
            ") overflows a 64-bit element count");
  r.require(!row_fits || v.token_stride >= row, name, ".token_stride (", v.token_stride,
            ") makes tokens overlap (heads ", v.heads, ", head_stride ", v.head_stride,
            ", head_dim ", v.head_dim, ")");
  r.require(!r || detail::view_bytes(v) >= 0, name, " spans more bytes than a 64-bit count holds (",
            v.tokens, " tokens, token_stride ", v.token_stride, ")");
  r.require(v.tokens == 0 || v.data != nullptr, name, " is a null pointer with ", v.tokens,
            " tokens");
  r.require(aligned_to(v.data, alignof(T)), name, " is not aligned to its element size (",
            sizeof(T), " bytes)");
  return r;
}

//! Checks that `cu_seqlens` describes packed sequences of a tensor with `tokens` tokens: at least
//! two entries, starting at 0, non-decreasing, ending at `tokens`. Empty sequences are allowed.
inline validation validate_cu_seqlens(std::span<const std::int32_t> cu_seqlens, std::int64_t tokens,
                                      const char* name = "cu_seqlens") {
  validation r = validation::ok();
  if (cu_seqlens.size() < 2)
    return validation::fail(
        detail::concat(name, " needs batch + 1 >= 2 entries (got ", cu_seqlens.size(), ")"));
  r.require(cu_seqlens[0] == 0, name, "[0] must be 0 (got ", cu_seqlens[0], ")");
  for (std::size_t i = 1; i < cu_seqlens.size() && r; ++i)
    r.require(cu_seqlens[i] >= cu_seqlens[i - 1], name, " is not monotone: ", name, "[", i,
              "] = ", cu_seqlens[i], " < ", name, "[", i - 1, "] = ", cu_seqlens[i - 1]);
  r.require(cu_seqlens.back() == tokens, name, " ends at ", cu_seqlens.back(),
            " but the tensor has ", tokens, " tokens");
  return r;
}

} // namespace ringattn
