#pragma once
//! \file
//! The Communicator family's concepts: host buffers, and device buffers on a stream. They name
//! no CUDA type.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>

namespace ringattn {

//! A host Communicator moves bytes between ranks' host buffers, with bounded waits: ring
//! exchange (send to one peer, receive from another, for a numbered step), all-gather (plan-time
//! agreement checks), barrier, abort (fail the group so peers stop waiting), and a byte count.
template <class C>
concept host_communicator = requires(C& c, const void* s, void* r, std::size_t n, int peer,
                                     std::int64_t step, const std::string& why) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.exchange(s, n, peer, r, n, peer, step);
  c.all_gather(s, n, r);
  c.barrier();
  c.abort(why);
  { c.bytes_sent() } -> std::convertible_to<std::uint64_t>;
};

//! A device Communicator also moves device buffers, enqueued on a CUDA stream with no host wait
//! on the device (NCCL, or the in-process one for ranks sharing a process), after a plan-time
//! `prepare_device()`. The stream type is a template parameter so this header needs no CUDA.
template <class C, class Stream>
concept device_communicator_for = host_communicator<C> &&
    requires(C& c, const void* s, void* r, std::size_t n, int peer, std::int64_t step,
             Stream stream) {
  c.prepare_device();
  c.exchange_async(s, n, peer, r, n, peer, step, stream);
};

} // namespace ringattn
