#pragma once
//! \file
//! The max logit over every rank. A forward asked for it sets the caller's `[q_heads]` buffer to
//! -inf, its kernels raise it over the rows this rank computes (state.cuh: `max_logit` of the
//! state; under the all-to-all only this rank's heads), and one reduction over the ranks leaves
//! every rank with the maxima of them all, NaN winning over every number (`nan_max`).
//!
//! On the host the reduction is one all-gather of the ranks' maxima; on the device, P - 1 ring
//! exchanges of `[q_heads]` floats on the call's stream, each followed by a one-block kernel that
//! takes the maximum (two `[q_heads]` buffers at the end of the forward's workspace): nothing
//! waits on the host, and the bytes are those of one all-gather.

#include <ringattn/core/state.cuh>
#include <ringattn/cuda_check.cuh>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>

#if defined(__CUDACC__)
#include <ringattn/block/kernel/elementwise.cuh>
#endif

namespace ringattn::detail {

//! Bytes of the device reduction's two buffers (at the end of the forward's device workspace).
inline constexpr std::size_t max_logit_buffer_bytes(int q_heads) {
  return 2 * static_cast<std::size_t>(q_heads) * sizeof(float);
}

//! Host: every rank's maxima gathered into `all` (`size() * heads` floats), then reduced in rank
//! order into `max_logit`. Collective.
template <class Communicator>
void reduce_max_logit_host(Communicator& comm, float* max_logit, int heads, std::span<float> all) {
  const int p = comm.size();
  if (p == 1 || heads == 0) return;
  comm.all_gather(max_logit, static_cast<std::size_t>(heads) * sizeof(float), all.data());
  for (int h = 0; h < heads; ++h) {
    float x = -std::numeric_limits<float>::infinity();
    for (int r = 0; r < p; ++r)
      x = nan_max(x, all[static_cast<std::size_t>(r) * heads + h]);
    max_logit[h] = x;
  }
}

#if defined(__CUDACC__)
//! Device: `max_logit` to -inf, on `stream`.
inline void clear_max_logit(float* max_logit, int heads, cudaStream_t stream) {
  if (heads == 0) return;
  kernels::fill_kernel<<<1, 256, 0, stream>>>(max_logit, std::int64_t{heads},
                                              -std::numeric_limits<float>::infinity());
  RINGATTN_CUDA_CHECK_LAUNCH();
}

//! Device: the ranks' maxima passed around the ring P - 1 times, on `stream`, through `buffers`
//! (`max_logit_buffer_bytes(heads)`); the exchanges are numbered from `first_step` on. This rank's
//! own buffer is copied first, so that no kernel writes what a peer may still be reading.
template <class Communicator>
void reduce_max_logit_device(Communicator& comm, float* max_logit, int heads, float* buffers,
                             std::int64_t first_step, cudaStream_t stream) {
  const int p = comm.size();
  if (p == 1 || heads == 0) return;
  const std::size_t bytes = static_cast<std::size_t>(heads) * sizeof(float);
  const int to = (comm.rank() + 1) % p, from = (comm.rank() + p - 1) % p;
  RINGATTN_CUDA_CHECK(cudaMemcpyAsync(buffers, max_logit, bytes, cudaMemcpyDeviceToDevice, stream));
  for (int j = 0; j < p - 1; ++j) {
    float* send = buffers + (j % 2) * heads;
    float* recv = buffers + ((j + 1) % 2) * heads;
    comm.exchange_async(send, bytes, to, recv, bytes, from, first_step + j, stream);
    kernels::max_logit_kernel<<<1, 256, 0, stream>>>(max_logit, recv, heads);
    RINGATTN_CUDA_CHECK_LAUNCH();
  }
}
#endif

} // namespace ringattn::detail
