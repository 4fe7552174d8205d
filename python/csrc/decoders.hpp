#pragma once
// The decoder models behind decoder.hpp: a rank of a communicator the process keeps
// (`endpoint_decoder`) and every rank of an in-process group (`virtual_decoder`), over the
// library's causal kernels (the host twin on CPU tensors). The device halves compile only under
// nvcc.
#include "decoder.hpp"
#include "plans.hpp"

#include <ringattn/block_kernel.cuh>
#include <ringattn/sharded_attention.cuh>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace ringattn_torch::detail {

//! The calls of one `sharded_attention` on the host or the device path.
template <class Decode, bool Device>
struct decode_calls {
  static void plan(Decode& d, std::span<const std::int32_t> cu_new, const cache_shard& c) {
    if (c.page_size > 0) {
      ringattn::paged_cache paged;
      paged.page_size = c.page_size;
      paged.pages = c.pages;
      paged.cu_pages = c.cu_pages;
      paged.page_table = c.page_table;
      paged.cache_length = c.length;
      d.plan(cu_new, paged);
    } else {
      d.plan(cu_new, c.begin, c.length, c.rows);
    }
  }

  static std::size_t workspace(const Decode& d, element_type type) {
    return with_element(type, [&]<class T>(T) -> std::size_t {
      if constexpr (!Device)
        return d.template host_workspace_bytes<T>();
      else if constexpr (std::is_same_v<T, float>)
        return 0; // the call is refused
      else
        return d.template device_workspace_bytes<T>();
    });
  }

  static void step(Decode& d, element_type type, const decode_io& io, std::byte* ws,
                   std::size_t bytes, [[maybe_unused]] cudaStream_t stream) {
    with_element(type, [&]<class T>(T) {
      if constexpr (Device) {
#if defined(__CUDACC__)
        if constexpr (std::is_same_v<T, float>)
          no_fp32_on_device();
        else
          d.template forward<T>(as_view<const T>(io.q), as_view<const T>(io.k),
                                as_view<const T>(io.v), as_view<const T>(io.k_cache),
                                as_view<const T>(io.v_cache), as_view<T>(io.out), io.lse, ws, bytes,
                                stream);
#else
        static_assert(!Device, "the device path is compiled by nvcc");
#endif
      } else {
        d.template forward_host<T>(as_view<const T>(io.q), as_view<const T>(io.k),
                                   as_view<const T>(io.v), as_view<const T>(io.k_cache),
                                   as_view<const T>(io.v_cache), as_view<T>(io.out), io.lse,
                                   std::span<std::byte>(ws, bytes));
      }
    });
  }
};

//! One rank of an endpoint's communicator: one `sharded_attention`.
template <class Communicator, bool Device>
class endpoint_decoder final : public decoder {
  using decode_type = ringattn::sharded_attention<Communicator, ringattn::causal>;
  using calls = decode_calls<decode_type, Device>;

public:
  endpoint_decoder(const ringattn::attention_arguments& args,
                   std::shared_ptr<endpoint_of<Communicator>> ep)
      : ep_(std::move(ep)), decode_(ep_->comm, args) {
    if constexpr (Device) decode_.prepare_device();
  }
  int ranks_here() const override { return 1; }
  int size() const override { return decode_.size(); }
  int first_rank() const override { return decode_.rank(); }
  int device() const override { return Device ? ep_->device() : -1; }
  std::uint64_t bytes_sent() const override { return ep_->bytes_sent(); }
  void plan(std::span<const std::int32_t> cu_new, std::span<const cache_shard> caches) override {
    check_io_count(caches.size(), 1, "the caches");
    calls::plan(decode_, cu_new, caches[0]);
  }
  std::size_t workspace_bytes(element_type type) const override {
    return calls::workspace(decode_, type);
  }
  void step(element_type type, std::span<const decode_io> io, void* ws, std::size_t bytes,
            void* stream) override {
    check_io_count(io.size(), 1);
    calls::step(decode_, type, io[0], static_cast<std::byte*>(ws), bytes,
                static_cast<cudaStream_t>(stream));
  }
  [[noreturn]] void refuse(element_type type, bool in_step, const std::string& reason) override {
    refuse_through<Device>(decode_, type, in_step, reason);
  }

private:
  std::shared_ptr<endpoint_of<Communicator>> ep_;
  decode_type decode_;
};

//! Every rank of an in-process group, each used from its own thread; on the device each rank
//! has its own stream, joined to the caller's by events (no host wait).
template <bool Device>
class virtual_decoder final : public decoder {
  using comm_type = ringattn::in_process_communicator;
  using decode_type = ringattn::sharded_attention<comm_type, ringattn::causal>;
  using calls = decode_calls<decode_type, Device>;

public:
  virtual_decoder(const ringattn::attention_arguments& args, int ranks, int device)
      : group_(ranks), streams_(ranks, device) {
    comms_.reserve(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r)
      comms_.push_back(group_.communicator(r));
    decoders_.resize(static_cast<std::size_t>(ranks));
    streams_.each(ranks, [&](int r) {
      auto d = std::make_unique<decode_type>(comms_[static_cast<std::size_t>(r)], args);
      if constexpr (Device) d->prepare_device();
      decoders_[static_cast<std::size_t>(r)] = std::move(d);
    });
  }

  int ranks_here() const override { return static_cast<int>(decoders_.size()); }
  int size() const override { return ranks_here(); }
  int first_rank() const override { return 0; }
  int device() const override { return streams_.device(); }
  std::uint64_t bytes_sent() const override {
    std::uint64_t total = 0;
    for (const auto& c : comms_)
      total += c.bytes_sent();
    return total;
  }
  void plan(std::span<const std::int32_t> cu_new, std::span<const cache_shard> caches) override {
    check_io_count(caches.size(), ranks_here(), "the caches");
    streams_.each(ranks_here(), [&](int r) {
      calls::plan(*decoders_[static_cast<std::size_t>(r)], cu_new,
                  caches[static_cast<std::size_t>(r)]);
    });
  }
  std::size_t workspace_bytes(element_type type) const override {
    std::size_t total = 0;
    for (int r = 0; r < ranks_here(); ++r)
      total += aligned(share(type, r));
    return total;
  }
  void step(element_type type, std::span<const decode_io> io, void* ws, std::size_t bytes,
            void* stream) override {
    const int ranks = ranks_here();
    check_io_count(io.size(), ranks);
    const auto shares = shares_of(ranks, ws, bytes, [&](int r) { return share(type, r); });
    streams_.run(ranks, stream, [&](int r, cudaStream_t s) {
      const auto at = static_cast<std::size_t>(r);
      calls::step(*decoders_[at], type, io[at], shares[at].first, shares[at].second, s);
    });
  }
  // Every rank is in this call: nobody waits for a refused one.
  [[noreturn]] void refuse(element_type, bool, const std::string& reason) override {
    throw ringattn::invalid_argument("ringattn: " + reason);
  }

private:
  std::size_t share(element_type type, int r) const {
    return calls::workspace(*decoders_[static_cast<std::size_t>(r)], type);
  }

  ringattn::in_process_group group_;
  std::vector<comm_type> comms_;
  virtual_streams<Device> streams_; // outlives the decoders, whose last steps ran on its streams
  std::vector<std::unique_ptr<decode_type>> decoders_;
};

} // namespace ringattn_torch::detail
