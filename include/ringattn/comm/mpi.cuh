#pragma once
//! \file
//! `mpi_communicator`: the ranks of a ring are the processes of an MPI communicator (host
//! buffers). Needs <mpi.h>; link ringattn::mpi.
//!
//! The communicator duplicates the user's `MPI_Comm` (so its messages never mix with the
//! application's) and sets `MPI_ERRORS_RETURN` on the duplicate, so every failure comes back as an
//! error code and is thrown as `communication_error` naming the call, MPI's text and the rank.
//! Every wait is bounded: non-blocking operations are polled until done or until `timeout`
//! (default 60 s), after which the call throws naming this rank, the peer and the step; a peer
//! that dies or never arrives therefore ends in an error, not a hang. MPI has no way to wake a
//! peer that is waiting elsewhere, so `abort()` only records the reason locally; the peers then
//! fail at their own timeout, naming this rank.
//!
//! Recovery: a timeout, an abort or any failed exchange breaks the communicator for good: every
//! later operation throws at once, naming the first failure and asking for a new communicator
//! (a late peer may still deliver the failed call's messages). A timed-out receive is cancelled;
//! a collective is never cancelled (MPI forbids it): it stays pending on buffers the communicator
//! keeps to the end of the process, so that a late rank completing it writes nowhere it should
//! not. Tags carry the ring's call number (`begin_call`) and the step, so no call can take
//! another's message.
//!
//! Device buffers (`exchange_async`, the ring's device path): with a CUDA-aware MPI the device
//! pointers go to MPI directly; otherwise through pinned host staging buffers (D2H, MPI, H2D).
//! CUDA-awareness is detected at `prepare_device()` (Open MPI's `MPIX_Query_cuda_support`;
//! `RINGATTN_MPI_CUDA_AWARE=0|1` in the environment, or the constructor's `cuda_awareness`,
//! override it). MPI cannot run on a CUDA stream, so a device exchange makes the calling thread
//! wait (bounded) for the stream's earlier work and for the transfer: in the ring that is the
//! communication stream, and the compute already enqueued keeps the GPU busy meanwhile; the
//! staging buffers are allocated at the first exchange of each size (not again afterwards).
//!
//! \code
//! ringattn::mpi_communicator comm(MPI_COMM_WORLD);
//! ringattn::ring_attention<ringattn::zigzag, ringattn::mpi_communicator, ringattn::causal>
//!     attn(comm, args, cu_seqlens);
//! \endcode

#include <ringattn/comm/mpi_error.cuh>
#include <ringattn/cuda_check.cuh>
#include <ringattn/error.cuh>

#include <cuda_runtime_api.h>
#include <mpi.h>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h> // Open MPI: MPIX_CUDA_AWARE_SUPPORT, MPIX_Query_cuda_support
#endif

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ringattn {

//! Whether MPI may be given device pointers: ask the library (`detect`), or say so.
enum class cuda_awareness { detect, yes, no };

class mpi_communicator {
public:
  explicit mpi_communicator(MPI_Comm comm,
                            std::chrono::milliseconds timeout = std::chrono::seconds(60),
                            cuda_awareness aware = cuda_awareness::detect)
      : timeout_(timeout), awareness_(aware) {
    RINGATTN_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
    RINGATTN_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    RINGATTN_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    RINGATTN_MPI_CHECK(MPI_Comm_size(comm_, &size_));
    int* ub = nullptr;
    int has = 0;
    RINGATTN_MPI_CHECK(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &ub, &has));
    tag_ub_ = has && ub != nullptr ? *ub : 32767; // MPI guarantees at least 32767
  }
  ~mpi_communicator() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_); // no throw from a destructor
    if (event_) cudaEventDestroy(event_);
    for (void* p : {send_stage_, recv_stage_})
      if (p) cudaFreeHost(p);
  }
  mpi_communicator(const mpi_communicator&) = delete;
  mpi_communicator& operator=(const mpi_communicator&) = delete;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  std::uint64_t bytes_sent() const noexcept { return bytes_sent_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  //! The duplicated communicator the ring uses.
  MPI_Comm native() const noexcept { return comm_; }

  //! Sends `send_bytes` to `to` and receives exactly `recv_bytes` from `from` for ring step
  //! `step`, both non-blocking, polled until done or the timeout.
  void exchange(const void* send, std::size_t send_bytes, int to, void* recv,
                std::size_t recv_bytes, int from, std::int64_t step) {
    error_rank_scope scope(rank_);
    require_live(step);
    breaks_on_failure([&] { transfer(send, send_bytes, to, recv, recv_bytes, from, step); });
  }

  //! Every rank contributes `bytes`; `recv` gets all contributions rank-major. Bounded. MPI
  //! works on the communicator's own buffers (see the file notes), copied in and out.
  void all_gather(const void* send, std::size_t bytes, void* recv) {
    error_rank_scope scope(rank_);
    require_live(-1);
    breaks_on_failure([&] {
      const std::size_t total = bytes * static_cast<std::size_t>(size_);
      check_count(total);
      if (gather_ == nullptr || gather_->size() < bytes + total)
        gather_ = std::make_shared<std::vector<std::byte>>(bytes + total);
      std::byte* mine = gather_->data();
      if (bytes) std::memcpy(mine, send, bytes);
      MPI_Request req;
      RINGATTN_MPI_CHECK(MPI_Iallgather(mine, static_cast<int>(bytes), MPI_BYTE, mine + bytes,
                                        static_cast<int>(bytes), MPI_BYTE, comm_, &req));
      collective(req);
      if (total) std::memcpy(recv, mine + bytes, total);
    });
  }
  void barrier() {
    error_rank_scope scope(rank_);
    require_live(-1);
    breaks_on_failure([&] {
      MPI_Request req;
      RINGATTN_MPI_CHECK(MPI_Ibarrier(comm_, &req));
      collective(req);
    });
  }

  //! The collectives are host-side and cheap: the ring agrees on every call (ring/call.cuh).
  static constexpr bool host_collectives = true;
  //! Numbers the ring's call that follows (the same on every rank): it goes into every tag.
  void begin_call(std::uint64_t call) noexcept { call_ = call; }
  //! The largest message MPI takes (its counts are ints), checked by the ring at plan time.
  static constexpr std::size_t max_message_bytes() noexcept {
    return static_cast<std::size_t>(std::numeric_limits<int>::max());
  }
  //! Whether a failure has broken the communicator (see the file notes).
  bool broken() const noexcept { return !broken_.empty(); }
  //! Device path, plan time: resolves CUDA-awareness (see the file notes) and creates the event
  //! the device exchanges wait on.
  void prepare_device() {
    if (event_) return;
    bool aware = false;
    if (awareness_ == cuda_awareness::yes) {
      aware = true;
    } else if (awareness_ == cuda_awareness::detect) {
      const char* env = std::getenv("RINGATTN_MPI_CUDA_AWARE");
      if (env != nullptr && (env[0] == '0' || env[0] == '1')) {
        aware = env[0] == '1';
      } else {
#if defined(MPIX_CUDA_AWARE_SUPPORT) && MPIX_CUDA_AWARE_SUPPORT
        aware = MPIX_Query_cuda_support() == 1;
#endif
      }
    }
    cuda_aware_ = aware;
    RINGATTN_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  //! Whether device exchanges hand device pointers to MPI (after `prepare_device`).
  bool cuda_aware() const noexcept { return cuda_aware_; }

  //! The ring's device exchange: `send` and `recv` are device memory; the send starts once the
  //! work enqueued on `stream` so far is done, and the received bytes are in `recv` for work
  //! enqueued on `stream` afterwards. The calling thread waits (bounded) for both.
  void exchange_async(const void* send, std::size_t send_bytes, int to, void* recv,
                      std::size_t recv_bytes, int from, std::int64_t step, cudaStream_t stream) {
    error_rank_scope scope(rank_);
    if (!event_)
      throw invalid_argument("ringattn: rank " + std::to_string(rank_) + ", step " +
                             std::to_string(step) + ": device exchange before prepare_device()");
    require_live(step);
    breaks_on_failure(
        [&] { device_transfer(send, send_bytes, to, recv, recv_bytes, from, step, stream); });
  }

  //! Records why this rank gave up and breaks the communicator (MPI cannot wake peers waiting
  //! elsewhere; see the file notes).
  void abort(const std::string& reason) {
    if (broken_.empty()) broken_ = reason.starts_with("ringattn: ") ? reason.substr(10) : reason;
    aborted_ = reason;
  }
  const std::string& abort_reason() const noexcept { return aborted_; }

private:
  // `exchange_async`'s transfer, with no check of the communicator's state.
  void device_transfer(const void* send, std::size_t send_bytes, int to, void* recv,
                       std::size_t recv_bytes, int from, std::int64_t step, cudaStream_t stream) {
    settle(stream, step); // the send buffer is complete (and the last receive copied out)
    if (cuda_aware_) {
      transfer(send, send_bytes, to, recv, recv_bytes, from, step);
      return;
    }
    stage(send_stage_, send_capacity_, send_bytes);
    stage(recv_stage_, recv_capacity_, recv_bytes);
    if (send_bytes) {
      RINGATTN_CUDA_CHECK(
          cudaMemcpyAsync(send_stage_, send, send_bytes, cudaMemcpyDeviceToHost, stream));
      settle(stream, step);
    }
    transfer(send_stage_, send_bytes, to, recv_stage_, recv_bytes, from, step);
    // The staging buffer is read by this copy until `stream` passes it; the next exchange's
    // first `settle` waits for that before reusing it.
    if (recv_bytes)
      RINGATTN_CUDA_CHECK(
          cudaMemcpyAsync(recv, recv_stage_, recv_bytes, cudaMemcpyHostToDevice, stream));
  }

  // One exchange (see `exchange`), with no check of the communicator's state.
  void transfer(const void* send, std::size_t send_bytes, int to, void* recv,
                std::size_t recv_bytes, int from, std::int64_t step) {
    check_count(send_bytes);
    check_count(recv_bytes);
    const int tag = tag_of(step);
    MPI_Request req[2];
    RINGATTN_MPI_CHECK(
        MPI_Irecv(recv, static_cast<int>(recv_bytes), MPI_BYTE, from, tag, comm_, &req[0]));
    RINGATTN_MPI_CHECK(
        MPI_Isend(send, static_cast<int>(send_bytes), MPI_BYTE, to, tag, comm_, &req[1]));
    MPI_Status status[2];
    wait_all(req, status, step, from, to);
    int got = 0;
    RINGATTN_MPI_CHECK(MPI_Get_count(&status[0], MPI_BYTE, &got));
    if (static_cast<std::size_t>(got) != recv_bytes)
      throw communication_error("ringattn: rank " + std::to_string(rank_) + ", step " +
                                std::to_string(step) + ": rank " + std::to_string(from) + " sent " +
                                std::to_string(got) + " bytes, " + std::to_string(recv_bytes) +
                                " expected");
    bytes_sent_ += send_bytes;
  }
  // Runs `f`; any failure breaks the communicator (the first reason is kept) and is rethrown.
  template <class F>
  void breaks_on_failure(F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      const std::string what = e.what();
      if (broken_.empty()) broken_ = what.starts_with("ringattn: ") ? what.substr(10) : what;
      throw;
    }
  }
  void require_live(std::int64_t step) const {
    if (broken_.empty()) return;
    throw communication_error("ringattn: rank " + std::to_string(rank_) +
                              (step >= 0 ? ", step " + std::to_string(step) : std::string()) +
                              ": this MPI communicator is broken (" + broken_ +
                              "); create a new mpi_communicator");
  }
  int tag_of(std::int64_t step) const {
    // A prime stride between calls: the call number shows in the tag even when MPI_TAG_UB is
    // its guaranteed minimum, 32767.
    const std::uint64_t t = call_ * 4099u + static_cast<std::uint64_t>(step);
    return static_cast<int>(t % (static_cast<std::uint64_t>(tag_ub_) + 1));
  }
  // Waits (bounded) for a collective. On timeout the request stays pending with the buffers it
  // uses, kept to the end of the process (never cancelled: MPI forbids it).
  void collective(MPI_Request& req) {
    if (wait_for(&req, 1)) return;
    static std::mutex kept_mutex;
    static std::vector<std::pair<MPI_Request, std::shared_ptr<std::vector<std::byte>>>> kept;
    {
      std::lock_guard<std::mutex> lock(kept_mutex);
      kept.emplace_back(req, gather_);
    }
    throw communication_error("ringattn: rank " + std::to_string(rank_) +
                              ", all-gather: timed out after " + std::to_string(timeout_.count()) +
                              " ms waiting for every rank to join a collective");
  }
  // Waits (bounded) until the work enqueued on `stream` so far is done.
  void settle(cudaStream_t stream, std::int64_t step) {
    RINGATTN_CUDA_CHECK(cudaEventRecord(event_, stream));
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      const cudaError_t e = cudaEventQuery(event_);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) RINGATTN_CUDA_CHECK(e);
      if (std::chrono::steady_clock::now() >= deadline)
        throw communication_error("ringattn: rank " + std::to_string(rank_) + ", step " +
                                  std::to_string(step) + ": timed out after " +
                                  std::to_string(timeout_.count()) +
                                  " ms waiting for the device before an MPI exchange");
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  // Pinned host memory of at least `bytes` in `p` (grown only when a larger message comes).
  static void stage(void*& p, std::size_t& capacity, std::size_t bytes) {
    if (bytes <= capacity) return;
    if (p) RINGATTN_CUDA_CHECK(cudaFreeHost(p));
    p = nullptr;
    capacity = 0;
    RINGATTN_CUDA_CHECK(detail::pinned_malloc(&p, bytes));
    capacity = bytes;
  }

  void check_count(std::size_t bytes) const {
    if (bytes > static_cast<std::size_t>(std::numeric_limits<int>::max()))
      throw invalid_argument("ringattn: rank " + std::to_string(rank_) + ": a message of " +
                             std::to_string(bytes) + " bytes exceeds MPI's int count");
  }

  // Polls until the `n` requests complete (true; `status` filled) or the timeout passes (false).
  bool wait_for(MPI_Request* req, int n, MPI_Status* status = MPI_STATUSES_IGNORE) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    auto pause = std::chrono::microseconds(1);
    for (;;) {
      int done = 0;
      RINGATTN_MPI_CHECK(MPI_Testall(n, req, &done, status));
      if (done) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(pause);
      if (pause < std::chrono::milliseconds(1)) pause *= 2;
    }
  }
  // An exchange's receive and send (`req[0]`, `req[1]`), bounded. On timeout the receive is
  // cancelled (and waited for, so nothing lands in `recv` afterwards), the send released, and
  // the call throws naming the peers and the step.
  void wait_all(MPI_Request* req, MPI_Status* status, std::int64_t step, int from, int to) {
    if (wait_for(req, 2, status)) return;
    if (req[0] != MPI_REQUEST_NULL) {
      MPI_Cancel(&req[0]);
      MPI_Wait(&req[0], MPI_STATUS_IGNORE); // a cancelled receive completes at once
    }
    if (req[1] != MPI_REQUEST_NULL) MPI_Request_free(&req[1]);
    throw communication_error(
        "ringattn: rank " + std::to_string(rank_) + ", step " + std::to_string(step) +
        ": timed out after " + std::to_string(timeout_.count()) + " ms waiting for rank " +
        std::to_string(from) + " to send and rank " + std::to_string(to) + " to receive");
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::chrono::milliseconds timeout_;
  std::uint64_t bytes_sent_ = 0;
  std::string aborted_;
  std::string broken_;     // the first failure; non-empty: broken for good
  std::uint64_t call_ = 0; // the ring's call (begin_call), in every tag
  int tag_ub_ = 32767;
  std::shared_ptr<std::vector<std::byte>> gather_; // all_gather's buffers (see `collective`)
  cuda_awareness awareness_;
  bool cuda_aware_ = false;
  cudaEvent_t event_ = nullptr;
  void* send_stage_ = nullptr;
  void* recv_stage_ = nullptr;
  std::size_t send_capacity_ = 0, recv_capacity_ = 0;
};

} // namespace ringattn
