#pragma once
//! \file
//! NVTX ranges that mark the ring's steps in Nsight Systems timelines. NVTX v3 is header-only and
//! costs a branch when no tool is attached. Define RINGATTN_NO_NVTX to compile the ranges out.

#include <ringattn/config.cuh>

#if !defined(RINGATTN_NO_NVTX) && __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define RINGATTN_DETAIL_HAS_NVTX 1
#endif

#include <cstdio>

namespace ringattn::detail {
//! A named range for the lifetime of the object ("ringattn step 3 (rank 1)").
class nvtx_range {
public:
  nvtx_range(const char* what, int step, int rank) {
#if defined(RINGATTN_DETAIL_HAS_NVTX)
    // NVTX initialises itself lazily on the first call, racing when the ranks' threads make their
    // first calls together (ThreadSanitizer reports it). A function-local static initialises it
    // once, and its guard orders that before every later call on every thread.
    static const bool initialised = (nvtxInitialize(nullptr), true);
    (void)initialised;
    char name[64];
    std::snprintf(name, sizeof name, "ringattn %s %d (rank %d)", what, step, rank);
    nvtxRangePushA(name);
#else
    (void)what, (void)step, (void)rank;
#endif
  }
  ~nvtx_range() {
#if defined(RINGATTN_DETAIL_HAS_NVTX)
    nvtxRangePop();
#endif
  }
  nvtx_range(const nvtx_range&) = delete;
  nvtx_range& operator=(const nvtx_range&) = delete;
};
} // namespace ringattn::detail
