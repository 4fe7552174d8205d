#pragma once
//! \file
//! PTX wrappers and tile copies shared by every kernel: shared-memory addresses, cp.async,
//! ldmatrix, mma.sync m16n8k16, exp2, 16-bit packing, e4m3 pairs to 16-bit pairs, the swizzled
//! [rows, D] tile, the max logit's NaN-aware atomic maximum. Device code only.

#include <ringattn/config.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
// clang-format off
#error "ringattn's kernels need sm_80 or newer: set CMAKE_CUDA_ARCHITECTURES (or -arch) to 80, 90a"
// clang-format on
#endif

#if defined(__CUDACC__)

RINGATTN_ABI_BEGIN
namespace kernels {

__device__ __forceinline__ std::uint32_t smem_address(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
//! 4 bytes (zero-filled where not `valid`), through L1.
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n"); }
//! Waits until at most `Pending` of this thread's committed cp.async groups are still in flight.
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

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

//! The larger of a and b, NaN when either is NaN (fmaxf drops a NaN operand): a running max that
//! a NaN score reaches stays NaN, so the row's sum, lse and output do too.
__device__ __forceinline__ float nan_max(float a, float b) { return a > b || a != a ? a : b; }

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

//! Two e4m3 elements (the low byte first) as one register of two 16-bit T elements (exact: every
//! e4m3 value, NaN included, is an fp16 and a bf16 value).
template <class T>
__device__ __forceinline__ std::uint32_t e4m3x2_to(std::uint32_t pair) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair & 0xffffu), __NV_E4M3);
  if constexpr (std::is_same_v<T, __half>) {
    return static_cast<std::uint32_t>(h.x) | (static_cast<std::uint32_t>(h.y) << 16);
  } else {
    const float2 f = __half22float2(__half2(h));
    return pack2<T>(f.x, f.y);
  }
}

//! Half `hi` (0: the low one) of a register of two 16-bit elements, as a float.
template <class T>
__device__ __forceinline__ float unpack1(std::uint32_t r, int hi) {
  const auto bits = static_cast<unsigned short>(hi ? r >> 16 : r & 0xffffu);
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
  else
    return __half2float(__ushort_as_half(bits));
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

//! Raises `*at` to `x` unless it is already larger, NaN winning over every number: a
//! non-negative float orders as its bits read as a signed int, a negative one inversely to its
//! bits read unsigned, and NaN (made the positive quiet NaN) above +inf in the first order and
//! below every negative number in the second.
__device__ __forceinline__ void atomic_max_logit(float* at, float x) {
  if (x == -__builtin_huge_valf()) return;
  if (x != x) x = __int_as_float(0x7fc00000);
  if (__float_as_int(x) >= 0)
    atomicMax(reinterpret_cast<int*>(at), __float_as_int(x));
  else
    atomicMin(reinterpret_cast<unsigned*>(at), __float_as_uint(x));
}

} // namespace kernels
RINGATTN_ABI_END

#endif // __CUDACC__
