#pragma once
//! \file
//! The NCCL communicator: one rank per GPU (one process per GPU, or one thread per GPU), the
//! ring's K/V blocks moving device to device with `ncclSend`/`ncclRecv` enqueued on the ring's
//! communication stream. Needs <nccl.h>; link `ringattn::nccl`.
//!
//! The communicator is created non-blocking (`ncclConfig_t::blocking = 0`), so no NCCL call can
//! block the host: every host wait — creation, the plan-time all-gather, barriers, host-buffer
//! exchanges, `wait(stream)` — polls with a deadline (`timeout`, default 60 s). On timeout or on
//! an asynchronous NCCL error the communicator is aborted (`ncclCommAbort`) and the call throws
//! `communication_error` naming this rank, the step and what it waited for.
//!
//! Device exchanges (`exchange_async`, what `ring_attention::forward` uses) never wait on the
//! host: they are enqueued on the caller's stream. A peer that never posts its half leaves the
//! GPU waiting; `wait(stream, step)` is the bounded way to join such a stream on the host.
//!
//! \code
//! ncclUniqueId id;                       // rank 0: ncclGetUniqueId(&id), then share it
//! cudaSetDevice(local_rank);
//! ringattn::nccl_communicator comm(id, size, rank);
//! ringattn::ring_attention<ringattn::zigzag, ringattn::nccl_communicator, ringattn::causal>
//!     ring(comm, args, cu_seqlens);
//! ring.prepare_device();
//! ring.forward(q, k, v, out, lse, workspace, bytes, stream);
//! \endcode
//! With MPI, `ringattn::make_nccl_communicator(MPI_COMM_WORLD)` (comm/nccl_mpi.cuh) does the
//! unique-id broadcast.

#include <ringattn/comm/nccl_error.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/error.cuh>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>

namespace ringattn {

class nccl_communicator {
public:
  using clock = std::chrono::steady_clock;

  //! Joins (collectively: every rank calls it with the same `id` and `size`) a communicator of
  //! `size` ranks as `rank`, on the current CUDA device. Bounded by `timeout`: a rank that never
  //! joins makes the others throw instead of waiting forever.
  nccl_communicator(const ncclUniqueId& id, int size, int rank,
                    std::chrono::milliseconds timeout = std::chrono::seconds(60))
      : size_(size), rank_(rank), timeout_(timeout) {
    if (size < 1 || rank < 0 || rank >= size)
      throw invalid_argument("ringattn: an NCCL communicator of " + std::to_string(size) +
                             " ranks has no rank " + std::to_string(rank));
    RINGATTN_CUDA_CHECK(cudaGetDevice(&device_));
    RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    try {
      RINGATTN_NCCL_CHECK(ncclCommInitRankConfig(&comm_, size, id, rank, &config));
      settle(-1, "every rank to join the communicator");
    } catch (...) {
      if (comm_ && !aborted_) ncclCommAbort(comm_);
      cudaStreamDestroy(stream_);
      throw;
    }
  }
  //! Wraps a communicator the caller created and keeps: not destroyed here (`abort` still aborts
  //! it). Host waits are bounded as above, but NCCL calls themselves can block the host on a
  //! blocking communicator (for instance the first connection to a peer): create it with
  //! `ncclConfig_t::blocking = 0` for waits that are bounded throughout.
  static nccl_communicator wrap(ncclComm_t comm,
                                std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    if (comm == nullptr) throw invalid_argument("ringattn: wrapping a null NCCL communicator");
    int rank = 0, size = 0, device = 0;
    RINGATTN_NCCL_CHECK(ncclCommUserRank(comm, &rank));
    RINGATTN_NCCL_CHECK(ncclCommCount(comm, &size));
    RINGATTN_NCCL_CHECK(ncclCommCuDevice(comm, &device));
    return nccl_communicator(comm, size, rank, device, timeout);
  }
  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;
  nccl_communicator(nccl_communicator&& o) noexcept
      : comm_(std::exchange(o.comm_, nullptr)), stream_(std::exchange(o.stream_, nullptr)),
        staging_(std::exchange(o.staging_, nullptr)), staging_bytes_(o.staging_bytes_),
        size_(o.size_), rank_(o.rank_), device_(o.device_), timeout_(o.timeout_),
        aborted_(o.aborted_), owned_(o.owned_), bytes_sent_(o.bytes_sent_) {}
  nccl_communicator& operator=(nccl_communicator&&) = delete;
  ~nccl_communicator() {
    // The communicator's stream and staging buffer live on its device; the caller's current
    // device may be another (one thread releasing several GPUs' communicators).
    int current = -1;
    const bool switched = stream_ != nullptr && cudaGetDevice(&current) == cudaSuccess &&
                          current != device_ && cudaSetDevice(device_) == cudaSuccess;
    if (comm_ && !aborted_ && owned_) {
      // Finalize flushes outstanding operations (bounded); if it cannot finish, abort instead.
      ncclResult_t state = ncclCommFinalize(comm_);
      const auto deadline = clock::now() + timeout_;
      while ((state == ncclSuccess || state == ncclInProgress) &&
             ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state == ncclInProgress &&
             clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      if (state == ncclSuccess)
        ncclCommDestroy(comm_);
      else
        ncclCommAbort(comm_);
    }
    if (staging_) cudaFree(staging_);
    if (stream_) cudaStreamDestroy(stream_);
    if (switched) cudaSetDevice(current);
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  //! The CUDA device the communicator was created on.
  int device() const noexcept { return device_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  //! Bytes this rank has sent through `exchange` and `exchange_async`.
  std::uint64_t bytes_sent() const noexcept { return bytes_sent_; }
  //! The NCCL communicator, for callers that share it with their own collectives.
  ncclComm_t native() const noexcept { return comm_; }

  //! Device path, plan time: checks that the current device is the communicator's.
  void prepare_device() {
    int current = -1;
    RINGATTN_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device_)
      throw invalid_argument("ringattn: rank " + std::to_string(rank_) +
                             ": the NCCL communicator lives on device " + std::to_string(device_) +
                             " but the current device is " + std::to_string(current));
  }

  //! Enqueues on `stream` the send of `send_bytes` at `send` (device memory) to rank `to` and the
  //! receive of `recv_bytes` from rank `from` into `recv`, for ring step `step`. Returns without
  //! waiting for the device; later work on `stream` sees the received bytes, and `send` may be
  //! overwritten by later work on `stream`. Sending to and receiving from this rank itself is a
  //! device copy. The sizes must match what the peers send and expect (NCCL cannot check it).
  void exchange_async(const void* send, std::size_t send_bytes, int to, void* recv,
                      std::size_t recv_bytes, int from, std::int64_t step, cudaStream_t stream) {
    check_live(step);
    check_peer(to, step);
    check_peer(from, step);
    if (to == rank_ && from == rank_ && send_bytes != recv_bytes)
      throw invalid_argument("ringattn: " + where(step) + ": sends " + std::to_string(send_bytes) +
                             " bytes to itself but expects " + std::to_string(recv_bytes));
    RINGATTN_NCCL_CHECK(ncclGroupStart());
    if (send_bytes) RINGATTN_NCCL_CHECK(ncclSend(send, send_bytes, ncclUint8, to, comm_, stream));
    if (recv_bytes) RINGATTN_NCCL_CHECK(ncclRecv(recv, recv_bytes, ncclUint8, from, comm_, stream));
    RINGATTN_NCCL_CHECK(ncclGroupEnd());
    settle(step, "NCCL to accept a send/receive");
    bytes_sent_ += send_bytes;
  }

  //! The same exchange on host buffers, through device staging; returns when both are done
  //! (bounded). For the host ring path and tests; grows its staging buffer when needed.
  void exchange(const void* send, std::size_t send_bytes, int to, void* recv,
                std::size_t recv_bytes, int from, std::int64_t step) {
    check_live(step);
    std::byte* s = stage(send_bytes + recv_bytes);
    if (send_bytes)
      RINGATTN_CUDA_CHECK(cudaMemcpyAsync(s, send, send_bytes, cudaMemcpyHostToDevice, stream_));
    exchange_async(s, send_bytes, to, s + send_bytes, recv_bytes, from, step, stream_);
    if (recv_bytes)
      RINGATTN_CUDA_CHECK(
          cudaMemcpyAsync(recv, s + send_bytes, recv_bytes, cudaMemcpyDeviceToHost, stream_));
    wait(stream_, step);
  }

  //! Every rank contributes `bytes` at `send` (host memory); `recv` receives all contributions,
  //! rank-major. Collective and bounded; used at plan time to check that ranks agree.
  void all_gather(const void* send, std::size_t bytes, void* recv) {
    check_live(-1);
    const std::size_t total = bytes * static_cast<std::size_t>(size_);
    std::byte* s = stage(bytes + total);
    if (bytes)
      RINGATTN_CUDA_CHECK(cudaMemcpyAsync(s, send, bytes, cudaMemcpyHostToDevice, stream_));
    RINGATTN_NCCL_CHECK(ncclAllGather(s, s + bytes, bytes, ncclUint8, comm_, stream_));
    settle(-1, "NCCL to accept an all-gather");
    if (total)
      RINGATTN_CUDA_CHECK(cudaMemcpyAsync(recv, s + bytes, total, cudaMemcpyDeviceToHost, stream_));
    wait(stream_, -1);
  }

  //! Returns when every rank has arrived (bounded).
  void barrier() {
    char none = 0;
    std::string all(static_cast<std::size_t>(size_), '\0');
    all_gather(&none, 1, all.data());
  }

  //! Waits until `stream`'s work so far is done, at most `timeout()`. On timeout, or on an NCCL
  //! error reported meanwhile, aborts the communicator and throws `communication_error` naming
  //! this rank and `step` (-1: no step).
  void wait(cudaStream_t stream, std::int64_t step = -1) {
    const auto deadline = clock::now() + timeout_;
    for (;;) {
      const cudaError_t e = cudaStreamQuery(stream);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) RINGATTN_CUDA_CHECK(e);
      check_async(step);
      if (clock::now() >= deadline) fail(step, "its stream to finish (a peer may be missing)");
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  //! Fails the communicator (`ncclCommAbort`): peers' pending NCCL operations with this rank
  //! fail instead of waiting (they notice at their next bounded wait). `reason` is for the log.
  void abort(const std::string& reason) {
    (void)reason;
    if (comm_ && !aborted_) {
      ncclCommAbort(comm_);
      aborted_ = true;
    }
  }

private:
  nccl_communicator(ncclComm_t borrowed, int size, int rank, int device,
                    std::chrono::milliseconds timeout)
      : comm_(borrowed), size_(size), rank_(rank), device_(device), timeout_(timeout),
        owned_(false) {
    RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  std::string where(std::int64_t step) const {
    return step >= 0 ? "rank " + std::to_string(rank_) + ", step " + std::to_string(step)
                     : "rank " + std::to_string(rank_);
  }
  void check_live(std::int64_t step) const {
    if (aborted_)
      throw communication_error("ringattn: " + where(step) + ": the NCCL communicator was aborted");
  }
  void check_peer(int peer, std::int64_t step) const {
    if (peer < 0 || peer >= size_)
      throw invalid_argument("ringattn: " + where(step) + ": peer " + std::to_string(peer) +
                             " is out of range [0, " + std::to_string(size_) + ")");
  }
  [[noreturn]] void fail(std::int64_t step, const std::string& what) {
    abort(what);
    throw communication_error("ringattn: " + where(step) + ": waited " +
                              std::to_string(timeout_.count()) + " ms for " + what +
                              "; the NCCL communicator was aborted");
  }
  void check_async(std::int64_t step) {
    ncclResult_t state = ncclSuccess;
    RINGATTN_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
    if (state != ncclSuccess && state != ncclInProgress) {
      std::string msg = ncclGetErrorString(state);
      const char* last = ncclGetLastError(comm_);
      if (last != nullptr && last[0] != '\0') msg += std::string(": ") + last;
      abort(msg);
      throw communication_error("ringattn: " + where(step) + ": NCCL failed: " + msg);
    }
  }
  //! A non-blocking communicator may answer ncclInProgress: poll until it settles (bounded).
  void settle(std::int64_t step, const char* what) {
    const auto deadline = clock::now() + timeout_;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      RINGATTN_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) check_async(step);
      if (clock::now() >= deadline) fail(step, what);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  std::byte* stage(std::size_t bytes) {
    if (bytes > staging_bytes_) {
      wait(stream_, -1); // the old buffer may still be in use
      if (staging_) RINGATTN_CUDA_CHECK(cudaFree(staging_));
      staging_ = nullptr;
      RINGATTN_CUDA_CHECK(detail::device_malloc(&staging_, bytes));
      staging_bytes_ = bytes;
    }
    return static_cast<std::byte*>(staging_);
  }

  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr; // host-buffer operations
  void* staging_ = nullptr;
  std::size_t staging_bytes_ = 0;
  int size_ = 0, rank_ = 0, device_ = 0;
  std::chrono::milliseconds timeout_;
  bool aborted_ = false;
  bool owned_ = true; // false: wrap()ped, the caller destroys the NCCL communicator
  std::uint64_t bytes_sent_ = 0;
};

} // namespace ringattn
