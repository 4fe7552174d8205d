#pragma once
//! \file
//! The in-process communicator: the ranks of a ring are threads of one process.
//!
//! An `in_process_group` is the shared meeting point of `size` ranks; each thread takes its
//! `in_process_communicator` with `group.communicator(rank)`. This is how CI runs the whole ring
//! on the CPU, and (with device buffers) how one GPU hosts several virtual ranks, or one process
//! drives several GPUs (a rank per GPU, copies between them peer to peer where possible).
//!
//! Every wait is bounded (`timeout`, default 60 s, settable): a peer that never arrives makes the
//! waiting rank throw `communication_error` naming itself, the peer and the step. A rank that
//! fails calls `abort(reason)` (the ring driver does this for it), which wakes every waiting rank
//! with an error naming the failed rank instead of letting them wait out the timeout.
//!
//! Recovery: a timeout or an abort breaks the group for good (its rendezvous may hold a late
//! rank's offer); every later exchange or all-gather of any rank throws at once, naming the first
//! failure and asking for a new group. Offers carry the call number the ring gives each call
//! (`begin_call`) and the step, so nothing of one call is ever taken by another.
//!
//! One call at a time per rank: while a thread is inside a call (`enter_call`, which the ring
//! takes for each call) or an operation of rank r, another thread's operation or call on rank r
//! breaks the group and throws `invalid_argument` naming it, since the two would trade each
//! other's messages. Calls of a rank's objects one after another, from any thread, are fine.
//!
//! \code
//! ringattn::in_process_group group(4);
//! std::vector<std::thread> threads;
//! for (int r = 0; r < 4; ++r)
//!   threads.emplace_back([&, r] { auto comm = group.communicator(r); /* ring_attention(...) */ });
//! \endcode

#include <ringattn/cuda_check.cuh>
#include <ringattn/error.cuh>

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

namespace ringattn {

class in_process_communicator;

//! Shared state of the ranks of one in-process ring. Outlives every communicator taken from it.
class in_process_group {
public:
  //! The most ranks one group may have (threads of one process).
  static constexpr int max_size = 65536;

  explicit in_process_group(int size, std::chrono::milliseconds timeout = std::chrono::seconds(60))
      : size_(checked_size(size)), timeout_(timeout), posts_(static_cast<std::size_t>(size_)),
        ready_(posts_.size(), nullptr), copied_(posts_.size(), nullptr),
        devices_(posts_.size(), -1), taken_(posts_.size(), false), users_(posts_.size()),
        holds_(posts_.size(), 0), gathered_(posts_.size(), nullptr), joined_(posts_.size(), -1) {}
  in_process_group(const in_process_group&) = delete;
  in_process_group& operator=(const in_process_group&) = delete;

  int size() const noexcept { return size_; }
  std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  //! The communicator of rank `rank`, for that rank's thread. Each rank is taken once (its
  //! communicator may be copied within the thread); taking a rank again throws.
  in_process_communicator communicator(int rank);

  //! Creates rank `rank`'s CUDA events for device exchanges on the current device (the rank's:
  //! ranks of one group may use different GPUs of the process) and lets that device access its
  //! ring neighbours' devices directly where peer access is possible. Idempotent and
  //! thread-safe; called at plan time by each rank's `ring_attention::prepare_device`.
  void prepare_device(int rank) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (rank < 0 || rank >= size_)
      throw invalid_argument("ringattn: rank " + std::to_string(rank) + " is out of range [0, " +
                             std::to_string(size_) + ")");
    const auto r = static_cast<std::size_t>(rank);
    if (ready_[r] != nullptr) return;
    int device = 0;
    RINGATTN_CUDA_CHECK(cudaGetDevice(&device));
    devices_[r] = device;
    RINGATTN_CUDA_CHECK(cudaEventCreateWithFlags(&ready_[r], cudaEventDisableTiming));
    RINGATTN_CUDA_CHECK(cudaEventCreateWithFlags(&copied_[r], cudaEventDisableTiming));
    // Copies out of a neighbour's buffers: direct peer access where the devices allow it (else
    // the driver stages them). Done for both neighbours once both have registered.
    for (int peer : {(rank + 1) % size_, (rank - 1 + size_) % size_}) {
      const int other = devices_[static_cast<std::size_t>(peer)];
      if (other < 0 || other == device) continue;
      enable_peer(device, other);
      enable_peer(other, device);
    }
  }
  ~in_process_group() {
    for (cudaEvent_t e : ready_)
      if (e) cudaEventDestroy(e);
    for (cudaEvent_t e : copied_)
      if (e) cudaEventDestroy(e);
  }

  //! Breaks the group: every current wait throws with `reason`, every later operation at once.
  void abort(int rank, const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex_);
    constexpr std::string_view prefix = "ringattn: "; // an error's own text, passed on
    const std::string_view why = std::string_view(reason).starts_with(prefix)
                                     ? std::string_view(reason).substr(prefix.size())
                                     : std::string_view(reason);
    if (aborted_.empty())
      aborted_ = "rank " + std::to_string(rank) + " aborted the ring: " + std::string(why);
    changed_.notify_all();
  }
  //! Whether a timeout or an abort has broken the group (see the file notes).
  bool broken() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return !aborted_.empty();
  }

private:
  friend class in_process_communicator;

  // What rank `from` offers to its successor for one step: the sender's buffer stays valid until
  // the receiver has copied it (consumed), so no intermediate copy is needed.
  struct post {
    const void* data = nullptr;
    std::size_t bytes = 0;
    std::uint64_t call = 0; // the ring call it belongs to (begin_call)
    std::int64_t step = -1;
    bool consumed = true;
    cudaEvent_t ready = nullptr;  // device exchange: the sender's data is complete
    cudaEvent_t copied = nullptr; // device exchange: the receiver's copy of it is complete
  };

  //! "rank r, step s" (or "rank r, all-gather" for step < 0: the agreement of a plan or of a
  //! call): where an error happened.
  static std::string where(int rank, std::int64_t step) {
    return "rank " + std::to_string(rank) +
           (step >= 0 ? ", step " + std::to_string(step) : std::string(", all-gather"));
  }

  // Waits on `changed_` until `ready()` or timeout/abort; throws naming the ranks and the step.
  // `then_reads_peers`: the caller goes on to read peers' buffers, so an aborted group fails the
  // wait even if its condition holds (the rank that aborted may be freeing its buffer); a wait
  // after which nothing of a peer is read returns once its condition holds.
  // `peer`: the rank waited for (-1: none), or a function that finds it when the wait times out.
  template <class Ready, class Peer>
  void wait(std::unique_lock<std::mutex>& lock, Ready ready, int rank, Peer peer, std::int64_t step,
            const char* what, bool then_reads_peers = true) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      if (!then_reads_peers && ready()) return;
      if (!aborted_.empty())
        throw communication_error("ringattn: " + where(rank, step) + ": " + aborted_);
      if (ready()) return;
      if (changed_.wait_until(lock, deadline) == std::cv_status::timeout && !ready()) {
        std::string msg = where(rank, step) + ": timed out after " +
                          std::to_string(timeout_.count()) + " ms waiting for ";
        int p = -1;
        if constexpr (std::is_invocable_v<Peer>)
          p = peer();
        else
          p = peer;
        msg += p >= 0 ? "rank " + std::to_string(p) + " " + what : what;
        if (aborted_.empty()) aborted_ = msg; // the group is broken from now on
        changed_.notify_all();
        throw communication_error("ringattn: " + msg);
      }
    }
  }

  static int checked_size(int size) {
    if (size < 1)
      throw invalid_argument("ringattn: an in-process group needs at least one rank (got " +
                             std::to_string(size) + ")");
    if (size > max_size)
      throw invalid_argument("ringattn: an in-process group has at most " +
                             std::to_string(max_size) + " ranks (got " + std::to_string(size) +
                             ")");
    return size;
  }

  //! Takes rank `rank` for the calling thread (a thread's nested takes count), or, if another
  //! thread holds it, breaks the group and throws (the caller holds the lock).
  void take_rank(int rank, std::int64_t step) {
    const auto r = static_cast<std::size_t>(rank);
    const std::thread::id me = std::this_thread::get_id();
    if (holds_[r] > 0 && users_[r] != me) {
      const std::string why =
          where(rank, step) + ": two threads use rank " + std::to_string(rank) +
          "'s communicator at once (one call at a time per rank: a rank's ring objects are "
          "called one after another, never concurrently)";
      if (aborted_.empty()) aborted_ = why;
      changed_.notify_all();
      throw invalid_argument("ringattn: " + why);
    }
    users_[r] = me;
    ++holds_[r];
  }
  void release_rank(int rank) noexcept {
    const auto r = static_cast<std::size_t>(rank);
    if (--holds_[r] == 0) users_[r] = std::thread::id();
  }
  //! Rank `rank` taken for one operation (the caller holds the lock while it is made and ends).
  class rank_use {
  public:
    rank_use(in_process_group& g, int rank, std::int64_t step) : g_(g), rank_(rank) {
      g_.take_rank(rank, step);
    }
    ~rank_use() { g_.release_rank(rank_); }
    rank_use(const rank_use&) = delete;
    rank_use& operator=(const rank_use&) = delete;

  private:
    in_process_group& g_;
    int rank_;
  };

  //! Throws at once if the group is broken (the caller holds the lock).
  void require_live(int rank, std::int64_t step) const {
    if (!aborted_.empty())
      throw communication_error("ringattn: " + where(rank, step) +
                                ": this in-process group is broken (" + aborted_ +
                                "); create a new in_process_group and take new communicators");
  }

  int size_;
  std::chrono::milliseconds timeout_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::string aborted_;
  std::vector<post> posts_;                 // posts_[r]: what rank r offers its successor
  std::vector<cudaEvent_t> ready_, copied_; // per rank, for device exchanges
  std::vector<int> devices_;                // per rank: its device (-1 before prepare_device)
  std::vector<bool> taken_;                 // per rank: its communicator was handed out
  std::vector<std::thread::id> users_;      // per rank: the thread inside a call or operation
  std::vector<int> holds_;                  // per rank: that thread's takes (0: the rank is free)

  //! Lets device `from` access device `to`'s memory directly, if the hardware can.
  static void enable_peer(int from, int to) {
    int can = 0;
    RINGATTN_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, from, to));
    if (!can) return;
    int current = 0;
    RINGATTN_CUDA_CHECK(cudaGetDevice(&current));
    RINGATTN_CUDA_CHECK(cudaSetDevice(from));
    const cudaError_t e = cudaDeviceEnablePeerAccess(to, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError(); // not an error here
    RINGATTN_CUDA_CHECK(cudaSetDevice(current));
    if (e != cudaErrorPeerAccessAlreadyEnabled) RINGATTN_CUDA_CHECK(e);
  }
  // all_gather / barrier state: a generation counter and per-rank pointers.
  std::vector<const void*> gathered_;
  std::vector<std::int64_t> joined_; // per rank: the generation of its latest all-gather
  int arrived_ = 0;
  std::int64_t generation_ = 0;
  int departed_ = 0;
};

//! One rank's handle on an `in_process_group`. Cheap to copy; all waits are bounded.
class in_process_communicator {
public:
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return group_->size_; }
  //! Bytes this rank has sent through `exchange` (for tests and benchmarks).
  std::uint64_t bytes_sent() const noexcept { return bytes_sent_; }

  //! Sends `send_bytes` at `send` to rank `to` and receives `recv_bytes` from rank `from` into
  //! `recv`, for ring step `step`; returns when both are done. The received size must match what
  //! the peer sent (a mismatch is an error naming both sizes, never a silent truncation).
  void exchange(const void* send, std::size_t send_bytes, int to, void* recv,
                std::size_t recv_bytes, int from, std::int64_t step) {
    in_process_group& g = *group_;
    std::unique_lock<std::mutex> lock(g.mutex_);
    check_peer(to, step);
    check_peer(from, step);
    g.require_live(rank_, step);
    const in_process_group::rank_use use(g, rank_, step);
    // 1. offer our buffer to `to`.
    g.wait(
        lock, [&] { return g.posts_[rank_].consumed; }, rank_, to, step,
        "to take the previous step's data", /*then_reads_peers=*/false);
    g.posts_[rank_] = {send, send_bytes, call_, step, false};
    g.changed_.notify_all();
    try {
      // 2. take what `from` offers for this step.
      g.wait(
          lock, [&] { return offered(g, from, step); }, rank_, from, step, "to send");
      in_process_group::post& in = take(g, recv_bytes, from, step);
      if (recv_bytes) std::memcpy(recv, in.data, recv_bytes);
      in.consumed = true;
      g.changed_.notify_all();
      // 3. our buffer must stay valid until `to` has copied it.
      g.wait(
          lock, [&] { return g.posts_[rank_].consumed; }, rank_, to, step, "to receive",
          /*then_reads_peers=*/false);
    } catch (...) {
      withdraw(g, send, step); // the caller may free `send` once we throw
      throw;
    }
    bytes_sent_ += send_bytes;
  }

  //! Device exchange for ranks that share a process (one GPU, or several with peer access):
  //! enqueues on `stream` the receive of `recv_bytes` from rank `from` into `recv` (a device
  //! copy from the sender's buffer, ordered after the sender's `stream` work by an event) and
  //! makes `stream` wait until rank `to` has copied `send` before anything later on `stream` may
  //! overwrite it. The host threads meet only to swap pointers and events (bounded waits); no
  //! thread waits for the device. Needs `prepare_device()` first (on this rank's device).
  void exchange_async(const void* send, std::size_t send_bytes, int to, void* recv,
                      std::size_t recv_bytes, int from, std::int64_t step, cudaStream_t stream) {
    in_process_group& g = *group_;
    std::unique_lock<std::mutex> lock(g.mutex_);
    check_peer(to, step);
    check_peer(from, step);
    g.require_live(rank_, step);
    const in_process_group::rank_use use(g, rank_, step);
    if (g.ready_[static_cast<std::size_t>(rank_)] == nullptr)
      throw invalid_argument("ringattn: " + in_process_group::where(rank_, step) +
                             ": device exchange before prepare_device()");
    g.wait(
        lock, [&] { return g.posts_[rank_].consumed; }, rank_, to, step,
        "to take the previous step's data", /*then_reads_peers=*/false);
    cudaEvent_t ready = g.ready_[static_cast<std::size_t>(rank_)];
    RINGATTN_CUDA_CHECK(cudaEventRecord(ready, stream)); // our data is complete after this point
    g.posts_[rank_] = {send, send_bytes, call_, step, false, ready, nullptr};
    g.changed_.notify_all();
    try {
      g.wait(
          lock, [&] { return offered(g, from, step); }, rank_, from, step, "to send");
      in_process_group::post& in = take(g, recv_bytes, from, step);
      cudaEvent_t copied = g.copied_[static_cast<std::size_t>(rank_)];
      RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, in.ready, 0));
      if (recv_bytes)
        RINGATTN_CUDA_CHECK(
            cudaMemcpyAsync(recv, in.data, recv_bytes, cudaMemcpyDeviceToDevice, stream));
      RINGATTN_CUDA_CHECK(cudaEventRecord(copied, stream));
      in.copied = copied;
      in.consumed = true;
      g.changed_.notify_all();
      g.wait(
          lock, [&] { return g.posts_[rank_].consumed; }, rank_, to, step, "to receive",
          /*then_reads_peers=*/false);
    } catch (...) {
      withdraw(g, send, step);
      throw;
    }
    // Later work on `stream` (the next receive into this buffer) waits for the peer's copy.
    RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(stream, g.posts_[rank_].copied, 0));
    bytes_sent_ += send_bytes;
  }

  //! Every rank contributes `bytes` at `send`; `recv` receives all contributions, rank-major
  //! (`size() * bytes`). Used at plan time to check that ranks agree.
  void all_gather(const void* send, std::size_t bytes, void* recv) {
    in_process_group& g = *group_;
    std::unique_lock<std::mutex> lock(g.mutex_);
    g.require_live(rank_, -1);
    const in_process_group::rank_use use(g, rank_, -1);
    const std::int64_t gen = g.generation_;
    g.gathered_[rank_] = send;
    g.joined_[rank_] = gen;
    if (++g.arrived_ == g.size_) {
      g.arrived_ = 0;
      ++g.generation_;
      g.changed_.notify_all();
    } else {
      auto missing = [&] { // the first rank not here yet, for the message
        int r = 0;
        while (r < g.size_ && g.joined_[static_cast<std::size_t>(r)] == gen)
          ++r;
        return r;
      };
      g.wait(
          lock, [&] { return g.generation_ != gen; }, rank_, missing, -1, "to join an all-gather");
    }
    for (int r = 0; r < g.size_; ++r)
      if (bytes) std::memcpy(static_cast<char*>(recv) + r * bytes, g.gathered_[r], bytes);
    // Nobody may leave (and free its buffer) before everyone has copied.
    if (++g.departed_ == g.size_) {
      g.departed_ = 0;
      ++g.generation_;
      g.changed_.notify_all();
    } else {
      g.wait(
          lock, [&] { return g.generation_ != gen + 1; }, rank_, -1, -1,
          "every rank to finish an all-gather", /*then_reads_peers=*/false);
    }
  }

  //! Waits until every rank has arrived.
  void barrier() {
    char none = 0;
    std::vector<char> all(static_cast<std::size_t>(size()));
    all_gather(&none, 1, all.data());
  }

  //! Creates this rank's device events on the current device (see
  //! in_process_group::prepare_device).
  void prepare_device() { group_->prepare_device(rank_); }

  //! Breaks the whole group (see in_process_group::abort).
  void abort(const std::string& reason) { group_->abort(rank_, reason); }

  //! The collectives are host-side and cheap: the ring agrees on every call (ring/call.cuh).
  static constexpr bool host_collectives = true;
  //! Numbers the ring's call that follows (the same on every rank): offers of one call are never
  //! taken by another.
  void begin_call(std::uint64_t call) noexcept { call_ = call; }

  //! This rank taken by the calling thread for one call, until the returned object ends: another
  //! thread's call or operation on this rank meanwhile breaks the group (see the file notes).
  class call_use {
  public:
    explicit call_use(in_process_group& g, int rank) : g_(&g), rank_(rank) {
      std::lock_guard<std::mutex> lock(g.mutex_);
      g.take_rank(rank, -1);
    }
    ~call_use() {
      std::lock_guard<std::mutex> lock(g_->mutex_);
      g_->release_rank(rank_);
    }
    call_use(const call_use&) = delete;
    call_use& operator=(const call_use&) = delete;

  private:
    in_process_group* g_;
    int rank_;
  };
  [[nodiscard]] call_use enter_call() { return call_use(*group_, rank_); }

private:
  friend class in_process_group;
  in_process_communicator(in_process_group* g, int rank) : group_(g), rank_(rank) {}
  // What `from` offers for `step` (the caller has waited for it), if its size is the one expected;
  // a mismatch fails the whole group, so every waiting rank learns why.
  in_process_group::post& take(in_process_group& g, std::size_t recv_bytes, int from,
                               std::int64_t step) const {
    in_process_group::post& in = g.posts_[from];
    if (in.bytes != recv_bytes) {
      const std::string why = in_process_group::where(rank_, step) + ": rank " +
                              std::to_string(from) + " sent " + std::to_string(in.bytes) +
                              " bytes, " + std::to_string(recv_bytes) + " expected";
      if (g.aborted_.empty()) g.aborted_ = why;
      g.changed_.notify_all();
      throw communication_error("ringattn: " + why);
    }
    return in;
  }
  // Whether `from` offers this call's `step`.
  bool offered(const in_process_group& g, int from, std::int64_t step) const {
    const in_process_group::post& p = g.posts_[static_cast<std::size_t>(from)];
    return !p.consumed && p.call == call_ && p.step == step;
  }
  // A failed exchange takes back its offer (under the group's lock) if nobody has taken it yet,
  // so that no peer copies from a buffer its owner is about to free or reuse.
  void withdraw(in_process_group& g, const void* send, std::int64_t step) const {
    in_process_group::post& mine = g.posts_[rank_];
    if (!mine.consumed && mine.data == send && mine.step == step) {
      mine = in_process_group::post{};
      g.changed_.notify_all();
    }
  }
  void check_peer(int peer, std::int64_t step) const {
    if (peer < 0 || peer >= group_->size_)
      throw invalid_argument("ringattn: " + in_process_group::where(rank_, step) + ": peer " +
                             std::to_string(peer) + " is out of range [0, " +
                             std::to_string(group_->size_) + ")");
  }

  in_process_group* group_;
  int rank_;
  std::uint64_t call_ = 0;
  std::uint64_t bytes_sent_ = 0;
};

inline in_process_communicator in_process_group::communicator(int rank) {
  if (rank < 0 || rank >= size_)
    throw invalid_argument("ringattn: rank " + std::to_string(rank) + " is out of range [0, " +
                           std::to_string(size_) + ")");
  std::lock_guard<std::mutex> lock(mutex_);
  if (taken_[static_cast<std::size_t>(rank)])
    throw invalid_argument("ringattn: rank " + std::to_string(rank) +
                           " of this in-process group is taken already (one communicator per "
                           "rank; copy it within the rank's thread)");
  taken_[static_cast<std::size_t>(rank)] = true;
  return in_process_communicator(this, rank);
}

} // namespace ringattn
