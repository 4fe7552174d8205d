#pragma once
//! \file
//! Compiler and build configuration shared by every header.
//!
//! Every header compiles both as CUDA (nvcc) and as plain C++20 (g++/clang++): the host path of
//! the library (host block kernel, in-process and MPI communicators, the reference) needs no CUDA
//! compiler. Device code is guarded by `__CUDACC__`.
//!
//! Macros a user may set before including any ringattn header:
//! - `RINGATTN_DEBUG_SYNC`: synchronise and check the last CUDA error after every launch
//!   (off by default; never use in production, it serialises the stream with the host).
//! - `RINGATTN_EXPERIMENTS`: compile the kernel variants kept for tuning comparisons (the wgmma
//!   block backward with 1 or 2 warpgroups, the mma.sync forward's tile-shape options). Define it
//!   for a whole program or not at all; the ABI namespace carries it.

#include <ringattn/version.cuh>

#if defined(__CUDACC__)
#define RINGATTN_HOST_DEVICE __host__ __device__
#else
#define RINGATTN_HOST_DEVICE
#endif

#if __cplusplus < 202002L && !defined(_MSVC_LANG)
#error "ringattn needs C++20 (-std=c++20 for the host compiler, and for nvcc)"
#endif

// The ABI namespace: everything that launches kernels lives in an inline namespace whose name
// carries the library version and, under nvcc, the list of target architectures
// (__CUDA_ARCH_LIST__, e.g. "800,900"). Two shared libraries built with different options then
// cannot resolve each other's kernels, which would otherwise be an ODR violation the linker
// silently "fixes" by picking one.
#define RINGATTN_DETAIL_CAT2(a, b) a##b
#define RINGATTN_DETAIL_CAT(a, b) RINGATTN_DETAIL_CAT2(a, b)
#define RINGATTN_DETAIL_COUNT(...) RINGATTN_DETAIL_COUNT_(__VA_ARGS__, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define RINGATTN_DETAIL_COUNT_(a, b, c, d, e, f, g, h, n, ...) n
#define RINGATTN_DETAIL_ARCH_TAG(...)                                                              \
  RINGATTN_DETAIL_CAT(RINGATTN_DETAIL_ARCH_TAG_, RINGATTN_DETAIL_COUNT(__VA_ARGS__))(__VA_ARGS__)
#define RINGATTN_DETAIL_ARCH_TAG_1(a) _sm##a
#define RINGATTN_DETAIL_ARCH_TAG_2(a, b) RINGATTN_DETAIL_CAT(_sm##a, RINGATTN_DETAIL_ARCH_TAG_1(b))
#define RINGATTN_DETAIL_ARCH_TAG_3(a, ...)                                                         \
  RINGATTN_DETAIL_CAT(_sm##a, RINGATTN_DETAIL_ARCH_TAG_2(__VA_ARGS__))
#define RINGATTN_DETAIL_ARCH_TAG_4(a, ...)                                                         \
  RINGATTN_DETAIL_CAT(_sm##a, RINGATTN_DETAIL_ARCH_TAG_3(__VA_ARGS__))
#define RINGATTN_DETAIL_ARCH_TAG_5(a, ...)                                                         \
  RINGATTN_DETAIL_CAT(_sm##a, RINGATTN_DETAIL_ARCH_TAG_4(__VA_ARGS__))
#define RINGATTN_DETAIL_ARCH_TAG_6(a, ...)                                                         \
  RINGATTN_DETAIL_CAT(_sm##a, RINGATTN_DETAIL_ARCH_TAG_5(__VA_ARGS__))
#define RINGATTN_DETAIL_ARCH_TAG_7(a, ...)                                                         \
  RINGATTN_DETAIL_CAT(_sm##a, RINGATTN_DETAIL_ARCH_TAG_6(__VA_ARGS__))
#define RINGATTN_DETAIL_ARCH_TAG_8(a, ...)                                                         \
  RINGATTN_DETAIL_CAT(_sm##a, RINGATTN_DETAIL_ARCH_TAG_7(__VA_ARGS__))

#define RINGATTN_DETAIL_VERSION_TAG                                                                \
  RINGATTN_DETAIL_CAT(RINGATTN_DETAIL_CAT(RINGATTN_DETAIL_CAT(abi_v, RINGATTN_VERSION_MAJOR),      \
                                          RINGATTN_DETAIL_CAT(_, RINGATTN_VERSION_MINOR)),         \
                      RINGATTN_DETAIL_CAT(_, RINGATTN_VERSION_PATCH))

#if defined(RINGATTN_EXPERIMENTS)
#define RINGATTN_DETAIL_VARIANT_TAG RINGATTN_DETAIL_CAT(RINGATTN_DETAIL_VERSION_TAG, _x)
#else
#define RINGATTN_DETAIL_VARIANT_TAG RINGATTN_DETAIL_VERSION_TAG
#endif

#if defined(__CUDA_ARCH_LIST__)
#define RINGATTN_ABI_NAMESPACE                                                                     \
  RINGATTN_DETAIL_CAT(RINGATTN_DETAIL_VARIANT_TAG, RINGATTN_DETAIL_ARCH_TAG(__CUDA_ARCH_LIST__))
#else
#define RINGATTN_ABI_NAMESPACE RINGATTN_DETAIL_CAT(RINGATTN_DETAIL_VARIANT_TAG, _host)
#endif

//! Opens `namespace ringattn { inline namespace <abi tag> {`; for code that launches kernels.
#define RINGATTN_ABI_BEGIN                                                                         \
  namespace ringattn {                                                                             \
  inline namespace RINGATTN_ABI_NAMESPACE {
#define RINGATTN_ABI_END                                                                           \
  }                                                                                                \
  }
