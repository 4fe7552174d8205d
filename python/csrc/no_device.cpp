// A build without the device path (no CUDA compiler, or RINGATTN_TORCH_DEVICE=OFF): the device
// factories say so.
#include "decoder.hpp"
#include "plan.hpp"

#include <ringattn/error.cuh>

namespace ringattn_torch {

namespace {
[[noreturn]] void no_device() {
  throw ringattn::invalid_argument(
      "ringattn: this build of ringattn_torch has the host path only (built without the CUDA "
      "kernels); CUDA tensors need a build with RINGATTN_TORCH_DEVICE=ON");
}
} // namespace

bool has_device_path() { return false; }
bool has_cudnn_kernel() { return false; }
std::vector<std::uint8_t> nccl_unique_id() { no_device(); }
std::shared_ptr<endpoint> make_nccl_endpoint(std::span<const std::uint8_t>, int, int, int,
                                             std::int64_t) {
  no_device();
}
std::unique_ptr<plan> make_virtual_device_plan(const layout&, int, int) { no_device(); }
std::unique_ptr<plan> make_device_plan(const layout&, std::shared_ptr<endpoint>) { no_device(); }
std::unique_ptr<decoder> make_virtual_device_decoder(const ringattn::attention_arguments&, int,
                                                     int) {
  no_device();
}
std::unique_ptr<decoder> make_device_decoder(const ringattn::attention_arguments&,
                                             std::shared_ptr<endpoint>) {
  no_device();
}

} // namespace ringattn_torch
