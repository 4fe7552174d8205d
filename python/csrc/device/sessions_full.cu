// Device sessions of the full mask.
#include "device_sessions.cuh"

namespace ringattn_torch::device {
RINGATTN_TORCH_DEVICE_SESSIONS(ringattn::full)
} // namespace ringattn_torch::device
