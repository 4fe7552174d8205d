// Device plans of the sliding window mask.
#include "device_plans.cuh"

namespace ringattn_torch::device {
RINGATTN_TORCH_DEVICE_PLANS(ringattn::sliding_window)
} // namespace ringattn_torch::device
