// Device plans of the cuDNN kernel under the full mask, fp16 and bf16.
#include "device_plans.cuh"

namespace ringattn_torch::device {
RINGATTN_TORCH_CUDNN_PLANS(RINGATTN_TORCH_DEVICE_PLANS, ringattn::full_mask)
} // namespace ringattn_torch::device
