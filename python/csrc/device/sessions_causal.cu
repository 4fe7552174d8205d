// Device sessions of the causal mask.
#include "device_sessions.cuh"

namespace ringattn_torch::device {
RINGATTN_TORCH_DEVICE_SESSIONS(ringattn::causal)
} // namespace ringattn_torch::device
