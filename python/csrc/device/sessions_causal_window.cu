// Device sessions of the causal window mask.
#include "device_sessions.cuh"

namespace ringattn_torch::device {
RINGATTN_TORCH_DEVICE_SESSIONS(ringattn::causal_window)
} // namespace ringattn_torch::device
