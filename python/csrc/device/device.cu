// The device path of the extension: NCCL endpoints and the plans on CUDA devices, by mask.
#include "device_plans.cuh"

#include <ringattn/comm/nccl_error.cuh>
#include <ringattn/cuda_check.cuh>

#include <chrono>
#include <cstring>

namespace ringattn_torch {

namespace {
template <class F>
std::unique_ptr<plan> by_mask(ringattn::mask_kind m, F&& f) {
  switch (m) {
  case ringattn::mask_kind::full: return f(ringattn::full{});
  case ringattn::mask_kind::causal: return f(ringattn::causal{});
  case ringattn::mask_kind::sliding_window: return f(ringattn::sliding_window{});
  case ringattn::mask_kind::causal_window: break;
  }
  return f(ringattn::causal_window{});
}

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
} // namespace

bool has_device_path() { return true; }

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
  device_scope scope(device);
  return std::make_shared<device::nccl_endpoint>(id, size, rank,
                                                 std::chrono::milliseconds(timeout_ms));
}

std::unique_ptr<plan> make_virtual_device_plan(const layout& l, int ranks, int device) {
  device_scope scope(device);
  return by_mask(l.mask, [&]<class K>(K) { return device::virtual_plan_for<K>(l, ranks, device); });
}

std::unique_ptr<plan> make_device_plan(const layout& l, std::shared_ptr<endpoint> ep) {
  auto nccl = std::dynamic_pointer_cast<device::nccl_endpoint>(ep);
  if (!nccl)
    throw ringattn::invalid_argument(
        "ringattn: CUDA tensors run over an NCCL endpoint; this endpoint is not one");
  device_scope scope(nccl->device());
  return by_mask(l.mask, [&]<class K>(K) { return device::rank_plan_for<K>(l, nccl); });
}

} // namespace ringattn_torch
