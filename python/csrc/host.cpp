// The host path of the extension: virtual ranks on CPU threads and a rank of a process group's
// CPU backend, for every partitioner x mask x schedule; the decoders on the host; the layout
// helpers.
#include "decoders.hpp"
#include "group_communicator.hpp"
#include "plan.hpp"
#include "plans.hpp"

#include <ringattn/partition/plan.cuh>

#include <memory>

namespace ringattn_torch {

namespace {
using group_endpoint = detail::endpoint_of<group_communicator>;

template <class F>
auto with_partitioner(partitioner_kind p, F&& f) {
  switch (p) {
  case partitioner_kind::contiguous: return f(ringattn::contiguous{});
  case partitioner_kind::round_robin: return f(ringattn::round_robin{});
  case partitioner_kind::balanced: return f(ringattn::balanced{});
  case partitioner_kind::zigzag: break;
  }
  return f(ringattn::zigzag{});
}

//! The host path runs the host twin of every kernel; a cuDNN plan is the device path's.
void check_host_kernel(const layout& l) {
  if (l.kernel != kernel_kind::native)
    throw ringattn::invalid_argument(
        "ringattn: kernel 'cudnn' runs CUDA tensors; CPU tensors run the host path "
        "(kernel 'native')");
}
} // namespace

std::shared_ptr<endpoint> make_group_endpoint(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                              std::int64_t timeout_ms) {
  return std::make_shared<group_endpoint>(group, std::chrono::milliseconds(timeout_ms));
}

std::unique_ptr<plan> make_virtual_host_plan(const layout& l, int ranks) {
  check_host_kernel(l);
  return detail::dispatch<ringattn::full, ringattn::causal, ringattn::sliding_window,
                          ringattn::causal_window>(
      l, [&]<class P, class K, class S>() -> std::unique_ptr<plan> {
        return std::make_unique<detail::virtual_plan<P, K, S, false>>(l, ranks, -1);
      });
}

std::unique_ptr<plan> make_host_plan(const layout& l, std::shared_ptr<endpoint> ep) {
  check_host_kernel(l);
  auto group = std::dynamic_pointer_cast<group_endpoint>(ep);
  if (!group)
    throw ringattn::invalid_argument(
        "ringattn: CPU tensors run over a process group's CPU backend; this endpoint is not one");
  return detail::dispatch<ringattn::full, ringattn::causal, ringattn::sliding_window,
                          ringattn::causal_window>(
      l, [&]<class P, class K, class S>() -> std::unique_ptr<plan> {
        return std::make_unique<detail::endpoint_plan<P, group_communicator, K, S, false>>(l,
                                                                                           group);
      });
}

std::unique_ptr<decoder> make_virtual_host_decoder(const ringattn::attention_arguments& args,
                                                   int ranks) {
  return std::make_unique<detail::virtual_decoder<false>>(args, ranks, -1);
}

std::unique_ptr<decoder> make_host_decoder(const ringattn::attention_arguments& args,
                                           std::shared_ptr<endpoint> ep) {
  auto group = std::dynamic_pointer_cast<group_endpoint>(ep);
  if (!group)
    throw ringattn::invalid_argument(
        "ringattn: CPU tensors run over a process group's CPU backend; this endpoint is not one");
  return std::make_unique<detail::endpoint_decoder<group_communicator, false>>(args, group);
}

std::vector<std::int64_t> token_indices(partitioner_kind p, std::span<const std::int32_t> cu,
                                        int ranks, int rank) {
  return with_partitioner(p, [&]<class P>(P) {
    const ringattn::partition_plan<P> partition(cu, ranks);
    std::vector<std::int64_t> out(static_cast<std::size_t>(partition.local_tokens(rank)));
    for (std::size_t i = 0; i < out.size(); ++i)
      out[i] = partition.global_token(rank, static_cast<std::int64_t>(i));
    return out;
  });
}

std::vector<std::int32_t> position_ids(partitioner_kind p, std::span<const std::int32_t> cu,
                                       int ranks, int rank) {
  return with_partitioner(p, [&]<class P>(P) {
    const ringattn::partition_plan<P> partition(cu, ranks);
    return partition.position_ids(rank);
  });
}

} // namespace ringattn_torch
