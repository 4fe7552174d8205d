// The device path's decoders: virtual ranks on one GPU and a rank of an NCCL communicator, over
// the library's causal kernels (the split-K/V decode kernel where the step takes it).
#include "../decoders.hpp"
#include "device_plans.cuh"

#include <ringattn/cuda_check.cuh>

#include <memory>

namespace ringattn_torch {

std::unique_ptr<decoder> make_virtual_device_decoder(const ringattn::attention_arguments& args,
                                                     int ranks, int device) {
  device::device_scope scope(device);
  return std::make_unique<detail::virtual_decoder<true>>(args, ranks, device);
}

std::unique_ptr<decoder> make_device_decoder(const ringattn::attention_arguments& args,
                                             std::shared_ptr<endpoint> ep) {
  auto nccl = std::dynamic_pointer_cast<device::nccl_endpoint>(ep);
  if (!nccl)
    throw ringattn::invalid_argument(
        "ringattn: CUDA tensors run over an NCCL endpoint; this endpoint is not one");
  device::device_scope scope(nccl->device());
  return std::make_unique<detail::endpoint_decoder<ringattn::nccl_communicator, true>>(args, nccl);
}

} // namespace ringattn_torch
