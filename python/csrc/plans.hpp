#pragma once
// The plan models behind plan.hpp: a rank of a communicator the process keeps
// (`endpoint_plan`) and every rank of an in-process group (`virtual_plan`), each for one
// Partitioner x BlockKernel x Schedule, and the dispatch from a layout's kinds to those types.
// The device halves of the models compile only under nvcc.
#include "plan.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/comm/in_process.cuh>
#include <ringattn/core/element.cuh>
#include <ringattn/partition/balanced.cuh>
#include <ringattn/partition/contiguous.cuh>
#include <ringattn/partition/round_robin.cuh>
#include <ringattn/partition/zigzag.cuh>
#include <ringattn/ring_attention.cuh>

#include <cuda_runtime_api.h>

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace ringattn_torch::detail {

inline constexpr std::size_t share_alignment = 256;

inline std::size_t aligned(std::size_t bytes) {
  return (bytes + share_alignment - 1) / share_alignment * share_alignment;
}

template <class T>
ringattn::thd_view<T> as_view(const view& v) {
  return ringattn::thd_view<T>(static_cast<T*>(v.data), v.tokens, v.heads, v.dim, v.token_stride,
                               v.head_stride);
}

//! Calls `f(T{})` with T the element type named by `type`.
template <class F>
decltype(auto) with_element(element_type type, F&& f) {
  switch (type) {
  case element_type::f16: return f(__half{});
  case element_type::bf16: return f(__nv_bfloat16{});
  case element_type::f32: break;
  }
  return f(float{});
}

//! That a call got one entry (`what`: "the tensors", "the caches") per rank it runs here.
inline void check_io_count(std::size_t got, int want, const char* what = "the tensors") {
  if (got != static_cast<std::size_t>(want))
    throw ringattn::invalid_argument("ringattn: a call here takes " + std::string(what) + " of " +
                                     std::to_string(want) + " rank(s), got " + std::to_string(got));
}

//! Refuses a call through `owner.refuse<T>(in_step, Device, reason)` (a ring or a sharded
//! decode), T the element type `type` names (bf16 for fp32 on the device, which refuses fp32
//! anyway), so that the peers' call fails too; then throws `reason` here.
template <bool Device, class Owner>
[[noreturn]] void refuse_through(Owner& owner, element_type type, bool in_step,
                                 const std::string& reason) {
  with_element(type, [&]<class T>(T) {
    if constexpr (Device && std::is_same_v<T, float>)
      owner.template refuse<__nv_bfloat16>(in_step, Device, reason);
    else
      owner.template refuse<T>(in_step, Device, reason);
  });
  throw ringattn::invalid_argument("ringattn: " + reason);
}

//! Rethrows the most telling of the failures of a call's threads, lowest rank first: a rank's
//! own invalid argument, then one that names a peer's rejection (the library's agreements say
//! "rank r rejected its ... (its own error says why)"), then any other; returns where none failed.
inline void rethrow_most_telling(const std::vector<std::exception_ptr>& errors) {
  std::exception_ptr own, argument, other;
  for (const auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const ringattn::invalid_argument& x) {
      const bool about_a_peer =
          std::string_view(x.what()).find("(its own error says why)") != std::string_view::npos;
      if (!own && !about_a_peer) own = e;
      if (!argument) argument = e;
    } catch (...) {
      if (!other) other = e;
    }
  }
  for (const auto& e : {own, argument, other})
    if (e) std::rethrow_exception(e);
}

//! Threads kept from call to call that run `body(i)` for every i in [0, n) together (the ranks
//! of an in-process group meet in collectives, so each needs a thread of its own): index 0 on
//! the caller's thread, the others on the pool's. A thread's first CUDA call costs more than a
//! decode step's host work, so the threads live as long as the pool. Calls from several threads
//! take turns.
class rank_threads {
public:
  explicit rank_threads(int n) : owner_(getpid()) {
    try {
      threads_.reserve(static_cast<std::size_t>(std::max(n - 1, 0)));
      for (int i = 1; i < n; ++i)
        threads_.emplace_back([this, i] { serve(i); });
    } catch (...) { // no thread to be had: end those started, then fail
      stop();
      throw;
    }
  }
  ~rank_threads() { stop(); }
  rank_threads(const rank_threads&) = delete;
  rank_threads& operator=(const rank_threads&) = delete;

  //! Runs `body(i)` for i in [0, n) (n at most the pool's size) and returns after all have
  //! ended, rethrowing the most telling failure.
  template <class Body>
  void run(int n, Body&& body) {
    if (getpid() != owner_)
      throw ringattn::invalid_argument(
          "ringattn: virtual ranks made before a fork() run only in the process that made them");
    if (n - 1 > static_cast<int>(threads_.size()))
      throw ringattn::invalid_argument("ringattn: " + std::to_string(n) +
                                       " virtual ranks on a pool of " +
                                       std::to_string(threads_.size() + 1) + " threads");
    if (n <= 0) return;
    const std::lock_guard<std::mutex> turn(turn_);
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(n));
    auto one = [&](int i) {
      try {
        body(i);
      } catch (...) {
        errors[static_cast<std::size_t>(i)] = std::current_exception();
      }
    };
    const std::function<void(int)> job = one;
    {
      const std::lock_guard<std::mutex> lock(m_);
      job_ = &job;
      working_ = n;
      pending_ = n - 1;
      ++generation_;
    }
    wake_.notify_all();
    one(0);
    {
      std::unique_lock<std::mutex> lock(m_);
      done_.wait(lock, [&] { return pending_ == 0; });
      job_ = nullptr;
    }
    rethrow_most_telling(errors);
  }

private:
  void stop() noexcept {
    {
      const std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_)
      t.join();
  }
  void serve(int i) {
    std::uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(m_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (i >= working_) continue;
      const std::function<void(int)>* job = job_;
      lock.unlock();
      (*job)(i);
      lock.lock();
      if (--pending_ == 0) done_.notify_one();
    }
  }

  pid_t owner_;
  std::mutex turn_; // one call at a time
  std::mutex m_;
  std::condition_variable wake_, done_;
  std::uint64_t generation_ = 0;
  int working_ = 0, pending_ = 0;
  bool stop_ = false;
  const std::function<void(int)>* job_ = nullptr;
  std::vector<std::thread> threads_;
};

[[noreturn]] inline void no_fp32_on_device() {
  throw ringattn::invalid_argument(
      "ringattn: the device path takes fp16 or bf16 tensors (got fp32)");
}

//! Whether a BlockKernel runs element type T: every type, unless it is planned for one
//! (`Kernel::element_type`, as cudnn_kernel).
template <class Kernel, class T>
constexpr bool kernel_takes() {
  if constexpr (requires { typename Kernel::element_type; })
    return std::is_same_v<T, typename Kernel::element_type>;
  else
    return true;
}

template <class Kernel, class T>
[[noreturn]] void wrong_element() {
  throw ringattn::invalid_argument(
      std::string("ringattn: this plan's cuDNN graphs are built for ") +
      ringattn::to_string(ringattn::dtype_of_v<typename Kernel::element_type>) +
      " but the call passes " + ringattn::to_string(ringattn::dtype_of_v<T>));
}

//! The two call paths of one ring object, with the workspace sizes per element type.
template <class Ring, class Kernel, bool Device>
struct ring_calls {
  template <class T>
  static std::size_t workspace(const Ring& ring, bool backward) {
    if constexpr (!kernel_takes<Kernel, T>()) {
      return 0; // the call is refused (`forward`, `backward`)
    } else if constexpr (Device) {
      if constexpr (std::is_same_v<T, float>)
        return 0;
      else
        return backward ? ring.template device_backward_workspace_bytes<T>()
                        : ring.template device_workspace_bytes<T>();
    } else {
      return backward ? ring.template host_backward_workspace_bytes<T>()
                      : ring.template host_workspace_bytes<T>();
    }
  }

  template <class T>
  static void forward(Ring& ring, const forward_io& io, std::byte* ws, std::size_t bytes,
                      [[maybe_unused]] cudaStream_t stream) {
    using ringattn::thd_view;
    if constexpr (!kernel_takes<Kernel, T>()) {
      wrong_element<Kernel, T>();
    } else if constexpr (Device) {
#if defined(__CUDACC__)
      if constexpr (std::is_same_v<T, float>)
        no_fp32_on_device();
      else
        ring.template forward<T>(as_view<const T>(io.q), as_view<const T>(io.k),
                                 as_view<const T>(io.v), as_view<T>(io.out), io.lse, io.max_logit,
                                 ws, bytes, stream);
#else
      static_assert(!Device, "the device path is compiled by nvcc");
#endif
    } else {
      ring.template forward_host<T>(as_view<const T>(io.q), as_view<const T>(io.k),
                                    as_view<const T>(io.v), as_view<T>(io.out), io.lse,
                                    io.max_logit, std::span<std::byte>(ws, bytes));
    }
  }

  template <class T>
  static void backward(Ring& ring, const backward_io& io, std::byte* ws, std::size_t bytes,
                       [[maybe_unused]] cudaStream_t stream) {
    if constexpr (!kernel_takes<Kernel, T>()) {
      wrong_element<Kernel, T>();
    } else if constexpr (Device) {
#if defined(__CUDACC__)
      if constexpr (std::is_same_v<T, float>)
        no_fp32_on_device();
      else
        ring.template backward<T>(as_view<const T>(io.q), as_view<const T>(io.k),
                                  as_view<const T>(io.v), as_view<const T>(io.out), io.lse,
                                  as_view<const T>(io.dout), as_view<T>(io.dq), as_view<T>(io.dk),
                                  as_view<T>(io.dv), ws, bytes, stream);
#else
      static_assert(!Device, "the device path is compiled by nvcc");
#endif
    } else {
      ring.template backward_host<T>(
          as_view<const T>(io.q), as_view<const T>(io.k), as_view<const T>(io.v),
          as_view<const T>(io.out), io.lse, as_view<const T>(io.dout), as_view<T>(io.dq),
          as_view<T>(io.dk), as_view<T>(io.dv), std::span<std::byte>(ws, bytes));
    }
  }
};

//! Each rank's share of a workspace of `bytes` bytes at `ws`, back to back, rank r's
//! `aligned(want(r))` bytes; a short workspace gives the last shares less (each rank's own
//! validation then names it).
template <class Want>
std::vector<std::pair<std::byte*, std::size_t>> shares_of(int ranks, void* ws, std::size_t bytes,
                                                          Want&& want) {
  std::vector<std::pair<std::byte*, std::size_t>> shares;
  std::size_t offset = 0;
  for (int r = 0; r < ranks; ++r) {
    const std::size_t size = aligned(want(r));
    const std::size_t have = offset < bytes ? std::min(size, bytes - offset) : 0;
    shares.emplace_back(static_cast<std::byte*>(ws) + std::min(offset, bytes), have);
    offset += size;
  }
  return shares;
}

//! The threads of virtual ranks (kept from call to call) and, on the device, each rank's stream,
//! joined to the caller's stream by events (no host wait).
template <bool Device>
class virtual_streams {
public:
  virtual_streams(int ranks, int device) : device_(Device ? device : -1), threads_(ranks) {
    if constexpr (Device) {
      RINGATTN_CUDA_CHECK(cudaSetDevice(device_));
      RINGATTN_CUDA_CHECK(cudaEventCreateWithFlags(&start_, cudaEventDisableTiming));
      streams_.assign(static_cast<std::size_t>(ranks), nullptr);
      done_.assign(static_cast<std::size_t>(ranks), nullptr);
      for (std::size_t r = 0; r < streams_.size(); ++r) {
        RINGATTN_CUDA_CHECK(cudaStreamCreateWithFlags(&streams_[r], cudaStreamNonBlocking));
        RINGATTN_CUDA_CHECK(cudaEventCreateWithFlags(&done_[r], cudaEventDisableTiming));
      }
    }
  }
  ~virtual_streams() {
    if constexpr (Device) {
      int current = -1;
      const bool switched = cudaGetDevice(&current) == cudaSuccess && current != device_ &&
                            cudaSetDevice(device_) == cudaSuccess;
      for (auto s : streams_)
        if (s) cudaStreamDestroy(s);
      for (auto e : done_)
        if (e) cudaEventDestroy(e);
      if (start_) cudaEventDestroy(start_);
      if (switched) cudaSetDevice(current);
    }
  }
  virtual_streams(const virtual_streams&) = delete;
  virtual_streams& operator=(const virtual_streams&) = delete;

  int device() const { return device_; }

  //! Runs `body(r)` for every rank on a thread of its own, with the rank's device current.
  //! Rank 0 runs on the caller's thread, whose current device is the same after as before.
  template <class Body>
  void each(int ranks, Body&& body) const {
    int caller = -1;
    if constexpr (Device) RINGATTN_CUDA_CHECK(cudaGetDevice(&caller));
    try {
      threads_.run(ranks, [&](int r) {
        if constexpr (Device) RINGATTN_CUDA_CHECK(cudaSetDevice(device_));
        body(r);
      });
    } catch (...) {
      if constexpr (Device) cudaSetDevice(caller);
      throw;
    }
    if constexpr (Device) RINGATTN_CUDA_CHECK(cudaSetDevice(caller));
  }

  //! Runs `body(r, stream)` for every rank on a thread of its own: on the device, rank r's stream
  //! starts after the work enqueued on `caller` so far, and `caller` continues after every
  //! rank's work.
  template <class Body>
  void run(int ranks, void* caller_stream, Body&& body) {
    [[maybe_unused]] const auto caller = static_cast<cudaStream_t>(caller_stream);
    if constexpr (Device) {
      RINGATTN_CUDA_CHECK(cudaSetDevice(device_));
      RINGATTN_CUDA_CHECK(cudaEventRecord(start_, caller));
    }
    each(ranks, [&](int r) {
      const auto at = static_cast<std::size_t>(r);
      cudaStream_t s = nullptr;
      if constexpr (Device) {
        s = streams_[at];
        RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(s, start_, 0));
      }
      body(r, s);
      if constexpr (Device) RINGATTN_CUDA_CHECK(cudaEventRecord(done_[at], s));
    });
    if constexpr (Device)
      for (auto e : done_)
        RINGATTN_CUDA_CHECK(cudaStreamWaitEvent(caller, e, 0));
  }

private:
  int device_ = -1;
  mutable rank_threads threads_;
  cudaEvent_t start_ = nullptr;
  std::vector<cudaStream_t> streams_;
  std::vector<cudaEvent_t> done_;
};

//! A communicator the process keeps (`comm`), as an endpoint.
template <class Communicator>
class endpoint_of : public endpoint {
public:
  template <class... Args>
  explicit endpoint_of(Args&&... args) : comm(std::forward<Args>(args)...) {}
  int rank() const override { return comm.rank(); }
  int size() const override { return comm.size(); }
  int device() const override {
    if constexpr (requires { comm.device(); })
      return comm.device();
    else
      return -1;
  }
  std::uint64_t bytes_sent() const override { return comm.bytes_sent(); }

  Communicator comm;
};

//! One rank of an endpoint's communicator: one ring object.
template <class Partitioner, class Communicator, class Kernel, class Schedule, bool Device>
class endpoint_plan final : public plan {
  using ring_type = ringattn::ring_attention<Partitioner, Communicator, Kernel, Schedule>;
  using calls = ring_calls<ring_type, Kernel, Device>;

public:
  endpoint_plan(const layout& l, std::shared_ptr<endpoint_of<Communicator>> ep)
      : ep_(std::move(ep)), ring_(ep_->comm, l.args, l.cu_seqlens) {
    if constexpr (Device) ring_.prepare_device();
  }
  int ranks_here() const override { return 1; }
  int size() const override { return ring_.size(); }
  int first_rank() const override { return ring_.rank(); }
  std::int64_t local_tokens(int) const override { return ring_.local_tokens(); }
  int device() const override { return Device ? ep_->device() : -1; }
  std::size_t workspace_bytes(element_type type, bool backward) const override {
    return with_element(type,
                        [&]<class T>(T) { return calls::template workspace<T>(ring_, backward); });
  }
  std::uint64_t bytes_sent() const override { return ep_->bytes_sent(); }
  void forward(element_type type, std::span<const forward_io> io, void* ws, std::size_t bytes,
               void* stream) override {
    check_io_count(io.size(), 1);
    with_element(type, [&]<class T>(T) {
      calls::template forward<T>(ring_, io[0], static_cast<std::byte*>(ws), bytes,
                                 static_cast<cudaStream_t>(stream));
    });
  }
  void backward(element_type type, std::span<const backward_io> io, void* ws, std::size_t bytes,
                void* stream) override {
    check_io_count(io.size(), 1);
    with_element(type, [&]<class T>(T) {
      calls::template backward<T>(ring_, io[0], static_cast<std::byte*>(ws), bytes,
                                  static_cast<cudaStream_t>(stream));
    });
  }
  [[noreturn]] void refuse(element_type type, bool backward, const std::string& reason) override {
    refuse_through<Device>(ring_, type, backward, reason);
  }

private:
  std::shared_ptr<endpoint_of<Communicator>> ep_;
  ring_type ring_;
};

//! Every rank of an in-process group, each ring object used from its own thread; on the device,
//! each rank has its own stream, joined to the caller's stream by events (no host wait).
template <class Partitioner, class Kernel, class Schedule, bool Device>
class virtual_plan final : public plan {
  using comm_type = ringattn::in_process_communicator;
  using ring_type = ringattn::ring_attention<Partitioner, comm_type, Kernel, Schedule>;
  using calls = ring_calls<ring_type, Kernel, Device>;

public:
  virtual_plan(const layout& l, int ranks, int device) : group_(ranks), streams_(ranks, device) {
    comms_.reserve(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r)
      comms_.push_back(group_.communicator(r));
    rings_.resize(static_cast<std::size_t>(ranks));
    streams_.each(ranks, [&](int r) {
      auto ring =
          std::make_unique<ring_type>(comms_[static_cast<std::size_t>(r)], l.args, l.cu_seqlens);
      if constexpr (Device) ring->prepare_device();
      rings_[static_cast<std::size_t>(r)] = std::move(ring);
    });
  }

  int ranks_here() const override { return static_cast<int>(rings_.size()); }
  int size() const override { return ranks_here(); }
  int first_rank() const override { return 0; }
  std::int64_t local_tokens(int i) const override {
    return rings_.at(static_cast<std::size_t>(i))->local_tokens();
  }
  int device() const override { return streams_.device(); }
  std::size_t workspace_bytes(element_type type, bool backward) const override {
    std::size_t total = 0;
    for (int r = 0; r < ranks_here(); ++r)
      total += aligned(share(type, backward, r));
    return total;
  }
  std::uint64_t bytes_sent() const override {
    std::uint64_t total = 0;
    for (const auto& c : comms_)
      total += c.bytes_sent();
    return total;
  }
  void forward(element_type type, std::span<const forward_io> io, void* ws, std::size_t bytes,
               void* stream) override {
    run(type, io, ws, bytes, stream, false);
  }
  void backward(element_type type, std::span<const backward_io> io, void* ws, std::size_t bytes,
                void* stream) override {
    run(type, io, ws, bytes, stream, true);
  }
  // Every rank is in this call: nobody waits for a refused one.
  [[noreturn]] void refuse(element_type, bool, const std::string& reason) override {
    throw ringattn::invalid_argument("ringattn: " + reason);
  }

private:
  std::size_t share(element_type type, bool backward, int r) const {
    return with_element(type, [&]<class T>(T) {
      return calls::template workspace<T>(*rings_[static_cast<std::size_t>(r)], backward);
    });
  }

  template <class IO>
  void run(element_type type, std::span<const IO> io, void* ws, std::size_t bytes, void* stream,
           bool backward) {
    const int ranks = ranks_here();
    check_io_count(io.size(), ranks);
    const auto shares =
        shares_of(ranks, ws, bytes, [&](int r) { return share(type, backward, r); });
    streams_.run(ranks, stream, [&](int r, cudaStream_t s) {
      const auto at = static_cast<std::size_t>(r);
      with_element(type, [&]<class T>(T) {
        if constexpr (std::is_same_v<IO, forward_io>)
          calls::template forward<T>(*rings_[at], io[at], shares[at].first, shares[at].second, s);
        else
          calls::template backward<T>(*rings_[at], io[at], shares[at].first, shares[at].second, s);
      });
    });
  }

  ringattn::in_process_group group_;
  std::vector<comm_type> comms_;
  virtual_streams<Device> streams_; // outlives the rings, whose last work ran on its streams
  std::vector<std::unique_ptr<ring_type>> rings_;
};

//! Calls `f.template operator()<Partitioner, Kernel, Schedule>()` for the layout's kinds, with
//! Kernel restricted to `Kernels...` (a translation unit instantiates its share of masks).
template <class... Kernels, class F>
std::unique_ptr<plan> dispatch(const layout& l, F&& f) {
  auto with_schedule = [&]<class P, class K>() -> std::unique_ptr<plan> {
    if (l.schedule == schedule_kind::all_gather)
      return f.template operator()<P, K, ringattn::all_gather_kv>();
    if (l.schedule == schedule_kind::all_to_all)
      return f.template operator()<P, K, ringattn::all_to_all_heads>();
    return f.template operator()<P, K, ringattn::ring_pass>();
  };
  auto with_partitioner = [&]<class K>() -> std::unique_ptr<plan> {
    switch (l.partitioner) {
    case partitioner_kind::contiguous:
      return with_schedule.template operator()<ringattn::contiguous, K>();
    case partitioner_kind::round_robin:
      return with_schedule.template operator()<ringattn::round_robin, K>();
    case partitioner_kind::balanced:
      return with_schedule.template operator()<ringattn::balanced, K>();
    case partitioner_kind::zigzag: break;
    }
    return with_schedule.template operator()<ringattn::zigzag, K>();
  };
  std::unique_ptr<plan> made;
  const bool found =
      ((Kernels::mask == l.mask ? (made = with_partitioner.template operator()<Kernels>(), true)
                                : false) ||
       ...);
  if (!found)
    throw ringattn::invalid_argument(std::string("ringattn: this build has no ring for mask ") +
                                     ringattn::to_string(l.mask));
  return made;
}

} // namespace ringattn_torch::detail
