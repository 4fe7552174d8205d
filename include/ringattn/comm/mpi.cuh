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
//! \code
//! ringattn::mpi_communicator comm(MPI_COMM_WORLD);
//! ringattn::ring_attention<ringattn::zigzag, ringattn::mpi_communicator, ringattn::causal>
//!     attn(comm, args, cu_seqlens);
//! \endcode

#include <ringattn/comm/mpi_error.cuh>
#include <ringattn/error.cuh>

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>

namespace ringattn {

class mpi_communicator {
public:
  explicit mpi_communicator(MPI_Comm comm,
                            std::chrono::milliseconds timeout = std::chrono::seconds(60))
      : timeout_(timeout) {
    RINGATTN_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
    RINGATTN_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    RINGATTN_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    RINGATTN_MPI_CHECK(MPI_Comm_size(comm_, &size_));
  }
  ~mpi_communicator() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&comm_); // no throw from a destructor
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
    check_count(send_bytes);
    check_count(recv_bytes);
    const int tag = static_cast<int>(step % 32768); // MPI guarantees tags up to 32767
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

  //! Every rank contributes `bytes`; `recv` gets all contributions rank-major. Bounded.
  void all_gather(const void* send, std::size_t bytes, void* recv) {
    error_rank_scope scope(rank_);
    check_count(bytes);
    MPI_Request req;
    RINGATTN_MPI_CHECK(MPI_Iallgather(send, static_cast<int>(bytes), MPI_BYTE, recv,
                                      static_cast<int>(bytes), MPI_BYTE, comm_, &req));
    MPI_Status status;
    wait_all(&req, &status, -1, -1, -1, 1);
  }
  void barrier() {
    error_rank_scope scope(rank_);
    MPI_Request req;
    RINGATTN_MPI_CHECK(MPI_Ibarrier(comm_, &req));
    MPI_Status status;
    wait_all(&req, &status, -1, -1, -1, 1);
  }
  //! Records why this rank gave up (MPI cannot wake peers waiting elsewhere; see the file notes).
  void abort(const std::string& reason) { aborted_ = reason; }
  const std::string& abort_reason() const noexcept { return aborted_; }

private:
  void check_count(std::size_t bytes) const {
    if (bytes > static_cast<std::size_t>(std::numeric_limits<int>::max()))
      throw invalid_argument("ringattn: rank " + std::to_string(rank_) + ": a message of " +
                             std::to_string(bytes) + " bytes exceeds MPI's int count");
  }

  // Polls until every request completes or the timeout passes; on timeout cancels what is
  // pending and throws naming the peers and the step.
  void wait_all(MPI_Request* req, MPI_Status* status, std::int64_t step, int from, int to,
                int n = 2) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    auto pause = std::chrono::microseconds(1);
    for (;;) {
      int done = 0;
      RINGATTN_MPI_CHECK(MPI_Testall(n, req, &done, status));
      if (done) return;
      if (std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(pause);
      if (pause < std::chrono::milliseconds(1)) pause *= 2;
    }
    for (int i = 0; i < n; ++i)
      if (req[i] != MPI_REQUEST_NULL) {
        MPI_Cancel(&req[i]);
        MPI_Request_free(&req[i]);
      }
    std::string where =
        "rank " + std::to_string(rank_) +
        (step >= 0 ? ", step " + std::to_string(step) : std::string(", at plan time"));
    std::string what = from >= 0 ? "rank " + std::to_string(from) + " to send and rank " +
                                       std::to_string(to) + " to receive"
                                 : std::string("every rank to join a collective");
    throw communication_error("ringattn: " + where + ": timed out after " +
                              std::to_string(timeout_.count()) + " ms waiting for " + what);
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::chrono::milliseconds timeout_;
  std::uint64_t bytes_sent_ = 0;
  std::string aborted_;
};

} // namespace ringattn
