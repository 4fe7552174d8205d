#pragma once
// The device path's plans for one BlockKernel: virtual ranks on one GPU and a rank of an NCCL
// communicator. Each translation unit of this folder instantiates them for its masks, so the
// kernels of different masks compile in parallel.
#include "../plans.hpp"

#include <ringattn/comm/nccl.cuh>

#include <memory>

namespace ringattn_torch::device {

using nccl_endpoint = detail::endpoint_of<ringattn::nccl_communicator>;

template <class Kernel>
std::unique_ptr<plan> virtual_plan_for(const layout& l, int ranks, int device) {
  return detail::dispatch<Kernel>(l, [&]<class P, class K, class S>() -> std::unique_ptr<plan> {
    return std::make_unique<detail::virtual_plan<P, K, S, true>>(l, ranks, device);
  });
}

template <class Kernel>
std::unique_ptr<plan> rank_plan_for(const layout& l, std::shared_ptr<nccl_endpoint> ep) {
  return detail::dispatch<Kernel>(l, [&]<class P, class K, class S>() -> std::unique_ptr<plan> {
    return std::make_unique<detail::endpoint_plan<P, ringattn::nccl_communicator, K, S, true>>(l,
                                                                                               ep);
  });
}

#define RINGATTN_TORCH_DEVICE_PLANS(Kernel)                                                        \
  template std::unique_ptr<plan> virtual_plan_for<Kernel>(const layout&, int, int);                \
  template std::unique_ptr<plan> rank_plan_for<Kernel>(const layout&,                              \
                                                       std::shared_ptr<nccl_endpoint>);

#define RINGATTN_TORCH_EXTERN_DEVICE_PLANS(Kernel)                                                 \
  extern template std::unique_ptr<plan> virtual_plan_for<Kernel>(const layout&, int, int);         \
  extern template std::unique_ptr<plan> rank_plan_for<Kernel>(const layout&,                       \
                                                              std::shared_ptr<nccl_endpoint>);

RINGATTN_TORCH_EXTERN_DEVICE_PLANS(ringattn::full)
RINGATTN_TORCH_EXTERN_DEVICE_PLANS(ringattn::causal)
RINGATTN_TORCH_EXTERN_DEVICE_PLANS(ringattn::sliding_window)
RINGATTN_TORCH_EXTERN_DEVICE_PLANS(ringattn::causal_window)

} // namespace ringattn_torch::device
