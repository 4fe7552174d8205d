// Device plans of the full mask.
#include "device_plans.cuh"

namespace ringattn_torch::device {
RINGATTN_TORCH_DEVICE_PLANS(ringattn::full)
} // namespace ringattn_torch::device
