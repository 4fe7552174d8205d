#pragma once
//! \file
//! Hopper warpgroup matrix instructions (wgmma.mma_async) as inline PTX, plus the fences and the
//! shared-memory matrix descriptor they need. sm_90a only: callers compile these into kernel
//! bodies guarded by `RINGATTN_WGMMA_ENABLED`.
//!
//! Shapes used by the forward kernel: m64nNk16 with N = 64 or 128, fp32 accumulators
//! (N / 2 registers a thread), bf16 or fp16 inputs. `wgmma_ss`: A and B from shared memory;
//! `wgmma_rs`: A from registers (the m16n8k16 A fragment of each warp's 16 rows), B from shared
//! memory. `TransB` = 0 reads B K-major (rows of B^T contiguous), 1 reads it N-major.

#include <ringattn/config.cuh>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__)

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define RINGATTN_WGMMA_ENABLED 1
#else
#define RINGATTN_WGMMA_ENABLED 0
#endif

RINGATTN_ABI_BEGIN
namespace kernels {

//! Makes register writes of ordinary instructions visible to the next wgmma (accumulators, A).
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
//! Waits until at most `Pending` committed groups of this warpgroup are still in flight.
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}
//! `wgmma_wait<Pending>`, held after the computation of `x` in the machine code. ptxas schedules
//! a wait as early as its basic block allows (it does not model how long a wait stalls), ahead of
//! arithmetic that was written before it and does not need the products, which then no longer
//! runs while they do. It does keep shared-memory stores ahead of the wait, so a store of x
//! pins the wait after everything x depends on: predicated on x < 0, which the callers' values
//! (sums of exponentials, or NaN) never are, and into `sink`, a shared word of the caller's, so
//! that it would be harmless if it ran.
template <int Pending>
__device__ __forceinline__ void wgmma_wait_after(float x, std::uint32_t sink) {
  asm volatile("{\n.reg .pred p;\nsetp.lt.f32 p, %0, 0f00000000;\n@p st.shared.f32 [%1], %0;\n}\n"
               "wgmma.wait_group.sync.aligned %2;\n" ::"f"(x),
               "r"(sink), "n"(Pending)
               : "memory");
}
//! Orders this thread's generic-proxy shared-memory writes (st.shared, cp.async) before later
//! async-proxy reads (wgmma operands); a barrier must follow for other threads' reads.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
//! mbarrier in shared memory: init (one thread, then a block barrier), arrive, parity wait.
__device__ __forceinline__ void mbarrier_init(std::uint32_t bar, std::uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(std::uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar)
               : "memory");
}
//! Arrives on `bar` if `cond`, as one predicated instruction: no branch splits the code around
//! it into separately scheduled blocks.
__device__ __forceinline__ void mbarrier_arrive_if(std::uint32_t bar, bool cond) {
  asm volatile("{\n.reg .pred p;\n.reg .b64 state;\nsetp.ne.b32 p, %1, 0;\n"
               "@p mbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar),
               "r"(static_cast<int>(cond))
               : "memory");
}
//! Arrives on `bar` once every cp.async this thread issued so far has landed (the barrier's
//! expected count includes this arrival).
__device__ __forceinline__ void cp_async_mbarrier_arrive(std::uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(std::uint32_t bar, std::uint32_t parity) {
  std::uint32_t done = 0;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
  } while (!done);
}
//! Whether `x` holds in any of the 128 threads of a warpgroup, through named barrier `id` (a
//! barrier with a reduction; every thread of the warpgroup must call it).
__device__ __forceinline__ bool warpgroup_any(bool x, int id) {
  std::uint32_t any;
  asm volatile("{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbar.red.or.pred q, %2, 128, p;\n"
               "selp.u32 %0, 1, 0, q;\n}\n"
               : "=r"(any)
               : "r"(static_cast<std::uint32_t>(x)), "r"(id)
               : "memory");
  return any != 0;
}
//! Adds `bytes` (a multiple of 16) of fp32 from shared memory at `src` to global memory at `dst`
//! (16-byte aligned), element by element, in the L2, as part of the bulk group this thread
//! commits next (`bulk_commit`).
__device__ __forceinline__ void bulk_reduce_add_f32_uncommitted(float* dst, std::uint32_t src,
                                                                int bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
      "r"(src), "r"(bytes)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
//! `bulk_reduce_add_f32_uncommitted` committed as one bulk group of its own.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, std::uint32_t src, int bytes) {
  bulk_reduce_add_f32_uncommitted(dst, src, bytes);
  bulk_commit();
}
//! Waits until all but the newest `Pending` of this thread's bulk groups have read their shared
//! memory (which may then change or go away; the writes to global memory complete on their own).
template <int Pending = 0>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(Pending) : "memory");
}
//! Waits until this thread's bulk groups are complete (their writes done).
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}
//! Named barriers (ids 1..15; 0 is __syncthreads) over `Threads` threads.
template <int Threads>
__device__ __forceinline__ void named_barrier_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(Threads) : "memory");
}
template <int Threads>
__device__ __forceinline__ void named_barrier_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(Threads) : "memory");
}
//! Hands registers back to (dec) or takes them from (inc) the block's pool, per warpgroup.
template <int Registers>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Registers));
}
template <int Registers>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Registers));
}

//! Keeps the compiler from moving reads or writes of `r` across a wgmma issue or wait.
template <int N>
__device__ __forceinline__ void fence_operands(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
    asm volatile("" : "+f"(r[i])::"memory");
}

template <int N, int M>
__device__ __forceinline__ void fence_operands(std::uint32_t (&r)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < M; ++j)
      asm volatile("" : "+r"(r[i][j])::"memory");
}

//! Descriptor of a shared-memory operand in the 128-byte swizzled canonical layout: rows of 128
//! bytes, 8-row (1024-byte) swizzle atoms stacked at 1024 bytes. `lbo`: byte distance between
//! 64-element panels along N for an N-major operand (unused for K-major). The atom pattern must
//! start 1024-byte aligned; `addr` may be offset inside a row (the k-step within a panel).
__device__ __forceinline__ std::uint64_t sw128_descriptor(std::uint32_t addr, std::uint32_t lbo) {
  return (std::uint64_t{1} << 62) | (std::uint64_t{1024 >> 4} << 32) |
         (static_cast<std::uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         static_cast<std::uint64_t>((addr & 0x3FFFF) >> 4);
}

// Operand lists of the accumulator fragments (N / 2 fp32 registers a thread).
#define RINGATTN_DETAIL_WGMMA_D32                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "    \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define RINGATTN_DETAIL_WGMMA_OUT32                                                                \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),     \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),   \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),   \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define RINGATTN_DETAIL_WGMMA_D64                                                                  \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "    \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "     \
  "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "     \
  "%56, %57, %58, %59, %60, %61, %62, %63}"
#define RINGATTN_DETAIL_WGMMA_OUT64                                                                \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),  \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),     \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),   \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),   \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),   \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),   \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),   \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),   \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
// One instruction, A from a descriptor: operands d..., a, b, accumulate, TransA, TransB.
#define RINGATTN_DETAIL_WGMMA_SS(N, TYPE, D, A, B, SCALE, TA, TB)                                  \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" SCALE ", 0;\n"                                              \
  "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TYPE "." TYPE " " D ", %" A ", %" B             \
  ", p, 1, 1, %" TA ", %" TB ";\n}\n"
// One instruction, A in four registers: operands d..., a0..a3, b, accumulate, TransB.
#define RINGATTN_DETAIL_WGMMA_RS(N, TYPE, D, A0, A1, A2, A3, B, SCALE, TB)                         \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" SCALE ", 0;\n"                                              \
  "wgmma.mma_async.sync.aligned.m64n" N "k16.f32." TYPE "." TYPE " " D ", {%" A0 ", %" A1 ", %" A2 \
  ", %" A3 "}, %" B ", p, 1, 1, %" TB ";\n}\n"

//! d (m64n64, fp32) = a * b + (accumulate ? d : 0); a from a descriptor, read K-major
//! (`TransA` 0) or M-major (1: the tile holds A^T, rows of 64 M elements).
template <class T, int TransB, int TransA = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[32], std::uint64_t a, std::uint64_t b,
                                         int accumulate) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(RINGATTN_DETAIL_WGMMA_SS("64", "bf16", RINGATTN_DETAIL_WGMMA_D32, "32", "33", "34",
                                          "35", "36")
                 : RINGATTN_DETAIL_WGMMA_OUT32
                 : "l"(a), "l"(b), "r"(accumulate), "n"(TransA), "n"(TransB));
  else
    asm volatile(RINGATTN_DETAIL_WGMMA_SS("64", "f16", RINGATTN_DETAIL_WGMMA_D32, "32", "33", "34",
                                          "35", "36")
                 : RINGATTN_DETAIL_WGMMA_OUT32
                 : "l"(a), "l"(b), "r"(accumulate), "n"(TransA), "n"(TransB));
}

//! d (m64n64, fp32) = a * b + (accumulate ? d : 0); a in registers.
template <class T, int TransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const std::uint32_t (&a)[4],
                                         std::uint64_t b, int accumulate) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(RINGATTN_DETAIL_WGMMA_RS("64", "bf16", RINGATTN_DETAIL_WGMMA_D32, "32", "33", "34",
                                          "35", "36", "37", "38")
                 : RINGATTN_DETAIL_WGMMA_OUT32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate),
                   "n"(TransB));
  else
    asm volatile(RINGATTN_DETAIL_WGMMA_RS("64", "f16", RINGATTN_DETAIL_WGMMA_D32, "32", "33", "34",
                                          "35", "36", "37", "38")
                 : RINGATTN_DETAIL_WGMMA_OUT32
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate),
                   "n"(TransB));
}

//! d (m64n128, fp32) = a * b + (accumulate ? d : 0); a from a descriptor.
template <class T, int TransB>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], std::uint64_t a, std::uint64_t b,
                                         int accumulate) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(RINGATTN_DETAIL_WGMMA_SS("128", "bf16", RINGATTN_DETAIL_WGMMA_D64, "64", "65",
                                          "66", "67", "68")
                 : RINGATTN_DETAIL_WGMMA_OUT64
                 : "l"(a), "l"(b), "r"(accumulate), "n"(0), "n"(TransB));
  else
    asm volatile(RINGATTN_DETAIL_WGMMA_SS("128", "f16", RINGATTN_DETAIL_WGMMA_D64, "64", "65", "66",
                                          "67", "68")
                 : RINGATTN_DETAIL_WGMMA_OUT64
                 : "l"(a), "l"(b), "r"(accumulate), "n"(0), "n"(TransB));
}

//! d (m64n128, fp32) = a * b + (accumulate ? d : 0); a in registers.
template <class T, int TransB>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const std::uint32_t (&a)[4],
                                         std::uint64_t b, int accumulate) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(RINGATTN_DETAIL_WGMMA_RS("128", "bf16", RINGATTN_DETAIL_WGMMA_D64, "64", "65",
                                          "66", "67", "68", "69", "70")
                 : RINGATTN_DETAIL_WGMMA_OUT64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate),
                   "n"(TransB));
  else
    asm volatile(RINGATTN_DETAIL_WGMMA_RS("128", "f16", RINGATTN_DETAIL_WGMMA_D64, "64", "65", "66",
                                          "67", "68", "69", "70")
                 : RINGATTN_DETAIL_WGMMA_OUT64
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate),
                   "n"(TransB));
}

//! Copies rows [0, Rows) of a [tokens, D] global slice into a panelled swizzled tile with the
//! `Threads` threads of the producer (`tid` 0..Threads-1); rows >= valid are zero-filled. Thread
//! `tid` always copies chunk tid % (D/8) of rows tid / (D/8) + k * step (step = Threads / (D/8)):
//! the swizzled offset then only moves by a constant per row step (an immediate of the unrolled
//! loop; with a step of 4 rows, one of two constants taking turns), and the source by one 64-bit
//! add, so each copy costs a few instructions (the producer has few registers a thread and must
//! keep ahead of two consumer warpgroups).
template <int Rows, int D, int Threads = 128, class T>
__device__ __forceinline__ void produce_tile(std::uint32_t s, const T* g, std::int64_t stride,
                                             int valid, int tid) {
  constexpr int chunks = D / 8, step = Threads / chunks;
  static_assert((step % 8 == 0 || step == 4) && Rows % (2 * step) == 0);
  const int ch = tid % chunks, r0 = tid / chunks;
  // Rows r0 + k step: the swizzle's row phase is r0 & 7, or with a 4-row step (r0 < 4) r0 + 4 on
  // odd k.
  const std::uint32_t dst0 =
      s + 2 * ((ch >> 3) * Rows * 64 + r0 * 64 + (((ch & 7) ^ (r0 & 7)) << 3));
  const std::uint32_t dst1 =
      step % 8 == 0 ? dst0
                    : s + 2 * ((ch >> 3) * Rows * 64 + r0 * 64 + (((ch & 7) ^ (r0 + 4)) << 3));
  const T* src = g + r0 * stride + ch * 8;
  const std::int64_t jump = step * stride;
  if (valid >= Rows) { // a whole tile: no predicate
#pragma unroll
    for (int k = 0; k < Rows / step; ++k, src += jump)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((k & 1 ? dst1 : dst0) +
                                                                       k * step * 128),
                   "l"(src));
    return;
  }
  const int rows = valid - r0; // this thread's rows r0 + k * step with k * step < rows are real
#pragma unroll
  for (int k = 0; k < Rows / step; ++k, src += jump) {
    const bool ok = k * step < rows;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"((k & 1 ? dst1 : dst0) +
                                                                         k * step * 128),
                 "l"(ok ? src : g), "r"(ok ? 16 : 0));
  }
}

//! `produce_tile` for every width the kernels take: a 192-wide tile is its first two panels (128
//! columns) and its third, copied as a 128-wide and a 64-wide tile.
template <int Rows, int D, int Threads = 128, class T>
__device__ __forceinline__ void produce_panels(std::uint32_t s, const T* g, std::int64_t stride,
                                               int valid, int tid) {
  if constexpr (D == 192) {
    produce_tile<Rows, 128, Threads>(s, g, stride, valid, tid);
    produce_tile<Rows, 64, Threads>(s + 2 * Rows * 128, g + 128, stride, valid, tid);
  } else {
    produce_tile<Rows, D, Threads>(s, g, stride, valid, tid);
  }
}

} // namespace kernels
RINGATTN_ABI_END

#undef RINGATTN_DETAIL_WGMMA_SS
#undef RINGATTN_DETAIL_WGMMA_RS
#undef RINGATTN_DETAIL_WGMMA_D32
#undef RINGATTN_DETAIL_WGMMA_D64
#undef RINGATTN_DETAIL_WGMMA_OUT32
#undef RINGATTN_DETAIL_WGMMA_OUT64

#endif // __CUDACC__
