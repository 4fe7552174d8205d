#pragma once
// The device path's plans for one BlockKernel: virtual ranks on one GPU and a rank of an NCCL
// communicator. Each translation unit of this folder instantiates them for its masks (and, for
// cuDNN, element types), so the kernels of different masks compile in parallel.
// RINGATTN_TORCH_CUDNN (1 where the build has cuDNN 9 and cudnn-frontend) adds the cuDNN kernels.
#include "../plans.hpp"

#include <ringattn/comm/nccl.cuh>
#include <ringattn/cuda_check.cuh>
#if RINGATTN_TORCH_CUDNN
#include <ringattn/cudnn.cuh>
#endif

#include <memory>

namespace ringattn_torch::device {

using nccl_endpoint = detail::endpoint_of<ringattn::nccl_communicator>;

//! Makes `device` current for the scope.
class device_scope {
public:
  explicit device_scope(int device) {
    RINGATTN_CUDA_CHECK(cudaGetDevice(&previous_));
    RINGATTN_CUDA_CHECK(cudaSetDevice(device));
  }
  ~device_scope() { cudaSetDevice(previous_); }
  device_scope(const device_scope&) = delete;
  device_scope& operator=(const device_scope&) = delete;

private:
  int previous_ = 0;
};

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

#if RINGATTN_TORCH_CUDNN
//! The cuDNN kernel of the extension: PyTorch's default backward algorithm (atomic dQ).
template <class Mask, class T>
using cudnn_kernel = ringattn::cudnn_kernel<Mask, T, ringattn::cudnn_atomic>;
template <class Mask>
using cudnn_f16 = cudnn_kernel<Mask, __half>;
template <class Mask>
using cudnn_bf16 = cudnn_kernel<Mask, __nv_bfloat16>;

#define RINGATTN_TORCH_CUDNN_PLANS(Macro, Mask) Macro(cudnn_f16<Mask>) Macro(cudnn_bf16<Mask>)

RINGATTN_TORCH_CUDNN_PLANS(RINGATTN_TORCH_EXTERN_DEVICE_PLANS, ringattn::full_mask)
RINGATTN_TORCH_CUDNN_PLANS(RINGATTN_TORCH_EXTERN_DEVICE_PLANS, ringattn::causal_mask)
RINGATTN_TORCH_CUDNN_PLANS(RINGATTN_TORCH_EXTERN_DEVICE_PLANS, ringattn::sliding_window_mask)
RINGATTN_TORCH_CUDNN_PLANS(RINGATTN_TORCH_EXTERN_DEVICE_PLANS, ringattn::causal_window_mask)
#endif

} // namespace ringattn_torch::device
