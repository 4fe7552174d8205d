// The device path of the extension: NCCL endpoints and the plans on CUDA devices, by mask.
#include "device_plans.cuh"

#include <ringattn/comm/nccl_error.cuh>
#include <ringattn/cuda_check.cuh>

#include <chrono>
#include <cstring>

namespace ringattn_torch {

namespace {
//! Calls `f(Mask{})` for the layout's mask.
template <class F>
std::unique_ptr<plan> by_mask(ringattn::mask_kind m, F&& f) {
  switch (m) {
  case ringattn::mask_kind::full: return f(ringattn::full_mask{});
  case ringattn::mask_kind::causal: return f(ringattn::causal_mask{});
  case ringattn::mask_kind::sliding_window: return f(ringattn::sliding_window_mask{});
  case ringattn::mask_kind::causal_window: break;
  }
  return f(ringattn::causal_window_mask{});
}

//! Calls `f(Kernel{})` for the layout's BlockKernel: mask, kernel kind and (cuDNN) element type.
template <class F>
std::unique_ptr<plan> by_kernel(const layout& l, F&& f) {
  return by_mask(l.mask, [&]<class Mask>(Mask) -> std::unique_ptr<plan> {
    if (l.kernel == kernel_kind::native) return f(ringattn::native_kernel<Mask>{});
#if RINGATTN_TORCH_CUDNN
    switch (l.element) {
    case element_type::f16: return f(device::cudnn_f16<Mask>{});
    case element_type::bf16: return f(device::cudnn_bf16<Mask>{});
    case element_type::f32: break;
    }
    detail::no_fp32_on_device();
#else
    throw ringattn::invalid_argument(
        "ringattn: this build of ringattn_torch has no cuDNN kernel (it was built without cuDNN 9 "
        "or the cudnn-frontend headers; install nvidia-cudnn-frontend and reinstall, or use "
        "kernel 'native')");
#endif
  });
}

} // namespace

bool has_device_path() { return true; }
bool has_cudnn_kernel() { return RINGATTN_TORCH_CUDNN != 0; }

std::vector<std::uint8_t> nccl_unique_id() {
  ncclUniqueId id;
  RINGATTN_NCCL_CHECK(ncclGetUniqueId(&id));
  std::vector<std::uint8_t> bytes(sizeof id);
  std::memcpy(bytes.data(), &id, sizeof id);
  return bytes;
}

std::shared_ptr<endpoint> make_nccl_endpoint(std::span<const std::uint8_t> id_bytes, int size,
                                             int rank, int device, std::int64_t timeout_ms) {
  ncclUniqueId id;
  if (id_bytes.size() != sizeof id)
    throw ringattn::invalid_argument("ringattn: an NCCL unique id has " +
                                     std::to_string(sizeof id) + " bytes, got " +
                                     std::to_string(id_bytes.size()));
  std::memcpy(&id, id_bytes.data(), sizeof id);
  device::device_scope scope(device);
  return std::make_shared<device::nccl_endpoint>(id, size, rank,
                                                 std::chrono::milliseconds(timeout_ms));
}

std::unique_ptr<plan> make_virtual_device_plan(const layout& l, int ranks, int device) {
  device::device_scope scope(device);
  return by_kernel(l, [&]<class K>(K) { return device::virtual_plan_for<K>(l, ranks, device); });
}

std::unique_ptr<plan> make_device_plan(const layout& l, std::shared_ptr<endpoint> ep) {
  auto nccl = std::dynamic_pointer_cast<device::nccl_endpoint>(ep);
  if (!nccl)
    throw ringattn::invalid_argument(
        "ringattn: CUDA tensors run over an NCCL endpoint; this endpoint is not one");
  device::device_scope scope(nccl->device());
  return by_kernel(l, [&]<class K>(K) { return device::rank_plan_for<K>(l, nccl); });
}

} // namespace ringattn_torch
