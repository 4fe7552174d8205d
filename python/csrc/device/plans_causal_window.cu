// Device plans of the causal window mask.
#include "device_plans.cuh"

namespace ringattn_torch::device {
RINGATTN_TORCH_DEVICE_PLANS(ringattn::causal_window)
} // namespace ringattn_torch::device
