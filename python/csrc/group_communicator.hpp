#pragma once
// `group_communicator`: a host Communicator (ringattn::host_communicator) over a
// torch.distributed process group's CPU backend (gloo), for the ring's host path on CPU tensors.
// Every wait is bounded by the timeout; a rank that fails marks its communicator broken (later
// calls throw at once), and its peers' pending waits end at their timeout with an error naming
// the step. The process group itself is left alone: it belongs to the caller.
#include <ringattn/error.cuh>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <ATen/ATen.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ringattn_torch {

class group_communicator {
public:
  //! Per-call agreement runs over the group (a small all-gather per call).
  static constexpr bool host_collectives = true;

  //! Holds `group` weakly: torch.distributed.destroy_process_group releases it (its worker
  //! threads end there, not during the interpreter's shutdown), and a later call is refused.
  group_communicator(const c10::intrusive_ptr<c10d::ProcessGroup>& group,
                     std::chrono::milliseconds timeout)
      : group_(group), timeout_(timeout) {
    if (!group) throw ringattn::invalid_argument("ringattn: no process group");
    rank_ = group->getRank();
    size_ = group->getSize();
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  std::uint64_t bytes_sent() const noexcept { return bytes_sent_; }

  void exchange(const void* send, std::size_t send_bytes, int to, void* recv,
                std::size_t recv_bytes, int from, std::int64_t step) {
    check_live(step);
    check_peer(to, step);
    check_peer(from, step);
    if (to == rank_ && from == rank_) {
      if (send_bytes != recv_bytes)
        throw ringattn::invalid_argument(
            "ringattn: " + where(step) + ": sends " + std::to_string(send_bytes) +
            " bytes to itself but expects " + std::to_string(recv_bytes));
      if (send_bytes && send != recv) std::memmove(recv, send, send_bytes);
      bytes_sent_ += send_bytes;
      return;
    }
    guarded(step, "a send/receive", [&] {
      const int tag = static_cast<int>(step & 0x3fffffff);
      c10::intrusive_ptr<c10d::Work> sent, received;
      std::vector<at::Tensor> out{bytes(const_cast<void*>(send), send_bytes)};
      std::vector<at::Tensor> in{bytes(recv, recv_bytes)};
      const auto group = live(step);
      if (send_bytes) sent = group->send(out, to, tag);
      if (recv_bytes) received = group->recv(in, from, tag);
      if (sent) wait(sent, step, "its send to rank " + std::to_string(to));
      if (received) wait(received, step, "the block from rank " + std::to_string(from));
    });
    bytes_sent_ += send_bytes;
  }

  void all_gather(const void* send, std::size_t n, void* recv) {
    check_live(-1);
    if (size_ == 1) { // nobody to gather from: no collective (and none of its host latency)
      if (n && send != recv) std::memmove(recv, send, n);
      return;
    }
    guarded(-1, "an all-gather", [&] {
      std::vector<at::Tensor> in{bytes(const_cast<void*>(send), n)};
      std::vector<std::vector<at::Tensor>> out(1);
      for (int r = 0; r < size_; ++r)
        out[0].push_back(bytes(static_cast<std::byte*>(recv) + static_cast<std::size_t>(r) * n, n));
      wait(live(-1)->allgather(out, in), -1, "every rank's part of an all-gather");
    });
  }

  void barrier() {
    char none = 0;
    std::string all(static_cast<std::size_t>(size_), '\0');
    all_gather(&none, 1, all.data());
  }

  void abort(const std::string& reason) {
    if (reason_.empty()) reason_ = reason.empty() ? "aborted" : reason;
    broken_ = true;
  }

private:
  static at::Tensor bytes(void* p, std::size_t n) {
    return at::from_blob(p, {static_cast<std::int64_t>(n)},
                         at::TensorOptions().dtype(at::kByte).device(at::kCPU));
  }
  std::string where(std::int64_t step) const {
    return step >= 0 ? "rank " + std::to_string(rank_) + ", step " + std::to_string(step)
                     : "rank " + std::to_string(rank_);
  }
  void check_live(std::int64_t step) const {
    if (broken_)
      throw ringattn::communication_error("ringattn: " + where(step) +
                                          ": this ring's process-group communicator failed "
                                          "earlier (" +
                                          reason_ + "); plan the ring again");
  }
  c10::intrusive_ptr<c10d::ProcessGroup> live(std::int64_t step) {
    auto group = group_.lock();
    if (!group)
      fail(step, "its process group was destroyed (torch.distributed.destroy_process_group)");
    return group;
  }
  void check_peer(int peer, std::int64_t step) const {
    if (peer < 0 || peer >= size_)
      throw ringattn::invalid_argument("ringattn: " + where(step) + ": peer " +
                                       std::to_string(peer) + " is out of range [0, " +
                                       std::to_string(size_) + ")");
  }
  void wait(const c10::intrusive_ptr<c10d::Work>& work, std::int64_t step,
            const std::string& what) {
    bool done = false;
    try {
      done = work->wait(timeout_);
    } catch (const std::exception& e) {
      fail(step, "waiting for " + what + ": " + e.what());
    }
    if (!done)
      fail(step, "waited " + std::to_string(timeout_.count()) + " ms for " + what +
                     " (a peer may be missing)");
  }
  template <class Body>
  void guarded(std::int64_t step, const char* what, Body&& body) {
    try {
      body();
    } catch (const ringattn::error&) {
      throw;
    } catch (const std::exception& e) {
      fail(step, std::string("the process group refused ") + what + ": " + e.what());
    }
  }
  [[noreturn]] void fail(std::int64_t step, const std::string& what) {
    abort(what);
    throw ringattn::communication_error("ringattn: " + where(step) + ": " + what);
  }

  c10::weak_intrusive_ptr<c10d::ProcessGroup> group_;
  std::chrono::milliseconds timeout_;
  int rank_ = 0, size_ = 1;
  bool broken_ = false;
  std::string reason_;
  std::uint64_t bytes_sent_ = 0;
};

} // namespace ringattn_torch

namespace ringattn_torch {
class endpoint;
//! This rank's end of `group` (its CPU backend) as a host endpoint for `make_host_plan`.
std::shared_ptr<endpoint> make_group_endpoint(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                              std::int64_t timeout_ms);
} // namespace ringattn_torch
