// Device plans of the causal mask.
#include "device_plans.cuh"

namespace ringattn_torch::device {
RINGATTN_TORCH_DEVICE_PLANS(ringattn::causal)
} // namespace ringattn_torch::device
